// Gated DeltaNet chunked prefill, the part that runs in sequence over chunks (model-qwen35.md
// §4.1), after gdn_chunk_prep. Per chunk of L tokens, with S the incoming state [d_k][d_v]:
//   Vn = U - W S
//   O  = (Q exp(gamma)) S + P Vn
//   S  = exp(gamma_L) S + (K exp(gamma_L - gamma))^T Vn
// Columns of S are independent, so one workgroup takes one V head and a block of CB = 16 state
// columns, keeps that block in shared memory across all chunks of the dispatch and writes it
// back at the end. Threads work on (row, 4 columns) pairs as vec4. o is written pre-norm
// ([rows][n_v D]); gdn_gated_norm follows. Chunk indices are relative to `ch0`.
struct Params {
    rows: u32,
    n_k: u32,
    n_v: u32,
    cd: u32,      // conv_dim, the row stride of u
    ch0: u32,
    n_chunks: u32,
    _pad0: u32,
    _pad1: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> u: array<f32>;         // [rows][cd]: q | k | v
@group(0) @binding(2) var<storage, read> gam: array<f32>;       // [chunk][n_v][C]
@group(0) @binding(3) var<storage, read> uw: array<f32>;        // [chunk][n_v][C][2D]
@group(0) @binding(4) var<storage, read> pm: array<f32>;        // [chunk][n_v][C][C]
@group(0) @binding(5) var<storage, read_write> s: array<f32>;   // [n_v][D][D]
@group(0) @binding(6) var<storage, read_write> o: array<f32>;   // [rows][n_v D]

// D (the head size, a multiple of CB), C and CB come with the kernel (backend::gpu::kernels).
const G: u32 = CB / 4u;   // vec4 groups per state row

var<workgroup> sb: array<vec4<f32>, D * G>;   // S[i][c0 .. c0 + CB]
var<workgroup> vn: array<vec4<f32>, C * G>;
var<workgroup> gs: array<f32, C>;
var<workgroup> eg: array<f32, C>;             // exp(gamma_t)
var<workgroup> el: array<f32, C>;             // exp(gamma_L - gamma_t)

@compute @workgroup_size(WG)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {
    let j = wid.x;
    let c0 = wid.y * CB;
    let kh = j % p.n_k;
    let sbase = j * D * D;
    let qo = kh * D;
    let ko = p.n_k * D + kh * D;
    let ow = p.n_v * D;

    for (var e = lid.x; e < D * G; e += WG) {
        let r = sbase + (e / G) * D + c0 + (e % G) * 4u;
        sb[e] = vec4<f32>(s[r], s[r + 1u], s[r + 2u], s[r + 3u]);
    }

    let t = lid.x / G;
    let q4 = lid.x % G;
    for (var chunk = 0u; chunk < p.n_chunks; chunk++) {
        let t0 = (p.ch0 + chunk) * C;
        let len = min(C, p.rows - t0);
        let base = chunk * p.n_v + j;
        if (lid.x < C) {
            gs[lid.x] = gam[base * C + lid.x];
        }
        workgroupBarrier();
        if (lid.x < C) {
            eg[lid.x] = exp(gs[lid.x]);
            el[lid.x] = exp(gs[len - 1u] - gs[lid.x]);
        }
        workgroupBarrier();

        // Vn = U - W S
        let tok = t0 + t;
        let uwr = (base * C + t) * 2u * D;
        if (t < len) {
            var acc = vec4<f32>(0.0);
            for (var i = 0u; i < D; i++) {
                acc += uw[uwr + D + i] * sb[i * G + q4];
            }
            let ui = uwr + c0 + q4 * 4u;
            vn[t * G + q4] = vec4<f32>(uw[ui], uw[ui + 1u], uw[ui + 2u], uw[ui + 3u]) - acc;
        }
        workgroupBarrier();

        // O = (Q exp(gamma)) S + P Vn
        if (t < len) {
            let qr = tok * p.cd + qo;
            var acc = vec4<f32>(0.0);
            for (var i = 0u; i < D; i++) {
                acc += u[qr + i] * sb[i * G + q4];
            }
            acc *= eg[t];
            let pr = (base * C + t) * C;
            for (var s2 = 0u; s2 <= t; s2++) {
                acc += pm[pr + s2] * vn[s2 * G + q4];
            }
            let oi = tok * ow + j * D + c0 + q4 * 4u;
            o[oi] = acc.x;
            o[oi + 1u] = acc.y;
            o[oi + 2u] = acc.z;
            o[oi + 3u] = acc.w;
        }
        // Every read of the old S is done before it is replaced.
        workgroupBarrier();

        // S = exp(gamma_L) S + (K exp(gamma_L - gamma))^T Vn
        let decay = eg[len - 1u];
        for (var e = lid.x; e < D * G; e += WG) {
            let i = e / G;
            let g4 = e % G;
            var acc = sb[e] * decay;
            for (var s2 = 0u; s2 < len; s2++) {
                acc += (u[(t0 + s2) * p.cd + ko + i] * el[s2]) * vn[s2 * G + g4];
            }
            sb[e] = acc;
        }
        // gs, eg, el and vn are rewritten by the next chunk, and sb is read by it.
        workgroupBarrier();
    }

    for (var e = lid.x; e < D * G; e += WG) {
        let r = sbase + (e / G) * D + c0 + (e % G) * 4u;
        let v = sb[e];
        s[r] = v.x;
        s[r + 1u] = v.y;
        s[r + 2u] = v.z;
        s[r + 3u] = v.w;
    }
}
