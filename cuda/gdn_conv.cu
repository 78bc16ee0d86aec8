// Gated DeltaNet input stage (port of shaders/gdn_conv.wgsl): causal depthwise conv over
// [carried state; tokens], SiLU, then the L2 norm of every q and k head (x / max(||x||, eps)),
// q also scaled by 1/sqrt(d).
//
// One block of 64 threads per (head segment of d channels, block of TB tokens): grid
// (2 n_k + n_v, ceil(rows / TB)). Segments are the q heads (0..n_k), the k heads (n_k..2 n_k)
// and the v heads; only q/k segments are normalised. Tokens are independent (every tap is read
// from the carried state or from `mixed`), so blocks run in parallel. The blocks of the last
// token block also write the new conv state (the last kw-1 raw inputs) to `new_state`; the host
// copies it over the carried state after this launch, since other blocks may still be reading
// the old one.
#include "common.cuh"


// Raw input at index `ci` of the concatenation [state rows; mixed rows].
__device__ __forceinline__ float raw(const float* __restrict__ state,
                                     const float* __restrict__ mixed, u32 kw, u32 cd, u32 ci,
                                     u32 ch) {
    const u32 h = kw - 1u;
    if (ci < h) {
        return state[(u64)ci * cd + ch];
    }
    return mixed[(u64)(ci - h) * cd + ch];
}

extern "C" __global__ void __launch_bounds__(WG)
    gdn_conv(const float* __restrict__ mixed, const float* __restrict__ w,
             const float* __restrict__ state, float* __restrict__ u,
             float* __restrict__ new_state, u32 rows, u32 cd, u32 d, u32 n_k, u32 kw, float eps,
             float q_scale) {
    __shared__ float red[WG];
    const u32 lid = threadIdx.x;
    const u32 seg = blockIdx.x;
    const u32 t0 = blockIdx.y * TB;
    const u32 t1 = min(t0 + TB, rows);
    const u32 c0 = seg * d;
    for (u32 t = t0; t < t1; t++) {
        float ss = 0.0f;
        for (u32 c = lid; c < d; c += WG) {
            const u32 ch = c0 + c;
            // Same order as the reference: the current tap first, then the state, oldest first.
            const u32 tw = ch * kw;
            float acc = w[tw + kw - 1u] * mixed[(u64)t * cd + ch];
            for (u32 k = 0; k + 1u < kw; k++) {
                acc += w[tw + k] * raw(state, mixed, kw, cd, t + k, ch);
            }
            const float y = acc / (1.0f + expf(-acc));
            u[(u64)t * cd + ch] = y;
            ss += y * y;
        }
        if (seg < 2u * n_k) {
            const float scale = 1.0f / fmaxf(sqrtf(block_sum(red, lid, ss, WG)), eps);
            const float qs = seg < n_k ? q_scale : 1.0f;
            for (u32 c = lid; c < d; c += WG) {
                const u64 i = (u64)t * cd + c0 + c;
                u[i] = u[i] * scale * qs;
            }
        }
    }
    if (blockIdx.y + 1u == gridDim.y) {
        for (u32 r = 0; r + 1u < kw; r++) {
            for (u32 c = lid; c < d; c += WG) {
                new_state[(u64)r * cd + c0 + c] = raw(state, mixed, kw, cd, rows + r, c0 + c);
            }
        }
    }
}
