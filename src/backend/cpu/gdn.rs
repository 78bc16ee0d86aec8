//! The Gated DeltaNet core (model-qwen35.md §4) over consecutive tokens of one sequence.
//!
//! The batch runs in chunks of `CHUNK` tokens, each in two phases. The causal conv, SiLU, L2
//! norms and q scale depend only on the raw inputs, so they run for the chunk's tokens at once,
//! in parallel over (token, head). The recurrence is sequential in time but independent per V
//! head, so each head runs through the chunk's tokens in one task (one rayon split per chunk,
//! not per token), the gated RMSNorm included.

use rayon::prelude::*;

use super::{math, rms_scale, sigmoid, silu, softplus, Recurrent, Tensor};
use crate::backend::GdnParams;

/// Tokens per chunk: the conv output of a chunk stays small (and cached) while the heads scan
/// it, however long the prompt.
const CHUNK: usize = 128;

/// The per-layer weights of the core, decoded.
pub(super) struct Weights<'a> {
    /// The conv taps tap-major, `[d_conv][conv_dim]`.
    pub conv_taps: &'a [f32],
    pub dt_bias: &'a [f32],
    pub ssm_a: &'a [f32],
    pub norm: &'a [f32],
}

/// `x / max(||x||, eps)`, ggml's l2_norm.
fn l2_normalize(x: &mut [f32], eps: f32) {
    let scale = 1.0 / (math::sum_sq(x).sqrt() as f32).max(eps);
    x.iter_mut().for_each(|v| *v *= scale);
}

#[allow(clippy::too_many_arguments)]
pub(super) fn gdn(
    p: &GdnParams,
    mixed: &Tensor,
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &Weights<'_>,
    st: &mut Recurrent,
) -> Tensor {
    let (cd, d, n_tok) = (p.conv_dim(), p.d, mixed.rows);
    assert_eq!(mixed.cols, cd);
    let mut out = Tensor::zeros(n_tok, p.n_v * d);
    for t0 in (0..n_tok).step_by(CHUNK) {
        let t1 = (t0 + CHUNK).min(n_tok);
        let u = conv_silu_norm(p, mixed, t0..t1, w.conv_taps, &st.conv);
        // The recurrence and gated norm, one task per V head over the chunk's tokens.
        let heads: Vec<Vec<f32>> = st
            .ssm
            .par_chunks_mut(d * d)
            .enumerate()
            .map(|(j, s)| {
                let mut y = vec![0f32; (t1 - t0) * d];
                head_scan(p, j, t0, &u, z, b, a, w, s, &mut y);
                y
            })
            .collect();
        for (j, y) in heads.iter().enumerate() {
            for (t, yt) in (t0..).zip(y.chunks_exact(d)) {
                out.data[(t * p.n_v + j) * d..][..d].copy_from_slice(yt);
            }
        }
    }
    // The new conv state: the last d_conv - 1 rows of X = [state; mixed].
    let mut conv = Vec::with_capacity(st.conv.len());
    for i in n_tok..n_tok + p.d_conv - 1 {
        conv.extend_from_slice(conv_input(p, &st.conv, mixed, i));
    }
    st.conv = conv;
    out
}

/// Row `i` of the conv input X: the carried state rows, then the `mixed` rows.
fn conv_input<'a>(p: &GdnParams, state: &'a [f32], mixed: &'a Tensor, i: usize) -> &'a [f32] {
    let (cd, kw1) = (p.conv_dim(), p.d_conv - 1);
    if i < kw1 {
        &state[i * cd..(i + 1) * cd]
    } else {
        mixed.row(i - kw1)
    }
}

/// `u[t] = silu(conv(X)[t])` for the batch rows `tokens`, with q and k heads L2-normalised and q
/// scaled by `1/sqrt(d)`, where X is the carried `d_conv - 1` raw inputs followed by the
/// `mixed` rows.
fn conv_silu_norm(
    p: &GdnParams,
    mixed: &Tensor,
    tokens: std::ops::Range<usize>,
    taps: &[f32],
    state: &[f32],
) -> Vec<f32> {
    let (cd, d, kw) = (p.conv_dim(), p.d, p.d_conv);
    let q_scale = 1.0 / (d as f32).sqrt();
    let heads = cd / d; // n_k q heads, n_k k heads, n_v v heads
    let mut u = vec![0f32; tokens.len() * cd];
    // One task per (token, head): the conv, SiLU and that head's norm.
    u.par_chunks_mut(d).enumerate().for_each(|(i, o)| {
        let (t, h) = (tokens.start + i / heads, i % heads);
        let cols = h * d..(h + 1) * d;
        let x = |k: usize| &conv_input(p, state, mixed, t + k)[cols.clone()];
        let tap = |k: usize| &taps[k * cd..(k + 1) * cd][cols.clone()];
        // c = w[kw-1]·x[t] + Σ_{k<kw-1} w[k]·x[t-(kw-1)+k], then SiLU.
        for ((o, &wk), &xv) in o.iter_mut().zip(tap(kw - 1)).zip(x(kw - 1)) {
            *o = wk * xv;
        }
        for k in 0..kw - 1 {
            for ((o, &wk), &xv) in o.iter_mut().zip(tap(k)).zip(x(k)) {
                *o += wk * xv;
            }
        }
        math::silu_in_place(o);
        if h < 2 * p.n_k {
            l2_normalize(o, p.eps);
        }
        if h < p.n_k {
            o.iter_mut().for_each(|v| *v *= q_scale);
        }
    });
    u
}

/// V head `j` over the batch rows `t0..t0 + y.len() / d` (whose conv outputs are `u`): the
/// delta rule on its state `s` (`S[i][j']`, j' fastest), then the gated RMSNorm, into `y`.
#[allow(clippy::too_many_arguments)]
fn head_scan(
    p: &GdnParams,
    j: usize,
    t0: usize,
    u: &[f32],
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &Weights<'_>,
    s: &mut [f32],
    y: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the features are present.
        return unsafe { head_scan_fma(p, j, t0, u, z, b, a, w, s, y) };
    }
    head_scan_body::<false>(p, j, t0, u, z, b, a, w, s, y)
}

/// `head_scan_body` compiled for AVX2 with fused multiply-adds.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
#[allow(clippy::too_many_arguments)]
unsafe fn head_scan_fma(
    p: &GdnParams,
    j: usize,
    t0: usize,
    u: &[f32],
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &Weights<'_>,
    s: &mut [f32],
    y: &mut [f32],
) {
    head_scan_body::<true>(p, j, t0, u, z, b, a, w, s, y)
}

/// `a * b + c`, fused when the caller is compiled with FMA.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// Columns `c0..c0 + C` of one token's sweep down the rows of `S` (`d` wide):
/// `S[i] = decay·S[i] + k[i]·δ`, `o = Σ_i S[i]·q[i]`, `kv_next = Σ_i S[i]·k_next[i]`.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn sweep<const FMA: bool, const C: usize>(
    s: &mut [f32],
    d: usize,
    c0: usize,
    decay: f32,
    k: &[f32],
    q: &[f32],
    k_next: &[f32],
    delta: &[f32],
    o: &mut [f32],
    kv_next: &mut [f32],
) {
    let dl: [f32; C] = delta[c0..c0 + C].try_into().expect("C columns");
    let mut oa = [0f32; C];
    let mut kn = [0f32; C];
    for (i, srow) in s.chunks_exact_mut(d).enumerate() {
        let (ki, qi, kni) = (k[i], q[i], k_next[i]);
        let row: &mut [f32; C] = (&mut srow[c0..c0 + C]).try_into().expect("C columns");
        for c in 0..C {
            row[c] = madd::<FMA>(ki, dl[c], row[c] * decay);
            oa[c] = madd::<FMA>(row[c], qi, oa[c]);
            kn[c] = madd::<FMA>(row[c], kni, kn[c]);
        }
    }
    o[c0..c0 + C].copy_from_slice(&oa);
    kv_next[c0..c0 + C].copy_from_slice(&kn);
}

/// The recurrence of §4 step 9 for one head, per token:
/// ```text
/// S = S·exp(g);  kv = Sᵀk;  δ = β(v − kv);  S += k ⊗ δ;  o = Sᵀq
/// ```
/// computed as `kv = exp(g)·(S_oldᵀk)` followed by one pass over the rows of S that forms the
/// new row `S[i] = exp(g)·S[i] + k[i]·δ`, accumulates `o += S[i]·q[i]`, and already accumulates
/// the next token's `S_oldᵀk` from the same row: one sweep of the state per token.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn head_scan_body<const FMA: bool>(
    p: &GdnParams,
    j: usize,
    t0: usize,
    u: &[f32],
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &Weights<'_>,
    s: &mut [f32],
    y: &mut [f32],
) {
    let (cd, d) = (p.conv_dim(), p.d);
    let n_tok = y.len() / d;
    let kh = j % p.n_k; // tiled V order
    let q_at = |t: usize| &u[t * cd + kh * d..][..d];
    let k_at = |t: usize| &u[t * cd + (p.n_k + kh) * d..][..d];
    let v_at = |t: usize| &u[t * cd + (2 * p.n_k + j) * d..][..d];
    // kv = S_oldᵀ k for the first token.
    let mut kv = vec![0f32; d];
    for (srow, &ki) in s.chunks_exact(d).zip(k_at(0)) {
        for (acc, &sv) in kv.iter_mut().zip(srow) {
            *acc = madd::<FMA>(sv, ki, *acc);
        }
    }
    let mut delta = vec![0f32; d];
    let mut kv_next = vec![0f32; d];
    const COLS: usize = 32;
    for t in 0..n_tok {
        let beta = sigmoid(b.row(t0 + t)[j]);
        let decay = (w.ssm_a[j] * softplus(a.row(t0 + t)[j] + w.dt_bias[j])).exp();
        for ((dl, &vv), &kk) in delta.iter_mut().zip(v_at(t)).zip(&kv) {
            *dl = beta * (vv - decay * kk);
        }
        let (q, k) = (q_at(t), k_at(t));
        let k_next = k_at((t + 1).min(n_tok - 1));
        let o = &mut y[t * d..(t + 1) * d];
        // Columns in blocks of COLS, so that δ, o and the next kv of a block stay in
        // registers while the sweep runs down the rows; then the leftover columns.
        let full = d / COLS * COLS;
        for c0 in (0..full).step_by(COLS) {
            sweep::<FMA, COLS>(s, d, c0, decay, k, q, k_next, &delta, o, &mut kv_next);
        }
        for c0 in full..d {
            sweep::<FMA, 1>(s, d, c0, decay, k, q, k_next, &delta, o, &mut kv_next);
        }
        std::mem::swap(&mut kv, &mut kv_next);
        // Gated RMSNorm over the head.
        let sc = rms_scale(o, p.eps);
        let zj = &z.row(t0 + t)[j * d..(j + 1) * d];
        for ((ov, &g), &zv) in o.iter_mut().zip(w.norm).zip(zj) {
            *ov = *ov * sc * g * silu(zv);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(rows: usize, cols: usize, seed: usize) -> Tensor {
        let data = (0..rows * cols)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0 - 1.0) * 0.5)
            .collect();
        Tensor { data, rows, cols }
    }

    /// A batch longer than a chunk gives the outputs and state of feeding it token by token.
    #[test]
    fn batch_across_chunks_matches_token_by_token() {
        let p = GdnParams {
            n_k: 2,
            n_v: 4,
            d: 32,
            d_conv: 4,
            eps: 1e-6,
        };
        let n = 2 * CHUNK + 37;
        let (mixed, z) = (tensor(n, p.conv_dim(), 1), tensor(n, p.n_v * p.d, 2));
        let (b, a) = (tensor(n, p.n_v, 3), tensor(n, p.n_v, 4));
        let conv = tensor(p.d_conv, p.conv_dim(), 5).data;
        let (dt_bias, ssm_a, norm) = (vec![0.3; p.n_v], vec![-0.7; p.n_v], vec![1.1; p.d]);
        let w = Weights {
            conv_taps: &conv,
            dt_bias: &dt_bias,
            ssm_a: &ssm_a,
            norm: &norm,
        };
        let fresh = || Recurrent {
            conv: vec![0.1; p.conv_state_len()],
            ssm: vec![0.01; p.ssm_state_len()],
        };
        let mut batch_st = fresh();
        let batch = gdn(&p, &mixed, &z, &b, &a, &w, &mut batch_st);
        let mut step_st = fresh();
        let row = |t: &Tensor, i: usize| Tensor {
            data: t.row(i).to_vec(),
            rows: 1,
            cols: t.cols,
        };
        let mut steps = Vec::new();
        for i in 0..n {
            let (m, zz, bb, aa) = (row(&mixed, i), row(&z, i), row(&b, i), row(&a, i));
            steps.extend(gdn(&p, &m, &zz, &bb, &aa, &w, &mut step_st).data);
        }
        let nmse = crate::backend::nmse;
        assert!(
            nmse(&batch.data, &steps) < 1e-12,
            "{}",
            nmse(&batch.data, &steps)
        );
        assert!(nmse(&batch_st.ssm, &step_st.ssm) < 1e-12);
        assert_eq!(batch_st.conv, step_st.conv);
    }
}
