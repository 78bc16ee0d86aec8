// Gated DeltaNet chunked prefill, the part that runs in sequence over chunks (port of
// shaders/gdn_chunk_scan.wgsl; model-qwen35.md §4.1), after gdn_chunk_prep. Per chunk of L
// tokens, with S the incoming state [d_k][d_v]:
//   Vn = U - W S
//   O  = (Q exp(gamma)) S + P Vn
//   S  = exp(gamma_L) S + (K exp(gamma_L - gamma))^T Vn
// Columns of S are independent, so one block takes one V head and a block of CB = 16 state
// columns (grid (n_v, D / CB)), keeps that block in shared memory across all chunks of the
// launch and writes it back at the end. Threads work on (row, 4 columns) groups. o is written
// pre-norm ([rows][n_v D]); gdn_gated_norm follows. Chunk indices are relative to `ch0`. The
// head size D (a multiple of CB), C, CB and WG come with the kernel (backend::gpu::kernels).
#include "common.cuh"

#define G (CB / 4u)  // 4-column groups per state row

// Four state columns.
struct F4 {
    float v[4];
};

__device__ __forceinline__ F4 f4_zero() {
    F4 r;
#pragma unroll
    for (u32 k = 0; k < 4u; k++) {
        r.v[k] = 0.0f;
    }
    return r;
}

// r += a * b (a scalar).
__device__ __forceinline__ void f4_axpy(F4& r, float a, const F4& b) {
#pragma unroll
    for (u32 k = 0; k < 4u; k++) {
        r.v[k] += a * b.v[k];
    }
}

extern "C" __global__ void __launch_bounds__(WG)
    gdn_chunk_scan(const float* __restrict__ u, const float* __restrict__ gam,
                   const float* __restrict__ uw, const float* __restrict__ pm,
                   float* __restrict__ s, float* __restrict__ o, u32 rows, u32 n_k, u32 n_v,
                   u32 cd, u32 ch0, u32 n_chunks) {
    __shared__ F4 sb[D * G];  // S[i][c0 .. c0 + CB]
    __shared__ F4 vn[C * G];
    __shared__ float gs[C];
    __shared__ float eg[C];  // exp(gamma_t)
    __shared__ float el[C];  // exp(gamma_L - gamma_t)
    const u32 lid = threadIdx.x;
    const u32 j = blockIdx.x;
    const u32 c0 = blockIdx.y * CB;
    const u32 kh = j % n_k;
    const u64 sbase = (u64)j * D * D;
    const u32 qo = kh * D;
    const u32 ko = n_k * D + kh * D;
    const u64 ow = (u64)n_v * D;

    for (u32 e = lid; e < D * G; e += WG) {
        const u64 r = sbase + (u64)(e / G) * D + c0 + (e % G) * 4u;
#pragma unroll
        for (u32 k = 0; k < 4u; k++) {
            sb[e].v[k] = s[r + k];
        }
    }

    const u32 t = lid / G;
    const u32 q4 = lid % G;
    for (u32 chunk = 0; chunk < n_chunks; chunk++) {
        const u32 t0 = (ch0 + chunk) * C;
        const u32 len = min(C, rows - t0);
        const u64 base = (u64)chunk * n_v + j;
        if (lid < C) {
            gs[lid] = gam[base * C + lid];
        }
        __syncthreads();
        if (lid < C) {
            eg[lid] = expf(gs[lid]);
            el[lid] = expf(gs[len - 1u] - gs[lid]);
        }
        __syncthreads();

        // Vn = U - W S
        const u32 tok = t0 + t;
        const u64 uwr = (base * C + t) * 2u * D;
        if (t < len) {
            F4 acc = f4_zero();
            for (u32 i = 0; i < D; i++) {
                f4_axpy(acc, uw[uwr + D + i], sb[i * G + q4]);
            }
            const u64 ui = uwr + c0 + q4 * 4u;
            F4 r;
#pragma unroll
            for (u32 k = 0; k < 4u; k++) {
                r.v[k] = uw[ui + k] - acc.v[k];
            }
            vn[t * G + q4] = r;
        }
        __syncthreads();

        // O = (Q exp(gamma)) S + P Vn
        if (t < len) {
            const u64 qr = (u64)tok * cd + qo;
            F4 acc = f4_zero();
            for (u32 i = 0; i < D; i++) {
                f4_axpy(acc, u[qr + i], sb[i * G + q4]);
            }
#pragma unroll
            for (u32 k = 0; k < 4u; k++) {
                acc.v[k] *= eg[t];
            }
            const u64 pr = (base * C + t) * C;
            for (u32 s2 = 0; s2 <= t; s2++) {
                f4_axpy(acc, pm[pr + s2], vn[s2 * G + q4]);
            }
            const u64 oi = (u64)tok * ow + (u64)j * D + c0 + q4 * 4u;
#pragma unroll
            for (u32 k = 0; k < 4u; k++) {
                o[oi + k] = acc.v[k];
            }
        }
        // Every read of the old S is done before it is replaced.
        __syncthreads();

        // S = exp(gamma_L) S + (K exp(gamma_L - gamma))^T Vn
        const float decay = eg[len - 1u];
        for (u32 e = lid; e < D * G; e += WG) {
            const u32 i = e / G;
            const u32 g4 = e % G;
            F4 acc = sb[e];
#pragma unroll
            for (u32 k = 0; k < 4u; k++) {
                acc.v[k] *= decay;
            }
            for (u32 s2 = 0; s2 < len; s2++) {
                f4_axpy(acc, u[(u64)(t0 + s2) * cd + ko + i] * el[s2], vn[s2 * G + g4]);
            }
            sb[e] = acc;
        }
        // gs, eg, el and vn are rewritten by the next chunk, and sb is read by it.
        __syncthreads();
    }

    for (u32 e = lid; e < D * G; e += WG) {
        const u64 r = sbase + (u64)(e / G) * D + c0 + (e % G) * 4u;
#pragma unroll
        for (u32 k = 0; k < 4u; k++) {
            s[r + k] = sb[e].v[k];
        }
    }
}
