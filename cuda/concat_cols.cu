// y[r] = [a[r] | b[r]]: rows of a and b side by side (port of shaders/concat_cols.wgsl).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    concat_cols(const float* __restrict__ a, const float* __restrict__ b, float* __restrict__ y,
                u32 rows, u32 ca, u32 cb) {
    const u64 i = (u64)blockIdx.x * WG + threadIdx.x;
    const u32 w = ca + cb;
    if (i >= (u64)rows * w) {
        return;
    }
    const u64 r = i / w;
    const u32 c = (u32)(i % w);
    if (c < ca) {
        y[i] = a[r * ca + c];
    } else {
        y[i] = b[r * cb + (c - ca)];
    }
}
