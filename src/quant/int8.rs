//! Integer dot products for the serving path, as llama.cpp computes them: the activations of a
//! matmul are quantized to int8 once (a scale per block, like ggml's `Q8_0` / `Q8_K`
//! activation blocks), then every stored row is dotted with them in integers and scaled once
//! per block. The f32 kernels in `mod.rs` stay the reference (`tern logits`, `--cpu-exact`).
//!
//! Every weight type is read as unsigned codes `c` with a zero point `z` (value = `(c - z) * d`):
//! Q8_0 as `q + 128` (the bias turns its signed bytes into the unsigned operand of
//! `vpdpbusd` / `vpmaddubsw`), Q4_0 as its nibbles with `z = 8`, PQ2_0 and PTQ1_0 as their codes
//! with `z = 1`. So a block's dot is `dw * (dx * Σ c·q - z * dx * Σ q)`, and the second term is
//! computed once per activation block when quantizing (`QActs::o`).
//!
//! Activation blocks: 32 elements for Q8_0 and Q4_0 (the weight block), 128 for PQ2_0 and PTQ1_0
//! (one scale pair per ternary block). PQ2_0's activations are stored interleaved within each
//! block, position `32s + m` holding element `4m + s`, so that the code plane `(qs >> 2s) & 3`
//! of the block's 32 bytes meets its activations in order, with no shuffle.
//!
//! The kernels take 1 to [`MAX_ROWS`] activation rows per call: a weight block is loaded and
//! decoded once for all of them (several decoding sequences, a verify batch).

use rayon::prelude::*;

use crate::tensor::GgmlType;

use super::fp::le_f16;

/// Activation rows one kernel call serves.
pub const MAX_ROWS: usize = 4;

/// Whether `ty` has integer kernels.
pub fn supported(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::PQ2_0 | GgmlType::Q2_0Legacy | GgmlType::PTQ1_0
    )
}

/// Elements per activation block for weights of type `ty`.
fn act_block(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 => 32,
        _ => 128,
    }
}

/// The zero point of `ty`'s codes.
fn zero_point(ty: GgmlType) -> f32 {
    match ty {
        GgmlType::Q8_0 => 128.0,
        GgmlType::Q4_0 => 8.0,
        _ => 1.0,
    }
}

/// Rows of activations quantized to int8 for weights of one type.
pub struct QActs {
    pub(super) ty: GgmlType,
    pub(super) k: usize,
    pub(super) rows: usize,
    /// `rows * k` levels, each block in the weight type's element order.
    pub(super) qs: Vec<i8>,
    /// The scale of each block, `rows * k / qk`.
    pub(super) d: Vec<f32>,
    /// Each block's zero-point term `z * d * Σ q`.
    pub(super) o: Vec<f32>,
    /// For 32-element blocks: `d` and `o / 8`, eight copies per block, the lanes of one
    /// block's eight i32 partial sums.
    pub(super) d8: Vec<f32>,
    pub(super) o8: Vec<f32>,
}

impl QActs {
    /// Quantizes `x` (`rows` of `k`, `k` a whole number of `ty`'s blocks) for weights of type
    /// `ty`: per block, `d = max |x| / 127` and `q = round(x / d)`.
    pub fn quantize(ty: GgmlType, x: &[f32], k: usize) -> QActs {
        assert!(supported(ty), "QActs: no integer kernels for {ty}");
        let qk = act_block(ty);
        assert!(
            k > 0 && k.is_multiple_of(qk) && k.is_multiple_of(ty.block_size()),
            "QActs: {k} columns is not a whole number of {ty} blocks"
        );
        assert_eq!(x.len() % k, 0, "QActs: input is not whole rows of {k}");
        let rows = x.len() / k;
        let nb = x.len() / qk;
        let z = zero_point(ty);
        let interleave = matches!(ty, GgmlType::PQ2_0 | GgmlType::Q2_0Legacy);
        let mut a = QActs {
            ty,
            k,
            rows,
            qs: vec![0; x.len()],
            d: vec![0.0; nb],
            o: vec![0.0; nb],
            d8: Vec::new(),
            o8: Vec::new(),
        };
        let nbr = k / qk;
        let row = |x: &[f32], q: &mut [i8], d: &mut [f32], o: &mut [f32]| {
            quantize_row(qk, z, interleave, x, q, d, o)
        };
        // One row (a decode step) is quicker than a fork.
        if rows == 1 {
            row(x, &mut a.qs, &mut a.d, &mut a.o);
        } else {
            x.par_chunks(k)
                .zip(a.qs.par_chunks_mut(k))
                .zip(a.d.par_chunks_mut(nbr).zip(a.o.par_chunks_mut(nbr)))
                .for_each(|((x, q), (d, o))| row(x, q, d, o));
        }
        if qk == 32 {
            a.d8 = a.d.iter().flat_map(|&d| [d; 8]).collect();
            a.o8 = a.o.iter().flat_map(|&o| [o / 8.0; 8]).collect();
        }
        a
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The levels of row `t`.
    pub(super) fn row(&self, t: usize) -> &[i8] {
        &self.qs[t * self.k..(t + 1) * self.k]
    }

    /// Blocks per row.
    pub(super) fn blocks(&self) -> usize {
        self.k / act_block(self.ty)
    }
}

/// The instruction sets the kernels are written for, in order.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Portable,
    Avx2,
    Avx512Vnni,
}

/// The kernels this CPU can run, the best last.
pub fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if super::x86_int8::avx2() {
            v.push(Isa::Avx2);
        }
        if super::x86_int8::vnni() {
            v.push(Isa::Avx512Vnni);
        }
    }
    v
}

/// One row of [`QActs::quantize`]: its levels `q` (interleaved for PQ2_0), and per block of
/// `qk` the scale `d` and the zero-point term `o`.
fn quantize_row(
    qk: usize,
    z: f32,
    interleave: bool,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    o: &mut [f32],
) {
    for (((xb, qb), d), o) in x
        .chunks_exact(qk)
        .zip(q.chunks_exact_mut(qk))
        .zip(d.iter_mut())
        .zip(o.iter_mut())
    {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        *d = amax / 127.0;
        let id = if *d > 0.0 { 1.0 / *d } else { 0.0 };
        let mut sum = 0i32;
        for (j, &v) in xb.iter().enumerate() {
            let l = (v * id).round() as i8;
            sum += l as i32;
            let at = if interleave { (j % 4) * 32 + j / 4 } else { j };
            qb[at] = l;
        }
        *o = z * *d * sum as f32;
    }
}

/// `out[i] = row · x[t0 + i]` for `out.len()` (1 to [`MAX_ROWS`]) activation rows, `row` one
/// stored row of the activations' weight type (`ty.row_bytes(k)` bytes).
pub fn dot_rows(row: &[u8], acts: &QActs, t0: usize, out: &mut [f32]) {
    dot_rows_isa(row, acts, t0, out, Isa::Avx512Vnni)
}

/// [`dot_rows`] with the kernels of `isa` at most (the tests run every path the CPU has).
pub fn dot_rows_isa(row: &[u8], acts: &QActs, t0: usize, out: &mut [f32], isa: Isa) {
    let n = out.len();
    assert!(
        (1..=MAX_ROWS).contains(&n) && t0 + n <= acts.rows,
        "int8::dot_rows: rows {t0}..{} of {}",
        t0 + n,
        acts.rows
    );
    assert_eq!(
        acts.ty.row_bytes(acts.k as u64),
        Some(row.len() as u64),
        "int8::dot_rows: a {} row of {} bytes against {} activations",
        acts.ty,
        row.len(),
        acts.k
    );
    #[cfg(target_arch = "x86_64")]
    if super::x86_int8::dot_rows(row, acts, t0, out, isa) {
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot_portable(row, acts, t0 + i);
    }
}

/// The integer kernel without SIMD: the reference the vector paths are tested against, and the
/// path of CPUs without AVX2 (aarch64 included: no NEON kernel yet).
pub fn dot_portable(row: &[u8], a: &QActs, t: usize) -> f32 {
    let q = a.row(t);
    let nb = a.blocks();
    let (d, o) = (&a.d[t * nb..(t + 1) * nb], &a.o[t * nb..(t + 1) * nb]);
    let mut acc = 0.0f32;
    match a.ty {
        GgmlType::Q8_0 => {
            for (b, (wb, qb)) in row.chunks_exact(34).zip(q.chunks_exact(32)).enumerate() {
                let s: i32 = wb[2..]
                    .iter()
                    .zip(qb)
                    .map(|(&w, &x)| w as i8 as i32 * x as i32)
                    .sum();
                acc += le_f16(wb, 0) * (d[b] * s as f32);
            }
        }
        GgmlType::Q4_0 => {
            for (b, (wb, qb)) in row.chunks_exact(18).zip(q.chunks_exact(32)).enumerate() {
                let mut s = 0i32;
                for (j, &c) in wb[2..].iter().enumerate() {
                    s += (c & 15) as i32 * qb[j] as i32 + (c >> 4) as i32 * qb[j + 16] as i32;
                }
                acc += le_f16(wb, 0) * (d[b] * s as f32 - o[b]);
            }
        }
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => {
            for (b, (wb, qb)) in row.chunks_exact(34).zip(q.chunks_exact(128)).enumerate() {
                let mut s = 0i32;
                for (m, &c) in wb[2..].iter().enumerate() {
                    for p in 0..4 {
                        s += ((c >> (2 * p)) & 3) as i32 * qb[32 * p + m] as i32;
                    }
                }
                acc += le_f16(wb, 0) * (d[b] * s as f32 - o[b]);
            }
        }
        GgmlType::PTQ1_0 => {
            let mut w = [0.0f32; 128];
            for (b, (wb, qb)) in row.chunks_exact(28).zip(q.chunks_exact(128)).enumerate() {
                let dw = super::ptq1_0::decode(wb.try_into().expect("PTQ1_0 block"), &mut w);
                // The decoder's levels are trits - 1, exact in f32.
                let s: i32 = w
                    .iter()
                    .zip(qb)
                    .map(|(&l, &x)| (l as i32 + 1) * x as i32)
                    .sum();
                acc += dw * (d[b] * s as f32 - o[b]);
            }
        }
        ty => unreachable!("QActs::quantize admits no {ty}"),
    }
    acc
}
