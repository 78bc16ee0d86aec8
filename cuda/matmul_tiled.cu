// Tiled matrix product for prefill (port of shaders/matmul_tiled.wgsl): y[t][row0 + r] = W[r] . x[t]
// for the rows r of one weight part and any number of token rows. Each block computes a tile of 64 output rows by 32 tokens: per step
// of 32 input elements, its 256 threads decode the 64x32 weight slice once into shared memory
// (one 8-element unit each, common.cuh `load8`) and stage the 32x32 input slice next to it, then
// each thread accumulates 4 rows x 2 tokens. Accumulation is f32.
//
// TY (the weight decoder), BM, BN and BK come with the kernel (backend::gpu::kernels).
#include "common.cuh"

// Shared tiles are k-major with one column of padding against bank conflicts.
#define WS 65u
#define XS 33u

extern "C" __global__ void __launch_bounds__(WG)
    matmul_tiled(const u8* __restrict__ wq, const float* __restrict__ x, float* __restrict__ y,
                 u32 n_tok, u32 ne0, u32 n_rows, u32 row0, u32 n_out, u32 row_bytes) {
    __shared__ float ws[BK * WS];
    __shared__ float xs[BK * XS];
    const u32 lid = threadIdx.x;
    const u32 n_rt = (n_rows + BM - 1u) / BM;
    const u32 n_tt = (n_tok + BN - 1u) / BN;
    const u32 idx = blockIdx.x;
    if (idx >= n_rt * n_tt) {
        return;
    }
    const u32 r0 = (idx % n_rt) * BM;
    const u32 t0 = (idx / n_rt) * BN;
    // Loading: thread -> (weight row lr of the tile, unit lu of the 32-wide step). Rows past the
    // end read the last row again; their results are not written.
    const u32 lr = lid / 4u;
    const u32 lu = lid % 4u;
    const u8* row = wq + (u64)min(r0 + lr, n_rows - 1u) * row_bytes;
    // Computing: thread -> rows tx + 16i, tokens ty + 16j of the tile.
    const u32 tx = lid % 16u;
    const u32 ty = lid / 16u;

    float acc0[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    float acc1[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (u32 k0 = 0; k0 < ne0; k0 += BK) {
        const u32 c = 8u * lu;
        float w[8];
        load8<TY>(row, k0 + c, ne0, w);
#pragma unroll
        for (u32 k = 0; k < 8u; k++) {
            ws[(c + k) * WS + lr] = w[k];
        }
#pragma unroll
        for (u32 j = 0; j < 4u; j++) {
            const u32 l = lid + WG * j;
            const u32 tl = l / BK;
            const u32 kk = l % BK;
            const u32 t = t0 + tl;
            const u32 k = k0 + kk;
            float v = 0.0f;
            if (t < n_tok && k < ne0) {
                v = x[(u64)t * ne0 + k];
            }
            xs[kk * XS + tl] = v;
        }
        __syncthreads();
#pragma unroll 8
        for (u32 kk = 0; kk < BK; kk++) {
            const u32 wb = kk * WS + tx;
            const float xa = xs[kk * XS + ty];
            const float xb = xs[kk * XS + ty + 16u];
#pragma unroll
            for (u32 i = 0; i < 4u; i++) {
                const float a = ws[wb + 16u * i];
                acc0[i] += a * xa;
                acc1[i] += a * xb;
            }
        }
        __syncthreads();
    }

    const u32 ta = t0 + ty;
    const u32 tb = ta + 16u;
#pragma unroll
    for (u32 i = 0; i < 4u; i++) {
        const u32 r = r0 + tx + 16u * i;
        if (r < n_rows) {
            if (ta < n_tok) {
                y[(u64)ta * n_out + row0 + r] = acc0[i];
            }
            if (tb < n_tok) {
                y[(u64)tb * n_out + row0 + r] = acc1[i];
            }
        }
    }
}
