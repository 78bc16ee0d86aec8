// Embedding lookup (port of shaders/embed.wgsl): y[o] = row ids[o] of the table, decoded with
// common.cuh `load8`. One block of 64 threads per id, 8 elements at a time. The inverse Hadamard
// rule, where the table carries one, runs afterwards (fwht.cu).
//
// Entry points embed_<type>, one per stored weight type.
#include "common.cuh"

#define WG 64u

template <int TY>
__device__ __forceinline__ void embed_impl(const u8* __restrict__ wq, const u32* __restrict__ ids,
                                           float* __restrict__ y, u32 n, u32 ne0, u32 row_bytes) {
    const u32 idx = blockIdx.x;
    if (idx >= n) {
        return;
    }
    float* out = y + (u64)idx * ne0;
    const u8* row = wq + (u64)ids[idx] * row_bytes;
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

#define EMBED(name, ty)                                                                        \
    extern "C" __global__ void __launch_bounds__(64)                                           \
        embed_##name(const u8* __restrict__ wq, const u32* __restrict__ ids,                   \
                     float* __restrict__ y, u32 n, u32 ne0, u32 row_bytes) {                   \
        embed_impl<ty>(wq, ids, y, n, ne0, row_bytes);                                         \
    }
FOR_EACH_WEIGHT_TYPE(EMBED)
