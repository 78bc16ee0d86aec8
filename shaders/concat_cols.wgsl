// y[r] = [a[r] | b[r]]: rows of a and b side by side.
struct Params {
    rows: u32,
    ca: u32,
    cb: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> a: array<f32>;
@group(0) @binding(2) var<storage, read> b: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * 256u;
    let w = p.ca + p.cb;
    if (i >= p.rows * w) {
        return;
    }
    let r = i / w;
    let c = i % w;
    if (c < p.ca) {
        y[i] = a[r * p.ca + c];
    } else {
        y[i] = b[r * p.cb + (c - p.ca)];
    }
}
