// y[r][c] += s[r] * x[r][c]: a LoRA adapter's term added to its matrix's product, each row (a
// token of some sequence) with its own scale. The product is rounded, then the sum, as
// llama.cpp's ggml_scale then ggml_add.
struct Params {
    rows: u32,
    cols: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> y: array<f32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read> s: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i < p.rows * p.cols) {
        let t = s[i / p.cols] * x[i];
        y[i] = y[i] + t;
    }
}
