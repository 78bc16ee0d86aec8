// Full (non-causal) attention of the vision tower, flash-style (port of
// shaders/vision_attn.wgsl): one block of WG threads per (tile of R queries, head) runs an
// online softmax over every key, a tile of WG keys at a time, so no n x n score matrix
// exists. Per key tile: one thread per key forms its R scores, threads lid < R fold the tile
// into their query's running max m and sum l, then each thread accumulates its head_dim
// stripe of p * V for the R queries. The output is acc / l, per head, into y [n][n_head * hd].
//
// q and k come rotated and head-major ([n_head][n][hd], vision_rope); v is read in place from
// qkv [n][3 * n_head * hd]. R (R * hd <= MAX_Q), WG and MAX_Q come with the kernel
// (backend::gpu::kernels).
#include "common.cuh"

// Stands in for -inf, as in the WGSL.
#define NEG (-3.0e38f)

extern "C" __global__ void __launch_bounds__(WG)
    vision_attn(const float* __restrict__ q, const float* __restrict__ k,
                const float* __restrict__ qkv, float* __restrict__ y, u32 n, u32 n_head, u32 hd,
                float scale, u32 n_tiles) {
    __shared__ float qs[MAX_Q];
    __shared__ float acc[MAX_Q];
    // Scores, then probabilities, of the tile [r][key].
    __shared__ float pc[R * WG];
    // Per query: the new running max and the rescale factor of the tile (at the end, 1 / l).
    __shared__ float mn[R];
    __shared__ float al[R];

    const u32 lid = threadIdx.x;
    const u32 idx = blockIdx.x;
    if (idx >= n_tiles * n_head) {
        return;
    }
    const u32 h = idx / n_tiles;
    const u32 first = (idx % n_tiles) * R;
    const u32 n_q = min(R, n - first);
    const u64 head = (u64)h * n;
    const u64 ldv = 3ull * n_head * hd;
    const u64 v0 = 2ull * n_head * hd + (u64)h * hd;

    for (u32 r = 0; r < R; r++) {
        for (u32 d = lid; d < hd; d += WG) {
            float v = 0.0f;
            if (r < n_q) {
                v = q[(head + first + r) * hd + d];
            }
            qs[r * hd + d] = v;
            acc[r * hd + d] = 0.0f;
        }
    }
    __syncthreads();

    // Running max and sum of query `lid` (threads lid < R).
    float m = NEG;
    float l = 0.0f;
    float s[R];
    for (u32 t0 = 0; t0 < n; t0 += WG) {
        const u32 j = t0 + lid;
        const u32 n_t = min(WG, n - t0);
#pragma unroll
        for (u32 r = 0; r < R; r++) {
            s[r] = 0.0f;
        }
        if (j < n) {
            const float* kj = k + (head + j) * hd;
            for (u32 i = 0; i < hd; i++) {
                const float kv = kj[i];
#pragma unroll
                for (u32 r = 0; r < R; r++) {
                    s[r] += qs[r * hd + i] * kv;
                }
            }
        }
#pragma unroll
        for (u32 r = 0; r < R; r++) {
            pc[r * WG + lid] = j < n && r < n_q ? s[r] * scale : NEG;
        }
        __syncthreads();
        if (lid < R) {
            const u32 r = lid;
            float mt = NEG;
            for (u32 jj = 0; jj < n_t; jj++) {
                mt = fmaxf(mt, pc[r * WG + jj]);
            }
            const float m_new = fmaxf(m, mt);
            al[r] = expf(m - m_new);
            mn[r] = m_new;
            m = m_new;
        }
        __syncthreads();
#pragma unroll
        for (u32 r = 0; r < R; r++) {
            float pj = 0.0f;
            if (j < n && r < n_q) {
                pj = expf(pc[r * WG + lid] - mn[r]);
            }
            pc[r * WG + lid] = pj;
        }
        __syncthreads();
        if (lid < R) {
            const u32 r = lid;
            float ps = 0.0f;
            for (u32 jj = 0; jj < n_t; jj++) {
                ps += pc[r * WG + jj];
            }
            l = l * al[r] + ps;
        }
        for (u32 d = lid; d < hd; d += WG) {
            float a[R];
#pragma unroll
            for (u32 r = 0; r < R; r++) {
                a[r] = acc[r * hd + d] * al[r];
            }
            for (u32 jj = 0; jj < n_t; jj++) {
                const float v = qkv[(u64)(t0 + jj) * ldv + v0 + d];
#pragma unroll
                for (u32 r = 0; r < R; r++) {
                    a[r] += pc[r * WG + jj] * v;
                }
            }
#pragma unroll
            for (u32 r = 0; r < R; r++) {
                acc[r * hd + d] = a[r];
            }
        }
        // The next tile rewrites pc, al and mn.
        __syncthreads();
    }

    if (lid < n_q) {
        al[lid] = 1.0f / l;
    }
    __syncthreads();
    const u64 width = (u64)n_head * hd;
    for (u32 r = 0; r < n_q; r++) {
        for (u32 d = lid; d < hd; d += WG) {
            y[(u64)(first + r) * width + (u64)h * hd + d] = acc[r * hd + d] * al[r];
        }
    }
}
