// Stores f32 rows into a KV cache in its dtype, byte-compatible with ggml's row layout and
// reference quantizers (round-to-nearest; Q8_0 d = amax/127, Q4_0 d = max/-8).
//
// The cache is an array of u32 words; each cache row is the ggml row (`width` elements, blocks
// of 32 for Q8_0/Q4_0) padded to a whole number of words (`row_words`). One invocation writes
// one "unit" of whole words of a row:
//   f32: 1 word (1 element); f16/bf16: 1 word (2 elements, the odd tail half is 0);
//   q8_0: a pair of blocks (68 bytes = 17 words; a lone last block 34 bytes -> 9 words);
//   q4_0: a pair of blocks (36 bytes = 9 words; a lone last block 18 bytes -> 5 words).
// A block pair always starts on a word boundary, so no two invocations share a word.
//
// KIND comes with the kernel (backend::gpu::kernels: 0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q4_0).

struct Params {
    rows: u32,
    width: u32,
    row_words: u32,
    // Cache row of the first source row.
    row0: u32,
    // Units per row.
    units: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> src: array<f32>;
@group(0) @binding(2) var<storage, read_write> dst: array<u32>;

#include "f16.wgsl"

// ggml_compute_fp32_to_bf16.
fn f32_to_bf16(x: f32) -> u32 {
    let u = bitcast<u32>(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return ((u >> 16u) | 64u) & 0xffffu;
    }
    return ((u + 0x7fffu + ((u >> 16u) & 1u)) >> 16u) & 0xffffu;
}

fn next_up(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) + 1u);
}

fn next_down(x: f32) -> f32 {
    return bitcast<f32>(bitcast<u32>(x) - 1u);
}

// a / b rounded to nearest for a >= 0, b > 0, whatever the precision of `/`: the quotient is
// moved to the neighbour whose exact residual a - q*b (one fused multiply-add) is smaller.
fn div_rn(a: f32, b: f32) -> f32 {
    var q = a / b;
    if (a == 0.0) {
        return 0.0;
    }
    for (var i = 0; i < 4; i++) {
        let r = abs(fma(-q, b, a));
        let up = next_up(q);
        let dn = next_down(q);
        let ru = abs(fma(-up, b, a));
        let rd = abs(fma(-dn, b, a));
        if (ru < r || (ru == r && (bitcast<u32>(up) & 1u) == 0u)) {
            q = up;
        } else if (rd < r || (rd == r && (bitcast<u32>(dn) & 1u) == 0u)) {
            q = dn;
        } else {
            break;
        }
    }
    return q;
}

// C's roundf: half away from zero (WGSL's round() is half to even).
fn round_away(v: f32) -> f32 {
    let a = abs(v);
    var t = trunc(a);
    if (a - t >= 0.5) {
        t += 1.0;
    }
    return select(t, -t, v < 0.0);
}

var<private> words: array<u32, 17>;

fn put_byte(at: u32, b: u32) {
    words[at >> 2u] |= (b & 0xffu) << ((at & 3u) * 8u);
}

// quantize_row_q8_0_ref for the block at element `e0` of source row `base`, into bytes at `at`.
fn quant_q8_0(base: u32, at: u32) {
    var amax = 0.0;
    for (var j = 0u; j < 32u; j++) {
        let v = abs(src[base + j]);
        amax = select(v, amax, amax > v);
    }
    let d = div_rn(amax, 127.0);
    var id = 0.0;
    if (d != 0.0) {
        id = div_rn(1.0, d);
    }
    let h = f32_to_f16(d);
    put_byte(at, h);
    put_byte(at + 1u, h >> 8u);
    for (var j = 0u; j < 32u; j++) {
        let q = clamp(i32(round_away(src[base + j] * id)), -128, 127);
        put_byte(at + 2u + j, u32(q));
    }
}

// quantize_row_q4_0_ref for one block.
fn quant_q4_0(base: u32, at: u32) {
    var amax = 0.0;
    var mx = 0.0;
    for (var j = 0u; j < 32u; j++) {
        let v = src[base + j];
        if (amax < abs(v)) {
            amax = abs(v);
            mx = v;
        }
    }
    // max / -8 is exact as a product by -1/8.
    let d = mx * -0.125;
    var id = 0.0;
    if (d > 0.0) {
        id = div_rn(1.0, d);
    } else if (d < 0.0) {
        id = -div_rn(1.0, -d);
    }
    let h = f32_to_f16(d);
    put_byte(at, h);
    put_byte(at + 1u, h >> 8u);
    for (var j = 0u; j < 16u; j++) {
        let s0 = src[base + j] * id;
        let s1 = src[base + j + 16u] * id;
        let q0 = u32(clamp(i32(s0 + 8.5), 0, 15));
        let q1 = u32(clamp(i32(s1 + 8.5), 0, 15));
        put_byte(at + 2u + j, q0 | (q1 << 4u));
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let u = (wid.x + wid.y * nwg.x) * 64u + lid.x;
    if (u >= p.rows * p.units) {
        return;
    }
    let r = u / p.units;
    let k = u % p.units;
    let sbase = r * p.width;
    let dbase = (p.row0 + r) * p.row_words;
    if (KIND == 0u) {
        dst[dbase + k] = bitcast<u32>(src[sbase + k]);
    } else if (KIND == 1u || KIND == 2u) {
        let e = 2u * k;
        var lo = 0u;
        var hi = 0u;
        if (KIND == 1u) {
            lo = f32_to_f16(src[sbase + e]);
            if (e + 1u < p.width) {
                hi = f32_to_f16(src[sbase + e + 1u]);
            }
        } else {
            lo = f32_to_bf16(src[sbase + e]);
            if (e + 1u < p.width) {
                hi = f32_to_bf16(src[sbase + e + 1u]);
            }
        }
        dst[dbase + k] = lo | (hi << 16u);
    } else {
        let nb = p.width / 32u;
        let b0 = 2u * k;
        let pair = b0 + 1u < nb;
        for (var i = 0u; i < 17u; i++) {
            words[i] = 0u;
        }
        var n_words = 0u;
        if (KIND == 3u) {
            quant_q8_0(sbase + b0 * 32u, 0u);
            n_words = 9u;
            if (pair) {
                quant_q8_0(sbase + b0 * 32u + 32u, 34u);
                n_words = 17u;
            }
            for (var i = 0u; i < n_words; i++) {
                dst[dbase + 17u * k + i] = words[i];
            }
        } else {
            quant_q4_0(sbase + b0 * 32u, 0u);
            n_words = 5u;
            if (pair) {
                quant_q4_0(sbase + b0 * 32u + 32u, 18u);
                n_words = 9u;
            }
            for (var i = 0u; i < n_words; i++) {
                dst[dbase + 9u * k + i] = words[i];
            }
        }
    }
}
