// Flash-style attention over a chunk of cache positions, one workgroup per (row, query head,
// chunk): online softmax over tiles of 64 positions (one score per invocation, K dequantized in
// the dot product), then each invocation accumulates its head_dim stripe of p * V. Writes the
// chunk's partial (running max m, sum l, unnormalised o[hd]) for attn_combine.
//
// Causal: row t sees positions 0..=pos0+t. Grouped GQA: query head h reads kv head h / group.
// Cache rows are `row_words` u32 words (ggml row, padded to a word); the dtypes are specialised
// by the host: 0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q4_0.
const K_TYPE: u32 = 0u;
const V_TYPE: u32 = 0u;

struct Params {
    rows: u32,
    n_head: u32,
    hd: u32,
    group: u32,
    pos0: u32,
    n_chunks: u32,
    chunk_len: u32,
    k_row_words: u32,
    v_row_words: u32,
    scale: f32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kc: array<u32>;
@group(0) @binding(3) var<storage, read> vc: array<u32>;
@group(0) @binding(4) var<storage, read_write> part: array<f32>;

const WG: u32 = 64u;
const MAX_HD: u32 = 512u;
// Stands in for -inf (WGSL does not promise infinities).
const NEG: f32 = -3.0e38;

var<workgroup> qs: array<f32, MAX_HD>;
var<workgroup> acc: array<f32, MAX_HD>;
var<workgroup> sc: array<f32, WG>;
var<workgroup> red: array<f32, WG>;

fn f16_bits(h: u32) -> f32 {
    let sign = (h & 0x8000u) << 16u;
    let e = h & 0x7c00u;
    let m = h & 0x3ffu;
    if (e == 0x7c00u) {
        return bitcast<f32>(sign | 0x7f800000u | (m << 13u));
    }
    if (e == 0u) {
        // Zero and subnormals: m * 2^-24, exact.
        let v = f32(m) * 5.9604644775390625e-8;
        return select(v, -v, sign != 0u);
    }
    return bitcast<f32>(sign | (((h & 0x7fffu) << 13u) + 0x38000000u));
}

// Byte `at` of a cache row starting at word `base`.
fn byte_k(base: u32, at: u32) -> u32 {
    return (kc[base + (at >> 2u)] >> ((at & 3u) * 8u)) & 0xffu;
}

fn byte_v(base: u32, at: u32) -> u32 {
    return (vc[base + (at >> 2u)] >> ((at & 3u) * 8u)) & 0xffu;
}

// The f16 at even byte `at` (never straddles a word).
fn half_k(base: u32, at: u32) -> f32 {
    return f16_bits((kc[base + (at >> 2u)] >> ((at & 2u) * 8u)) & 0xffffu);
}

fn half_v(base: u32, at: u32) -> f32 {
    return f16_bits((vc[base + (at >> 2u)] >> ((at & 2u) * 8u)) & 0xffffu);
}

// Element e of the V row at word `base`.
fn v_at(base: u32, e: u32) -> f32 {
    if (V_TYPE == 0u) {
        return bitcast<f32>(vc[base + e]);
    } else if (V_TYPE == 1u || V_TYPE == 2u) {
        let h = (vc[base + (e >> 1u)] >> ((e & 1u) * 16u)) & 0xffffu;
        if (V_TYPE == 1u) {
            return f16_bits(h);
        }
        return bitcast<f32>(h << 16u);
    } else if (V_TYPE == 3u) {
        let o = (e >> 5u) * 34u;
        let d = half_v(base, o);
        let qb = byte_v(base, o + 2u + (e & 31u));
        return f32((i32(qb) << 24u) >> 24u) * d;
    }
    let o = (e >> 5u) * 18u;
    let d = half_v(base, o);
    let j = e & 31u;
    let qb = byte_v(base, o + 2u + (j & 15u));
    let nib = select(qb & 15u, qb >> 4u, j >= 16u);
    return f32(i32(nib) - 8) * d;
}

// q . K[row] over elements [e0, e0 + hd) of the K row at word `base`.
fn k_dot(base: u32, e0: u32) -> f32 {
    let hd = p.hd;
    var s = 0.0;
    if (K_TYPE == 0u) {
        for (var i = 0u; i < hd; i++) {
            s += qs[i] * bitcast<f32>(kc[base + e0 + i]);
        }
    } else if (K_TYPE == 1u || K_TYPE == 2u) {
        // e0 and hd are even: whole words.
        for (var i = 0u; i < hd; i += 2u) {
            let w = kc[base + ((e0 + i) >> 1u)];
            var a = 0.0;
            var b = 0.0;
            if (K_TYPE == 1u) {
                a = f16_bits(w & 0xffffu);
                b = f16_bits(w >> 16u);
            } else {
                a = bitcast<f32>(w << 16u);
                b = bitcast<f32>(w & 0xffff0000u);
            }
            s += qs[i] * a + qs[i + 1u] * b;
        }
    } else if (K_TYPE == 3u) {
        // hd is a multiple of 32: whole blocks.
        for (var b = 0u; b < hd / 32u; b++) {
            let o = ((e0 >> 5u) + b) * 34u;
            let d = half_k(base, o);
            var bs = 0.0;
            for (var j = 0u; j < 32u; j++) {
                let qb = byte_k(base, o + 2u + j);
                bs += qs[b * 32u + j] * f32((i32(qb) << 24u) >> 24u);
            }
            s += bs * d;
        }
    } else {
        for (var b = 0u; b < hd / 32u; b++) {
            let o = ((e0 >> 5u) + b) * 18u;
            let d = half_k(base, o);
            var bs = 0.0;
            for (var j = 0u; j < 16u; j++) {
                let qb = byte_k(base, o + 2u + j);
                bs += qs[b * 32u + j] * f32(i32(qb & 15u) - 8);
                bs += qs[b * 32u + j + 16u] * f32(i32(qb >> 4u) - 8);
            }
            s += bs * d;
        }
    }
    return s;
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= p.rows * p.n_head * p.n_chunks) {
        return;
    }
    let c = idx % p.n_chunks;
    let th = idx / p.n_chunks;
    let h = th % p.n_head;
    let t = th / p.n_head;
    let hd = p.hd;
    let e0 = (h / p.group) * hd;
    let n_ctx = p.pos0 + t + 1u;
    let c0 = c * p.chunk_len;
    let c1 = min(c0 + p.chunk_len, n_ctx);

    for (var d = lid.x; d < hd; d += WG) {
        qs[d] = q[th * hd + d];
        acc[d] = 0.0;
    }
    workgroupBarrier();

    var m = NEG;
    var l = 0.0;
    for (var tile0 = c0; tile0 < c1; tile0 += WG) {
        let j = tile0 + lid.x;
        let valid = j < c1;
        var s = NEG;
        if (valid) {
            s = k_dot(j * p.k_row_words, e0) * p.scale;
        }
        red[lid.x] = s;
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
            if (lid.x < stride) {
                red[lid.x] = max(red[lid.x], red[lid.x + stride]);
            }
            workgroupBarrier();
        }
        let m_new = max(m, red[0]);
        workgroupBarrier();
        let alpha = exp(m - m_new);
        var pj = 0.0;
        if (valid) {
            pj = exp(s - m_new);
        }
        sc[lid.x] = pj;
        red[lid.x] = pj;
        workgroupBarrier();
        for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
            if (lid.x < stride) {
                red[lid.x] += red[lid.x + stride];
            }
            workgroupBarrier();
        }
        l = l * alpha + red[0];
        let n_t = min(WG, c1 - tile0);
        for (var d = lid.x; d < hd; d += WG) {
            var a = acc[d] * alpha;
            for (var jj = 0u; jj < n_t; jj++) {
                a += sc[jj] * v_at((tile0 + jj) * p.v_row_words, e0 + d);
            }
            acc[d] = a;
        }
        m = m_new;
        workgroupBarrier();
    }

    let out = idx * (hd + 2u);
    if (lid.x == 0u) {
        part[out] = m;
        part[out + 1u] = l;
    }
    for (var d = lid.x; d < hd; d += WG) {
        part[out + 2u + d] = acc[d];
    }
}
