// Gated RMSNorm of the Gated DeltaNet output, in place (port of shaders/gdn_gated_norm.wgsl): per
// token and V head (rows of d), o = o / sqrt(mean(o^2) + eps) * w * silu(z). One block of 64
// threads per (token, head).
#include "common.cuh"


extern "C" __global__ void __launch_bounds__(WG)
    gdn_gated_norm(float* __restrict__ o, const float* __restrict__ z, const float* __restrict__ w,
                   u32 n, u32 d, float eps) {
    __shared__ float partial[WG];
    const u32 lid = threadIdx.x;
    const u32 r = blockIdx.x;
    if (r >= n) {
        return;
    }
    const u64 base = (u64)r * d;
    float s = 0.0f;
    for (u32 i = lid; i < d; i += WG) {
        const float v = o[base + i];
        s += v * v;
    }
    const float scale = 1.0f / sqrtf(block_sum(partial, lid, s, WG) / (float)d + eps);
    for (u32 i = lid; i < d; i += WG) {
        const float zi = z[base + i];
        o[base + i] = o[base + i] * scale * w[i] * (zi / (1.0f + expf(-zi)));
    }
}
