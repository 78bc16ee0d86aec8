//! The serving path's integer kernels (`quant::int8`, issue #21): every instruction set this
//! CPU has against an f64 reference of the same integer arithmetic and against the f32 kernels,
//! on random weights (all code values, not only what the quantizers write) and awkward shapes;
//! then whole models on the int8 CPU backend against the goldens at the quantized tolerance.

use std::path::{Path, PathBuf};

use tern::backend::cpu::CpuBackend;
use tern::backend::{nmse, Backend};
use tern::model::Model;
use tern::quant::int8::{self, Isa, Panel, QActs, TiledActs, MAX_ROWS};
use tern::quant::{dequantize_row, dot_row};
use tern::tensor::GgmlType::{self, *};

/// xorshift64*: deterministic inputs without a dependency.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    /// Uniform in [-1, 1).
    fn f(&mut self) -> f32 {
        (self.next() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
}

/// Where a block keeps its f16 scale, and the block's size in bytes.
fn scale_at(ty: GgmlType) -> (usize, usize) {
    match ty {
        Q8_0 => (0, 34),
        Q4_0 => (0, 18),
        PQ2_0 => (0, 34),
        PTQ1_0 => (26, 28),
        _ => unreachable!(),
    }
}

/// `rows` stored rows of `k`: random bytes (every code value, Q8_0's -128 too) with a scale
/// from a small set of f16s (0.0078, 0.125, 1.0, 0.5) in each block.
fn random_rows(rng: &mut Rng, ty: GgmlType, k: usize, rows: usize) -> Vec<u8> {
    let (at, bytes) = scale_at(ty);
    let n = ty.row_bytes(k as u64).unwrap() as usize * rows;
    let mut v: Vec<u8> = (0..n).map(|_| rng.next() as u8).collect();
    for blk in v.chunks_exact_mut(bytes) {
        let h: u16 = [0x2000, 0x3000, 0x3c00, 0x3800][(rng.next() % 4) as usize];
        blk[at..at + 2].copy_from_slice(&h.to_le_bytes());
    }
    v
}

/// Activations with a spread of magnitudes across blocks, some blocks all zero.
fn random_acts(rng: &mut Rng, n: usize) -> Vec<f32> {
    let mut x: Vec<f32> = (0..n).map(|_| rng.f()).collect();
    for (b, c) in x.chunks_mut(32).enumerate() {
        let s = match b % 5 {
            0 => 0.0,
            1 => 10.0,
            2 => 1e-3,
            _ => 1.0,
        };
        c.iter_mut().for_each(|v| *v *= s);
    }
    x
}

/// `x` as the kernels see it: each activation block rounded to `d * round(x / d)`,
/// `d = max |x| / 127`, with the blocks of the weight type's activations (32 or 128).
fn rounded(ty: GgmlType, x: &[f32]) -> Vec<f64> {
    let qk = if matches!(ty, Q8_0 | Q4_0) { 32 } else { 128 };
    x.chunks(qk)
        .flat_map(|b| {
            let d = b.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
            let id = if d > 0.0 { 1.0 / d } else { 0.0 };
            b.iter()
                .map(move |&v| (v * id).round() as f64 * d as f64)
                .collect::<Vec<_>>()
        })
        .collect()
}

/// Runs `int8::dot_rows_isa` over every weight row and every activation row, in groups of up
/// to `MAX_ROWS` as the backend does: `out[t][r]`.
fn int8_products(ty: GgmlType, w: &[u8], n_out: usize, x: &[f32], k: usize, isa: Isa) -> Vec<f32> {
    let acts = QActs::quantize(ty, x, k);
    let n_tok = acts.rows();
    let rb = w.len() / n_out;
    let mut out = vec![0f32; n_tok * n_out];
    let mut o = [0f32; MAX_ROWS];
    for r in 0..n_out {
        for t0 in (0..n_tok).step_by(MAX_ROWS) {
            let n = MAX_ROWS.min(n_tok - t0);
            int8::dot_rows_isa(&w[r * rb..(r + 1) * rb], &acts, t0, &mut o[..n], isa);
            for (i, &v) in o[..n].iter().enumerate() {
                out[(t0 + i) * n_out + r] = v;
            }
        }
    }
    out
}

#[test]
fn int8_kernels_match_the_integer_reference_on_every_isa() {
    let isas = int8::isas();
    println!("instruction sets: {isas:?}");
    let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
    let n_out = 7;
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        // Whole blocks only; odd block counts leave Q8_0's and PQ2_0's 512-bit kernels (two
        // blocks a step) a last single block, even ones (256, 1024, 2304 for PQ2_0) none. Q8_0's
        // four-block steps: none (1, 3 blocks), whole groups only (4), one group and 3 left (7),
        // several and 1 left (17, 65).
        let ks: &[usize] = match ty {
            Q8_0 | Q4_0 => &[32, 96, 128, 224, 544, 2080],
            _ => &[128, 256, 384, 640, 1024, 1152, 2304],
        };
        for &k in ks {
            let w = random_rows(&mut rng, ty, k, n_out);
            let rb = w.len() / n_out;
            let mut wf = vec![0f32; n_out * k];
            for (r, row) in wf.chunks_exact_mut(k).enumerate() {
                dequantize_row(ty, &w[r * rb..(r + 1) * rb], row).unwrap();
            }
            for n_tok in 1..=5 {
                let x = random_acts(&mut rng, n_tok * k);
                let xr = rounded(ty, &x);
                for &isa in &isas {
                    let got = int8_products(ty, &w, n_out, &x, k, isa);
                    for t in 0..n_tok {
                        for r in 0..n_out {
                            let (wr, xt) = (&wf[r * k..(r + 1) * k], &xr[t * k..(t + 1) * k]);
                            let want: f64 = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b).sum();
                            let mag: f64 =
                                wr.iter().zip(xt).map(|(&a, &b)| (a as f64 * b).abs()).sum();
                            let g = got[t * n_out + r] as f64;
                            assert!(
                                (g - want).abs() <= 1e-5 * mag + 1e-6,
                                "{ty} {isa:?} k={k} n_tok={n_tok} [{t},{r}]: {g} vs {want} (|terms| {mag})"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The tiled product (`int8::gemm_isa`, prefill's kernel) against the same f64 reference: tile
/// remainders in both directions (weight rows 1, 5, 9 against the 4-row register tile,
/// activation rows 1 to 9, a window starting past row 0), block counts that leave a partial
/// group of 16 (and one of several groups), k never a multiple of 256, on every instruction
/// set this CPU has.
#[test]
fn int8_tiled_product_matches_the_integer_reference_on_every_isa() {
    let mut rng = Rng(0x5eed_0f71);
    let mut panel = Panel::default();
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        // Last groups 2, 4, 8 and 16 blocks wide (partial or whole), after none or several.
        let ks: &[usize] = match ty {
            Q8_0 | Q4_0 => &[32, 96, 160, 288, 544, 1120],
            _ => &[128, 384, 1024, 2176, 3584, 4224],
        };
        for &k in ks {
            for n_out in [1, 5, 9] {
                let w = random_rows(&mut rng, ty, k, n_out);
                let rb = w.len() / n_out;
                let mut wf = vec![0f32; n_out * k];
                for (r, row) in wf.chunks_exact_mut(k).enumerate() {
                    dequantize_row(ty, &w[r * rb..(r + 1) * rb], row).unwrap();
                }
                panel.decode(ty, &w, n_out, k);
                let rows = 10;
                let x = random_acts(&mut rng, rows * k);
                let xr = rounded(ty, &x);
                let acts = TiledActs::new(&QActs::quantize(ty, &x, k));
                for &isa in &int8::isas() {
                    for (t0, n) in (1..=9).map(|n| (0, n)).chain([(1, 9), (3, 6)]) {
                        let mut got = vec![f32::NAN; n * n_out];
                        int8::gemm_isa(&panel, &acts, t0, n, &mut got, isa);
                        for i in 0..n {
                            let xt = &xr[(t0 + i) * k..(t0 + i + 1) * k];
                            for r in 0..n_out {
                                let wr = &wf[r * k..(r + 1) * k];
                                let want: f64 =
                                    wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b).sum();
                                let mag: f64 =
                                    wr.iter().zip(xt).map(|(&a, &b)| (a as f64 * b).abs()).sum();
                                let g = got[i * n_out + r] as f64;
                                assert!(
                                    (g - want).abs() <= 1e-5 * mag + 1e-6,
                                    "{ty} {isa:?} k={k} n_out={n_out} rows {t0}+{n} [{i},{r}]: {g} vs {want} (|terms| {mag})"
                                );
                            }
                        }
                    }
                }
            }
        }
    }
}

/// Prefill's one-pass quantizer (`TiledActs::quantize`) writes exactly what the scalar
/// quantizer then tiling writes, and decode's (`QActs::quantize_isa`) what the scalar one
/// writes, on every instruction set: rounding ties (levels that land on .5, both signs),
/// all-zero rows, a block of subnormals (its inverse step overflows), NaN and infinite
/// elements, partial groups of 16 blocks, 1 to 9 and 63/65/129 rows.
#[test]
fn int8_tiled_quantizer_matches_quantize_then_tile_bit_for_bit() {
    let mut rng = Rng(0x007a_b1e5);
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        let (qk, ks): (usize, &[usize]) = match ty {
            Q8_0 | Q4_0 => (32, &[32, 160, 544, 1120]),
            _ => (128, &[128, 1024, 2176, 4224]),
        };
        for &k in ks {
            for rows in (1..=9).chain([63, 65, 129]) {
                let mut x = random_acts(&mut rng, rows * k);
                // A block whose max is 127 steps: every level is x itself, and halves tie.
                for (j, v) in x[..qk].iter_mut().enumerate() {
                    *v = if j == 0 {
                        127.0
                    } else {
                        (j as f32 - 64.0) / 2.0
                    };
                }
                if rows > 2 {
                    let b = &mut x[k..k + qk];
                    b.iter_mut()
                        .enumerate()
                        .for_each(|(j, v)| *v = j as f32 * 1e-44);
                    x[2 * k] = f32::NAN;
                }
                if rows > 3 {
                    x[3 * k] = f32::INFINITY;
                    x[3 * k + 1] = -3.0;
                }
                let plain = QActs::quantize_isa(ty, &x, k, Isa::Portable);
                let want = TiledActs::new(&plain);
                let (wq, wd, wo) = want.contents();
                for &isa in &int8::isas() {
                    // The serving path's own quantizer (decode's activations) too.
                    let a = QActs::quantize_isa(ty, &x, k, isa);
                    let ((gq, gd, go), (pq, pd, po)) = (a.contents(), plain.contents());
                    assert_eq!(gq, pq, "{ty} {isa:?} k={k} rows={rows}: QActs levels");
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(gd), bits(pd), "{ty} {isa:?} k={k} rows={rows}: scales");
                    assert_eq!(
                        bits(go),
                        bits(po),
                        "{ty} {isa:?} k={k} rows={rows}: zero terms"
                    );
                    let got = TiledActs::quantize_isa(ty, &x, k, isa);
                    let (gq, gd, go) = got.contents();
                    assert_eq!(gq, wq, "{ty} {isa:?} k={k} rows={rows}: levels");
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(bits(gd), bits(wd), "{ty} {isa:?} k={k} rows={rows}: scales");
                    assert_eq!(
                        bits(go),
                        bits(wo),
                        "{ty} {isa:?} k={k} rows={rows}: offsets"
                    );
                }
            }
        }
    }
}

/// `Panel::decode`'s vector path (gathered from the stored blocks) writes the portable
/// decoder's panel: every code value, partial groups, one and several rows.
#[test]
fn int8_panel_decode_is_the_same_on_every_isa() {
    let mut rng = Rng(0xdec0de);
    let (mut want, mut got) = (Panel::default(), Panel::default());
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        let ks: &[usize] = match ty {
            Q8_0 | Q4_0 => &[32, 96, 160, 288, 544, 1120],
            _ => &[128, 384, 1024, 2176, 3584, 4224],
        };
        for &k in ks {
            for n_out in [1, 5] {
                let w = random_rows(&mut rng, ty, k, n_out);
                want.decode_isa(ty, &w, n_out, k, Isa::Portable);
                for &isa in &int8::isas() {
                    got.decode_isa(ty, &w, n_out, k, isa);
                    let ((gc, gd), (wc, wd)) = (got.contents(), want.contents());
                    assert_eq!(gc, wc, "{ty} {isa:?} k={k} rows={n_out}: codes");
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                    assert_eq!(
                        bits(gd),
                        bits(wd),
                        "{ty} {isa:?} k={k} rows={n_out}: scales"
                    );
                }
            }
        }
    }
}

/// The tiled product over prefill-sized windows (63, 65 and 129 activation rows: whole and
/// partial 4-row tiles after many) agrees with the portable kernel on the same panel.
#[test]
fn int8_tiled_product_agrees_with_portable_on_long_windows() {
    let mut rng = Rng(0x0010_4a11);
    let mut panel = Panel::default();
    for ty in [Q8_0, PQ2_0] {
        let k = if ty == Q8_0 { 544 } else { 2176 };
        let n_out = 7;
        let w = random_rows(&mut rng, ty, k, n_out);
        panel.decode(ty, &w, n_out, k);
        for rows in [63, 65, 129] {
            let x = random_acts(&mut rng, rows * k);
            let acts = TiledActs::quantize(ty, &x, k);
            let mut want = vec![0f32; rows * n_out];
            int8::gemm_isa(&panel, &acts, 0, rows, &mut want, Isa::Portable);
            for &isa in &int8::isas() {
                let mut got = vec![f32::NAN; rows * n_out];
                int8::gemm_isa(&panel, &acts, 0, rows, &mut got, isa);
                for (i, (g, w)) in got.iter().zip(&want).enumerate() {
                    assert!(
                        (g - w).abs() <= 1e-4 * w.abs().max(1.0),
                        "{ty} {isa:?} rows={rows} [{}]: {g} vs {w}",
                        i
                    );
                }
            }
        }
    }
}

/// The rounding of the activations is the only difference from the f32 kernels: each element
/// moves by at most half its block's step, so `|int8 - f32| <= Σ |w_i| * d_i / 2` (plus f32
/// rounding), on the quantizers' own rows.
#[test]
fn int8_kernels_stay_within_the_activation_rounding_of_the_f32_kernels() {
    let mut rng = Rng(42);
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        let k = if matches!(ty, Q8_0 | Q4_0) { 352 } else { 640 };
        let qk = if matches!(ty, Q8_0 | Q4_0) { 32 } else { 128 };
        let n_out = 5;
        let src: Vec<f32> = (0..n_out * k).map(|_| rng.f()).collect();
        let w = tern::quant::quantize_row(ty, &src).unwrap();
        let rb = w.len() / n_out;
        let mut wf = vec![0f32; n_out * k];
        dequantize_row(ty, &w, &mut wf).unwrap();
        let x = random_acts(&mut rng, 3 * k);
        let got = int8_products(ty, &w, n_out, &x, k, Isa::Avx512Vnni);
        for t in 0..3 {
            let xt = &x[t * k..(t + 1) * k];
            for r in 0..n_out {
                let f = dot_row(ty, &w[r * rb..(r + 1) * rb], xt);
                let bound: f32 = wf[r * k..(r + 1) * k]
                    .chunks(qk)
                    .zip(xt.chunks(qk))
                    .map(|(wb, xb)| {
                        let d = xb.iter().fold(0f32, |m, v| m.max(v.abs())) / 127.0;
                        wb.iter().map(|v| v.abs()).sum::<f32>() * d / 2.0
                    })
                    .sum();
                let g = got[t * n_out + r];
                assert!(
                    (g - f).abs() <= bound * 1.001 + 1e-4 * f.abs().max(1.0),
                    "{ty} [{t},{r}]: int8 {g} vs f32 {f}, bound {bound}"
                );
            }
        }
    }
}

/// A row's result does not depend on how many rows share the call: a sequence decoded in a
/// batch computes what it computes alone.
#[test]
fn int8_rows_are_bit_identical_alone_and_in_a_group() {
    let mut rng = Rng(7);
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        let k = 1024;
        let w = random_rows(&mut rng, ty, k, 1);
        let x = random_acts(&mut rng, MAX_ROWS * k);
        let acts = QActs::quantize(ty, &x, k);
        for &isa in &int8::isas() {
            let mut group = [0f32; MAX_ROWS];
            int8::dot_rows_isa(&w, &acts, 0, &mut group, isa);
            for (t, g) in group.iter().enumerate() {
                let mut one = [0f32];
                int8::dot_rows_isa(&w, &acts, t, &mut one, isa);
                assert_eq!(one[0].to_bits(), g.to_bits(), "{ty} {isa:?} row {t}");
            }
        }
    }
}

/// The decode step's span kernel (`int8::dot_span_isa`: one activation row against a run of
/// weight rows) gives each row bit for bit what `dot_rows` gives it alone, on every instruction
/// set (so a sequence decodes the same in a step of its own as in a batch), and agrees with the
/// f64 reference of the integer arithmetic: odd and even block counts (a last single block
/// after the two-block steps, a block boundary + 1), spans of 0 to 9 rows, an activation row
/// past the first.
#[test]
fn int8_span_kernels_match_dot_rows_bit_for_bit_on_every_isa() {
    let mut rng = Rng(0x5a4e_0001);
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        let ks: &[usize] = match ty {
            Q8_0 | Q4_0 => &[32, 64, 96, 1056, 3584],
            _ => &[128, 256, 384, 1024, 1152, 2048],
        };
        for &k in ks {
            let n_out = 9;
            let w = random_rows(&mut rng, ty, k, n_out);
            let rb = w.len() / n_out;
            let mut wf = vec![0f32; n_out * k];
            for (r, row) in wf.chunks_exact_mut(k).enumerate() {
                dequantize_row(ty, &w[r * rb..(r + 1) * rb], row).unwrap();
            }
            let x = random_acts(&mut rng, 3 * k);
            let xr = rounded(ty, &x);
            let acts = QActs::quantize(ty, &x, k);
            for &isa in &int8::isas() {
                for t in [0, 2] {
                    for (r0, n) in [(0, 0), (0, 1), (3, 2), (1, 7), (0, 9)] {
                        let mut got = vec![f32::NAN; n];
                        int8::dot_span_isa(&w[r0 * rb..(r0 + n) * rb], &acts, t, &mut got, isa);
                        for (i, &g) in got.iter().enumerate() {
                            let r = r0 + i;
                            let mut one = [0f32];
                            int8::dot_rows_isa(&w[r * rb..(r + 1) * rb], &acts, t, &mut one, isa);
                            assert_eq!(
                                g.to_bits(),
                                one[0].to_bits(),
                                "{ty} {isa:?} k={k} row {r} of span {r0}+{n}, x row {t}: {g} vs {}",
                                one[0]
                            );
                            let (wr, xt) = (&wf[r * k..(r + 1) * k], &xr[t * k..(t + 1) * k]);
                            let want: f64 = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b).sum();
                            let mag: f64 =
                                wr.iter().zip(xt).map(|(&a, &b)| (a as f64 * b).abs()).sum();
                            assert!(
                                (g as f64 - want).abs() <= 1e-5 * mag + 1e-6,
                                "{ty} {isa:?} k={k} row {r}, x row {t}: {g} vs {want} (|terms| {mag})"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The span kernels for a few activation rows (`int8::dot_span_rows_isa`: a 2-4-stream step or
/// a verify batch, each weight row read once for all of them) give each (weight row, token row)
/// bit for bit what `dot_rows` gives that pair alone, on every instruction set, so a stream
/// decodes the same beside others as alone: 1 to 4 token rows from a row past the first, spans
/// of 0 to 9 weight rows, odd and even block counts.
#[test]
fn int8_multi_row_spans_match_dot_rows_bit_for_bit_on_every_isa() {
    let mut rng = Rng(0x5a4e_0002);
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        let ks: &[usize] = match ty {
            Q8_0 | Q4_0 => &[32, 96, 1056],
            _ => &[128, 384, 1024, 1152],
        };
        for &k in ks {
            let n_out = 9;
            let w = random_rows(&mut rng, ty, k, n_out);
            let rb = w.len() / n_out;
            let x = random_acts(&mut rng, 5 * k);
            let acts = QActs::quantize(ty, &x, k);
            for &isa in &int8::isas() {
                for n in 1..=MAX_ROWS {
                    let t0 = 5 - n;
                    for (r0, nr) in [(0, 0), (0, 1), (3, 2), (1, 7), (0, 9)] {
                        let mut got = vec![f32::NAN; nr * n];
                        let span = &w[r0 * rb..(r0 + nr) * rb];
                        int8::dot_span_rows_isa(span, &acts, t0, n, &mut got, isa);
                        for (j, &g) in got.iter().enumerate() {
                            let (r, t) = (r0 + j / n, t0 + j % n);
                            let mut one = [0f32];
                            int8::dot_rows_isa(&w[r * rb..(r + 1) * rb], &acts, t, &mut one, isa);
                            assert_eq!(
                                g.to_bits(),
                                one[0].to_bits(),
                                "{ty} {isa:?} k={k} row {r} of span {r0}+{nr}, x row {t} of {t0}+{n}: {g} vs {}",
                                one[0]
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The wrappers the backend calls (`dot_rows`, `dot_span`, `dot_span_rows`, which pass an x86
/// variant as their "best") run this CPU's best kernel: bit for bit what the last of
/// `int8::isas()` gives. On aarch64 this holds only if every x86 variant ranks above the NEON
/// ones, the rule `Isa`'s order keeps (qemu's `max` CPU: NeonDot, not the plain Neon kernel).
#[test]
fn int8_default_wrappers_run_the_best_isa() {
    let isas = int8::isas();
    assert!(isas.windows(2).all(|w| w[0] < w[1]), "{isas:?}: best last");
    let best = *isas.last().unwrap();
    let mut rng = Rng(0x5a4e_0003);
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        let k = match ty {
            Q8_0 | Q4_0 => 1056,
            _ => 1152,
        };
        let n_out = 5;
        let w = random_rows(&mut rng, ty, k, n_out);
        let rb = w.len() / n_out;
        let x = random_acts(&mut rng, MAX_ROWS * k);
        let acts = QActs::quantize(ty, &x, k);
        let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
        for n in 1..=MAX_ROWS {
            let (mut got, mut want) = (vec![0f32; n], vec![0f32; n]);
            int8::dot_rows(&w[..rb], &acts, 0, &mut got);
            int8::dot_rows_isa(&w[..rb], &acts, 0, &mut want, best);
            assert_eq!(
                bits(&got),
                bits(&want),
                "{ty} dot_rows, {n} rows, best {best:?}"
            );
            let (mut got, mut want) = (vec![0f32; n * n_out], vec![0f32; n * n_out]);
            int8::dot_span_rows(&w, &acts, 0, n, &mut got);
            int8::dot_span_rows_isa(&w, &acts, 0, n, &mut want, best);
            assert_eq!(
                bits(&got),
                bits(&want),
                "{ty} dot_span_rows, {n} rows, best {best:?}"
            );
        }
        let (mut got, mut want) = (vec![0f32; n_out], vec![0f32; n_out]);
        int8::dot_span(&w, &acts, 1, &mut got);
        int8::dot_span_isa(&w, &acts, 1, &mut want, best);
        assert_eq!(bits(&got), bits(&want), "{ty} dot_span, best {best:?}");
    }
}

/// Rows quantized together (inline for a decode step's few rows, in parallel for many) are
/// each what quantizing the row alone gives: the products agree bit for bit.
#[test]
fn int8_rows_quantized_together_or_alone_agree() {
    let mut rng = Rng(11);
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        let k = 1024;
        let w = random_rows(&mut rng, ty, k, 1);
        // 3 rows are quantized on the calling thread, 40 (40,960 elements) in parallel.
        for n in [3usize, 40] {
            let x = random_acts(&mut rng, n * k);
            let all = QActs::quantize(ty, &x, k);
            for t in 0..n {
                let one = QActs::quantize(ty, &x[t * k..(t + 1) * k], k);
                let (mut a, mut b) = ([0f32], [0f32]);
                int8::dot_rows(&w, &all, t, &mut a);
                int8::dot_rows(&w, &one, 0, &mut b);
                assert_eq!(a[0].to_bits(), b[0].to_bits(), "{ty} {n} rows: row {t}");
            }
        }
    }
}

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn tokens(file: &str) -> Vec<u32> {
    let text = std::fs::read_to_string(fixtures().join("manifest.json")).unwrap();
    let m: serde_json::Value = serde_json::from_str(&text).unwrap();
    let e = m["fixtures"]
        .as_array()
        .unwrap()
        .iter()
        .find(|e| e["file"] == file)
        .unwrap_or_else(|| panic!("{file} not in the manifest"));
    e["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect()
}

fn argmax(r: &[f32]) -> usize {
    (0..r.len()).fold(0, |b, i| if r[i] > r[b] { i } else { b })
}

/// Logits of every position of `t`, one prefill batch.
fn prefill(be: &CpuBackend, path: &Path, t: &[u32]) -> (Vec<f32>, usize) {
    let m = Model::open(be, path).unwrap();
    let mut st = m.new_state(be);
    let out = be.to_host(&m.forward(be, &mut st, t, true).unwrap().logits);
    (out, m.cfg.n_vocab)
}

/// The trained demo models (real activations, unlike the random fixtures): the int8 path's
/// logits over 256 held-out tokens against the f32 reference's (which `golden.rs` and
/// `demo_model.rs` tie to llama.cpp) within issue #21's quantized tolerance, NMSE at most 5e-3
/// and the same top-1 token at 96% of positions or more. Measured: Q8_0 3.5e-5 and 253/256,
/// PQ2_0 4.8e-5 and 250/256, PTQ1_0 5.5e-5 and 247/256 (transcoded on x86, see below).
fn check_demo(file: &str) {
    check_demo_on(file, &CpuBackend::int8());
}

fn check_demo_on(file: &str, be: &CpuBackend) {
    let ev: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(fixtures().join("demo/eval.json")).unwrap())
            .unwrap();
    let t: Vec<u32> = ev["heldout_slice"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .take(256)
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    assert_eq!(t.len(), 256);
    let path = fixtures().join("demo").join(file);
    let (exact, nv) = prefill(&CpuBackend::new(), &path, &t);
    let (ours, _) = prefill(be, &path, &t);
    let e = nmse(&ours, &exact);
    let same = ours
        .chunks(nv)
        .zip(exact.chunks(nv))
        .filter(|(a, g)| argmax(a) == argmax(g))
        .count();
    println!("{file}: int8 vs f32 reference NMSE {e:.3e}, top-1 {same}/256");
    assert!(e <= 5e-3, "{file}: NMSE {e:e}");
    assert!(same as f64 / 256.0 >= 0.96, "{file}: top-1 {same}/256");
}

#[test]
fn int8_demo_q8_0_within_quantized_tolerance() {
    check_demo("demo-q8_0.gguf");
}

#[test]
fn int8_demo_pq2_0_within_quantized_tolerance() {
    check_demo("demo-pq2_0.gguf");
}

#[test]
fn int8_demo_ptq1_0_within_quantized_tolerance() {
    check_demo("demo-ptq1_0.gguf");
}

/// PTQ1_0 read as stored by its own kernels (`int8_unpacked`; Arm's serving path): the demo
/// model's widths (128 to 384) are not whole packed groups, so on x86 `int8` transcodes its
/// matrices to PQ2_0 blocks (`quant::packed::Layout::Transcoded`) and the test above runs
/// those. Measured here: NMSE 5.21e-5 and top-1 250/256 as stored, 5.47e-5 and 247/256
/// transcoded (the f32 sums of the same integer products in another order).
#[test]
fn int8_demo_ptq1_0_stored_within_quantized_tolerance() {
    check_demo_on("demo-ptq1_0.gguf", &CpuBackend::int8_unpacked());
}

/// The random tiny fixtures amplify any rounding through their layers: llama.cpp's own int8
/// path lands at NMSE 1.0e-2 (Q8_0) and 8.8e-3 (Q4_0) from the exact golden there, beyond the
/// 5e-3 that holds on the trained models above. So here the int8 path must stay within twice
/// llama.cpp's own distance from the exact golden (measured: Q8_0 1.18e-2 vs 1.04e-2, Q4_0
/// 1.23e-2 vs 8.8e-3, tied Q8_0 8.9e-4 vs 8.2e-4), within 1.5e-2 where llama.cpp cannot run the
/// file (PQ2_0: 6.2e-3). Token-by-token decode is held to the same bound: each row's
/// activations are quantized alone, but the f32 ops around the matmuls sum in another order
/// when batched, and a level that flips at a rounding edge is amplified like any other error
/// (tiny PQ2_0: 5e-4 between the two).
fn check_model(file: &str) {
    let be = CpuBackend::int8();
    let t = tokens(file);
    let path = fixtures().join(file);
    let (prefill, nv) = prefill(&be, &path, &t);
    let m = Model::open(&be, &path).unwrap();
    let mut st = m.new_state(&be);
    let mut decode = Vec::new();
    for &tok in &t {
        decode.extend(be.to_host(&m.forward(&be, &mut st, &[tok], true).unwrap().logits));
    }
    let stem = file.trim_end_matches(".gguf");
    let golden = |kind: &str| tern::npy::read(fixtures().join(format!("golden/{stem}.{kind}.npy")));
    let (exact, _) = golden("exact").unwrap();
    let bound = match golden("llama") {
        Ok((llama, _)) => 2.0 * nmse(&llama, &exact),
        Err(_) => 1.5e-2,
    };
    for (mode, ours) in [("prefill", &prefill), ("decode", &decode)] {
        let e = nmse(ours, &exact);
        let same = ours
            .chunks(nv)
            .zip(exact.chunks(nv))
            .filter(|(a, g)| argmax(a) == argmax(g))
            .count();
        println!(
            "{file} int8 {mode}: exact golden NMSE {e:.3e} (bound {bound:.3e}), top-1 {same}/{}",
            t.len()
        );
        assert!(
            e <= bound,
            "{file} {mode}: NMSE {e:e} vs exact golden, bound {bound:e}"
        );
    }
}

#[test]
fn int8_model_q8_0_near_llama_cpp() {
    check_model("tiny-q8_0.gguf");
}

#[test]
fn int8_model_q4_0_near_llama_cpp() {
    check_model("tiny-q4_0.gguf");
}

#[test]
fn int8_model_pq2_0_near_exact() {
    check_model("tiny-pq2_0.gguf");
}

#[test]
fn int8_model_tied_q8_0_near_llama_cpp() {
    check_model("tiny-tied-q8_0.gguf");
}

/// The serving path packs Q8_0 matrices at load (`quant::packed`) where this CPU has the packed
/// kernel; packed or read in place, a model computes the same bits: a prefill (the tiled
/// product, its panels unpacked per task), token-by-token decode (one-row spans, the packed
/// embedding table's rows unpacked), and three-token batches (the multi-row kernels). The tiny
/// fixture's matrices are 128 and 256 wide, the demo model's 128 to 384, with an untied head.
#[test]
fn int8_packed_q8_0_computes_the_unpacked_bits() {
    for file in ["tiny-q8_0.gguf", "demo/demo-q8_0.gguf"] {
        let path = fixtures().join(file);
        let run = |be: &CpuBackend| {
            let t: Vec<u32> = (0..40u32).map(|i| (i * 37 + 5) % 120).collect();
            let m = Model::open(be, &path).unwrap();
            let mut out = Vec::new();
            let mut st = m.new_state(be);
            out.extend(be.to_host(&m.forward(be, &mut st, &t[..33], true).unwrap().logits));
            for &tok in &t[33..36] {
                out.extend(be.to_host(&m.forward(be, &mut st, &[tok], true).unwrap().logits));
            }
            out.extend(be.to_host(&m.forward(be, &mut st, &t[36..39], true).unwrap().logits));
            out.iter().map(|v| v.to_bits()).collect::<Vec<_>>()
        };
        let packed = run(&CpuBackend::int8());
        let unpacked = run(&CpuBackend::int8_unpacked());
        assert_eq!(packed.len(), unpacked.len());
        let differ = packed.iter().zip(&unpacked).filter(|(a, b)| a != b).count();
        assert_eq!(
            differ,
            0,
            "{file}: {differ} of {} logits differ",
            packed.len()
        );
    }
}
