//! References for the vision tower's ops, written from model-vision.md §3 and ggml's
//! definitions in f64: the CPU's op tests (tests/ops_cpu.rs) and the tower block on every
//! backend (tests/ops_vision.rs) check against these.

use half::f16;

/// ggml_norm, then the weight and the bias.
pub fn layer_norm_ref(x: &[f64], w: &[f64], b: &[f64], eps: f64) -> Vec<f64> {
    let n = x.len() as f64;
    let mean = x.iter().sum::<f64>() / n;
    let var = x.iter().map(|v| (v - mean) * (v - mean)).sum::<f64>() / n;
    let s = 1.0 / (var + eps).sqrt();
    x.iter()
        .zip(w.iter().zip(b))
        .map(|(v, (g, c))| (v - mean) * s * g + c)
        .collect()
}

/// The tanh form of GELU, exactly.
pub fn gelu_tanh(x: f64) -> f64 {
    0.5 * x * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (x + 0.044715 * x * x * x)).tanh())
}

/// GELU as ggml's CPU evaluates it on f32: 0 at or below -10, x at or above 10, otherwise the
/// tanh form at x rounded to f16, rounded to f16.
pub fn gelu_ggml_ref(x: f64) -> f64 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        let h = f16::from_f64(x as f32 as f64).to_f64();
        f16::from_f64(gelu_tanh(h)).to_f64()
    }
}

/// The rotary angle of every (patch, pair j < hd/2) of a `rows x cols` patch grid in the
/// tower's token order (2x2 blocks row-major, (0,0) (0,1) (1,0) (1,1) inside): row · θ^(-4j/hd)
/// for j < hd/4, col · θ^(-4(j - hd/4)/hd) above, θ = 10000.
pub fn rope_angles(rows: usize, cols: usize, hd: usize) -> Vec<f64> {
    let mut out = Vec::new();
    for by in 0..rows / 2 {
        for bx in 0..cols / 2 {
            for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                let (r, c) = ((2 * by + dy) as f64, (2 * bx + dx) as f64);
                for j in 0..hd / 2 {
                    let (p, e) = if j < hd / 4 { (r, j) } else { (c, j - hd / 4) };
                    out.push(p * 10000f64.powf(-4.0 * e as f64 / hd as f64));
                }
            }
        }
    }
    out
}

/// softmax(q·k / sqrt(hd)) v per head over all n tokens, q and k rotated by `rope`
/// ((sin, cos) per (token, pair), pairs (j, j + hd/2)). `qkv` is `[n][3 * n_head * hd]`.
pub fn vision_attention_ref(
    qkv: &[f64],
    n: usize,
    n_head: usize,
    hd: usize,
    rope: &[f64],
) -> Vec<f64> {
    let w = n_head * hd;
    let half = hd / 2;
    let rotate = |t: usize, x: &[f64]| -> Vec<f64> {
        let mut y = x.to_vec();
        for j in 0..half {
            let (s, c) = (rope[(t * half + j) * 2], rope[(t * half + j) * 2 + 1]);
            y[j] = x[j] * c - x[j + half] * s;
            y[j + half] = x[j] * s + x[j + half] * c;
        }
        y
    };
    let mut out = vec![0f64; n * w];
    for h in 0..n_head {
        let head = |t: usize, part: usize| &qkv[t * 3 * w + part * w + h * hd..][..hd];
        let k: Vec<Vec<f64>> = (0..n).map(|t| rotate(t, head(t, 1))).collect();
        for t in 0..n {
            let q = rotate(t, head(t, 0));
            let s: Vec<f64> = k
                .iter()
                .map(|kj| q.iter().zip(kj).map(|(a, b)| a * b).sum::<f64>() / (hd as f64).sqrt())
                .collect();
            let m = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = s.iter().map(|v| (v - m).exp()).collect();
            let z: f64 = e.iter().sum();
            for (j, ej) in e.iter().enumerate() {
                for (o, v) in out[t * w + h * hd..][..hd].iter_mut().zip(head(j, 2)) {
                    *o += ej / z * v;
                }
            }
        }
    }
    out
}
