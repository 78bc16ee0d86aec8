// One butterfly stage (u+v, u-v) of the blockwise Walsh-Hadamard transform, in place, through
// global memory: for blocks larger than the 1024 elements fwht.wgsl holds in shared memory, the
// stages len = 1024, 2048, ..., block/2 run here, one dispatch each and in that order. One
// thread per pair; the last stage of an inverse transform also applies ⊙ s.

struct Params {
    rows: u32,
    width: u32,
    len: u32,
    // 4: ⊙ s after this stage.
    flags: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
// ±1 per column; bound to some other read-only buffer when unused.
@group(0) @binding(1) var<storage, read> s: array<f32>;
@group(0) @binding(2) var<storage, read_write> y: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let half = p.width / 2u;
    let q = (wid.x + wid.y * nwg.x) * 256u + lid;
    if (q >= p.rows * half) {
        return;
    }
    let row = (q / half) * p.width;
    let pr = q % half;
    let i = (pr / p.len) * 2u * p.len + pr % p.len;
    let j = i + p.len;
    let a = y[row + i];
    let b = y[row + j];
    var u = a + b;
    var v = a - b;
    if ((p.flags & 4u) != 0u) {
        u *= s[i];
        v *= s[j];
    }
    y[row + i] = u;
    y[row + j] = v;
}
