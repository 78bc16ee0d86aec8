// y[r][c] += s[r] * x[r][c] (port of shaders/add_scaled.wgsl): a LoRA adapter's term, each row
// with its own scale. __fmul_rn / __fadd_rn keep the product and the sum rounded apart (no
// fused multiply-add), as llama.cpp's ggml_scale then ggml_add.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    add_scaled(float* __restrict__ y, const float* __restrict__ x, const float* __restrict__ s,
               u32 rows, u32 cols) {
    const u64 i = (u64)blockIdx.x * WG + threadIdx.x;
    if (i < (u64)rows * cols) {
        y[i] = __fadd_rn(y[i], __fmul_rn(s[i / cols], x[i]));
    }
}
