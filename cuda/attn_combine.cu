// Merges attn_split's per-chunk partials of one (row, query head), one block each (port of
// shaders/attn_combine.wgsl): o = sum_c o_c e^(m_c - M) / sum_c l_c e^(m_c - M), then the output
// gate o * sigmoid(gate), gate being the second half of the head's [q_h | gate_h] slice of `qg`.
// Output [rows][n_head*hd].
#include "common.cuh"

// Largest chunk count (the host plans at most this many).

extern "C" __global__ void __launch_bounds__(WG)
    attn_combine(const float* __restrict__ part, const float* __restrict__ qg,
                 float* __restrict__ y, u32 rows, u32 n_head, u32 hd, u32 n_chunks) {
    __shared__ float wc[MAX_CHUNKS];
    const u32 lid = threadIdx.x;
    const u32 th = blockIdx.x;
    if (th >= rows * n_head) {
        return;
    }
    const u32 stride = hd + 2u;
    const u64 base = (u64)th * n_chunks * stride;
    // Every thread forms the same M and L (n_chunks is small).
    float mx = part[base];
    for (u32 c = 1u; c < n_chunks; c++) {
        mx = fmaxf(mx, part[base + (u64)c * stride]);
    }
    float l = 0.0f;
    for (u32 c = 0u; c < n_chunks; c++) {
        l += part[base + (u64)c * stride + 1u] * expf(part[base + (u64)c * stride] - mx);
    }
    const float inv = 1.0f / l;
    for (u32 c = lid; c < n_chunks; c += WG) {
        wc[c] = expf(part[base + (u64)c * stride] - mx) * inv;
    }
    __syncthreads();
    const u32 t = th / n_head;
    const u32 h = th % n_head;
    const u64 gate = (u64)t * 2u * n_head * hd + (u64)h * 2u * hd + hd;
    for (u32 d = lid; d < hd; d += WG) {
        float o = 0.0f;
        for (u32 c = 0u; c < n_chunks; c++) {
            o += part[base + (u64)c * stride + 2u + d] * wc[c];
        }
        const float g = qg[gate + d];
        y[(u64)th * hd + d] = o * (1.0f / (1.0f + expf(-g)));
    }
}
