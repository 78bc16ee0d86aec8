// y[r] = ((x[r] - mean) * scale) * w + b with scale = 1 / sqrt(var + eps): ggml_norm then
// ggml_mul and ggml_add (the vision tower's LayerNorms). One workgroup per row; the mean, then
// the variance about it, each a workgroup sum.
struct Params {
    rows: u32,
    cols: u32,
    eps: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> w: array<f32>;
@group(0) @binding(3) var<storage, read> b: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

#include "reduce.wgsl"

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let r = wid.x + wid.y * nwg.x;
    if (r >= p.rows) {
        return;
    }
    let base = r * p.cols;
    var s = 0.0;
    for (var i = lid.x; i < p.cols; i += WG) {
        s += x[base + i];
    }
    let mean = workgroup_sum(lid.x, s) / f32(p.cols);
    var q = 0.0;
    for (var i = lid.x; i < p.cols; i += WG) {
        let d = x[base + i] - mean;
        q += d * d;
    }
    let scale = 1.0 / sqrt(workgroup_sum(lid.x, q) / f32(p.cols) + p.eps);
    for (var i = lid.x; i < p.cols; i += WG) {
        y[base + i] = (x[base + i] - mean) * scale * w[i] + b[i];
    }
}
