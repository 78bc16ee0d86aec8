//! The CPU backend's ops against references written here from the math (model-qwen35.md
//! §3–§5), in f64, on random inputs and awkward shapes. The CPU is the reference the GPU op
//! tests compare with (tests/ops_*.rs), so it is checked against something that is not itself:
//! these plain loops, the quant module's decoders (`dequantize_row`, byte-exact with ggml,
//! src/quant/tests.rs) and its Hadamard rules (`Fold::apply`, checked against an explicit
//! Sylvester matrix there). The whole-model goldens from stock llama.cpp check the same ops on
//! real shapes.

mod common;

use common::{assert_close, cpu, hadamard, weight, with_fold, Rng};
use tern::backend::cpu::CpuBackend;
use tern::backend::{AttnParams, Backend, Fold, GdnParams, GdnWeights, KvTypes};
use tern::quant::hadamard::GdnPermutation;
use tern::quant::{dequantize_row, quantize_row};
use tern::tensor::GgmlType;

/// The CPU computes in f32, the references in f64: f32 rounding of sums of up to a few
/// thousand terms, NMSE ~1e-13. A wrong index or a missing term is >= 1e-4.
const TOL: f64 = 1e-10;

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn f32s(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

fn silu(x: f64) -> f64 {
    x / (1.0 + (-x).exp())
}

fn sigmoid(x: f64) -> f64 {
    1.0 / (1.0 + (-x).exp())
}

/// `x / sqrt(mean(x²) + eps) * w`.
fn rms_norm_ref(x: &[f64], w: &[f64], eps: f64) -> Vec<f64> {
    let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
    let s = 1.0 / (ms + eps).sqrt();
    x.iter().zip(w).map(|(v, g)| v * s * g).collect()
}

#[test]
fn rows_ops() {
    let be = cpu();
    let mut rng = Rng(1011);
    for (rows, cols) in [(1, 1), (3, 7), (5, 300), (2, 1024), (70, 64)] {
        let x = rng.vec(rows * cols, 2.0);
        let w = rng.vec(cols, 1.0);
        let ours = be.to_host(
            &be.rms_norm(
                &be.from_host(&x, rows, cols),
                &be.upload(&weight("norm", GgmlType::F32, cols, 1, &w))
                    .unwrap(),
                1e-6,
            ),
        );
        let want: Vec<f64> = x
            .chunks(cols)
            .flat_map(|r| rms_norm_ref(&f64s(r), &f64s(&w), 1e-6))
            .collect();
        assert_close(&format!("rms_norm {rows}x{cols}"), &ours, &f32s(&want), TOL);

        let y = rng.vec(rows * cols, 3.0);
        let ours =
            be.to_host(&be.swiglu(&be.from_host(&x, rows, cols), &be.from_host(&y, rows, cols)));
        let want: Vec<f32> = x
            .iter()
            .zip(&y)
            .map(|(&g, &u)| (silu(g as f64) * u as f64) as f32)
            .collect();
        assert_close(&format!("swiglu {rows}x{cols}"), &ours, &want, TOL);

        let mut t = be.from_host(&x, rows, cols);
        be.add_assign(&mut t, &be.from_host(&y, rows, cols));
        let want: Vec<f32> = x.iter().zip(&y).map(|(a, b)| a + b).collect();
        assert_eq!(be.to_host(&t), want, "add {rows}x{cols}");

        let scales: Vec<f32> = (0..rows)
            .map(|r| if r % 2 == 1 { 0.0 } else { rng.f32() * 2.0 })
            .collect();
        let mut t = be.from_host(&x, rows, cols);
        be.add_scaled_rows(&mut t, &be.from_host(&y, rows, cols), &scales);
        let want: Vec<f32> = x
            .iter()
            .zip(&y)
            .enumerate()
            .map(|(i, (a, b))| a + scales[i / cols] * b)
            .collect();
        assert_eq!(be.to_host(&t), want, "add_scaled_rows {rows}x{cols}");

        let c = rng.vec(rows * 3, 1.0);
        let ours =
            be.to_host(&be.concat_cols(&be.from_host(&x, rows, cols), &be.from_host(&c, rows, 3)));
        let want: Vec<f32> = (0..rows)
            .flat_map(|r| {
                x[r * cols..(r + 1) * cols]
                    .iter()
                    .chain(&c[r * 3..r * 3 + 3])
                    .copied()
            })
            .collect();
        assert_eq!(ours, want, "concat_cols {rows}x{cols}+3");

        // Runs of rows, in the order asked, including an empty one.
        let runs = [(rows - 1, 1), (0, rows / 2), (rows / 2, 0)];
        let ours = be.to_host(&be.gather_rows(&be.from_host(&x, rows, cols), &runs));
        let want: Vec<f32> = runs
            .iter()
            .flat_map(|&(s, n)| x[s * cols..(s + n) * cols].iter().copied())
            .collect();
        assert_eq!(ours, want, "gather_rows {rows}x{cols}");
    }
}

/// A weight's rows decoded by the quant module's reference decoder.
fn decoded(ty: GgmlType, ne0: usize, rows: usize, data: &[f32]) -> Vec<f64> {
    let mut out = vec![0f32; ne0];
    let mut all = Vec::with_capacity(ne0 * rows);
    for r in data.chunks(ne0) {
        let q = quantize_row(ty, r).unwrap();
        dequantize_row(ty, &q, &mut out).unwrap();
        all.extend(f64s(&out));
    }
    all
}

/// `y[t][r] = Σ W[r][i] x'[t][i]` in f64, x' the input after the fold's rule when there is one.
fn matmul_ref(w: &[f64], ne0: usize, x: &[f32], fold: Option<&Fold>) -> Vec<f32> {
    let mut scratch = Vec::new();
    x.chunks(ne0)
        .flat_map(|row| {
            let mut xr = row.to_vec();
            if let Some(f) = fold {
                f.apply(&mut xr, &mut scratch);
            }
            let xr = f64s(&xr);
            w.chunks(ne0)
                .map(move |wr| wr.iter().zip(&xr).map(|(a, b)| a * b).sum::<f64>() as f32)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Every weight dtype, through each token-count path of the CPU matmul (one token, the
/// multi-token row kernel, the tiled GEMM), folded and not, and `matmul_many` sharing one
/// transform between weights; and the embedding lookup with and without the inverse rule.
#[test]
fn matmul_and_embed() {
    let be = cpu();
    let mut rng = Rng(1021);
    for ty in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::PQ2_0,
        GgmlType::PTQ1_0,
    ] {
        let block = ty.block_size();
        let widths: Vec<usize> = if block == 1 {
            vec![5, 64, 300]
        } else {
            vec![block, 3 * block]
        };
        for ne0 in widths {
            let n_out = 37;
            let data = rng.vec(ne0 * n_out, 1.0);
            let w = decoded(ty, ne0, n_out, &data);
            let src = weight("blk.0.ffn_down.weight", ty, ne0, n_out, &data);
            let gw = be.upload(&src).unwrap();
            for n_tok in [1, 3, 4, 5, 65] {
                let x = rng.vec(n_tok * ne0, 1.0);
                let ours = be.to_host(&be.matmul(&gw, &be.from_host(&x, n_tok, ne0)));
                let want = matmul_ref(&w, ne0, &x, None);
                assert_close(
                    &format!("matmul {ty} {ne0}->{n_out} x{n_tok}"),
                    &ours,
                    &want,
                    TOL,
                );
            }
            // The lookup decodes exactly what dequantize_row does.
            let ids = [0u32, 36, 5, 5];
            let ours = be.to_host(&be.embed(&gw, &ids));
            let want: Vec<f32> = ids
                .iter()
                .flat_map(|&i| f32s(&w[i as usize * ne0..(i as usize + 1) * ne0]))
                .collect();
            assert_eq!(ours, want, "embed {ty} {ne0}");
        }
    }

    // Folded weights: the transform of the true input, with and without the GDN permutation
    // (ssm_out's grouped V order), one transform shared by `matmul_many`.
    for (block, ne0, perm) in [
        (64, 128, None),
        (64, 128, Some(GdnPermutation::new(128, 4, 2).unwrap())),
        (128, 384, None),
    ] {
        let h = hadamard(block, &[ne0], true, 7 + block as u64);
        let ty = GgmlType::PQ2_0;
        let (a, b) = (rng.vec(ne0 * 19, 1.0), rng.vec(ne0 * 8, 1.0));
        let wa = with_fold(weight("blk.0.ffn_down.weight", ty, ne0, 19, &a), &h, perm);
        let wb = with_fold(weight("blk.0.ffn_down.weight", ty, ne0, 8, &b), &h, perm);
        let fold = wa.fold.clone().unwrap();
        let (ga, gb) = (be.upload(&wa).unwrap(), be.upload(&wb).unwrap());
        for n_tok in [1, 5] {
            let x = rng.vec(n_tok * ne0, 1.0);
            let xt = be.from_host(&x, n_tok, ne0);
            let many = be.matmul_many(&[&ga, &gb], &xt);
            for (ours, (d, n_out)) in many.iter().zip([(&a, 19), (&b, 8)]) {
                let want = matmul_ref(&decoded(ty, ne0, n_out, d), ne0, &x, Some(&fold));
                assert_close(
                    &format!(
                        "folded matmul_many block {block} perm {} x{n_tok}",
                        perm.is_some()
                    ),
                    &be.to_host(ours),
                    &want,
                    TOL,
                );
            }
            assert_eq!(
                be.to_host(&be.matmul(&ga, &xt)),
                be.to_host(&many[0]),
                "matmul and matmul_many agree"
            );
        }
        // The inverse rule after the lookup.
        let mut t = weight("token_embd.weight", ty, ne0, 6, &rng.vec(ne0 * 6, 1.0));
        t.inverse = Some(h.clone());
        let mut table = vec![0f32; ne0 * 6];
        dequantize_row(ty, t.bytes(), &mut table).unwrap();
        let ids = [5u32, 0, 3];
        let ours = be.to_host(&be.embed(&be.upload(&t).unwrap(), &ids));
        let want: Vec<f32> = ids
            .iter()
            .flat_map(|&i| {
                let mut r = table[i as usize * ne0..(i as usize + 1) * ne0].to_vec();
                h.inverse_in_place(&mut r);
                r
            })
            .collect();
        assert_eq!(ours, want, "embed with the inverse rule, block {block}");
    }
}

/// Gated attention of model-qwen35.md §3 for one sequence: q/k RMSNorm, partial NEOX RoPE with
/// the IMROPE sector rule (text positions (p, p, p, 0)), K/V rounded through the cache dtype
/// as stored, causal grouped-GQA softmax in f64, the sigmoid gate.
struct AttnRef {
    p: AttnParams,
    types: KvTypes,
    k: Vec<Vec<f64>>,
    v: Vec<Vec<f64>>,
}

impl AttnRef {
    /// θ_i for position `pos`: base^(-2i/n_rot) multiplied up in f32 as ggml's rope does, 0 for
    /// pairs outside the t/h/w sections.
    fn theta(&self, pos: usize, i: usize) -> f64 {
        let p = &self.p;
        let scale = p.rope_base.powf(-2.0 / p.n_rot as f32);
        let mut t = pos as f32;
        for _ in 0..i {
            t *= scale;
        }
        let sect: i32 = p.rope_sections.iter().sum();
        let s = i as i32 % sect.max(1);
        let sec = p.rope_sections;
        let in_thw = sect <= 0
            || (s % 3 == 0 && s < 3 * sec[0])
            || (s % 3 == 1 && s < 3 * sec[1])
            || (s % 3 == 2 && s < 3 * sec[2]);
        if in_thw {
            t as f64
        } else {
            0.0
        }
    }

    fn rope(&self, x: &mut [f64], pos: usize) {
        let half = self.p.n_rot / 2;
        for i in 0..half {
            let (sin, cos) = self.theta(pos, i).sin_cos();
            let (a, b) = (x[i], x[i + half]);
            x[i] = a * cos - b * sin;
            x[i + half] = a * sin + b * cos;
        }
    }

    /// A row as the cache holds it.
    fn stored(ty: GgmlType, row: &[f64]) -> Vec<f64> {
        let r = f32s(row);
        let q = quantize_row(ty, &r).unwrap();
        let mut out = vec![0f32; r.len()];
        dequantize_row(ty, &q, &mut out).unwrap();
        f64s(&out)
    }

    fn step(&mut self, qg: &[f32], k: &[f32], v: &[f32], qn: &[f64], kn: &[f64]) -> Vec<f32> {
        let p = self.p;
        let (hd, nh, nkv) = (p.head_dim, p.n_head, p.n_head_kv);
        let pos = self.k.len();
        let eps = p.eps as f64;
        let mut krow = Vec::with_capacity(nkv * hd);
        for g in 0..nkv {
            let mut kh = rms_norm_ref(&f64s(&k[g * hd..(g + 1) * hd]), kn, eps);
            self.rope(&mut kh, pos);
            krow.extend(kh);
        }
        self.k.push(Self::stored(self.types.k, &krow));
        self.v.push(Self::stored(self.types.v, &f64s(v)));
        let group = nh / nkv;
        let mut out = Vec::with_capacity(nh * hd);
        for h in 0..nh {
            let base = h * 2 * hd;
            let mut q = rms_norm_ref(&f64s(&qg[base..base + hd]), qn, eps);
            self.rope(&mut q, pos);
            let g = h / group;
            let scores: Vec<f64> = self
                .k
                .iter()
                .map(|kr| {
                    q.iter()
                        .zip(&kr[g * hd..(g + 1) * hd])
                        .map(|(a, b)| a * b)
                        .sum::<f64>()
                        * p.scale as f64
                })
                .collect();
            let m = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = scores.iter().map(|s| (s - m).exp()).collect();
            let sum: f64 = e.iter().sum();
            for d in 0..hd {
                let o: f64 = e
                    .iter()
                    .zip(&self.v)
                    .map(|(w, vr)| w * vr[g * hd + d])
                    .sum::<f64>()
                    / sum;
                out.push((o * sigmoid(qg[base + hd + d] as f64)) as f32);
            }
        }
        out
    }
}

/// Quantized caches: K is rounded after the norm and RoPE, which the CPU computes in f32 and
/// the reference in f64, so an element on a rounding boundary can land one level apart (one
/// 16-bit ulp, or one Q8_0/Q4_0 step) and move the output by ~1e-9. Measured: 4.4e-12 at
/// most. A wrong kernel is >= 1e-4.
/// The serving path's `matmul_many` runs every matrix of a group in one parallel region with
/// the activations quantized once per input and weight type: each output is bit for bit what
/// `matmul` of that matrix alone gives, for a group mixing weight types, folded and unfolded
/// matrices, one of 2 rows beside ones of hundreds (GDN's beta/alpha beside qkv), and every
/// row count of the row kernels and past it (the tiled product takes over per matrix).
#[test]
fn int8_matmul_many_matches_matmul_per_matrix() {
    let be = CpuBackend::int8();
    let mut rng = Rng(4099);
    let ne0 = 384;
    let h = hadamard(128, &[ne0], true, 11);
    let mut srcs = Vec::new();
    for (ty, n_out, folded) in [
        (GgmlType::PQ2_0, 300, true),
        (GgmlType::Q8_0, 129, false),
        (GgmlType::PQ2_0, 2, false),
        (GgmlType::Q8_0, 37, true),
        (GgmlType::PQ2_0, 70, true),
    ] {
        let w = weight(
            "blk.0.ffn_up.weight",
            ty,
            ne0,
            n_out,
            &rng.vec(ne0 * n_out, 1.0),
        );
        srcs.push(if folded { with_fold(w, &h, None) } else { w });
    }
    let ws: Vec<_> = srcs.iter().map(|s| be.upload(s).unwrap()).collect();
    let refs: Vec<_> = ws.iter().collect();
    for n_tok in [1, 2, 4, 5, 9, 40] {
        let x = be.from_host(&rng.vec(n_tok * ne0, 1.0), n_tok, ne0);
        let many = be.matmul_many(&refs, &x);
        for (i, (w, y)) in ws.iter().zip(&many).enumerate() {
            let one = be.to_host(&be.matmul(w, &x));
            let got = be.to_host(y);
            assert_eq!(
                got.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                one.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                "matrix {i} of the group, {n_tok} rows"
            );
        }
    }
}

const TOL_QUANT_CACHE: f64 = 1e-9;

#[test]
fn attention() {
    let be = cpu();
    let mut rng = Rng(1031);
    for (n_head, n_head_kv, hd, n_rot, sections, types) in [
        (4, 2, 32, 16, [3, 3, 2, 0], KvTypes::default()),
        (2, 2, 64, 64, [0, 0, 0, 0], KvTypes::default()),
        // Sections that leave some pairs unrotated (the 4th stream at position 0).
        (6, 2, 64, 32, [2, 2, 2, 0], KvTypes::default()),
        (
            4,
            1,
            64,
            32,
            [5, 5, 6, 0],
            KvTypes {
                k: GgmlType::F16,
                v: GgmlType::Q8_0,
            },
        ),
        (
            2,
            1,
            32,
            16,
            [3, 3, 2, 0],
            KvTypes {
                k: GgmlType::Q4_0,
                v: GgmlType::BF16,
            },
        ),
    ] {
        let p = AttnParams {
            n_head,
            n_head_kv,
            head_dim: hd,
            n_rot,
            rope_base: 10_000_000.0,
            rope_sections: sections,
            eps: 1e-6,
            scale: 1.0 / (hd as f32).sqrt(),
        };
        let (qn, kn) = (rng.vec(hd, 1.0), rng.vec(hd, 1.0));
        let qnw = be
            .upload(&weight("q_norm", GgmlType::F32, hd, 1, &qn))
            .unwrap();
        let knw = be
            .upload(&weight("k_norm", GgmlType::F32, hd, 1, &kn))
            .unwrap();
        let mut kv = be.new_kv(&p, types).unwrap();
        let mut r = AttnRef {
            p,
            types,
            k: Vec::new(),
            v: Vec::new(),
        };
        let width = n_head_kv * hd;
        let tol = if types == KvTypes::default() {
            TOL
        } else {
            TOL_QUANT_CACHE
        };
        // A prefill, single steps, and a batch past a 256-position cache chunk.
        let mut pos = 0;
        for rows in [5, 1, 1, 300, 2] {
            let qg = rng.vec(rows * 2 * n_head * hd, 2.0);
            let k = rng.vec(rows * width, 2.0);
            let v = rng.vec(rows * width, 2.0);
            let ours = be.to_host(&be.attention(
                &p,
                &be.from_host(&qg, rows, 2 * n_head * hd),
                &be.from_host(&k, rows, width),
                &be.from_host(&v, rows, width),
                &qnw,
                &knw,
                &mut kv,
                pos,
                &tern::backend::rope_table(pos, rows, p.n_rot, p.rope_base, p.rope_sections),
            ));
            let mut want = Vec::new();
            for t in 0..rows {
                want.extend(r.step(
                    &qg[t * 2 * n_head * hd..(t + 1) * 2 * n_head * hd],
                    &k[t * width..(t + 1) * width],
                    &v[t * width..(t + 1) * width],
                    &f64s(&qn),
                    &f64s(&kn),
                ));
            }
            assert_close(
                &format!("attention {n_head}/{n_head_kv} hd {hd} rot {n_rot} {types:?} {rows} rows at {pos}"),
                &ours,
                &want,
                tol,
            );
            pos += rows;
        }
    }
}

/// The Gated DeltaNet of model-qwen35.md §4, token by token in f64 (the CPU runs the chunked
/// form for several tokens): conv over the carried raw inputs, SiLU, L2 norm, q scale, the
/// delta rule with V head j reading K head j % n_k, the gated RMSNorm.
struct GdnRef {
    p: GdnParams,
    conv_w: Vec<f64>,
    dt_bias: Vec<f64>,
    ssm_a: Vec<f64>,
    norm: Vec<f64>,
    conv: Vec<f64>,
    ssm: Vec<f64>,
}

impl GdnRef {
    fn step(&mut self, mixed: &[f32], z: &[f32], b: &[f32], a: &[f32]) -> Vec<f64> {
        let p = self.p;
        let (cd, d, n_k, n_v, kw) = (p.conv_dim(), p.d, p.n_k, p.n_v, p.d_conv);
        let eps = p.eps as f64;
        // Conv over [state rows; this row], then the state keeps the last kw - 1 raw rows.
        let mut u = vec![0f64; cd];
        for (ch, uc) in u.iter_mut().enumerate() {
            let mut c = 0.0;
            for k in 0..kw {
                let x = if k + 1 < kw {
                    self.conv[k * cd + ch]
                } else {
                    mixed[ch] as f64
                };
                c += self.conv_w[ch * kw + k] * x;
            }
            *uc = silu(c);
        }
        self.conv.drain(..cd);
        self.conv.extend(f64s(mixed));
        let l2 = |x: &[f64]| {
            let n = x.iter().map(|v| v * v).sum::<f64>().sqrt().max(eps);
            x.iter().map(|v| v / n).collect::<Vec<f64>>()
        };
        let qs = 1.0 / (d as f64).sqrt();
        let mut out = Vec::with_capacity(n_v * d);
        for j in 0..n_v {
            let kh = j % n_k;
            let q: Vec<f64> = l2(&u[kh * d..(kh + 1) * d])
                .iter()
                .map(|v| v * qs)
                .collect();
            let k = l2(&u[(n_k + kh) * d..(n_k + kh + 1) * d]);
            let v = &u[(2 * n_k + j) * d..(2 * n_k + j + 1) * d];
            let beta = sigmoid(b[j] as f64);
            let x = a[j] as f64 + self.dt_bias[j];
            let softplus = if x > 20.0 { x } else { x.exp().ln_1p() };
            let decay = (self.ssm_a[j] * softplus).exp();
            let s = &mut self.ssm[j * d * d..(j + 1) * d * d];
            s.iter_mut().for_each(|e| *e *= decay);
            for jv in 0..d {
                let kv: f64 = (0..d).map(|i| s[i * d + jv] * k[i]).sum();
                let delta = beta * (v[jv] - kv);
                for i in 0..d {
                    s[i * d + jv] += k[i] * delta;
                }
            }
            let o: Vec<f64> = (0..d)
                .map(|jv| (0..d).map(|i| s[i * d + jv] * q[i]).sum())
                .collect();
            let zj: Vec<f64> = z[j * d..(j + 1) * d]
                .iter()
                .map(|&v| silu(v as f64))
                .collect();
            let y = rms_norm_ref(&o, &self.norm, eps);
            out.extend(y.iter().zip(&zj).map(|(a, b)| a * b));
        }
        out
    }
}

#[test]
fn gated_delta_net() {
    let be: CpuBackend = cpu();
    let mut rng = Rng(1041);
    for (n_k, n_v, d) in [(2, 4, 32), (2, 2, 16), (1, 3, 24)] {
        let p = GdnParams {
            n_k,
            n_v,
            d,
            d_conv: 4,
            eps: 1e-6,
        };
        let cd = p.conv_dim();
        let conv_w = rng.vec(cd * 4, 0.6);
        let dt_bias = rng.vec(n_v, 1.0);
        let ssm_a: Vec<f32> = (0..n_v).map(|_| -(rng.f32() * 2.5 - 2.0).exp()).collect();
        let norm: Vec<f32> = (0..d).map(|_| 1.0 + 0.2 * rng.f32()).collect();
        let up = |name: &str, ne0: usize, rows: usize, v: &[f32]| {
            be.upload(&weight(name, GgmlType::F32, ne0, rows, v))
                .unwrap()
        };
        let (cw, dtw, aw, nw) = (
            up("conv", 4, cd, &conv_w),
            up("dt_bias", n_v, 1, &dt_bias),
            up("ssm_a", n_v, 1, &ssm_a),
            up("norm", d, 1, &norm),
        );
        let w = GdnWeights {
            conv: &cw,
            dt_bias: &dtw,
            ssm_a: &aw,
            norm: &nw,
        };
        let mut r = GdnRef {
            p,
            conv_w: f64s(&conv_w),
            dt_bias: f64s(&dt_bias),
            ssm_a: f64s(&ssm_a),
            norm: f64s(&norm),
            conv: vec![0.0; 3 * cd],
            ssm: vec![0.0; n_v * d * d],
        };
        let mut rs = be.new_recurrent(&p);
        // Around the 64-token chunk: one, a partial chunk, a chunk + 1, carried state between.
        for rows in [1, 3, 65, 1, 130] {
            let mixed = rng.vec(rows * cd, 2.0);
            let z = rng.vec(rows * n_v * d, 2.0);
            let b = rng.vec(rows * n_v, 3.0);
            let a = rng.vec(rows * n_v, 2.0);
            let ours = be.to_host(&be.gdn(
                &p,
                &be.from_host(&mixed, rows, cd),
                &be.from_host(&z, rows, n_v * d),
                &be.from_host(&b, rows, n_v),
                &be.from_host(&a, rows, n_v),
                &w,
                &mut rs,
            ));
            let mut want = Vec::new();
            for t in 0..rows {
                want.extend(r.step(
                    &mixed[t * cd..(t + 1) * cd],
                    &z[t * n_v * d..(t + 1) * n_v * d],
                    &b[t * n_v..(t + 1) * n_v],
                    &a[t * n_v..(t + 1) * n_v],
                ));
            }
            let what = format!("gdn n_k {n_k} n_v {n_v} d {d}, {rows} rows");
            assert_close(&format!("{what} output"), &ours, &f32s(&want), TOL);
            assert_close(&format!("{what} ssm state"), &rs.ssm, &f32s(&r.ssm), TOL);
            assert_eq!(
                rs.conv,
                f32s(&r.conv),
                "{what}: the conv state holds raw inputs"
            );
        }
    }
}

#[test]
fn argmax() {
    let be = cpu();
    let mut rng = Rng(1051);
    for (rows, cols) in [(1, 1), (3, 7), (4, 70_000), (65, 64)] {
        let x: Vec<f32> = (0..rows * cols)
            .map(|_| (rng.below(16) as f32 - 12.0) * 0.25)
            .collect();
        let want: Vec<u32> = x
            .chunks(cols)
            .map(|r| {
                // The first of equal maxima.
                let m = r.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
                r.iter().position(|&v| v == m).unwrap() as u32
            })
            .collect();
        let t = be.from_host(&x, rows, cols);
        assert_eq!(be.argmax_rows(&t), want, "argmax {rows}x{cols}");
        // The one-pass greedy pick agrees row by row, and finds no bad value in finite rows.
        for (r, &w) in want.iter().enumerate() {
            assert_eq!(
                be.argmax_checked(&t, r),
                Some((w, None)),
                "argmax_checked {rows}x{cols} row {r}"
            );
        }
    }
    // The first non-finite value of the row, wherever the chunks split it; the argmax is
    // of the values before and after alike.
    for (cols, at) in [(1, 0), (70_000, 3), (70_000, 16_384), (70_000, 69_999)] {
        for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
            let mut x: Vec<f32> = (0..2 * cols).map(|i| (i % 97) as f32 * 0.01).collect();
            x[cols + at] = bad;
            if at + 5 < cols {
                x[cols + at + 5] = f32::NAN;
            }
            let t = be.from_host(&x, 2, cols);
            let got = be.argmax_checked(&t, 1).expect("the cpu scans in place");
            assert_eq!(got.1.map(|b| b.0), Some(at), "{cols} cols, {bad} at {at}");
            assert_eq!(
                got.1.map(|b| b.1.to_bits()),
                Some(bad.to_bits()),
                "{cols} cols"
            );
            assert_eq!(be.argmax_checked(&t, 0).unwrap().1, None, "row 0 is finite");
        }
    }
}

/// `split_rows` gives what `rows` copies, run by run, including empty runs.
#[test]
fn split_rows_match_row_copies() {
    let be = cpu();
    let mut rng = Rng(1057);
    for (cols, counts) in [
        (5, vec![1]),
        (7, vec![1, 1, 1]),
        (3, vec![2, 0, 3, 1]),
        (1000, vec![4, 1]),
    ] {
        let rows: usize = counts.iter().sum();
        let x = rng.vec(rows * cols, 1.0);
        let t = be.from_host(&x, rows, cols);
        let parts = be.split_rows(be.from_host(&x, rows, cols), &counts);
        assert_eq!(parts.len(), counts.len());
        let mut at = 0;
        for (p, &n) in parts.iter().zip(&counts) {
            assert_eq!((p.rows, p.cols), (n, cols), "{counts:?}");
            assert_eq!(be.to_host(p), be.to_host(&be.rows(&t, at, n)), "{counts:?}");
            at += n;
        }
    }
}

/// The vision tower's row ops: LayerNorm against ggml_norm's definition, the row bias exactly,
/// and a reshape that moves nothing.
#[test]
fn vision_row_ops() {
    use common::vision::layer_norm_ref;
    let be = cpu();
    let mut rng = Rng(1061);
    for (rows, cols) in [(1, 1), (3, 7), (5, 300), (2, 1152), (70, 64)] {
        // Off-centre rows, so that the mean matters.
        let x: Vec<f32> = rng.vec(rows * cols, 2.0).iter().map(|v| v + 3.0).collect();
        let (w, b) = (rng.vec(cols, 1.0), rng.vec(cols, 1.0));
        let ws = be
            .upload(&weight("v.blk.0.ln1.weight", GgmlType::F32, cols, 1, &w))
            .unwrap();
        let bs = be
            .upload(&weight("v.blk.0.ln1.bias", GgmlType::F32, cols, 1, &b))
            .unwrap();
        let ours = be.to_host(&be.layer_norm(&be.from_host(&x, rows, cols), &ws, &bs, 1e-6));
        let want: Vec<f64> = x
            .chunks(cols)
            .flat_map(|r| layer_norm_ref(&f64s(r), &f64s(&w), &f64s(&b), 1e-6))
            .collect();
        // A one-element row is all mean: 0 * scale * w + b = b exactly.
        assert_close(
            &format!("layer_norm {rows}x{cols}"),
            &ours,
            &f32s(&want),
            TOL,
        );

        let mut t = be.from_host(&x, rows, cols);
        be.add_bias(&mut t, &bs);
        let want: Vec<f32> = x.iter().enumerate().map(|(i, v)| v + b[i % cols]).collect();
        assert_eq!(be.to_host(&t), want, "add_bias {rows}x{cols}");

        if rows % 2 == 0 {
            let t = be.reshape(be.from_host(&x, rows, cols), rows / 2, 2 * cols);
            assert_eq!(be.to_host(&t), x, "reshape {rows}x{cols}");
            // The new width is the one ops see.
            let b2 = rng.vec(2 * cols, 1.0);
            let mut t = t;
            be.add_bias(
                &mut t,
                &be.upload(&weight("b2", GgmlType::F32, 2 * cols, 1, &b2))
                    .unwrap(),
            );
            let want: Vec<f32> = x
                .iter()
                .enumerate()
                .map(|(i, v)| v + b2[i % (2 * cols)])
                .collect();
            assert_eq!(be.to_host(&t), want, "add_bias after reshape {rows}x{cols}");
        }
    }
}

fn sha256_hex(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    Sha256::digest(bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

/// sha256 of ggml-cpu's `ggml_table_gelu_f16` (65536 little-endian u16), as stock llama.cpp
/// (the vendored build in /work/llama/build) fills it in `ggml_cpu_init`: read back through
/// ctypes (`ggml_cpu_init()`, then `(c_uint16 * 65536).in_dll(libggml-cpu, "ggml_table_gelu_f16")`).
const GGML_GELU_TABLE_SHA256: &str =
    "5eceda6f287dec9dc0bcfa24516d6744a031a5c52d1984688b4558aeb1daf909";

/// GELU: the f16 table is ggml's to the bit, every entry is the tanh form at its input within
/// one f16 rounding, and the op takes ggml's branches (0 at or below -10, x at or above 10,
/// the table between, at the input rounded to f16).
#[test]
fn gelu() {
    use common::vision::gelu_tanh;
    let table = tern::backend::gelu_f16_table();
    let bytes: Vec<u8> = table.iter().flat_map(|h| h.to_le_bytes()).collect();
    let hash = sha256_hex(&bytes);
    assert_eq!(
        hash, GGML_GELU_TABLE_SHA256,
        "gelu table differs from ggml's"
    );
    for (h, &g) in table.iter().enumerate() {
        let x = half::f16::from_bits(h as u16).to_f64();
        if !x.is_finite() || x.abs() >= 10.0 {
            continue;
        }
        let (ours, exact) = (half::f16::from_bits(g).to_f64(), gelu_tanh(x));
        // Within one f16 ulp of the result (2^-10 relative for normals, 2^-24 absolute
        // below), plus what f32 loses in `1 + tanh` where tanh is near -1: an ulp or two of 1,
        // times x/2.
        let ulp = (exact.abs() * 2f64.powi(-10)).max(2f64.powi(-24));
        assert!(
            (ours - exact).abs() <= ulp + x.abs() * 2f64.powi(-22),
            "gelu table at {x}: {ours} vs {exact}"
        );
    }

    let be = cpu();
    let mut rng = Rng(1071);
    let mut x = rng.vec(4099, 12.0);
    x.extend([
        -10.0, 10.0, -9.999, 9.999, 0.0, -0.0, 1e-30, -1e-8, 1e6, -1e6,
    ]);
    let ours = be.to_host(&be.gelu(&be.from_host(&x, 1, x.len())));
    for (&v, &o) in x.iter().zip(&ours) {
        let want = if v <= -10.0 {
            0.0
        } else if v >= 10.0 {
            v
        } else {
            half::f16::from_bits(table[half::f16::from_f32(v).to_bits() as usize]).to_f32()
        };
        assert_eq!(o.to_bits(), want.to_bits(), "gelu({v})");
    }
}

/// sha256 of the (sin, cos) table ggml's `GGML_ROPE_TYPE_VISION` rope uses, read off its output
/// on unit vectors (x = [1..1, 0..0] gives [cos, sin] exactly), as f32 LE in
/// `vision_rope_table`'s layout: ggml-base/ggml-cpu of /work/llama/build through ctypes,
/// `ggml_rope_multi(ctx, a, pos, NULL, hd/2, {hd/4 x4}, 24, 32768, 10000, 1, 0, 1, 32, 1)` with
/// clip.cpp's positions, one thread.
const GGML_VISION_ROPE_SHA256: [(usize, usize, usize, &str); 4] = [
    (
        4,
        6,
        16,
        "ab9e1665cef76f954591672e7ce00570c0acbcd7bbad056d60c765e5a26845d2",
    ),
    (
        32,
        32,
        72,
        "6ae0afa014b5c138e01f781c15820e60fa564efbeb75f485b66c42be704d12b1",
    ),
    (
        64,
        16,
        72,
        "44a4eb76f6edfda2a25a7fb07fbf20fe393eac979198c214f9ee8b0274bfd2bc",
    ),
    (
        2,
        2,
        20,
        "98d8ff03d1514686e97b09199405c5ccc0c51de1d8ed68d60e4133af4664f61a",
    ),
];

/// The vision rotary table: ggml's bits, and the angles of model-vision.md §3 in the tower's
/// token order.
#[test]
fn vision_rope_table() {
    use common::vision::rope_angles;
    for (rows, cols, hd, want) in GGML_VISION_ROPE_SHA256 {
        let t = tern::backend::vision_rope_table(rows, cols, hd, 10000.0);
        let bytes: Vec<u8> = t.iter().flat_map(|v| v.to_le_bytes()).collect();
        let hash = sha256_hex(&bytes);
        assert_eq!(
            hash, want,
            "vision rope {rows}x{cols} hd {hd} differs from ggml's"
        );
        let angles = rope_angles(rows, cols, hd);
        assert_eq!(t.len(), 2 * angles.len());
        for (i, (&a, sc)) in angles.iter().zip(t.chunks_exact(2)).enumerate() {
            // ggml multiplies the angle up in f32 by a rounded factor: under 2^-23 per step.
            let j = i % (hd / 2);
            let err = 2.0 * (j as f64 + 2.0) * 2f64.powi(-24) * a + 1e-6;
            assert!(
                (sc[0] as f64 - a.sin()).abs() <= err && (sc[1] as f64 - a.cos()).abs() <= err,
                "vision rope {rows}x{cols} hd {hd} entry {i}: ({}, {}) for angle {a}",
                sc[0],
                sc[1]
            );
        }
    }
}

/// The vision tower's attention against the f64 reference: full (non-causal), every head, NEOX
/// pairs, on odd token counts, one token, head sizes that are not multiples of 4.
#[test]
fn vision_attention() {
    use common::vision::vision_attention_ref;
    let be = cpu();
    let mut rng = Rng(1081);
    for (n, n_head, hd) in [
        (1, 1, 16),
        (7, 2, 18),
        (37, 3, 72),
        (300, 2, 22),
        (24, 2, 16),
    ] {
        let qkv = rng.vec(n * 3 * n_head * hd, 1.5);
        // Any (sin, cos) table: random angles (vision_rope_table has its own test).
        let rope: Vec<f32> = (0..n * hd / 2)
            .flat_map(|_| {
                let a = rng.f32() * 40.0;
                [a.sin(), a.cos()]
            })
            .collect();
        let ours = be.to_host(&be.vision_attention(
            &be.from_host(&qkv, n, 3 * n_head * hd),
            n_head,
            hd,
            &rope,
        ));
        let want = vision_attention_ref(&f64s(&qkv), n, n_head, hd, &f64s(&rope));
        assert_close(
            &format!("vision_attention n {n} heads {n_head} hd {hd}"),
            &ours,
            &f32s(&want),
            TOL,
        );
    }
}
