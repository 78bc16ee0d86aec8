// Embedding lookup: y[o] = row i of a table part, for each (o, i) pair the backend lists for
// this part (token ids are grouped by part on the host). One workgroup per pair; 64 threads
// decode the row 8 elements at a time. The inverse Hadamard rule, where the table carries one,
// runs afterwards (fwht.wgsl).
//
// `TY` (backend::gpu::kernels::weight_code) selects the decoder of decode.wgsl.

struct Params {
    n: u32,
    ne0: u32,
    row_bytes: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> wq: array<u32>;
@group(0) @binding(2) var<storage, read> pairs: array<u32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= p.n) {
        return;
    }
    let out = pairs[2u * idx] * p.ne0;
    let rb = pairs[2u * idx + 1u] * p.row_bytes;
    for (var u = lid; u * 8u < p.ne0; u += WG) {
        let e = u * 8u;
        let w = load8(rb, e, p.ne0);
        var v = array<f32, 8>(w.lo.x, w.lo.y, w.lo.z, w.lo.w, w.hi.x, w.hi.y, w.hi.z, w.hi.w);
        let n = min(p.ne0 - e, 8u);
        for (var k = 0u; k < n; k++) {
            y[out + e + k] = v[k];
        }
    }
}

#include "decode.wgsl"
