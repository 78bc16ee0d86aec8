// Shared by every kernel: integer types, exact float conversions and the weight decoders.
// Kernels name it with `#include "common.cuh"`; the host (src/backend/cuda/kernels.rs) puts this
// text in place of that line before NVRTC sees the source, so no header search path (and no CUDA
// toolkit header) is needed at run time. Conversions are bit operations or single PTX
// instructions; nothing here uses cuda_fp16.h.

typedef unsigned char u8;
typedef signed char i8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef int i32;
typedef unsigned long long u64;

// f16 bits -> f32, exact (every f16 is an f32); the hardware conversion.
__device__ __forceinline__ float h2f(u32 h) {
#ifdef TERN_CUDA_EMU
    return tern_emu_h2f(h);
#else
    float f;
    unsigned short s = (unsigned short)h;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(s));
    return f;
#endif
}

// bf16 bits -> f32, exact.
__device__ __forceinline__ float bf2f(u32 h) {
    return __uint_as_float(h << 16);
}

// IEEE binary32 -> binary16 bits, round to nearest even (half::f16::from_f32), subnormals
// kept; NaNs keep their top payload bits and become quiet. The bit-exact twin of kv_store.wgsl.
__device__ __forceinline__ u32 f2h(float x) {
    u32 u = __float_as_uint(x);
    u32 sign = (u >> 16) & 0x8000u;
    u32 a = u & 0x7fffffffu;
    if (a > 0x7f800000u) {
        return sign | 0x7e00u | ((a >> 13) & 0x3ffu);
    }
    if (a >= 0x477ff000u) {
        return sign | 0x7c00u;
    }
    if (a >= 0x38800000u) {
        u32 r = a - 0x38000000u + 0xfffu + ((a >> 13) & 1u);
        return sign | (r >> 13);
    }
    u32 e = a >> 23;
    if (e < 102u) {
        return sign;
    }
    // Subnormal half: round |x| / 2^-24 to an integer, ties to even.
    u32 m = (a & 0x7fffffu) | 0x800000u;
    u32 s = 126u - e;
    u32 q = m >> s;
    u32 rem = m & ((1u << s) - 1u);
    u32 half = 1u << (s - 1u);
    if (rem > half || (rem == half && (q & 1u) == 1u)) {
        q += 1u;
    }
    return sign | q;
}

// ggml_compute_fp32_to_bf16.
__device__ __forceinline__ u32 f2bf(float x) {
    u32 u = __float_as_uint(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return ((u >> 16) | 64u) & 0xffffu;
    }
    return ((u + 0x7fffu + ((u >> 16) & 1u)) >> 16) & 0xffffu;
}

// The 16 bits at an even byte address.
__device__ __forceinline__ u32 ld16(const u8* p) {
    return *(const u16*)p;
}

// The 32 bits at an even byte address (two aligned halves: blocks of 34 and 18 bytes leave
// 4-byte words misaligned).
__device__ __forceinline__ u32 ld32e(const u8* p) {
    return ld16(p) | (ld16(p + 2) << 16);
}

// Byte k (0..3) of a word, as a signed value.
__device__ __forceinline__ float sbyte(u32 w, u32 k) {
    return (float)((i32)(w << (24u - 8u * k)) >> 24);
}

// Byte k (0..3) of a word.
__device__ __forceinline__ u32 ubyte(u32 w, u32 k) {
    return (w >> (8u * k)) & 0xffu;
}

// Sum over a warp; every lane gets the total.
__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        v += __shfl_xor_sync(0xffffffffu, v, o);
    }
    return v;
}

// ---- weight decoders ------------------------------------------------------------------------
// The decoders of shaders/decode.wgsl (`load8`), one per stored type. A weight row is its
// stored bytes at `row` (a row starts at an even byte offset of a 256-byte aligned allocation);
// `e` is an element index, a multiple of 8, and load8 writes elements e..e+8 of that row to `w`
// as f32, decoded exactly as quant::dequantize_row does (level times scale, one rounding).
// Float rows may end inside a unit: elements at or past `ne0` read as 0. Type codes: 0 F32,
// 1 F16, 2 BF16, 3 Q8_0, 4 Q4_0, 5 PQ2_0 (and the legacy Q2_0, type 42), 6 PTQ1_0.

__device__ __forceinline__ void load8_f32(const u8* row, u32 e, u32 ne0, float* w) {
    const float* r = (const float*)row + e;
    if (e + 8u <= ne0 && (ne0 & 3u) == 0u) {
        float4 a = *(const float4*)r;
        float4 b = *(const float4*)(r + 4);
        w[0] = a.x; w[1] = a.y; w[2] = a.z; w[3] = a.w;
        w[4] = b.x; w[5] = b.y; w[6] = b.z; w[7] = b.w;
        return;
    }
#pragma unroll
    for (u32 k = 0; k < 8u; k++) {
        w[k] = e + k < ne0 ? r[k] : 0.0f;
    }
}

__device__ __forceinline__ void load8_f16(const u8* row, u32 e, u32 ne0, float* w) {
    const u8* b = row + 2u * e;
    if (e + 8u <= ne0 && (ne0 & 7u) == 0u) {
        uint4 q = *(const uint4*)b;
        u32 v[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (u32 k = 0; k < 4u; k++) {
            w[2 * k] = h2f(v[k] & 0xffffu);
            w[2 * k + 1] = h2f(v[k] >> 16);
        }
        return;
    }
#pragma unroll
    for (u32 k = 0; k < 8u; k++) {
        w[k] = e + k < ne0 ? h2f(ld16(b + 2u * k)) : 0.0f;
    }
}

__device__ __forceinline__ void load8_bf16(const u8* row, u32 e, u32 ne0, float* w) {
    const u8* b = row + 2u * e;
    if (e + 8u <= ne0 && (ne0 & 7u) == 0u) {
        uint4 q = *(const uint4*)b;
        u32 v[4] = {q.x, q.y, q.z, q.w};
#pragma unroll
        for (u32 k = 0; k < 4u; k++) {
            w[2 * k] = __uint_as_float(v[k] << 16);
            w[2 * k + 1] = __uint_as_float(v[k] & 0xffff0000u);
        }
        return;
    }
#pragma unroll
    for (u32 k = 0; k < 8u; k++) {
        w[k] = e + k < ne0 ? bf2f(ld16(b + 2u * k)) : 0.0f;
    }
}

// Q8_0: 34-byte blocks of 32, f16 d then 32 i8.
__device__ __forceinline__ void load8_q8_0(const u8* row, u32 e, float* w) {
    const u8* bb = row + (e / 32u) * 34u;
    float d = h2f(ld16(bb));
    const u8* q = bb + 2u + e % 32u;
    u32 lo = ld32e(q);
    u32 hi = ld32e(q + 4);
#pragma unroll
    for (u32 k = 0; k < 4u; k++) {
        w[k] = sbyte(lo, k) * d;
        w[4 + k] = sbyte(hi, k) * d;
    }
}

// Q4_0: 18-byte blocks of 32, f16 d then 16 bytes: low nibbles are elements 0..15, high 16..31.
__device__ __forceinline__ void load8_q4_0(const u8* row, u32 e, float* w) {
    const u8* bb = row + (e / 32u) * 18u;
    float d = h2f(ld16(bb));
    u32 o = e % 32u;
    const u8* q = bb + 2u + o % 16u;
    u32 sh = o >= 16u ? 4u : 0u;
    u32 lo = (ld32e(q) >> sh) & 0x0f0f0f0fu;
    u32 hi = (ld32e(q + 4) >> sh) & 0x0f0f0f0fu;
#pragma unroll
    for (u32 k = 0; k < 4u; k++) {
        w[k] = ((float)ubyte(lo, k) - 8.0f) * d;
        w[4 + k] = ((float)ubyte(hi, k) - 8.0f) * d;
    }
}

// PQ2_0: 34-byte blocks of 128, f16 d then 4 two-bit codes per byte, LSB first; w = (code-1)*d.
__device__ __forceinline__ void load8_pq2_0(const u8* row, u32 e, float* w) {
    const u8* bb = row + (e / 128u) * 34u;
    float d = h2f(ld16(bb));
    u32 c = ld16(bb + 2u + (e % 128u) / 4u);
#pragma unroll
    for (u32 k = 0; k < 8u; k++) {
        w[k] = ((float)((c >> (2u * k)) & 3u) - 1.0f) * d;
    }
}

// Trit n of byte b is ((u8)(b * 3^n) * 3) >> 8; `p` holds 3^n.
__device__ __forceinline__ float trit(u32 b, u32 p) {
    return (float)((((b * p) & 0xffu) * 3u) >> 8);
}

__device__ __forceinline__ u32 pow3(u32 n) {
    u32 p = 1u;
    for (u32 k = 0; k < n; k++) {
        p *= 3u;
    }
    return p;
}

// PTQ1_0: 28-byte blocks of 128 (so 4-byte aligned), qs[24] qh[2] then f16 d. Bytes 0..15 hold
// elements n*16+m (trit n of byte m), bytes 16..23 elements 80+n*8+m, bytes 24..25 120+n*2+h.
__device__ __forceinline__ void load8_ptq1_0(const u8* row, u32 e, float* w) {
    const u8* bb = row + (e / 128u) * 28u;
    float d = h2f(ld16(bb + 26u));
    u32 o = e % 128u;
    if (o < 120u) {
        u32 p;
        const u32* q;
        if (o < 80u) {
            p = pow3(o / 16u);
            q = (const u32*)(bb + o % 16u);
        } else {
            p = pow3((o - 80u) / 8u);
            q = (const u32*)(bb + 16u);
        }
        u32 lo = q[0];
        u32 hi = q[1];
#pragma unroll
        for (u32 k = 0; k < 4u; k++) {
            w[k] = (trit(ubyte(lo, k), p) - 1.0f) * d;
            w[4 + k] = (trit(ubyte(hi, k), p) - 1.0f) * d;
        }
    } else {
        u32 q = ld16(bb + 24u);
        u32 b0 = q & 0xffu;
        u32 b1 = q >> 8;
        // Elements 120 + 2n + h: trit n of byte 24 + h.
        u32 p = 1u;
#pragma unroll
        for (u32 n = 0; n < 4u; n++) {
            w[2 * n] = (trit(b0, p) - 1.0f) * d;
            w[2 * n + 1] = (trit(b1, p) - 1.0f) * d;
            p *= 3u;
        }
    }
}

template <int T>
__device__ __forceinline__ void load8(const u8* row, u32 e, u32 ne0, float* w) {
    if (T == 0) {
        load8_f32(row, e, ne0, w);
    } else if (T == 1) {
        load8_f16(row, e, ne0, w);
    } else if (T == 2) {
        load8_bf16(row, e, ne0, w);
    } else if (T == 3) {
        load8_q8_0(row, e, w);
    } else if (T == 4) {
        load8_q4_0(row, e, w);
    } else if (T == 5) {
        load8_pq2_0(row, e, w);
    } else {
        load8_ptq1_0(row, e, w);
    }
}

// softplus as ggml computes it (shaders/softplus.wgsl): x above 20 as it is, else
// log1p(exp(x)).
__device__ __forceinline__ float softplus(float x) {
    if (x > 20.0f) {
        return x;
    }
    const float e = expf(x);
    // log1p(e): the series where 1 + e would lose e's digits.
    if (e < 1e-3f) {
        return e * (1.0f - e * (0.5f - e / 3.0f));
    }
    return logf(1.0f + e);
}

// The sum over a block of one float per thread, by the tree of shaders/reduce.wgsl (the same
// order every time). `partial` is the kernel's __shared__ float[WG]; every thread of the block
// calls it, and it ends with a barrier, so it may be called again.
__device__ __forceinline__ float block_sum(float* partial, u32 lid, float v, u32 wg) {
    partial[lid] = v;
    __syncthreads();
    for (u32 stride = wg / 2u; stride > 0u; stride /= 2u) {
        if (lid < stride) {
            partial[lid] += partial[lid + stride];
        }
        __syncthreads();
    }
    const float sum = partial[0];
    __syncthreads();
    return sum;
}
