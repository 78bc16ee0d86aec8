// Gated DeltaNet recurrence, token by token (the decode form, and the reference form for any
// number of tokens). Per token and V head j (K head kh = j % n_k, tiled order):
//   beta = sigmoid(b_j), g = ssm_a[j] * softplus(a_j + dt_bias[j]), S *= exp(g),
//   kv = S^T k, S += k (x) beta (v - kv), o = S^T q (after the update).
// S is [d_k][d_v] per head, v fastest. Columns of S are independent, so one workgroup takes
// one head and a block of CB columns; thread (rg, c) keeps rows i = rg + R m of column c in
// registers across the whole token loop, and the R partial sums of S^T k and S^T q are combined
// in shared memory. o is written pre-norm ([rows][n_v d]); gdn_gated_norm follows.
// q and k arrive L2-normalised (q scaled) from gdn_conv.
struct Params {
    rows: u32,
    n_k: u32,
    n_v: u32,
    cd: u32,      // conv_dim, the row stride of u
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> u: array<f32>;         // [rows][cd]: q | k | v
@group(0) @binding(2) var<storage, read> b: array<f32>;         // [rows][n_v]
@group(0) @binding(3) var<storage, read> a: array<f32>;         // [rows][n_v]
@group(0) @binding(4) var<storage, read> dt_bias: array<f32>;   // [n_v]
@group(0) @binding(5) var<storage, read> ssm_a: array<f32>;     // [n_v]
@group(0) @binding(6) var<storage, read_write> s: array<f32>;   // [n_v][D][D]
@group(0) @binding(7) var<storage, read_write> o: array<f32>;   // [rows][n_v D]

// D (the head size), CB and R come with the kernel (backend::gpu::kernels).
const NR: u32 = (D + R - 1u) / R;

var<workgroup> kq: array<f32, 2u * D>;   // k, then q, of the current token
var<workgroup> red: array<f32, R * CB>;

#include "softplus.wgsl"

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let j = wid.x;
    let c = lid.x % CB;
    let rg = lid.x / CB;
    let col = wid.y * CB + c;
    let valid = col < D;
    let kh = j % p.n_k;
    let sbase = j * D * D;

    var st: array<f32, NR>;
    for (var m = 0u; m < NR; m++) {
        let i = rg + R * m;
        st[m] = 0.0;
        if (valid && i < D) {
            st[m] = s[sbase + i * D + col];
        }
    }

    let ow = p.n_v * D;
    for (var t = 0u; t < p.rows; t++) {
        let ub = t * p.cd;
        for (var x = lid.x; x < D; x += CB * R) {
            kq[x] = u[ub + p.n_k * D + kh * D + x];
            kq[D + x] = u[ub + kh * D + x];
        }
        workgroupBarrier();
        let beta = 1.0 / (1.0 + exp(-b[t * p.n_v + j]));
        let g = ssm_a[j] * softplus(a[t * p.n_v + j] + dt_bias[j]);
        let decay = exp(g);

        var part = 0.0;
        for (var m = 0u; m < NR; m++) {
            let i = rg + R * m;
            if (i < D) {
                st[m] *= decay;
                part += st[m] * kq[i];
            }
        }
        red[rg * CB + c] = part;
        workgroupBarrier();
        var kv = 0.0;
        for (var r = 0u; r < R; r++) {
            kv += red[r * CB + c];
        }
        var v = 0.0;
        if (valid) {
            v = u[ub + 2u * p.n_k * D + j * D + col];
        }
        let delta = beta * (v - kv);
        workgroupBarrier();

        var po = 0.0;
        for (var m = 0u; m < NR; m++) {
            let i = rg + R * m;
            if (i < D) {
                st[m] += kq[i] * delta;
                po += st[m] * kq[D + i];
            }
        }
        red[rg * CB + c] = po;
        workgroupBarrier();
        if (rg == 0u && valid) {
            var acc = 0.0;
            for (var r = 0u; r < R; r++) {
                acc += red[r * CB + c];
            }
            o[t * ow + j * D + col] = acc;
        }
        // kq and red are rewritten by the next token.
        workgroupBarrier();
    }

    for (var m = 0u; m < NR; m++) {
        let i = rg + R * m;
        if (valid && i < D) {
            s[sbase + i * D + col] = st[m];
        }
    }
}
