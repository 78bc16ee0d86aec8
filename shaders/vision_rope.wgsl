// The vision tower's 2-D rotary on q and k (NEOX pairs (j, j + hd/2), the (sin, cos) table of
// backend::vision_rope_table), written head-major for vision_attn: q and k of
// qkv [n][3 * n_head * hd] (q | k | v) to [n_head][n][hd] each. One invocation per (token,
// head, pair).
struct Params {
    n: u32,
    n_head: u32,
    hd: u32,
    _pad: u32,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> rope: array<f32>;
@group(0) @binding(3) var<storage, read_write> qr: array<f32>;
@group(0) @binding(4) var<storage, read_write> kr: array<f32>;

@compute @workgroup_size(WG)
fn main(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>) {
    let i = gid.x + gid.y * nwg.x * WG;
    let half = p.hd / 2u;
    if (i >= p.n * p.n_head * half) {
        return;
    }
    let j = i % half;
    let h = (i / half) % p.n_head;
    let t = i / half / p.n_head;
    let sn = rope[(t * half + j) * 2u];
    let cs = rope[(t * half + j) * 2u + 1u];
    let width = p.n_head * p.hd;
    let src = t * 3u * width + h * p.hd + j;
    let dst = (h * p.n + t) * p.hd + j;
    let qa = qkv[src];
    let qb = qkv[src + half];
    qr[dst] = qa * cs - qb * sn;
    qr[dst + half] = qa * sn + qb * cs;
    let ka = qkv[src + width];
    let kb = qkv[src + width + half];
    kr[dst] = ka * cs - kb * sn;
    kr[dst + half] = ka * sn + kb * cs;
}
