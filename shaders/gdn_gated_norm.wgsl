// Gated RMSNorm of the Gated DeltaNet output, in place: per token and V head (rows of d),
// o = o / sqrt(mean(o^2) + eps) * w * silu(z). One workgroup per (token, head).
struct Params {
    n: u32,       // rows * n_v
    d: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> o: array<f32>;   // [n][d]
@group(0) @binding(2) var<storage, read> z: array<f32>;         // [n][d]
@group(0) @binding(3) var<storage, read> w: array<f32>;         // [d]

#include "reduce.wgsl"

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= p.n) {
        return;
    }
    let base = r * p.d;
    var s = 0.0;
    for (var i = lid.x; i < p.d; i += WG) {
        let v = o[base + i];
        s += v * v;
    }
    let scale = 1.0 / sqrt(workgroup_sum(lid.x, s) / f32(p.d) + p.eps);
    for (var i = lid.x; i < p.d; i += WG) {
        let zi = z[base + i];
        o[base + i] = o[base + i] * scale * w[i] * (zi / (1.0 + exp(-zi)));
    }
}
