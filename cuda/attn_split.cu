// Flash-style attention over a chunk of cache positions (port of shaders/attn_split.wgsl). One
// block of 64 threads per (tile of R query vectors, kv head, chunk of positions); the query
// vectors of kv head g are the (token, head) pairs with head in g's group, token-major, so one
// K/V element read from the cache serves R queries (the GQA group in decode, several tokens in
// prefill). Per tile of 64 positions: one thread per position forms its R scores (K dequantized
// once), online softmax per query (running max m, sum l), then each thread accumulates its
// head_dim stripe of p * V. Writes each query's chunk partial (m, l, unnormalised o[hd]) for
// attn_combine.
//
// Causal: token t sees positions 0..=pos0+t. Grouped GQA: query head h reads kv head h / group.
// Cache rows are `row_words` u32 words (ggml row, padded to a word). The cache dtypes are
// compiled in with the other constants (backend::gpu::kernels): K_TYPE, V_TYPE (0 f32, 1 f16,
// 2 bf16, 3 q8_0, 4 q4_0), R (R * hd <= MAX_Q, the query elements a block holds), WG, MAX_Q.
#include "common.cuh"

// Stands in for -inf, as in the WGSL.
#define NEG (-3.0e38f)

// The 4 bytes at even byte `at` of the row at word `base` (Q8_0/Q4_0 blocks are 2-aligned).
__device__ __forceinline__ u32 word2(const u32* __restrict__ c, u64 base, u32 at) {
    const u64 i = base + (at >> 2);
    if ((at & 2u) == 0u) {
        return c[i];
    }
    return (c[i] >> 16) | (c[i + 1u] << 16);
}

// Byte `at` of the row at word `base`.
__device__ __forceinline__ u32 byte_at(const u32* __restrict__ c, u64 base, u32 at) {
    return (c[base + (at >> 2)] >> ((at & 3u) * 8u)) & 0xffu;
}

// The f16 at even byte `at` (never straddles a word).
__device__ __forceinline__ float half_at(const u32* __restrict__ c, u64 base, u32 at) {
    return h2f((c[base + (at >> 2)] >> ((at & 2u) * 8u)) & 0xffffu);
}

// Element e of the V row at word `base`.
__device__ __forceinline__ float v_at(const u32* __restrict__ vc, u64 base, u32 e) {
    if (V_TYPE == 0) {
        return __uint_as_float(vc[base + e]);
    } else if (V_TYPE == 1 || V_TYPE == 2) {
        const u32 h = (vc[base + (e >> 1)] >> ((e & 1u) * 16u)) & 0xffffu;
        if (V_TYPE == 1) {
            return h2f(h);
        }
        return bf2f(h);
    } else if (V_TYPE == 3) {
        const u32 o = (e >> 5) * 34u;
        const float d = half_at(vc, base, o);
        const u32 qb = byte_at(vc, base, o + 2u + (e & 31u));
        return (float)((i32)(qb << 24) >> 24) * d;
    } else {
        const u32 o = (e >> 5) * 18u;
        const float d = half_at(vc, base, o);
        const u32 j = e & 31u;
        const u32 qb = byte_at(vc, base, o + 2u + (j & 15u));
        const u32 nib = j >= 16u ? qb >> 4 : qb & 15u;
        return (float)((i32)nib - 8) * d;
    }
}

// s[r] = q_r . K[row] over elements [e0, e0 + hd) of the K row at word `base`, with per-block
// partial sums bs scaled once by the block's d (as the WGSL).
__device__ __forceinline__ void k_scores(const u32* __restrict__ kc, const float* qs, u64 base,
                                         u32 e0, u32 hd, float* s) {
    float bs[R];
#pragma unroll
    for (u32 r = 0; r < R; r++) {
        s[r] = 0.0f;
        bs[r] = 0.0f;
    }
    if (K_TYPE == 0) {
        for (u32 i = 0; i < hd; i++) {
            const float kv = __uint_as_float(kc[base + e0 + i]);
#pragma unroll
            for (u32 r = 0; r < R; r++) {
                bs[r] += qs[r * hd + i] * kv;
            }
        }
#pragma unroll
        for (u32 r = 0; r < R; r++) {
            s[r] += bs[r];
        }
    } else if (K_TYPE == 1 || K_TYPE == 2) {
        // e0 and hd are even: whole words.
        for (u32 i = 0; i < hd; i += 2u) {
            const u32 w = kc[base + ((e0 + i) >> 1)];
            float k0;
            float k1;
            if (K_TYPE == 1) {
                k0 = h2f(w & 0xffffu);
                k1 = h2f(w >> 16);
            } else {
                k0 = __uint_as_float(w << 16);
                k1 = __uint_as_float(w & 0xffff0000u);
            }
#pragma unroll
            for (u32 r = 0; r < R; r++) {
                bs[r] += qs[r * hd + i] * k0;
                bs[r] += qs[r * hd + i + 1u] * k1;
            }
        }
#pragma unroll
        for (u32 r = 0; r < R; r++) {
            s[r] += bs[r];
        }
    } else if (K_TYPE == 3) {
        // hd is a multiple of 32: whole blocks.
        for (u32 b = 0; b < hd / 32u; b++) {
            const u32 o = ((e0 >> 5) + b) * 34u;
            for (u32 w = 0; w < 8u; w++) {
                const u32 qw = word2(kc, base, o + 2u + 4u * w);
                const u32 i = b * 32u + 4u * w;
#pragma unroll
                for (u32 j = 0; j < 4u; j++) {
                    const float kv = sbyte(qw, j);
#pragma unroll
                    for (u32 r = 0; r < R; r++) {
                        bs[r] += qs[r * hd + i + j] * kv;
                    }
                }
            }
            const float d = half_at(kc, base, o);
#pragma unroll
            for (u32 r = 0; r < R; r++) {
                s[r] += bs[r] * d;
                bs[r] = 0.0f;
            }
        }
    } else {
        for (u32 b = 0; b < hd / 32u; b++) {
            const u32 o = ((e0 >> 5) + b) * 18u;
            for (u32 w = 0; w < 4u; w++) {
                const u32 qw = word2(kc, base, o + 2u + 4u * w);
#pragma unroll
                for (u32 j = 0; j < 4u; j++) {
                    const u32 qb = ubyte(qw, j);
                    const u32 i = b * 32u + 4u * w + j;
                    const float lo = (float)((i32)(qb & 15u) - 8);
                    const float hi = (float)((i32)(qb >> 4) - 8);
#pragma unroll
                    for (u32 r = 0; r < R; r++) {
                        bs[r] += qs[r * hd + i] * lo;
                        bs[r] += qs[r * hd + i + 16u] * hi;
                    }
                }
            }
            const float d = half_at(kc, base, o);
#pragma unroll
            for (u32 r = 0; r < R; r++) {
                s[r] += bs[r] * d;
                bs[r] = 0.0f;
            }
        }
    }
}

extern "C" __global__ void __launch_bounds__(WG)
    attn_split(const float* __restrict__ q, const u32* __restrict__ kc, const u32* __restrict__ vc,
               float* __restrict__ part, u32 rows, u32 n_head, u32 hd, u32 group, u32 pos0,
               u32 n_chunks, u32 chunk_len, u32 k_row_words, u32 v_row_words, float scale,
               u32 n_tiles) {
    __shared__ float qs[MAX_Q];
    __shared__ float acc[MAX_Q];
    // Scores and probabilities [parity][r][position]; double-buffered by tile parity so that a
    // tile needs three barriers and none at its end.
    __shared__ float sc[1024];
    __shared__ float pc[1024];
    // New running max and rescale factor per query [parity][r].
    __shared__ float mn[16];
    __shared__ float al[16];

    const u32 lid = threadIdx.x;
    const u32 n_head_kv = n_head / group;
    const u32 idx = blockIdx.x;
    if (idx >= n_tiles * n_head_kv * n_chunks) {
        return;
    }
    const u32 c = idx % n_chunks;
    const u32 rest = idx / n_chunks;
    const u32 g = rest % n_head_kv;
    const u32 tile = rest / n_head_kv;
    const u32 e0 = g * hd;
    // Query vectors [first, first + n_q) of kv head g: entry e is token e / group, head
    // g * group + e % group.
    const u32 first = tile * R;
    const u32 n_q = min(R, rows * group - first);
    const u32 t_last = (first + n_q - 1u) / group;
    const u32 c0 = c * chunk_len;
    const u32 c1 = min(c0 + chunk_len, pos0 + t_last + 1u);

    for (u32 r = 0; r < R; r++) {
        const u32 e = first + r;
        const u64 th = (u64)(e / group) * n_head + g * group + e % group;
        for (u32 d = lid; d < hd; d += WG) {
            float v = 0.0f;
            if (r < n_q) {
                v = q[th * hd + d];
            }
            qs[r * hd + d] = v;
            acc[r * hd + d] = 0.0f;
        }
    }
    __syncthreads();

    // Running max and sum of query `lid` (threads lid < R).
    float m = NEG;
    float l = 0.0f;
    u32 pb = 0u;
    float s[R];
    for (u32 tile0 = c0; tile0 < c1; tile0 += WG) {
        const u32 j = tile0 + lid;
        const u32 n_t = min(WG, c1 - tile0);
        if (j < c1) {
            k_scores(kc, qs, (u64)j * k_row_words, e0, hd, s);
        }
#pragma unroll
        for (u32 r = 0; r < R; r++) {
            // Causal limit of query r: its token's position.
            const bool valid = j < c1 && r < n_q && j <= pos0 + (first + r) / group;
            sc[pb * 512u + r * WG + lid] = valid ? s[r] * scale : NEG;
        }
        __syncthreads();
        if (lid < R) {
            const u32 r = lid;
            float mt = NEG;
            for (u32 jj = 0; jj < n_t; jj++) {
                mt = fmaxf(mt, sc[pb * 512u + r * WG + jj]);
            }
            const float m_new = fmaxf(m, mt);
            al[pb * 8u + r] = expf(m - m_new);
            mn[pb * 8u + r] = m_new;
            m = m_new;
        }
        __syncthreads();
#pragma unroll
        for (u32 r = 0; r < R; r++) {
            const bool valid = j < c1 && r < n_q && j <= pos0 + (first + r) / group;
            float pj = 0.0f;
            if (valid) {
                pj = expf(sc[pb * 512u + r * WG + lid] - mn[pb * 8u + r]);
            }
            pc[pb * 512u + r * WG + lid] = pj;
        }
        __syncthreads();
        if (lid < R) {
            const u32 r = lid;
            float ps = 0.0f;
            for (u32 jj = 0; jj < n_t; jj++) {
                ps += pc[pb * 512u + r * WG + jj];
            }
            l = l * al[pb * 8u + r] + ps;
        }
        for (u32 d = lid; d < hd; d += WG) {
            float a[R];
#pragma unroll
            for (u32 r = 0; r < R; r++) {
                a[r] = acc[r * hd + d] * al[pb * 8u + r];
            }
            for (u32 jj = 0; jj < n_t; jj++) {
                const float v = v_at(vc, (u64)(tile0 + jj) * v_row_words, e0 + d);
#pragma unroll
                for (u32 r = 0; r < R; r++) {
                    a[r] += pc[pb * 512u + r * WG + jj] * v;
                }
            }
#pragma unroll
            for (u32 r = 0; r < R; r++) {
                acc[r * hd + d] = a[r];
            }
        }
        pb = 1u - pb;
    }

    // Each thread writes what it owns: its head_dim stripe, and (lid < R) m and l.
    for (u32 r = 0; r < n_q; r++) {
        const u32 e = first + r;
        const u64 th = (u64)(e / group) * n_head + g * group + e % group;
        const u64 out = (th * n_chunks + c) * (hd + 2u);
        if (lid == r) {
            part[out] = m;
            part[out + 1u] = l;
        }
        for (u32 d = lid; d < hd; d += WG) {
            part[out + 2u + d] = acc[r * hd + d];
        }
    }
}
