// Attention prologue, one workgroup per (token, head) over the n_head query heads followed by
// the n_head_kv key heads: RMSNorm over head_dim times the q_norm / k_norm weight, then partial
// NEOX RoPE on the first n_rot dims with ggml's IMROPE sector rule (text positions (p, p, p, 0):
// pairs whose sector is outside t/h/w rotate by position 0). Query heads are read from the
// first half of each [q_h | gate_h] slice of `qg`; the result goes to `qo` [rows][n_head][hd],
// key heads to `ko` [rows][n_head_kv * hd] (stored into the cache by kv_store). The rotation's
// (sin, cos) per (row, pair) come from the host (`backend::rope_table`): shader sin/cos carry no
// accuracy promise at angles up to the context length.
struct Params {
    rows: u32,
    n_head: u32,
    n_head_kv: u32,
    hd: u32,
    n_rot: u32,
    eps: f32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qg: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> q_norm: array<f32>;
@group(0) @binding(4) var<storage, read> k_norm: array<f32>;
@group(0) @binding(5) var<storage, read_write> qo: array<f32>;
@group(0) @binding(6) var<storage, read_write> ko: array<f32>;
@group(0) @binding(7) var<storage, read> rope: array<f32>;

var<workgroup> xs: array<f32, MAX_HD>;
#include "reduce.wgsl"

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let heads = p.n_head + p.n_head_kv;
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= p.rows * heads) {
        return;
    }
    let t = idx / heads;
    let hh = idx % heads;
    let hd = p.hd;
    let is_q = hh < p.n_head;
    let width = p.n_head_kv * hd;
    var src = 0u;
    var dst = 0u;
    if (is_q) {
        src = t * 2u * p.n_head * hd + hh * 2u * hd;
        dst = (t * p.n_head + hh) * hd;
    } else {
        src = t * width + (hh - p.n_head) * hd;
        dst = src;
    }

    var ss = 0.0;
    for (var i = lid.x; i < hd; i += WG) {
        var v = 0.0;
        if (is_q) {
            v = qg[src + i];
        } else {
            v = k[src + i];
        }
        xs[i] = v;
        ss += v * v;
    }
    let scale = 1.0 / sqrt(workgroup_sum(lid.x, ss) / f32(hd) + p.eps);
    for (var i = lid.x; i < hd; i += WG) {
        var w = 0.0;
        if (is_q) {
            w = q_norm[i];
        } else {
            w = k_norm[i];
        }
        xs[i] = xs[i] * scale * w;
    }
    workgroupBarrier();

    let half = p.n_rot / 2u;
    for (var i = lid.x; i < half; i += WG) {
        let sc = vec2<f32>(rope[(t * half + i) * 2u], rope[(t * half + i) * 2u + 1u]);
        let a = xs[i];
        let b = xs[i + half];
        let y0 = a * sc.y - b * sc.x;
        let y1 = a * sc.x + b * sc.y;
        if (is_q) {
            qo[dst + i] = y0;
            qo[dst + i + half] = y1;
        } else {
            ko[dst + i] = y0;
            ko[dst + i + half] = y1;
        }
    }
    for (var i = p.n_rot + lid.x; i < hd; i += WG) {
        if (is_q) {
            qo[dst + i] = xs[i];
        } else {
            ko[dst + i] = xs[i];
        }
    }
}
