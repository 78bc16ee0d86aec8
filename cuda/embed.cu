// Embedding lookup (port of shaders/embed.wgsl): y[o] = row i of a table part, for each (o, i)
// pair the host lists for this part (token ids are grouped by part), decoded with common.cuh
// `load8`. One block of 64 threads per pair, 8 elements at a time. The inverse Hadamard rule,
// where the table carries one, runs afterwards (fwht.cu).
//
// TY (the weight decoder) and WG come with the kernel (backend::gpu::kernels).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    embed(const u8* __restrict__ wq, const u32* __restrict__ pairs, float* __restrict__ y, u32 n,
          u32 ne0, u32 row_bytes) {
    const u32 idx = blockIdx.x;
    if (idx >= n) {
        return;
    }
    float* out = y + (u64)pairs[2u * idx] * ne0;
    const u8* row = wq + (u64)pairs[2u * idx + 1u] * row_bytes;
    for (u32 u = threadIdx.x; u * 8u < ne0; u += WG) {
        const u32 e = u * 8u;
        float w[8];
        load8<TY>(row, e, ne0, w);
        const u32 m = min(ne0 - e, 8u);
#pragma unroll
        for (u32 k = 0; k < 8u; k++) {
            if (k < m) {
                out[e + k] = w[k];
            }
        }
    }
}
