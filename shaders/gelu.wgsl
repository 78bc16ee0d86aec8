// y = GELU(x) as ggml's CPU backend computes it on f32 (ggml_vec_gelu_f32, GGML_GELU_FP16):
// 0 at or below -10, x at or above 10, otherwise ggml's table of the tanh form at x rounded to
// f16. `table` holds that table's 65536 entries as f32 (backend::gelu_f16_table), so the result
// is ggml's bits whatever this device's tanh does.
struct Params {
    n: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> table: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

#include "f16.wgsl"

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i < p.n) {
        let v = x[i];
        var g = v;
        if (v <= -10.0) {
            g = 0.0;
        } else if (v < 10.0) {
            g = table[f32_to_f16(v)];
        }
        y[i] = g;
    }
}
