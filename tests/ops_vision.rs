//! The vision tower's ops (LayerNorm, row bias, GELU, reshape, the tower's attention) on every
//! GPU backend against the CPU reference, on random inputs and awkward shapes (the CPU's own
//! tests against the math: tests/ops_cpu.rs); and one whole tower block on every backend
//! against a plain f64 reading of model-vision.md §3.

mod common;

use common::vision::{gelu_ggml_ref, layer_norm_ref, rope_angles, vision_attention_ref};
use common::{assert_close, cpu, weight, Rng};
use tern::backend::{vision_rope_table, Backend, WeightSource};
use tern::tensor::GgmlType;

/// f32 arithmetic in a different order than the reference (the mean and variance as workgroup
/// sums; the online softmax with its rescaling against the CPU's two passes): rounding only,
/// ~1e-13 measured. A wrong index, a missing rescale or a key left out is >= 1e-4.
const TOL: f64 = 1e-10;

fn f64s(x: &[f32]) -> Vec<f64> {
    x.iter().map(|&v| v as f64).collect()
}

fn f32s(x: &[f64]) -> Vec<f32> {
    x.iter().map(|&v| v as f32).collect()
}

fn layer_norm_bias_reshape<B: Backend>(be: &B) {
    let reference = cpu();
    let mut rng = Rng(31);
    // Awkward widths: one, odd, over a workgroup, the real tower's 1152.
    for (rows, cols) in [(1, 1), (3, 7), (5, 300), (2, 1152), (70, 64)] {
        let x: Vec<f32> = rng.vec(rows * cols, 2.0).iter().map(|v| v - 1.5).collect();
        let (w, b) = (rng.vec(cols, 1.0), rng.vec(cols, 1.0));
        let ws = weight("v.post_ln.weight", GgmlType::F32, cols, 1, &w);
        let bs = weight("v.post_ln.bias", GgmlType::F32, cols, 1, &b);
        let (gw, gb) = (be.upload(&ws).unwrap(), be.upload(&bs).unwrap());
        let (cw, cb) = (
            reference.upload(&ws).unwrap(),
            reference.upload(&bs).unwrap(),
        );
        let ours = be.to_host(&be.layer_norm(&be.from_host(&x, rows, cols), &gw, &gb, 1e-6));
        let want = reference.to_host(&reference.layer_norm(
            &reference.from_host(&x, rows, cols),
            &cw,
            &cb,
            1e-6,
        ));
        assert_close(
            &format!("layer_norm {rows}x{cols} [{}]", be.name()),
            &ours,
            &want,
            TOL,
        );

        // One f32 addition per element: exact.
        let mut t = be.from_host(&x, rows, cols);
        be.add_bias(&mut t, &gb);
        let mut want = reference.from_host(&x, rows, cols);
        reference.add_bias(&mut want, &cb);
        assert_close(
            &format!("add_bias {rows}x{cols} [{}]", be.name()),
            &be.to_host(&t),
            &reference.to_host(&want),
            0.0,
        );

        // The 2x2 merge's view: four rows as one, then an op at the new width.
        if rows % 2 == 0 {
            let t = be.reshape(be.from_host(&x, rows, cols), rows / 2, 2 * cols);
            assert_eq!(be.to_host(&t), x, "reshape {rows}x{cols} [{}]", be.name());
            let b2 = rng.vec(2 * cols, 1.0);
            let bs2 = weight("mm.0.bias", GgmlType::F32, 2 * cols, 1, &b2);
            let mut t = t;
            be.add_bias(&mut t, &be.upload(&bs2).unwrap());
            let mut want =
                reference.reshape(reference.from_host(&x, rows, cols), rows / 2, 2 * cols);
            reference.add_bias(&mut want, &reference.upload(&bs2).unwrap());
            assert_close(
                &format!("add_bias after reshape {rows}x{cols} [{}]", be.name()),
                &be.to_host(&t),
                &reference.to_host(&want),
                0.0,
            );
        }
    }
}

/// GELU through ggml's f16 table on every backend: the same bits as the CPU, including the
/// branches at ±10, signed zeros, f16 subnormals and values past f16's range.
fn gelu<B: Backend>(be: &B) {
    let reference = cpu();
    let mut rng = Rng(32);
    let mut x = rng.vec(5000, 12.0);
    x.extend([
        -10.0, 10.0, -9.999, 9.999, 0.0, -0.0, 1e-30, -3e-6, 6e-8, 65519.0, 1e6, -1e6,
    ]);
    for n in [1, 257, x.len()] {
        let ours = be.to_host(&be.gelu(&be.from_host(&x[..n], 1, n)));
        let want = reference.to_host(&reference.gelu(&reference.from_host(&x[..n], 1, n)));
        let same = ours
            .iter()
            .zip(&want)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same, "gelu x{n} [{}]: not the CPU's bits", be.name());
    }
}

/// The tower's attention: odd n, one token, n past several key tiles and not a multiple of
/// them, head sizes not multiples of 4 or of 32, up to the tile's largest (R = 4 at 512).
fn vision_attention<B: Backend>(be: &B) {
    let reference = cpu();
    let mut rng = Rng(33);
    for (n, n_head, hd, amp) in [
        (1, 1, 16, 1.0),
        (7, 2, 18, 1.0),
        (37, 3, 72, 1.5),
        (65, 2, 22, 1.0),
        (200, 4, 72, 1.0),
        (1100, 1, 64, 1.0),
        (9, 2, 512, 0.5),
        // Peaked softmax: large scores, so the running max moves between tiles.
        (150, 2, 40, 6.0),
    ] {
        let qkv = rng.vec(n * 3 * n_head * hd, amp);
        let rope: Vec<f32> = (0..n * hd / 2)
            .flat_map(|_| {
                let a = rng.f32() * 40.0;
                [a.sin(), a.cos()]
            })
            .collect();
        let cols = 3 * n_head * hd;
        let ours =
            be.to_host(&be.vision_attention(&be.from_host(&qkv, n, cols), n_head, hd, &rope));
        let want = reference.to_host(&reference.vision_attention(
            &reference.from_host(&qkv, n, cols),
            n_head,
            hd,
            &rope,
        ));
        assert_close(
            &format!(
                "vision_attention n {n} heads {n_head} hd {hd} [{}]",
                be.name()
            ),
            &ours,
            &want,
            TOL,
        );
    }
}

per_gpu_backend!(layer_norm_bias_reshape, gelu, vision_attention, tower_block);

/// A weight and its bias (a matrix `[n_out][ne0]` and `n_out` biases, or a LayerNorm's two
/// vectors), as the backend gets them and as f64 for the reference.
struct Pair {
    w: WeightSource,
    b: WeightSource,
    wd: Vec<f64>,
    bd: Vec<f64>,
}

impl Pair {
    fn matrix(rng: &mut Rng, name: &str, ne0: usize, n_out: usize) -> Pair {
        let w = rng.vec(ne0 * n_out, 1.0 / (ne0 as f32).sqrt());
        Pair::of(rng, name, w, ne0, n_out)
    }

    fn norm(rng: &mut Rng, name: &str, width: usize) -> Pair {
        let w: Vec<f32> = rng.vec(width, 0.5).iter().map(|v| v + 1.0).collect();
        Pair::of(rng, name, w, width, 1)
    }

    fn of(rng: &mut Rng, name: &str, w: Vec<f32>, ne0: usize, rows: usize) -> Pair {
        let n_out = if rows == 1 { ne0 } else { rows };
        let b = rng.vec(n_out, 0.2);
        Pair {
            w: weight(&format!("{name}.weight"), GgmlType::F32, ne0, rows, &w),
            b: weight(&format!("{name}.bias"), GgmlType::F32, n_out, 1, &b),
            wd: f64s(&w),
            bd: f64s(&b),
        }
    }

    /// `W x + b` on every row, in f64.
    fn linear(&self, x: &[f64]) -> Vec<f64> {
        let ne0 = self.wd.len() / self.bd.len();
        x.chunks(ne0)
            .flat_map(|r| {
                self.wd
                    .chunks(ne0)
                    .zip(&self.bd)
                    .map(|(wr, c)| wr.iter().zip(r).map(|(p, q)| p * q).sum::<f64>() + c)
                    .collect::<Vec<_>>()
            })
            .collect()
    }

    /// LayerNorm of every row, in f64.
    fn layer_norm(&self, x: &[f64], eps: f64) -> Vec<f64> {
        x.chunks(self.wd.len())
            .flat_map(|r| layer_norm_ref(r, &self.wd, &self.bd, eps))
            .collect()
    }
}

/// `W x + b` on the backend.
fn linear<B: Backend>(be: &B, m: &Pair, x: &B::T) -> B::T {
    let mut y = be.matmul(&be.upload(&m.w).unwrap(), x);
    be.add_bias(&mut y, &be.upload(&m.b).unwrap());
    y
}

/// One tower block on a tiny random layer, as model-vision.md §3 reads, in f64 here: pre-LN,
/// qkv + bias, 2-D rotary and full attention, output + bias, residual; LN, up + bias, GELU,
/// down + bias, residual; then the 2x2 merge's reshape, `mm.0` + bias and GELU.
///
/// Tolerance: the backend computes in f32, the reference in f64, and GELU rounds its input to
/// f16: where the f32 and f64 inputs straddle an f16 rounding boundary the two GELUs differ by
/// one f16 ulp (2^-11 relative), and the rotary angles differ by ggml's f32 products. A wrong
/// op order, a missing bias, a transposed head or a patch out of order is >= 1e-4.
const TOL_BLOCK: f64 = 1e-7;

fn tower_block<B: Backend>(be: &B) {
    let mut rng = Rng(34);
    // A 4x6 patch grid (24 patches), width 48 in 3 heads of 16, MLP 80, merger to 40.
    let (rows, cols, width, n_head, ff, out_w) = (4, 6, 48, 3, 80, 40);
    let (n, hd, eps) = (rows * cols, width / n_head, 1e-6);
    let ln1 = Pair::norm(&mut rng, "v.blk.0.ln1", width);
    let qkv = Pair::matrix(&mut rng, "v.blk.0.attn_qkv", width, 3 * width);
    let out = Pair::matrix(&mut rng, "v.blk.0.attn_out", width, width);
    let ln2 = Pair::norm(&mut rng, "v.blk.0.ln2", width);
    let up = Pair::matrix(&mut rng, "v.blk.0.ffn_up", width, ff);
    let down = Pair::matrix(&mut rng, "v.blk.0.ffn_down", ff, width);
    let mm0 = Pair::matrix(&mut rng, "mm.0", 4 * width, out_w);
    let x0 = rng.vec(n * width, 1.0);

    let norm = |p: &Pair, x: &B::T| {
        be.layer_norm(x, &be.upload(&p.w).unwrap(), &be.upload(&p.b).unwrap(), eps)
    };
    let rope = vision_rope_table(rows, cols, hd, 10000.0);
    let x = be.from_host(&x0, n, width);
    let a = be.vision_attention(&linear(be, &qkv, &norm(&ln1, &x)), n_head, hd, &rope);
    let mut x = {
        let mut y = linear(be, &out, &a);
        be.add_assign(&mut y, &x);
        y
    };
    let f = linear(be, &down, &be.gelu(&linear(be, &up, &norm(&ln2, &x))));
    be.add_assign(&mut x, &f);
    let block = be.to_host(&x);
    let merged = be.to_host(&be.gelu(&linear(be, &mm0, &be.reshape(x, n / 4, 4 * width))));

    let table: Vec<f64> = rope_angles(rows, cols, hd)
        .iter()
        .flat_map(|a| [a.sin(), a.cos()])
        .collect();
    let add =
        |p: Vec<f64>, q: &[f64]| -> Vec<f64> { p.iter().zip(q).map(|(a, b)| a + b).collect() };
    let gelu = |v: Vec<f64>| -> Vec<f64> { v.into_iter().map(gelu_ggml_ref).collect() };
    let eps = eps as f64;
    let x = f64s(&x0);
    let a = vision_attention_ref(&qkv.linear(&ln1.layer_norm(&x, eps)), n, n_head, hd, &table);
    let x = add(out.linear(&a), &x);
    let x = add(down.linear(&gelu(up.linear(&ln2.layer_norm(&x, eps)))), &x);
    let m = gelu(mm0.linear(&x));

    assert_close(
        &format!("tower block [{}]", be.name()),
        &block,
        &f32s(&x),
        TOL_BLOCK,
    );
    assert_close(
        &format!("tower block, merged [{}]", be.name()),
        &merged,
        &f32s(&m),
        TOL_BLOCK,
    );
}

#[test]
fn tower_block_cpu() {
    tower_block(&cpu());
}
