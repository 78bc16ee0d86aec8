// x[r][c] += b[c]: the bias of a vision tower matmul, on every row, in place.
struct Params {
    rows: u32,
    cols: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read_write> x: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    if (i < p.rows * p.cols) {
        x[i] = x[i] + b[i % p.cols];
    }
}
