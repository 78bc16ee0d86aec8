// y[r] = ((x[r] - mean) * scale) * w + b, scale = 1 / sqrt(var + eps) (port of
// shaders/layer_norm.wgsl): ggml_norm then ggml_mul and ggml_add. One block of 256 threads per
// row; the mean, then the variance about it, each a block sum.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    layer_norm(const float* __restrict__ x, const float* __restrict__ w,
               const float* __restrict__ b, float* __restrict__ y, u32 rows, u32 cols,
               float eps) {
    __shared__ float partial[WG];
    const u32 r = blockIdx.x;
    const u32 lid = threadIdx.x;
    if (r >= rows) {
        return;
    }
    const u64 base = (u64)r * cols;
    float s = 0.0f;
    for (u32 i = lid; i < cols; i += WG) {
        s += x[base + i];
    }
    const float mean = block_sum(partial, lid, s, WG) / (float)cols;
    float q = 0.0f;
    for (u32 i = lid; i < cols; i += WG) {
        const float d = x[base + i] - mean;
        q += d * d;
    }
    const float scale = 1.0f / sqrtf(block_sum(partial, lid, q, WG) / (float)cols + eps);
    for (u32 i = lid; i < cols; i += WG) {
        y[base + i] = (x[base + i] - mean) * scale * w[i] + b[i];
    }
}
