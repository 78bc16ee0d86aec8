// Attention prologue (port of shaders/attn_prep.wgsl), one block of 64 threads per (token, head)
// over the n_head query heads followed by the n_head_kv key heads: RMSNorm over head_dim times
// the q_norm / k_norm weight, then partial NEOX RoPE on the first n_rot dims with ggml's IMROPE
// sector rule (text positions (p, p, p, 0): pairs whose sector is outside t/h/w rotate by
// position 0). Query heads are read from the first half of each [q_h | gate_h] slice of `qg`;
// the result goes to `qo` [rows][n_head][hd], key heads to `ko` [rows][n_head_kv * hd] (stored
// into the cache by kv_store). The rotation's (sin, cos) per (row, pair) come from the host
// (`backend::rope_table`), the CPU reference's own numbers.
#include "common.cuh"

// Largest head_dim (checked by the host).

extern "C" __global__ void __launch_bounds__(WG)
    attn_prep(const float* __restrict__ qg, const float* __restrict__ k,
              const float* __restrict__ q_norm, const float* __restrict__ k_norm,
              float* __restrict__ qo, float* __restrict__ ko, const float* __restrict__ rope,
              u32 rows, u32 n_head, u32 n_head_kv, u32 hd, u32 n_rot, float eps) {
    __shared__ float xs[MAX_HD];
    __shared__ float red[WG];
    const u32 lid = threadIdx.x;
    const u32 heads = n_head + n_head_kv;
    const u32 idx = blockIdx.x;
    if (idx >= rows * heads) {
        return;
    }
    const u32 t = idx / heads;
    const u32 hh = idx % heads;
    const bool is_q = hh < n_head;
    const u32 width = n_head_kv * hd;
    u64 src;
    u64 dst;
    if (is_q) {
        src = (u64)t * 2u * n_head * hd + (u64)hh * 2u * hd;
        dst = ((u64)t * n_head + hh) * hd;
    } else {
        src = (u64)t * width + (u64)(hh - n_head) * hd;
        dst = src;
    }
    const float* in = is_q ? qg : k;
    const float* nw = is_q ? q_norm : k_norm;
    float* out = is_q ? qo : ko;

    float ss = 0.0f;
    for (u32 i = lid; i < hd; i += WG) {
        const float v = in[src + i];
        xs[i] = v;
        ss += v * v;
    }
    const float scale = 1.0f / sqrtf(block_sum(red, lid, ss, WG) / (float)hd + eps);
    for (u32 i = lid; i < hd; i += WG) {
        xs[i] = xs[i] * scale * nw[i];
    }
    __syncthreads();

    const u32 half = n_rot / 2u;
    for (u32 i = lid; i < half; i += WG) {
        const float sn = rope[((u64)t * half + i) * 2u];
        const float cs = rope[((u64)t * half + i) * 2u + 1u];
        const float a = xs[i];
        const float b = xs[i + half];
        out[dst + i] = a * cs - b * sn;
        out[dst + i + half] = a * sn + b * cs;
    }
    for (u32 i = n_rot + lid; i < hd; i += WG) {
        out[dst + i] = xs[i];
    }
}
