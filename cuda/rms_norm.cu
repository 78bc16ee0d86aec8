// y[r] = x[r] * w / sqrt(mean(x[r]^2) + eps) (port of shaders/rms_norm.wgsl): one block of 256
// threads per row, the sum of squares reduced through shared memory.
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    rms_norm(const float* __restrict__ x, const float* __restrict__ w, float* __restrict__ y,
             u32 rows, u32 cols, float eps) {
    __shared__ float partial[WG];
    const u32 r = blockIdx.x;
    const u32 lid = threadIdx.x;
    if (r >= rows) {
        return;
    }
    const u64 base = (u64)r * cols;
    float s = 0.0f;
    for (u32 i = lid; i < cols; i += WG) {
        const float v = x[base + i];
        s += v * v;
    }
    const float scale = 1.0f / sqrtf(block_sum(partial, lid, s, WG) / (float)cols + eps);
    for (u32 i = lid; i < cols; i += WG) {
        y[base + i] = x[base + i] * scale * w[i];
    }
}
