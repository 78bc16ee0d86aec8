// x[r][c] += b[c] (port of shaders/add_bias.wgsl): the bias of a vision tower matmul, in place.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    add_bias(float* __restrict__ x, const float* __restrict__ b, u32 rows, u32 cols) {
    const u64 i = (u64)blockIdx.x * WG + threadIdx.x;
    if (i < (u64)rows * cols) {
        x[i] = x[i] + b[i % cols];
    }
}
