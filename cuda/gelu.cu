// y = GELU(x) as ggml's CPU backend computes it on f32 (port of shaders/gelu.wgsl): 0 at or
// below -10, x at or above 10, otherwise ggml's f16 table (as f32, backend::gelu_f16_table) at
// x rounded to f16, so the result is ggml's bits.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    gelu(const float* __restrict__ x, const float* __restrict__ table, float* __restrict__ y,
         u32 n) {
    const u64 i = (u64)blockIdx.x * WG + threadIdx.x;
    if (i < n) {
        const float v = x[i];
        float g = v;
        if (v <= -10.0f) {
            g = 0.0f;
        } else if (v < 10.0f) {
            g = table[f2h(v)];
        }
        y[i] = g;
    }
}
