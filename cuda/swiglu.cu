// y = silu(gate) * up, elementwise (port of shaders/swiglu.wgsl).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    swiglu(const float* __restrict__ gate, const float* __restrict__ up, float* __restrict__ y,
           u32 n) {
    const u32 i = blockIdx.x * WG + threadIdx.x;
    if (i < n) {
        const float g = gate[i];
        y[i] = g / (1.0f + expf(-g)) * up[i];
    }
}
