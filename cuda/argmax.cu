// Per-row argmax (port of shaders/argmax.wgsl), one block of 256 threads per row; ties go to
// the lowest index (as the CPU's first-max scan). Writes one u32 id per row.
#include "common.cuh"

#define NONE 0xffffffffu

extern "C" __global__ void __launch_bounds__(WG)
    argmax(const float* __restrict__ x, u32* __restrict__ ids, u32 rows, u32 cols) {
    __shared__ float bv[WG];
    __shared__ u32 bi[WG];
    const u32 r = blockIdx.x;
    const u32 lid = threadIdx.x;
    if (r >= rows) {
        return;
    }
    const u64 base = (u64)r * cols;
    // Each thread scans a strided stripe in increasing index order; strict > keeps the first of
    // equal values.
    u32 best_i = NONE;
    float best_v = 0.0f;
    for (u32 i = lid; i < cols; i += WG) {
        const float v = x[base + i];
        if (best_i == NONE || v > best_v) {
            best_v = v;
            best_i = i;
        }
    }
    bv[lid] = best_v;
    bi[lid] = best_i;
    __syncthreads();
    for (u32 stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            const u32 oi = bi[lid + stride];
            const float ov = bv[lid + stride];
            const u32 mi = bi[lid];
            if (oi != NONE && (mi == NONE || ov > bv[lid] || (ov == bv[lid] && oi < mi))) {
                bv[lid] = ov;
                bi[lid] = oi;
            }
        }
        __syncthreads();
    }
    if (lid == 0u) {
        ids[r] = bi[0];
    }
}
