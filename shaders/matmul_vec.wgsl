// Matrix-vector product for decode: y[t][row0 + r] = W[r] . x[t] for the rows r of one weight
// part and 1 to 4 token rows t. One workgroup per (output row, group of 4 tokens): 64 threads
// stride over the row in units of 8 elements, decode each unit once from the stored bytes and
// use it for every token of the group, then the workgroup sums.
//
// `TY` (backend::gpu::kernels::weight_code) selects the decoder of decode.wgsl. On adapters
// with subgroups (backend::wgpu::shaders) the lines between `//#if subgroups` and `//#else`
// are uncommented and those up to `//#endif` dropped.

struct Params {
    n_tok: u32,
    ne0: u32,
    n_rows: u32,
    row0: u32,
    n_out: u32,
    row_bytes: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> wq: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> red: array<vec4<f32>, WG>;

// Elements o..o+8 of x, of which the first n (if fewer than 8) exist.
fn x8(o: u32, n: u32) -> W8 {
    if (n >= 8u) {
        return W8(vec4<f32>(x[o], x[o + 1u], x[o + 2u], x[o + 3u]),
                  vec4<f32>(x[o + 4u], x[o + 5u], x[o + 6u], x[o + 7u]));
    }
    var v: array<f32, 8>;
    for (var k = 0u; k < n; k++) {
        v[k] = x[o + k];
    }
    return w8(v);
}

fn dot8(a: W8, b: W8) -> f32 {
    return dot(a.lo, b.lo) + dot(a.hi, b.hi);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32,
//#if subgroups
//      @builtin(subgroup_invocation_id) lane: u32,
//      @builtin(subgroup_id) sg: u32,
//      @builtin(num_subgroups) n_sg: u32,
//#endif
) {
    let n_groups = (p.n_tok + NT - 1u) / NT;
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= p.n_rows * n_groups) {
        return;
    }
    let r = idx % p.n_rows;
    let t0 = (idx / p.n_rows) * NT;
    let nt = min(p.n_tok - t0, NT);
    let rb = r * p.row_bytes;
    // Tokens past the last are read as the last one again; their sums are not written.
    let last = p.n_tok - 1u;
    let x0 = t0 * p.ne0;
    let x1 = min(t0 + 1u, last) * p.ne0;
    let x2 = min(t0 + 2u, last) * p.ne0;
    let x3 = min(t0 + 3u, last) * p.ne0;

    var acc = vec4<f32>(0.0);
    for (var u = lid; u * 8u < p.ne0; u += WG) {
        let e = u * 8u;
        let n = p.ne0 - e;
        let w = load8(rb, e, p.ne0);
        if (nt == 1u) {
            acc.x += dot8(w, x8(x0 + e, n));
        } else {
            acc += vec4<f32>(dot8(w, x8(x0 + e, n)), dot8(w, x8(x1 + e, n)),
                             dot8(w, x8(x2 + e, n)), dot8(w, x8(x3 + e, n)));
        }
    }

//#if subgroups
//    let s = subgroupAdd(acc);
//    if (lane == 0u) {
//        red[sg] = s;
//    }
//    workgroupBarrier();
//    if (lid == 0u) {
//        var sum = red[0];
//        for (var i = 1u; i < n_sg; i++) {
//            sum += red[i];
//        }
//        red[0] = sum;
//    }
//#else
    red[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
//#endif
    if (lid == 0u) {
        let sum = red[0];
        let o = p.row0 + r;
        y[t0 * p.n_out + o] = sum.x;
        if (nt > 1u) {
            y[(t0 + 1u) * p.n_out + o] = sum.y;
        }
        if (nt > 2u) {
            y[(t0 + 2u) * p.n_out + o] = sum.z;
        }
        if (nt > 3u) {
            y[(t0 + 3u) * p.n_out + o] = sum.w;
        }
    }
}

#include "decode.wgsl"
