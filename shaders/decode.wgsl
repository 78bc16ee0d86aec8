// The weight decoders, included by matmul_vec.wgsl, matmul_tiled.wgsl and embed.wgsl (and
// ported to cuda/common.cuh). A weight is its stored bytes read as array<u32> `wq`, which the
// including kernel declares; `rb` is the byte offset of a row, `e` an element index (a multiple
// of 8) and `load8` returns elements e..e+8 of that row as f32, decoded exactly as
// quant::dequantize_row does (level times scale, one rounding). Every row and block starts at an
// even byte offset. Float rows may end inside a unit: elements at or past `ne0` read as 0. `TY`
// is the decoder the kernel is built with (backend::gpu::kernels::weight_code): 0 F32, 1 F16,
// 2 BF16, 3 Q8_0, 4 Q4_0, 5 PQ2_0 (and Q2_0Legacy), 6 PTQ1_0.

struct W8 {
    lo: vec4<f32>,
    hi: vec4<f32>,
}

fn w8(v: array<f32, 8>) -> W8 {
    return W8(vec4<f32>(v[0], v[1], v[2], v[3]), vec4<f32>(v[4], v[5], v[6], v[7]));
}

// The 16 bits at even byte offset b.
fn half_at(b: u32) -> u32 {
    return (wq[b >> 2u] >> ((b & 2u) * 8u)) & 0xffffu;
}

// The 32 bits at even byte offset b.
fn word_at(b: u32) -> u32 {
    let i = b >> 2u;
    if ((b & 2u) == 0u) {
        return wq[i];
    }
    return (wq[i] >> 16u) | (wq[i + 1u] << 16u);
}

fn f16_at(b: u32) -> f32 {
    return unpack2x16float(half_at(b)).x;
}

fn bf16_pair(w: u32) -> vec2<f32> {
    return vec2<f32>(bitcast<f32>(w << 16u), bitcast<f32>(w & 0xffff0000u));
}

fn load8_f32(rb: u32, e: u32, ne0: u32) -> W8 {
    let i = rb / 4u + e;
    if (e + 8u <= ne0) {
        return W8(bitcast<vec4<f32>>(vec4<u32>(wq[i], wq[i + 1u], wq[i + 2u], wq[i + 3u])),
                  bitcast<vec4<f32>>(vec4<u32>(wq[i + 4u], wq[i + 5u], wq[i + 6u], wq[i + 7u])));
    }
    var v: array<f32, 8>;
    for (var k = 0u; k < 8u; k++) {
        if (e + k < ne0) {
            v[k] = bitcast<f32>(wq[i + k]);
        }
    }
    return w8(v);
}

fn load8_f16(rb: u32, e: u32, ne0: u32) -> W8 {
    let b = rb + 2u * e;
    if (e + 8u <= ne0) {
        return W8(vec4<f32>(unpack2x16float(word_at(b)), unpack2x16float(word_at(b + 4u))),
                  vec4<f32>(unpack2x16float(word_at(b + 8u)), unpack2x16float(word_at(b + 12u))));
    }
    var v: array<f32, 8>;
    for (var k = 0u; k < 8u; k++) {
        if (e + k < ne0) {
            v[k] = f16_at(b + 2u * k);
        }
    }
    return w8(v);
}

fn load8_bf16(rb: u32, e: u32, ne0: u32) -> W8 {
    let b = rb + 2u * e;
    if (e + 8u <= ne0) {
        return W8(vec4<f32>(bf16_pair(word_at(b)), bf16_pair(word_at(b + 4u))),
                  vec4<f32>(bf16_pair(word_at(b + 8u)), bf16_pair(word_at(b + 12u))));
    }
    var v: array<f32, 8>;
    for (var k = 0u; k < 8u; k++) {
        if (e + k < ne0) {
            v[k] = bitcast<f32>(half_at(b + 2u * k) << 16u);
        }
    }
    return w8(v);
}

// Q8_0: 34-byte blocks of 32, f16 d then 32 i8.
fn load8_q8_0(rb: u32, e: u32) -> W8 {
    let bb = rb + (e / 32u) * 34u;
    let d = f16_at(bb);
    let q = bb + 2u + e % 32u;
    return W8(vec4<f32>(unpack4xI8(word_at(q))) * d, vec4<f32>(unpack4xI8(word_at(q + 4u))) * d);
}

// Q4_0: 18-byte blocks of 32, f16 d then 16 bytes: low nibbles are elements 0..15, high 16..31.
fn load8_q4_0(rb: u32, e: u32) -> W8 {
    let bb = rb + (e / 32u) * 18u;
    let d = f16_at(bb);
    let o = e % 32u;
    let q = bb + 2u + o % 16u;
    let sh = select(0u, 4u, o >= 16u);
    let lo = vec4<f32>(unpack4xU8((word_at(q) >> sh) & 0x0f0f0f0fu));
    let hi = vec4<f32>(unpack4xU8((word_at(q + 4u) >> sh) & 0x0f0f0f0fu));
    return W8((lo - 8.0) * d, (hi - 8.0) * d);
}

// PQ2_0: 34-byte blocks of 128, f16 d then 4 two-bit codes per byte, LSB first; w = (code-1)*d.
fn load8_pq2_0(rb: u32, e: u32) -> W8 {
    let bb = rb + (e / 128u) * 34u;
    let d = f16_at(bb);
    let c = vec4<u32>(half_at(bb + 2u + (e % 128u) / 4u));
    let lo = vec4<f32>((c >> vec4<u32>(0u, 2u, 4u, 6u)) & vec4<u32>(3u));
    let hi = vec4<f32>((c >> vec4<u32>(8u, 10u, 12u, 14u)) & vec4<u32>(3u));
    return W8((lo - 1.0) * d, (hi - 1.0) * d);
}

// Trit n of byte b is ((u8)(b * 3^n) * 3) >> 8; `p` holds 3^n.
fn trits(b: vec4<u32>, p: vec4<u32>) -> vec4<f32> {
    return vec4<f32>((((b * p) & vec4<u32>(0xffu)) * 3u) >> vec4<u32>(8u));
}

fn pow3(n: u32) -> u32 {
    var p = 1u;
    for (var k = 0u; k < n; k++) {
        p *= 3u;
    }
    return p;
}

// PTQ1_0: 28-byte blocks of 128 (so 4-byte aligned), qs[24] qh[2] then f16 d. Bytes 0..15 hold
// elements n*16+m (trit n of byte m), bytes 16..23 elements 80+n*8+m, bytes 24..25 120+n*2+h.
fn load8_ptq1_0(rb: u32, e: u32) -> W8 {
    let bb = rb + (e / 128u) * 28u;
    let d = f16_at(bb + 26u);
    let o = e % 128u;
    var lo: vec4<f32>;
    var hi: vec4<f32>;
    if (o < 80u) {
        let p = vec4<u32>(pow3(o / 16u));
        let i = (bb + o % 16u) / 4u;
        lo = trits(unpack4xU8(wq[i]), p);
        hi = trits(unpack4xU8(wq[i + 1u]), p);
    } else if (o < 120u) {
        let p = vec4<u32>(pow3((o - 80u) / 8u));
        let i = (bb + 16u) / 4u;
        lo = trits(unpack4xU8(wq[i]), p);
        hi = trits(unpack4xU8(wq[i + 1u]), p);
    } else {
        let q = wq[(bb + 24u) / 4u];
        let v = vec4<u32>(q & 0xffu, (q >> 8u) & 0xffu, q & 0xffu, (q >> 8u) & 0xffu);
        lo = trits(v, vec4<u32>(1u, 1u, 3u, 3u));
        hi = trits(v, vec4<u32>(9u, 9u, 27u, 27u));
    }
    return W8((lo - 1.0) * d, (hi - 1.0) * d);
}

fn load8(rb: u32, e: u32, ne0: u32) -> W8 {
    switch TY {
        case 0u: { return load8_f32(rb, e, ne0); }
        case 1u: { return load8_f16(rb, e, ne0); }
        case 2u: { return load8_bf16(rb, e, ne0); }
        case 3u: { return load8_q8_0(rb, e); }
        case 4u: { return load8_q4_0(rb, e); }
        case 5u: { return load8_pq2_0(rb, e); }
        default: { return load8_ptq1_0(rb, e); }
    }
}
