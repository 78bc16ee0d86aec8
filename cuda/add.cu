// x += y, elementwise (port of shaders/add.wgsl).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    add(float* __restrict__ x, const float* __restrict__ y, u32 n) {
    const u32 i = blockIdx.x * WG + threadIdx.x;
    if (i < n) {
        x[i] = x[i] + y[i];
    }
}
