// Flash-style attention over a chunk of cache positions. One workgroup per (tile of R query
// vectors, kv head, chunk of positions); the query vectors of kv head g are the (token, head)
// pairs with head in g's group, token-major, so one K/V element read from the cache serves R
// queries (the GQA group in decode, several tokens in prefill). Per tile of 64 positions:
// one invocation per position forms its R scores (K dequantized once), online softmax per query
// (running max m, sum l), then each invocation accumulates its head_dim stripe of p * V.
// Writes each query's chunk partial (m, l, unnormalised o[hd]) for attn_combine.
//
// Causal: token t sees positions 0..=pos0+t. Grouped GQA: query head h reads kv head h / group.
// Cache rows are `row_words` u32 words (ggml row, padded to a word); the constants
// K_TYPE, V_TYPE (cache codes: 0 f32, 1 f16, 2 bf16, 3 q8_0, 4 q4_0) and R (R * hd <= MAX_Q)
// come with the kernel (backend::gpu::kernels), as do WG and MAX_Q.

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
    // Query tiles per kv head.
    n_tiles: u32,
    _p0: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> kc: array<u32>;
@group(0) @binding(3) var<storage, read> vc: array<u32>;
@group(0) @binding(4) var<storage, read_write> part: array<f32>;

// Query elements a workgroup holds: R * hd.
// Stands in for -inf (WGSL does not promise infinities).
const NEG: f32 = -3.0e38;

var<workgroup> qs: array<f32, MAX_Q>;
var<workgroup> acc: array<f32, MAX_Q>;
// Scores and probabilities [parity][r][position]; double-buffered by tile parity so that a
// tile needs three barriers and none at its end.
var<workgroup> sc: array<f32, 1024>;
var<workgroup> pc: array<f32, 1024>;
// New running max and rescale factor per query [parity][r].
var<workgroup> mn: array<f32, 16>;
var<workgroup> al: array<f32, 16>;

var<private> s: array<f32, R>;
var<private> bs: array<f32, R>;

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

// The 4 bytes at even byte `at` of the K row at word `base` (Q8_0/Q4_0 blocks are 2-aligned).
fn word_k(base: u32, at: u32) -> u32 {
    let i = base + (at >> 2u);
    if ((at & 2u) == 0u) {
        return kc[i];
    }
    return (kc[i] >> 16u) | (kc[i + 1u] << 16u);
}

// Byte `at` of a cache row starting at word `base`.

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

// bs[r] += q_r[i] * kv for every query of the tile.
fn acc_k(i: u32, kv: f32) {
    let hd = p.hd;
    for (var r = 0u; r < R; r++) {
        bs[r] += qs[r * hd + i] * kv;
    }
}

// s[r] += bs[r] * d, bs = 0 (d is a block scale, or 1).
fn flush_k(d: f32) {
    for (var r = 0u; r < R; r++) {
        s[r] += bs[r] * d;
        bs[r] = 0.0;
    }
}

// s[r] = q_r . K[row] over elements [e0, e0 + hd) of the K row at word `base`.
fn k_scores(base: u32, e0: u32) {
    let hd = p.hd;
    for (var r = 0u; r < R; r++) {
        s[r] = 0.0;
        bs[r] = 0.0;
    }
    if (K_TYPE == 0u) {
        for (var i = 0u; i < hd; i++) {
            acc_k(i, bitcast<f32>(kc[base + e0 + i]));
        }
        flush_k(1.0);
    } else if (K_TYPE == 1u || K_TYPE == 2u) {
        // e0 and hd are even: whole words.
        for (var i = 0u; i < hd; i += 2u) {
            let w = kc[base + ((e0 + i) >> 1u)];
            if (K_TYPE == 1u) {
                acc_k(i, f16_bits(w & 0xffffu));
                acc_k(i + 1u, f16_bits(w >> 16u));
            } else {
                acc_k(i, bitcast<f32>(w << 16u));
                acc_k(i + 1u, bitcast<f32>(w & 0xffff0000u));
            }
        }
        flush_k(1.0);
    } else if (K_TYPE == 3u) {
        // hd is a multiple of 32: whole blocks.
        for (var b = 0u; b < hd / 32u; b++) {
            let o = ((e0 >> 5u) + b) * 34u;
            for (var w = 0u; w < 8u; w++) {
                let qw = word_k(base, o + 2u + 4u * w);
                let i = b * 32u + 4u * w;
                acc_k(i, f32((i32(qw) << 24u) >> 24u));
                acc_k(i + 1u, f32((i32(qw) << 16u) >> 24u));
                acc_k(i + 2u, f32((i32(qw) << 8u) >> 24u));
                acc_k(i + 3u, f32(i32(qw) >> 24u));
            }
            flush_k(half_k(base, o));
        }
    } else {
        for (var b = 0u; b < hd / 32u; b++) {
            let o = ((e0 >> 5u) + b) * 18u;
            for (var w = 0u; w < 4u; w++) {
                let qw = word_k(base, o + 2u + 4u * w);
                for (var j = 0u; j < 4u; j++) {
                    let qb = (qw >> (8u * j)) & 0xffu;
                    let i = b * 32u + 4u * w + j;
                    acc_k(i, f32(i32(qb & 15u) - 8));
                    acc_k(i + 16u, f32(i32(qb >> 4u) - 8));
                }
            }
            flush_k(half_k(base, o));
        }
    }
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let n_head_kv = p.n_head / p.group;
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= p.n_tiles * n_head_kv * p.n_chunks) {
        return;
    }
    let c = idx % p.n_chunks;
    let rest = idx / p.n_chunks;
    let g = rest % n_head_kv;
    let tile = rest / n_head_kv;
    let hd = p.hd;
    let e0 = g * hd;
    // Query vectors [first, first + n_q) of kv head g: entry e is token e / group, head
    // g * group + e % group.
    let first = tile * R;
    let n_q = min(R, p.rows * p.group - first);
    let t_last = (first + n_q - 1u) / p.group;
    let c0 = c * p.chunk_len;
    let c1 = min(c0 + p.chunk_len, p.pos0 + t_last + 1u);

    for (var r = 0u; r < R; r++) {
        let e = first + r;
        let th = (e / p.group) * p.n_head + g * p.group + e % p.group;
        for (var d = lid.x; d < hd; d += WG) {
            var v = 0.0;
            if (r < n_q) {
                v = q[th * hd + d];
            }
            qs[r * hd + d] = v;
            acc[r * hd + d] = 0.0;
        }
    }
    workgroupBarrier();

    // Running max and sum of query `lid` (invocations lid < R).
    var m = NEG;
    var l = 0.0;
    var pb = 0u;
    for (var tile0 = c0; tile0 < c1; tile0 += WG) {
        let j = tile0 + lid.x;
        let n_t = min(WG, c1 - tile0);
        if (j < c1) {
            k_scores(j * p.k_row_words, e0);
        }
        for (var r = 0u; r < R; r++) {
            // Causal limit of query r: its token's position.
            let valid = j < c1 && r < n_q && j <= p.pos0 + (first + r) / p.group;
            sc[pb * 512u + r * WG + lid.x] = select(NEG, s[r] * p.scale, valid);
        }
        workgroupBarrier();
        if (lid.x < R) {
            let r = lid.x;
            var mt = NEG;
            for (var jj = 0u; jj < n_t; jj++) {
                mt = max(mt, sc[pb * 512u + r * WG + jj]);
            }
            let m_new = max(m, mt);
            al[pb * 8u + r] = exp(m - m_new);
            mn[pb * 8u + r] = m_new;
            m = m_new;
        }
        workgroupBarrier();
        for (var r = 0u; r < R; r++) {
            let valid = j < c1 && r < n_q && j <= p.pos0 + (first + r) / p.group;
            var pj = 0.0;
            if (valid) {
                pj = exp(sc[pb * 512u + r * WG + lid.x] - mn[pb * 8u + r]);
            }
            pc[pb * 512u + r * WG + lid.x] = pj;
        }
        workgroupBarrier();
        if (lid.x < R) {
            let r = lid.x;
            var ps = 0.0;
            for (var jj = 0u; jj < n_t; jj++) {
                ps += pc[pb * 512u + r * WG + jj];
            }
            l = l * al[pb * 8u + r] + ps;
        }
        for (var d = lid.x; d < hd; d += WG) {
            var a: array<f32, R>;
            for (var r = 0u; r < R; r++) {
                a[r] = acc[r * hd + d] * al[pb * 8u + r];
            }
            for (var jj = 0u; jj < n_t; jj++) {
                let v = v_at((tile0 + jj) * p.v_row_words, e0 + d);
                for (var r = 0u; r < R; r++) {
                    a[r] += pc[pb * 512u + r * WG + jj] * v;
                }
            }
            for (var r = 0u; r < R; r++) {
                acc[r * hd + d] = a[r];
            }
        }
        pb = 1u - pb;
    }

    // Each invocation writes what it owns: its head_dim stripe, and (lid < R) m and l.
    for (var r = 0u; r < n_q; r++) {
        let e = first + r;
        let th = (e / p.group) * p.n_head + g * p.group + e % p.group;
        let out = (th * p.n_chunks + c) * (hd + 2u);
        if (lid.x == r) {
            part[out] = m;
            part[out + 1u] = l;
        }
        for (var d = lid.x; d < hd; d += WG) {
            part[out + 2u + d] = acc[r * hd + d];
        }
    }
}
