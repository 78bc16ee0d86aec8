// Gated DeltaNet input stage: causal depthwise conv over [carried state; tokens], SiLU, then the
// L2 norm of every q and k head (x / max(||x||, eps)), q also scaled by 1/sqrt(d).
//
// One workgroup per (head segment of d channels, block of TB tokens). Segments are the q heads
// (0..n_k), the k heads (n_k..2 n_k) and the v heads; only q/k segments are normalised. Tokens
// are independent (every tap is read from the carried state or from `mixed`), so blocks run in
// parallel. The workgroups of the last block also write the new conv state (the last kw-1 raw
// inputs) to `new_state`; the host copies it over the carried state after this dispatch, since
// other blocks may still be reading the old one.
struct Params {
    rows: u32,
    cd: u32,      // conv_dim, the row stride of mixed and u
    d: u32,
    n_k: u32,
    kw: u32,      // d_conv
    eps: f32,
    q_scale: f32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> mixed: array<f32>;     // [rows][cd], raw projections
@group(0) @binding(2) var<storage, read> w: array<f32>;         // [cd][kw], tap kw-1 on the current input
@group(0) @binding(3) var<storage, read> state: array<f32>;     // [kw-1][cd], oldest first
@group(0) @binding(4) var<storage, read_write> u: array<f32>;   // [rows][cd]
@group(0) @binding(5) var<storage, read_write> new_state: array<f32>;

#include "reduce.wgsl"

// Raw input at index `ci` of the concatenation [state rows; mixed rows].
fn raw(ci: u32, ch: u32) -> f32 {
    let h = p.kw - 1u;
    if (ci < h) {
        return state[ci * p.cd + ch];
    }
    return mixed[(ci - h) * p.cd + ch];
}

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let seg = wid.x;
    let t0 = wid.y * TB;
    let t1 = min(t0 + TB, p.rows);
    let c0 = seg * p.d;
    for (var t = t0; t < t1; t++) {
        var ss = 0.0;
        for (var c = lid.x; c < p.d; c += WG) {
            let ch = c0 + c;
            // Same order as the reference: the current tap first, then the state, oldest first.
            let tw = ch * p.kw;
            var acc = w[tw + p.kw - 1u] * mixed[t * p.cd + ch];
            for (var k = 0u; k + 1u < p.kw; k++) {
                acc += w[tw + k] * raw(t + k, ch);
            }
            let y = acc / (1.0 + exp(-acc));
            u[t * p.cd + ch] = y;
            ss += y * y;
        }
        if (seg < 2u * p.n_k) {
            let scale = 1.0 / max(sqrt(workgroup_sum(lid.x, ss)), p.eps);
            let qs = select(1.0, p.q_scale, seg < p.n_k);
            for (var c = lid.x; c < p.d; c += WG) {
                let i = t * p.cd + c0 + c;
                u[i] = u[i] * scale * qs;
            }
        }
    }
    if (wid.y + 1u == nwg.y) {
        for (var r = 0u; r + 1u < p.kw; r++) {
            for (var c = lid.x; c < p.d; c += WG) {
                new_state[r * p.cd + c0 + c] = raw(p.rows + r, c0 + c);
            }
        }
    }
}
