// Matrix-vector product for F16 weights on adapters with SHADER_F16: the same work split as
// matmul_vec.wgsl (one workgroup per (output row, group of 4 tokens), 64 threads striding over
// the row in units of 8), but the weights are read natively as vec4<f16> instead of being
// unpacked from u32 words. f16 -> f32 is exact and the products and sums stay f32 in the same
// order, so the result equals the unpacking path's. Needs ne0 % 8 == 0 (the host checks).
enable f16;

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
@group(0) @binding(1) var<storage, read> wh: array<vec4<f16>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> red: array<vec4<f32>, WG>;

fn dot8(wlo: vec4<f32>, whi: vec4<f32>, xo: u32) -> f32 {
    return dot(wlo, x[xo]) + dot(whi, x[xo + 1u]);
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let n_groups = (p.n_tok + NT - 1u) / NT;
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= p.n_rows * n_groups) {
        return;
    }
    let r = idx % p.n_rows;
    let t0 = (idx / p.n_rows) * NT;
    let nt = min(p.n_tok - t0, NT);
    let last = p.n_tok - 1u;
    // Offsets in vec4 units.
    let q = p.ne0 / 4u;
    let wr = r * q;
    let x0 = t0 * q;
    let x1 = min(t0 + 1u, last) * q;
    let x2 = min(t0 + 2u, last) * q;
    let x3 = min(t0 + 3u, last) * q;

    var acc = vec4<f32>(0.0);
    for (var u = lid; u * 8u < p.ne0; u += WG) {
        let e = u * 2u;
        let wlo = vec4<f32>(wh[wr + e]);
        let whi = vec4<f32>(wh[wr + e + 1u]);
        if (nt == 1u) {
            acc.x += dot8(wlo, whi, x0 + e);
        } else {
            acc += vec4<f32>(dot8(wlo, whi, x0 + e), dot8(wlo, whi, x1 + e),
                             dot8(wlo, whi, x2 + e), dot8(wlo, whi, x3 + e));
        }
    }
    red[lid] = acc;
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if (lid < s) {
            red[lid] += red[lid + s];
        }
        workgroupBarrier();
    }
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
