// Merges attn_split's per-chunk partials of one (row, query head), one workgroup each:
// o = sum_c o_c e^(m_c - M) / sum_c l_c e^(m_c - M), then the output gate o * sigmoid(gate),
// gate being the second half of the head's [q_h | gate_h] slice of `qg`. Output [rows][n_head*hd].
struct Params {
    rows: u32,
    n_head: u32,
    hd: u32,
    n_chunks: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> part: array<f32>;
@group(0) @binding(2) var<storage, read> qg: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

var<workgroup> wc: array<f32, MAX_CHUNKS>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let th = wid.x + wid.y * nwg.x;
    if (th >= p.rows * p.n_head) {
        return;
    }
    let hd = p.hd;
    let stride = hd + 2u;
    let base = th * p.n_chunks * stride;
    // Every invocation forms the same M and L (n_chunks is small).
    var mx = part[base];
    for (var c = 1u; c < p.n_chunks; c++) {
        mx = max(mx, part[base + c * stride]);
    }
    var l = 0.0;
    for (var c = 0u; c < p.n_chunks; c++) {
        l += part[base + c * stride + 1u] * exp(part[base + c * stride] - mx);
    }
    let inv = 1.0 / l;
    for (var c = lid.x; c < p.n_chunks; c += WG) {
        wc[c] = exp(part[base + c * stride] - mx) * inv;
    }
    workgroupBarrier();
    let t = th / p.n_head;
    let h = th % p.n_head;
    let gate = t * 2u * p.n_head * hd + h * 2u * hd + hd;
    for (var d = lid.x; d < hd; d += WG) {
        var o = 0.0;
        for (var c = 0u; c < p.n_chunks; c++) {
            o += part[base + c * stride + 2u + d] * wc[c];
        }
        let g = qg[gate + d];
        y[th * hd + d] = o * (1.0 / (1.0 + exp(-g)));
    }
}
