// The vision tower's 2-D rotary on q and k (port of shaders/vision_rope.wgsl): NEOX pairs
// (j, j + hd/2) with the (sin, cos) table of backend::vision_rope_table, q and k of
// qkv [n][3 * n_head * hd] written head-major, [n_head][n][hd] each. One thread per (token,
// head, pair).
#include "common.cuh"

extern "C" __global__ void __launch_bounds__(WG)
    vision_rope(const float* __restrict__ qkv, const float* __restrict__ rope,
                float* __restrict__ qr, float* __restrict__ kr, u32 n, u32 n_head, u32 hd) {
    const u64 i = (u64)blockIdx.x * WG + threadIdx.x;
    const u32 half = hd / 2u;
    if (i >= (u64)n * n_head * half) {
        return;
    }
    const u32 j = (u32)(i % half);
    const u32 h = (u32)((i / half) % n_head);
    const u64 t = i / half / n_head;
    const float sn = rope[(t * half + j) * 2u];
    const float cs = rope[(t * half + j) * 2u + 1u];
    const u64 width = (u64)n_head * hd;
    const u64 src = t * 3u * width + (u64)h * hd + j;
    const u64 dst = ((u64)h * n + t) * hd + j;
    const float qa = qkv[src];
    const float qb = qkv[src + half];
    qr[dst] = qa * cs - qb * sn;
    qr[dst + half] = qa * sn + qb * cs;
    const float ka = qkv[src + width];
    const float kb = qkv[src + width + half];
    kr[dst] = ka * cs - kb * sn;
    kr[dst + half] = ka * sn + kb * cs;
}
