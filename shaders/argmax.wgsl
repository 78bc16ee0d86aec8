// Per-row argmax, one workgroup per row; ties go to the lowest index (as the CPU's first-max
// scan). Writes one u32 id per row.
struct Params {
    rows: u32,
    cols: u32,
    _p0: u32,
    _p1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;

var<workgroup> bv: array<f32, WG>;
var<workgroup> bi: array<u32, WG>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= p.rows) {
        return;
    }
    let base = r * p.cols;
    // Each invocation scans a strided stripe in increasing index order; strict > keeps the
    // first of equal values.
    var best_i = 0xffffffffu;
    var best_v = 0.0;
    for (var i = lid.x; i < p.cols; i += WG) {
        let v = x[base + i];
        if (best_i == 0xffffffffu || v > best_v) {
            best_v = v;
            best_i = i;
        }
    }
    bv[lid.x] = best_v;
    bi[lid.x] = best_i;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid.x < stride) {
            let oi = bi[lid.x + stride];
            let ov = bv[lid.x + stride];
            let mi = bi[lid.x];
            if (oi != 0xffffffffu && (mi == 0xffffffffu || ov > bv[lid.x] || (ov == bv[lid.x] && oi < mi))) {
                bv[lid.x] = ov;
                bi[lid.x] = oi;
            }
        }
        workgroupBarrier();
    }
    if (lid.x == 0u) {
        ids[r] = bi[0];
    }
}
