// Tiled matrix product for prefill: y[t][row0 + r] = W[r] . x[t] for the rows r of one weight
// part and any number of token rows. Each workgroup computes a tile of 64 output rows by 32
// tokens: per step of 32 input elements, its 256 threads decode the 64x32 weight slice once into
// shared memory (one 8-element unit each) and stage the 32x32 input slice next to it, then each
// thread accumulates 4 rows x 2 tokens. Accumulation is f32.
//
// `TY` (backend::gpu::kernels::weight_code) selects the decoder of decode.wgsl.

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
@group(0) @binding(1) var<storage, read> wq: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// Shared tiles are k-major with one column of padding against bank conflicts.
const WS: u32 = 65u;
const XS: u32 = 33u;

var<workgroup> ws: array<f32, 2080>; // BK * WS
var<workgroup> xs: array<f32, 1056>; // BK * XS

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>,
        @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_index) lid: u32) {
    let n_rt = (p.n_rows + BM - 1u) / BM;
    let n_tt = (p.n_tok + BN - 1u) / BN;
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= n_rt * n_tt) {
        return;
    }
    let r0 = (idx % n_rt) * BM;
    let t0 = (idx / n_rt) * BN;
    // Loading: thread -> (weight row lr of the tile, unit lu of the 32-wide step). Rows past the
    // part read its last row again; their results are not written.
    let lr = lid / 4u;
    let lu = lid % 4u;
    let rb = min(r0 + lr, p.n_rows - 1u) * p.row_bytes;
    // Computing: thread -> rows tx + 16i, tokens ty + 16j of the tile.
    let tx = lid % 16u;
    let ty = lid / 16u;

    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    for (var k0 = 0u; k0 < p.ne0; k0 += BK) {
        let c = 8u * lu;
        let w = load8(rb, k0 + c, p.ne0);
        ws[(c + 0u) * WS + lr] = w.lo.x;
        ws[(c + 1u) * WS + lr] = w.lo.y;
        ws[(c + 2u) * WS + lr] = w.lo.z;
        ws[(c + 3u) * WS + lr] = w.lo.w;
        ws[(c + 4u) * WS + lr] = w.hi.x;
        ws[(c + 5u) * WS + lr] = w.hi.y;
        ws[(c + 6u) * WS + lr] = w.hi.z;
        ws[(c + 7u) * WS + lr] = w.hi.w;
        for (var j = 0u; j < 4u; j++) {
            let l = lid + WG * j;
            let tl = l / BK;
            let kk = l % BK;
            let t = t0 + tl;
            let k = k0 + kk;
            var v = 0.0;
            if (t < p.n_tok && k < p.ne0) {
                v = x[t * p.ne0 + k];
            }
            xs[kk * XS + tl] = v;
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk++) {
            let wb = kk * WS + tx;
            let a = vec4<f32>(ws[wb], ws[wb + 16u], ws[wb + 32u], ws[wb + 48u]);
            acc0 += a * xs[kk * XS + ty];
            acc1 += a * xs[kk * XS + ty + 16u];
        }
        workgroupBarrier();
    }

    let ta = t0 + ty;
    let tb = ta + 16u;
    for (var i = 0u; i < 4u; i++) {
        let r = r0 + tx + 16u * i;
        if (r < p.n_rows) {
            if (ta < p.n_tok) {
                y[ta * p.n_out + p.row0 + r] = acc0[i];
            }
            if (tb < p.n_tok) {
                y[tb * p.n_out + p.row0 + r] = acc1[i];
            }
        }
    }
}

#include "decode.wgsl"
