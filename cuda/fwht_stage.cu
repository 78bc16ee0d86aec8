// One butterfly stage (u+v, u-v) of the blockwise Walsh-Hadamard transform, in place, through
// global memory (port of shaders/fwht_stage.wgsl): for blocks larger than the 1024 elements
// fwht.cu holds in shared memory, the stages len = 1024, 2048, ..., block/2 run here, one launch
// each and in that order. One thread per pair; the last stage of an inverse transform also
// applies ⊙ s (flags & 4; `s` may be null otherwise).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    fwht_stage(const float* __restrict__ s, float* __restrict__ y, u32 rows, u32 width, u32 len,
               u32 flags) {
    const u32 half = width / 2u;
    const u64 q = (u64)blockIdx.x * WG + threadIdx.x;
    if (q >= (u64)rows * half) {
        return;
    }
    const u64 row = (q / half) * width;
    const u32 pr = (u32)(q % half);
    const u32 i = (pr / len) * 2u * len + pr % len;
    const u32 j = i + len;
    const float a = y[row + i];
    const float b = y[row + j];
    float u = a + b;
    float v = a - b;
    if ((flags & 4u) != 0u) {
        u = __fmul_rn(u, s[i]);
        v = __fmul_rn(v, s[j]);
    }
    y[row + i] = u;
    y[row + j] = v;
}
