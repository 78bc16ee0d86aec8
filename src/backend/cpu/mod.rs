//! The f32 reference backend: plain loops, rayon across output rows and heads.
//!
//! Weights stay in the mmap in their stored dtype; matvec streams each row through
//! `quant::dot_row`, so a 2.7 GB quantized file decodes without an f32 copy of itself.

use std::sync::Arc;

use rayon::prelude::*;

use super::{
    AttnParams, Backend, BackendError, Fold, GdnParams, GdnWeights, KvTypes, WeightSource,
};
use crate::quant::{self, hadamard::HadamardConfig};
use crate::tensor::GgmlType;

#[derive(Default)]
pub struct CpuBackend;

impl CpuBackend {
    pub fn new() -> Self {
        CpuBackend
    }
}

/// A row-major `[rows, cols]` activation.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl Tensor {
    fn zeros(rows: usize, cols: usize) -> Tensor {
        Tensor {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        }
    }
    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

pub struct Weight {
    src: WeightSource,
    ty: GgmlType,
    ne0: usize,
    rows: usize,
    row_bytes: usize,
    /// Small 1-D weights (norms, biases, conv taps) decoded once; matrices stay in the mmap.
    dense: Option<Vec<f32>>,
    fold: Option<Fold>,
    inverse: Option<Arc<HadamardConfig>>,
}

impl Weight {
    fn row_data(&self, r: usize) -> &[u8] {
        &self.src.bytes()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
    /// The decoded values of a small weight.
    pub fn dense(&self) -> &[f32] {
        self.dense
            .as_deref()
            .expect("dense view of a matrix weight")
    }
}

/// The attention cache of one layer. Values are kept as f32 but rounded through the chosen
/// dtype when stored, so the numbers are exactly those of a cache held in that dtype.
pub struct Kv {
    k: Vec<f32>,
    v: Vec<f32>,
    width: usize,
    types: KvTypes,
}

/// Rounds one cache row through `ty` (quantize then dequantize), as storing it would.
fn round_through(ty: GgmlType, row: &mut [f32]) {
    if ty != GgmlType::F32 {
        let q = quant::quantize_row(ty, row).expect("cache row is whole blocks");
        quant::dequantize_row(ty, &q, row).expect("cache row is whole blocks");
    }
}

#[derive(Clone)]
pub struct Recurrent {
    /// The last `d_conv - 1` raw conv inputs, oldest first, `[d_conv-1][conv_dim]`.
    pub conv: Vec<f32>,
    /// Per V head `S[i=k][j=v]`, v fastest.
    pub ssm: Vec<f32>,
}

/// Rows per rayon task in matvec: enough work per task to amortise the scheduling.
const ROW_CHUNK: usize = 32;

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let mean = (ss / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

fn silu(x: f32) -> f32 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// `x / max(||x||, eps)`, ggml's l2_norm.
fn l2_normalize(x: &mut [f32], eps: f32) {
    let ss: f64 = x.iter().map(|&v| (v as f64) * (v as f64)).sum();
    let scale = 1.0 / (ss.sqrt() as f32).max(eps);
    x.iter_mut().for_each(|v| *v *= scale);
}

/// NEOX rotation of the first `n_rot` dims of one head, pairs `(i, i + n_rot/2)`, with ggml's
/// interleaved M-RoPE sector rule: text positions are `(p, p, p, 0)`, so pairs in the fourth
/// section (or past the three) rotate by position 0, i.e. not at all.
fn rope_neox(x: &mut [f32], pos: usize, n_rot: usize, base: f32, sections: [i32; 4]) {
    let half = n_rot / 2;
    let theta_scale = base.powf(-2.0 / n_rot as f32);
    let sect_dims: i32 = sections.iter().sum();
    let mut theta_p = pos as f32;
    for i in 0..half {
        let theta = if sect_dims > 0 {
            let s = (i as i32) % sect_dims;
            let in_thw = (s % 3 == 1 && s < 3 * sections[1])
                || (s % 3 == 2 && s < 3 * sections[2])
                || (s % 3 == 0 && s < 3 * sections[0]);
            if in_thw {
                theta_p
            } else {
                0.0
            }
        } else {
            theta_p
        };
        let (sin, cos) = theta.sin_cos();
        let a = x[i];
        let b = x[i + half];
        x[i] = a * cos - b * sin;
        x[i + half] = a * sin + b * cos;
        theta_p *= theta_scale;
    }
}

impl Backend for CpuBackend {
    type T = Tensor;
    type W = Weight;
    type Kv = Kv;
    type Rs = Recurrent;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn upload(&self, w: &WeightSource) -> Result<Weight, BackendError> {
        let ty = w.info.ty;
        if !ty.can_compute() {
            return Err(BackendError::UnsupportedType {
                name: w.info.name.clone(),
                ty,
                backend: "cpu",
            });
        }
        let (ne0, rows) = w.shape2();
        let row_bytes = w.info.row_bytes() as usize;
        let dense = if rows == 1 || w.info.dims.len() == 1 || (ne0 * rows <= 1 << 16 && ne0 <= 8) {
            let mut out = vec![0f32; ne0 * rows];
            quant::dequantize_row(ty, w.bytes(), &mut out).map_err(|e| {
                BackendError::BadWeight {
                    name: w.info.name.clone(),
                    what: e.to_string(),
                }
            })?;
            Some(out)
        } else {
            None
        };
        Ok(Weight {
            src: w.clone(),
            ty,
            ne0,
            rows,
            row_bytes,
            dense,
            fold: w.fold.clone(),
            inverse: w.inverse.clone(),
        })
    }

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Tensor {
        assert_eq!(data.len(), rows * cols);
        Tensor {
            data: data.to_vec(),
            rows,
            cols,
        }
    }

    fn to_host(&self, t: &Tensor) -> Vec<f32> {
        t.data.clone()
    }

    fn rows(&self, t: &Tensor, start: usize, n: usize) -> Tensor {
        Tensor {
            data: t.data[start * t.cols..(start + n) * t.cols].to_vec(),
            rows: n,
            cols: t.cols,
        }
    }

    fn concat_cols(&self, a: &Tensor, b: &Tensor) -> Tensor {
        assert_eq!(a.rows, b.rows);
        let mut out = Tensor::zeros(a.rows, a.cols + b.cols);
        for r in 0..a.rows {
            let o = &mut out.data[r * (a.cols + b.cols)..(r + 1) * (a.cols + b.cols)];
            o[..a.cols].copy_from_slice(a.row(r));
            o[a.cols..].copy_from_slice(b.row(r));
        }
        out
    }

    fn concat_rows(&self, parts: &[&Tensor]) -> Tensor {
        let cols = parts[0].cols;
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        for p in parts {
            assert_eq!(p.cols, cols, "concat_rows: column counts differ");
            data.extend_from_slice(&p.data);
        }
        let rows = data.len() / cols.max(1);
        Tensor { data, rows, cols }
    }

    fn embed(&self, table: &Weight, ids: &[u32]) -> Tensor {
        let mut out = Tensor::zeros(ids.len(), table.ne0);
        out.data
            .par_chunks_mut(table.ne0)
            .zip(ids.par_iter())
            .for_each(|(row, &id)| {
                assert!(
                    (id as usize) < table.rows,
                    "token id {id} outside the {} rows",
                    table.rows
                );
                quant::dequantize_row(table.ty, table.row_data(id as usize), row)
                    .expect("row length validated at load");
                if let Some(h) = &table.inverse {
                    h.inverse_in_place(row);
                }
            });
        out
    }

    fn rms_norm(&self, x: &Tensor, w: &Weight, eps: f32) -> Tensor {
        let w = w.dense();
        assert_eq!(w.len(), x.cols);
        let mut out = x.clone();
        out.data.par_chunks_mut(x.cols).for_each(|row| {
            let s = rms_scale(row, eps);
            row.iter_mut().zip(w).for_each(|(v, &g)| *v = *v * s * g);
        });
        out
    }

    fn matmul(&self, w: &Weight, x: &Tensor) -> Tensor {
        assert_eq!(x.cols, w.ne0, "matmul {}: input width", w.src.name());
        let input: std::borrow::Cow<Tensor> = match &w.fold {
            None => std::borrow::Cow::Borrowed(x),
            Some(fold) => {
                let mut t = x.clone();
                t.data
                    .par_chunks_mut(x.cols)
                    .for_each_init(Vec::new, |scratch, row| fold.apply(row, scratch));
                std::borrow::Cow::Owned(t)
            }
        };
        let x = input.as_ref();
        let n_out = w.rows;
        let n_tok = x.rows;
        if let Some(d) = &w.dense {
            let mut out = Tensor::zeros(n_tok, n_out);
            for t in 0..n_tok {
                for r in 0..n_out {
                    out.data[t * n_out + r] = dot(&d[r * w.ne0..(r + 1) * w.ne0], x.row(t));
                }
            }
            return out;
        }
        if n_tok == 1 {
            let mut out = Tensor::zeros(1, n_out);
            out.data
                .par_chunks_mut(ROW_CHUNK)
                .enumerate()
                .for_each(|(c, chunk)| {
                    for (i, o) in chunk.iter_mut().enumerate() {
                        *o = quant::dot_row(w.ty, w.row_data(c * ROW_CHUNK + i), &x.data);
                    }
                });
            return out;
        }
        // Many tokens: decode each weight row once, then dot it with every token.
        let mut out_t = vec![0f32; n_out * n_tok];
        out_t
            .par_chunks_mut(ROW_CHUNK * n_tok)
            .enumerate()
            .for_each_init(
                || vec![0f32; w.ne0],
                |row_f32, (c, chunk)| {
                    for (i, o) in chunk.chunks_mut(n_tok).enumerate() {
                        let r = c * ROW_CHUNK + i;
                        quant::dequantize_row(w.ty, w.row_data(r), row_f32)
                            .expect("row length validated at load");
                        for (t, o) in o.iter_mut().enumerate() {
                            *o = dot(row_f32, x.row(t));
                        }
                    }
                },
            );
        let mut out = Tensor::zeros(n_tok, n_out);
        for r in 0..n_out {
            for t in 0..n_tok {
                out.data[t * n_out + r] = out_t[r * n_tok + t];
            }
        }
        out
    }

    fn add_assign(&self, x: &mut Tensor, y: &Tensor) {
        assert_eq!(x.data.len(), y.data.len());
        x.data.iter_mut().zip(&y.data).for_each(|(a, &b)| *a += b);
    }

    fn swiglu(&self, gate: &Tensor, up: &Tensor) -> Tensor {
        assert_eq!(gate.data.len(), up.data.len());
        let data = gate
            .data
            .iter()
            .zip(&up.data)
            .map(|(&g, &u)| silu(g) * u)
            .collect();
        Tensor {
            data,
            rows: gate.rows,
            cols: gate.cols,
        }
    }

    fn new_kv(&self, p: &AttnParams, types: KvTypes) -> Result<Kv, BackendError> {
        types.check()?;
        let width = p.n_head_kv * p.head_dim;
        for t in [types.k, types.v] {
            if width % t.block_size() != 0 {
                return Err(BackendError::BadWeight {
                    name: "KV cache".into(),
                    what: format!("row width {width} is not a multiple of the {t} block size"),
                });
            }
        }
        Ok(Kv {
            k: Vec::new(),
            v: Vec::new(),
            width,
            types,
        })
    }

    fn kv_len(&self, kv: &Kv) -> usize {
        kv.k.len() / kv.width
    }

    fn kv_truncate(&self, kv: &mut Kv, len: usize) {
        kv.k.truncate(len * kv.width);
        kv.v.truncate(len * kv.width);
    }

    fn attention(
        &self,
        p: &AttnParams,
        qg: &Tensor,
        k: &Tensor,
        v: &Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        kv: &mut Kv,
        pos0: usize,
    ) -> Tensor {
        let hd = p.head_dim;
        let n_tok = qg.rows;
        assert_eq!(qg.cols, 2 * p.n_head * hd);
        assert_eq!(k.cols, p.n_head_kv * hd);
        assert_eq!(
            self.kv_len(kv),
            pos0,
            "attention: cache holds {} positions, batch starts at {pos0}",
            self.kv_len(kv)
        );
        let (qn, kn) = (q_norm.dense(), k_norm.dense());
        // Queries and gates, normed and rotated.
        let mut q = vec![0f32; n_tok * p.n_head * hd];
        let mut gate = vec![0f32; n_tok * p.n_head * hd];
        for t in 0..n_tok {
            for h in 0..p.n_head {
                let src = &qg.row(t)[h * 2 * hd..(h + 1) * 2 * hd];
                let dq = &mut q[(t * p.n_head + h) * hd..][..hd];
                let s = rms_scale(&src[..hd], p.eps);
                for i in 0..hd {
                    dq[i] = src[i] * s * qn[i];
                }
                rope_neox(dq, pos0 + t, p.n_rot, p.rope_base, p.rope_sections);
                gate[(t * p.n_head + h) * hd..][..hd].copy_from_slice(&src[hd..]);
            }
            for h in 0..p.n_head_kv {
                let src = &k.row(t)[h * hd..(h + 1) * hd];
                let s = rms_scale(src, p.eps);
                let mut kr: Vec<f32> = src.iter().zip(kn).map(|(&x, &g)| x * s * g).collect();
                rope_neox(&mut kr, pos0 + t, p.n_rot, p.rope_base, p.rope_sections);
                kv.k.extend_from_slice(&kr);
            }
            {
                let n = kv.k.len();
                round_through(kv.types.k, &mut kv.k[n - kv.width..]);
            }
            kv.v.extend_from_slice(v.row(t));
            let n = kv.v.len();
            round_through(kv.types.v, &mut kv.v[n - kv.width..]);
        }
        let group = p.n_head / p.n_head_kv;
        let width = kv.width;
        let mut out = Tensor::zeros(n_tok, p.n_head * hd);
        let (kc, vc) = (&kv.k, &kv.v);
        out.data
            .par_chunks_mut(hd)
            .enumerate()
            .for_each(|(idx, o)| {
                let (t, h) = (idx / p.n_head, idx % p.n_head);
                let kvh = h / group;
                let qh = &q[idx * hd..(idx + 1) * hd];
                let n_ctx = pos0 + t + 1;
                let mut scores: Vec<f32> = (0..n_ctx)
                    .map(|j| dot(qh, &kc[j * width + kvh * hd..][..hd]) * p.scale)
                    .collect();
                let m = scores.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0f64;
                for s in scores.iter_mut() {
                    *s = (*s - m).exp();
                    sum += *s as f64;
                }
                let inv = (1.0 / sum) as f32;
                for (j, &s) in scores.iter().enumerate() {
                    let vr = &vc[j * width + kvh * hd..][..hd];
                    let w = s * inv;
                    o.iter_mut().zip(vr).for_each(|(a, &b)| *a += w * b);
                }
                let g = &gate[idx * hd..(idx + 1) * hd];
                o.iter_mut().zip(g).for_each(|(a, &b)| *a *= sigmoid(b));
            });
        out
    }

    fn new_recurrent(&self, p: &GdnParams) -> Recurrent {
        Recurrent {
            conv: vec![0.0; p.conv_state_len()],
            ssm: vec![0.0; p.ssm_state_len()],
        }
    }

    fn recurrent_copy(&self, from: &Recurrent, to: &mut Recurrent) {
        to.conv.copy_from_slice(&from.conv);
        to.ssm.copy_from_slice(&from.ssm);
    }

    fn gdn(
        &self,
        p: &GdnParams,
        mixed: &Tensor,
        z: &Tensor,
        b: &Tensor,
        a: &Tensor,
        w: &GdnWeights<'_, Weight>,
        st: &mut Recurrent,
    ) -> Tensor {
        let cd = p.conv_dim();
        let d = p.d;
        let kw = p.d_conv;
        let n_tok = mixed.rows;
        assert_eq!(mixed.cols, cd);
        let conv_w = w.conv.dense();
        let (dt_bias, ssm_a, norm_w) = (w.dt_bias.dense(), w.ssm_a.dense(), w.norm.dense());
        let q_scale = 1.0 / (d as f32).sqrt();
        let mut out = Tensor::zeros(n_tok, p.n_v * d);
        let mut u = vec![0f32; cd];
        for t in 0..n_tok {
            // Causal depthwise conv over [state; x_t], then SiLU.
            let x = mixed.row(t);
            for ch in 0..cd {
                let taps = &conv_w[ch * kw..(ch + 1) * kw];
                let mut c = taps[kw - 1] * x[ch];
                for k in 0..kw - 1 {
                    c += taps[k] * st.conv[k * cd + ch];
                }
                u[ch] = silu(c);
            }
            st.conv.copy_within(cd.., 0);
            st.conv[(kw - 2) * cd..].copy_from_slice(x);

            let (qs, rest) = u.split_at_mut(p.n_k * d);
            let (ks, vs) = rest.split_at_mut(p.n_k * d);
            for h in 0..p.n_k {
                l2_normalize(&mut qs[h * d..(h + 1) * d], p.eps);
                l2_normalize(&mut ks[h * d..(h + 1) * d], p.eps);
            }
            qs.iter_mut().for_each(|v| *v *= q_scale);
            let (qs, ks, vs) = (&*qs, &*ks, &*vs);
            let zr = z.row(t);
            let (br, ar) = (b.row(t), a.row(t));
            let orow = &mut out.data[t * p.n_v * d..(t + 1) * p.n_v * d];
            orow.par_chunks_mut(d)
                .zip(st.ssm.par_chunks_mut(d * d))
                .enumerate()
                .for_each(|(j, (o, s))| {
                    let kh = j % p.n_k;
                    let (q, k) = (&qs[kh * d..(kh + 1) * d], &ks[kh * d..(kh + 1) * d]);
                    let v = &vs[j * d..(j + 1) * d];
                    let beta = sigmoid(br[j]);
                    let g = ssm_a[j] * softplus(ar[j] + dt_bias[j]);
                    let decay = g.exp();
                    s.iter_mut().for_each(|x| *x *= decay);
                    // kv = Sᵀk, then S += k ⊗ beta(v - kv), then o = Sᵀq.
                    let mut kv = vec![0f32; d];
                    for i in 0..d {
                        let srow = &s[i * d..(i + 1) * d];
                        let ki = k[i];
                        kv.iter_mut()
                            .zip(srow)
                            .for_each(|(acc, &sv)| *acc += sv * ki);
                    }
                    let delta: Vec<f32> = v
                        .iter()
                        .zip(&kv)
                        .map(|(&vv, &kk)| beta * (vv - kk))
                        .collect();
                    o.iter_mut().for_each(|x| *x = 0.0);
                    for i in 0..d {
                        let srow = &mut s[i * d..(i + 1) * d];
                        let (ki, qi) = (k[i], q[i]);
                        for (jj, sv) in srow.iter_mut().enumerate() {
                            *sv += ki * delta[jj];
                            o[jj] += *sv * qi;
                        }
                    }
                    // Gated RMSNorm over the head.
                    let sc = rms_scale(o, p.eps);
                    let zj = &zr[j * d..(j + 1) * d];
                    for i in 0..d {
                        o[i] = o[i] * sc * norm_w[i] * silu(zj[i]);
                    }
                });
        }
        out
    }

    fn argmax_rows(&self, x: &Tensor) -> Vec<u32> {
        (0..x.rows)
            .map(|r| {
                let row = x.row(r);
                let mut best = 0;
                for (i, &v) in row.iter().enumerate() {
                    if v > row[best] {
                        best = i;
                    }
                }
                best as u32
            })
            .collect()
    }
}
