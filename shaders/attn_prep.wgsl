// Attention prologue, one workgroup per (token, head) over the n_head query heads followed by
// the n_head_kv key heads: RMSNorm over head_dim times the q_norm / k_norm weight, then partial
// NEOX RoPE on the first n_rot dims with ggml's IMROPE sector rule (text positions (p, p, p, 0):
// pairs whose sector is outside t/h/w rotate by position 0). Query heads are read from the
// first half of each [q_h | gate_h] slice of `qg`; the result goes to `qo` [rows][n_head][hd],
// key heads to `ko` [rows][n_head_kv * hd] (stored into the cache by kv_store).
struct Params {
    rows: u32,
    n_head: u32,
    n_head_kv: u32,
    hd: u32,
    n_rot: u32,
    pos0: u32,
    eps: f32,
    // base^(-2/n_rot), computed on the host exactly as the CPU reference does.
    theta_scale: f32,
    sections: vec4<i32>,
}

@group(0) @binding(0) var<uniform> p: Params;
@group(0) @binding(1) var<storage, read> qg: array<f32>;
@group(0) @binding(2) var<storage, read> k: array<f32>;
@group(0) @binding(3) var<storage, read> q_norm: array<f32>;
@group(0) @binding(4) var<storage, read> k_norm: array<f32>;
@group(0) @binding(5) var<storage, read_write> qo: array<f32>;
@group(0) @binding(6) var<storage, read_write> ko: array<f32>;

const WG: u32 = 64u;
// Largest head_dim (checked by the host).
const MAX_HD: u32 = 512u;

var<workgroup> xs: array<f32, MAX_HD>;
var<workgroup> red: array<f32, WG>;

// (sin x, cos x): quadrant reduction by a three-part pi/2 (Cody-Waite; the leading parts have
// few bits so j * part is exact for |j| < 2^13) and the cephes sinf/cosf polynomials on
// [-pi/4, pi/4]. WGSL's sin/cos have no accuracy guarantee outside [-pi, pi].
fn sin_cos(x: f32) -> vec2<f32> {
    let j = round(x * 0.63661977236758134);
    var r = x - j * 1.5703125;
    r = r - j * 4.837512969970703125e-4;
    r = r - j * 7.54978995489188216e-8;
    let z = r * r;
    let s = r + r * z * (-1.6666654611e-1 + z * (8.3321608736e-3 + z * -1.9515295891e-4));
    let c = 1.0 - 0.5 * z + z * z * (4.166664568298827e-2 + z * (-1.388731625493765e-3 + z * 2.443315711809948e-5));
    let quad = u32(i32(j) & 3);
    if (quad == 0u) {
        return vec2<f32>(s, c);
    } else if (quad == 1u) {
        return vec2<f32>(c, -s);
    } else if (quad == 2u) {
        return vec2<f32>(-s, -c);
    }
    return vec2<f32>(-c, s);
}

@compute @workgroup_size(64)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(num_workgroups) nwg: vec3<u32>,
        @builtin(local_invocation_id) lid: vec3<u32>) {
    let heads = p.n_head + p.n_head_kv;
    let idx = wid.x + wid.y * nwg.x;
    if (idx >= p.rows * heads) {
        return;
    }
    let t = idx / heads;
    let hh = idx % heads;
    let hd = p.hd;
    let is_q = hh < p.n_head;
    let width = p.n_head_kv * hd;
    var src = 0u;
    var dst = 0u;
    if (is_q) {
        src = t * 2u * p.n_head * hd + hh * 2u * hd;
        dst = (t * p.n_head + hh) * hd;
    } else {
        src = t * width + (hh - p.n_head) * hd;
        dst = src;
    }

    var ss = 0.0;
    for (var i = lid.x; i < hd; i += WG) {
        var v = 0.0;
        if (is_q) {
            v = qg[src + i];
        } else {
            v = k[src + i];
        }
        xs[i] = v;
        ss += v * v;
    }
    red[lid.x] = ss;
    workgroupBarrier();
    for (var stride = WG / 2u; stride > 0u; stride /= 2u) {
        if (lid.x < stride) {
            red[lid.x] += red[lid.x + stride];
        }
        workgroupBarrier();
    }
    let scale = 1.0 / sqrt(red[0] / f32(hd) + p.eps);
    for (var i = lid.x; i < hd; i += WG) {
        var w = 0.0;
        if (is_q) {
            w = q_norm[i];
        } else {
            w = k_norm[i];
        }
        xs[i] = xs[i] * scale * w;
    }
    workgroupBarrier();

    let half = p.n_rot / 2u;
    let pos = f32(p.pos0 + t);
    let s = p.sections;
    let sect_dims = s.x + s.y + s.z + s.w;
    for (var i = lid.x; i < half; i += WG) {
        // theta_p = pos * theta_scale^i, multiplied in the same order as the reference.
        var theta = pos;
        for (var j = 0u; j < i; j++) {
            theta *= p.theta_scale;
        }
        if (sect_dims > 0) {
            let sec = i32(i) % sect_dims;
            let in_thw = (sec % 3 == 1 && sec < 3 * s.y) || (sec % 3 == 2 && sec < 3 * s.z)
                || (sec % 3 == 0 && sec < 3 * s.x);
            if (!in_thw) {
                theta = 0.0;
            }
        }
        let sc = sin_cos(theta);
        let a = xs[i];
        let b = xs[i + half];
        let y0 = a * sc.y - b * sc.x;
        let y1 = a * sc.x + b * sc.y;
        if (is_q) {
            qo[dst + i] = y0;
            qo[dst + i + half] = y1;
        } else {
            ko[dst + i] = y0;
            ko[dst + i + half] = y1;
        }
    }
    for (var i = p.n_rot + lid.x; i < hd; i += WG) {
        if (is_q) {
            qo[dst + i] = xs[i];
        } else {
            ko[dst + i] = xs[i];
        }
    }
}
