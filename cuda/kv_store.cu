// Stores f32 rows into a KV cache in its dtype (port of shaders/kv_store.wgsl), byte-compatible
// with ggml's row layout and reference quantizers (round-to-nearest; Q8_0 d = amax/127, Q4_0
// d = max/-8). Every division and product below is a single IEEE round-to-nearest operation
// (__fdiv_rn, __fmul_rn: never contracted into a fused multiply-add), as in ggml's C.
//
// The cache is an array of u32 words; each cache row is the ggml row (`width` elements, blocks
// of 32 for Q8_0/Q4_0) padded to a whole number of words (`row_words`). One thread writes one
// "unit" of whole words of a row:
//   f32: 1 word (1 element); f16/bf16: 1 word (2 elements, the odd tail half is 0);
//   q8_0: a pair of blocks (68 bytes = 17 words; a lone last block 34 bytes -> 9 words);
//   q4_0: a pair of blocks (36 bytes = 9 words; a lone last block 18 bytes -> 5 words).
// A block pair always starts on a word boundary, so no two threads share a word.
//
// KIND (the cache dtype: 0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q4_0) and WG come with the kernel
// (backend::gpu::kernels).
#include "common.cuh"

__device__ __forceinline__ void put_byte(u32* words, u32 at, u32 b) {
    words[at >> 2] |= (b & 0xffu) << ((at & 3u) * 8u);
}

// quantize_row_q8_0_ref for the block at `src`, into bytes at `at` of `words`.
__device__ __forceinline__ void quant_q8_0(const float* __restrict__ src, u32* words, u32 at) {
    float amax = 0.0f;
    for (u32 j = 0; j < 32u; j++) {
        const float v = fabsf(src[j]);
        amax = amax > v ? amax : v;
    }
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    const u32 h = f2h(d);
    put_byte(words, at, h);
    put_byte(words, at + 1u, h >> 8);
    for (u32 j = 0; j < 32u; j++) {
        // C's roundf: half away from zero.
        const i32 q = max(-128, min(127, (i32)roundf(__fmul_rn(src[j], id))));
        put_byte(words, at + 2u + j, (u32)q);
    }
}

// quantize_row_q4_0_ref for one block.
__device__ __forceinline__ void quant_q4_0(const float* __restrict__ src, u32* words, u32 at) {
    float amax = 0.0f;
    float mx = 0.0f;
    for (u32 j = 0; j < 32u; j++) {
        const float v = src[j];
        if (amax < fabsf(v)) {
            amax = fabsf(v);
            mx = v;
        }
    }
    const float d = __fdiv_rn(mx, -8.0f);
    const float id = d != 0.0f ? __fdiv_rn(1.0f, d) : 0.0f;
    const u32 h = f2h(d);
    put_byte(words, at, h);
    put_byte(words, at + 1u, h >> 8);
    for (u32 j = 0; j < 16u; j++) {
        const float s0 = __fmul_rn(src[j], id);
        const float s1 = __fmul_rn(src[j + 16u], id);
        // (int8_t)(x + 8.5f): truncation toward zero, then MIN(15, .).
        const u32 q0 = (u32)max(0, min(15, (i32)__fadd_rn(s0, 8.5f)));
        const u32 q1 = (u32)max(0, min(15, (i32)__fadd_rn(s1, 8.5f)));
        put_byte(words, at + 2u + j, q0 | (q1 << 4));
    }
}

extern "C" __global__ void __launch_bounds__(WG)
    kv_store(const float* __restrict__ src, u32* __restrict__ dst, u32 rows, u32 width,
             u32 row_words, u32 row0, u32 units) {
    const u64 u = (u64)blockIdx.x * WG + threadIdx.x;
    if (u >= (u64)rows * units) {
        return;
    }
    const u32 r = (u32)(u / units);
    const u32 k = (u32)(u % units);
    const float* s = src + (u64)r * width;
    u32* d = dst + (u64)(row0 + r) * row_words;
    if (KIND == 0) {
        d[k] = __float_as_uint(s[k]);
    } else if (KIND == 1 || KIND == 2) {
        const u32 e = 2u * k;
        u32 lo;
        u32 hi = 0u;
        if (KIND == 1) {
            lo = f2h(s[e]);
            if (e + 1u < width) {
                hi = f2h(s[e + 1u]);
            }
        } else {
            lo = f2bf(s[e]);
            if (e + 1u < width) {
                hi = f2bf(s[e + 1u]);
            }
        }
        d[k] = lo | (hi << 16);
    } else {
        const u32 nb = width / 32u;
        const u32 b0 = 2u * k;
        const bool pair = b0 + 1u < nb;
        u32 words[17];
#pragma unroll
        for (u32 i = 0; i < 17u; i++) {
            words[i] = 0u;
        }
        if (KIND == 3) {
            quant_q8_0(s + b0 * 32u, words, 0u);
            if (pair) {
                quant_q8_0(s + b0 * 32u + 32u, words, 34u);
            }
            const u32 n_words = pair ? 17u : 9u;
            for (u32 i = 0; i < n_words; i++) {
                d[17u * k + i] = words[i];
            }
        } else {
            quant_q4_0(s + b0 * 32u, words, 0u);
            if (pair) {
                quant_q4_0(s + b0 * 32u + 32u, words, 18u);
            }
            const u32 n_words = pair ? 9u : 5u;
            for (u32 i = 0; i < n_words; i++) {
                d[9u * k + i] = words[i];
            }
        }
    }
}
