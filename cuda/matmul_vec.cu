// Matrix-vector product for decode (port of shaders/matmul_vec.wgsl): y[t][row0 + r] = W[r] . x[t]
// for the rows r of one weight part and 1 to 4 token rows t per group. One warp per (output row, group of 4
// tokens), four warps per block: the lanes stride over the row in units of 8 elements, decode
// each unit once from the stored bytes (common.cuh `load8`) and use it for every token of the
// group, then the warp sums with shuffles (the WGSL's subgroup path). f32 accumulation.
//
// TY (the weight decoder), NT and WARPS come with the kernel (backend::gpu::kernels).
#include "common.cuh"

// x[o .. o+8] . w, where only the first ne0 - e elements of the unit exist.
__device__ __forceinline__ float dot8(const float* w, const float* __restrict__ x, u32 e, u32 ne0) {
    if (e + 8u <= ne0 && (ne0 & 3u) == 0u) {
        float4 a = *(const float4*)(x + e);
        float4 b = *(const float4*)(x + e + 4u);
        return w[0] * a.x + w[1] * a.y + w[2] * a.z + w[3] * a.w
             + (w[4] * b.x + w[5] * b.y + w[6] * b.z + w[7] * b.w);
    }
    float s = 0.0f;
#pragma unroll
    for (u32 k = 0; k < 8u; k++) {
        if (e + k < ne0) {
            s += w[k] * x[e + k];
        }
    }
    return s;
}

extern "C" __global__ void __launch_bounds__(32 * WARPS)
    matmul_vec(const u8* __restrict__ wq, const float* __restrict__ x, float* __restrict__ y,
               u32 n_tok, u32 ne0, u32 n_rows, u32 row0, u32 n_out, u32 row_bytes) {
    const u32 lane = threadIdx.x & 31u;
    const u32 n_groups = (n_tok + NT - 1u) / NT;
    const u64 idx = (u64)blockIdx.x * WARPS + (threadIdx.x >> 5);
    if (idx >= (u64)n_rows * n_groups) {
        return;
    }
    const u32 r = (u32)(idx % n_rows);
    const u32 t0 = (u32)(idx / n_rows) * NT;
    const u32 nt = min(n_tok - t0, NT);
    const u8* row = wq + (u64)r * row_bytes;
    // Tokens past the last are read as the last one again; their sums are not written.
    const u32 last = n_tok - 1u;
    const float* x0 = x + (u64)t0 * ne0;
    const float* x1 = x + (u64)min(t0 + 1u, last) * ne0;
    const float* x2 = x + (u64)min(t0 + 2u, last) * ne0;
    const float* x3 = x + (u64)min(t0 + 3u, last) * ne0;

    float a0 = 0.0f, a1 = 0.0f, a2 = 0.0f, a3 = 0.0f;
    for (u32 u = lane; u * 8u < ne0; u += 32u) {
        const u32 e = u * 8u;
        float w[8];
        load8<TY>(row, e, ne0, w);
        if (nt == 1u) {
            a0 += dot8(w, x0, e, ne0);
        } else {
            a0 += dot8(w, x0, e, ne0);
            a1 += dot8(w, x1, e, ne0);
            a2 += dot8(w, x2, e, ne0);
            a3 += dot8(w, x3, e, ne0);
        }
    }
    a0 = warp_sum(a0);
    if (nt > 1u) {
        a1 = warp_sum(a1);
        a2 = warp_sum(a2);
        a3 = warp_sum(a3);
    }
    if (lane == 0u) {
        y[(u64)t0 * n_out + row0 + r] = a0;
        if (nt > 1u) {
            y[(u64)(t0 + 1u) * n_out + row0 + r] = a1;
        }
        if (nt > 2u) {
            y[(u64)(t0 + 2u) * n_out + row0 + r] = a2;
        }
        if (nt > 3u) {
            y[(u64)(t0 + 3u) * n_out + row0 + r] = a3;
        }
    }
}
