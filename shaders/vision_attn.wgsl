// Full (non-causal) attention of the vision tower, flash-style: one workgroup per (tile of R
// queries, head) runs an online softmax over every key, a tile of WG keys at a time, so no
// n x n score matrix exists. Per key tile: one invocation per key forms its R scores, the
// invocations lid < R fold the tile into their query's running max m and sum l, then each
// invocation accumulates its head_dim stripe of p * V for the R queries. The output is
// acc / l, per head, into y [n][n_head * hd].
//
// q and k come rotated and head-major ([n_head][n][hd], vision_rope); v is read in place from
// qkv [n][3 * n_head * hd]. R (R * hd <= MAX_Q), WG and MAX_Q come with the kernel
// (backend::gpu::kernels).

struct Params {
    n: u32,
    n_head: u32,
    hd: u32,
    scale: f32,
    // Query tiles per head.
    n_tiles: u32,
    _p0: u32,
    _p1: u32,
    _p2: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> q: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> qkv: array<f32>;
@group(0) @binding(4) var<storage, read_write> y: array<f32>;

// Stands in for -inf (WGSL does not promise infinities).
const NEG: f32 = -3.0e38;

var<workgroup> qs: array<f32, MAX_Q>;
var<workgroup> acc: array<f32, MAX_Q>;
// Scores, then probabilities, of the tile [r][key].
var<workgroup> pc: array<f32, R * WG>;
// Per query: the new running max and the rescale factor of the tile (at the end, 1 / l).
var<workgroup> mn: array<f32, R>;
var<workgroup> al: array<f32, R>;

var<private> s: array<f32, R>;

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= p.n_tiles * p.n_head) {
        return;
    }
    let h = idx / p.n_tiles;
    let first = (idx % p.n_tiles) * R;
    let n_q = min(R, p.n - first);
    let hd = p.hd;
    let head = h * p.n;
    let ldv = 3u * p.n_head * hd;
    let v0 = 2u * p.n_head * hd + h * hd;

    for (var r = 0u; r < R; r++) {
        for (var d = lid.x; d < hd; d += WG) {
            var v = 0.0;
            if (r < n_q) {
                v = q[(head + first + r) * hd + d];
            }
            qs[r * hd + d] = v;
            acc[r * hd + d] = 0.0;
        }
    }
    workgroupBarrier();

    // Running max and sum of query `lid` (invocations lid < R).
    var m = NEG;
    var l = 0.0;
    for (var t0 = 0u; t0 < p.n; t0 += WG) {
        let j = t0 + lid.x;
        let n_t = min(WG, p.n - t0);
        for (var r = 0u; r < R; r++) {
            s[r] = 0.0;
        }
        if (j < p.n) {
            let kb = (head + j) * hd;
            for (var i = 0u; i < hd; i++) {
                let kv = k[kb + i];
                for (var r = 0u; r < R; r++) {
                    s[r] += qs[r * hd + i] * kv;
                }
            }
        }
        for (var r = 0u; r < R; r++) {
            pc[r * WG + lid.x] = select(NEG, s[r] * p.scale, j < p.n && r < n_q);
        }
        workgroupBarrier();
        if (lid.x < R) {
            let r = lid.x;
            var mt = NEG;
            for (var jj = 0u; jj < n_t; jj++) {
                mt = max(mt, pc[r * WG + jj]);
            }
            let m_new = max(m, mt);
            al[r] = exp(m - m_new);
            mn[r] = m_new;
            m = m_new;
        }
        workgroupBarrier();
        for (var r = 0u; r < R; r++) {
            var pj = 0.0;
            if (j < p.n && r < n_q) {
                pj = exp(pc[r * WG + lid.x] - mn[r]);
            }
            pc[r * WG + lid.x] = pj;
        }
        workgroupBarrier();
        if (lid.x < R) {
            let r = lid.x;
            var ps = 0.0;
            for (var jj = 0u; jj < n_t; jj++) {
                ps += pc[r * WG + jj];
            }
            l = l * al[r] + ps;
        }
        for (var d = lid.x; d < hd; d += WG) {
            var a: array<f32, R>;
            for (var r = 0u; r < R; r++) {
                a[r] = acc[r * hd + d] * al[r];
            }
            for (var jj = 0u; jj < n_t; jj++) {
                let v = qkv[(t0 + jj) * ldv + v0 + d];
                for (var r = 0u; r < R; r++) {
                    a[r] += pc[r * WG + jj] * v;
                }
            }
            for (var r = 0u; r < R; r++) {
                acc[r * hd + d] = a[r];
            }
        }
        // The next tile rewrites pc, al and mn.
        workgroupBarrier();
    }

    if (lid.x < n_q) {
        al[lid.x] = 1.0 / l;
    }
    workgroupBarrier();
    let width = p.n_head * hd;
    for (var r = 0u; r < n_q; r++) {
        for (var d = lid.x; d < hd; d += WG) {
            y[(first + r) * width + h * hd + d] = acc[r * hd + d] * al[r];
        }
    }
}
