//! NEON versions of the integer kernels in `int8.rs`, chosen at run time: [`Isa::NeonDot`] with
//! the dot-product extension's `sdot` (Armv8.2 and later: Cortex-A55/A76 on, Neoverse, Apple M),
//! [`Isa::Neon`] with widening multiplies for the Armv8.0 cores without it (Cortex-A53/A72).
//!
//! `sdot` multiplies signed by signed bytes, so no weight needs the x86 kernels' unsigned codes:
//! each block is read as its signed levels `c - z` (Q8_0's bytes as stored, Q4_0's nibbles - 8,
//! PQ2_0's codes - 1, PTQ1_0's trits - 1) and its dot is `dw * dx * Σ l·q`, as `dot_portable`
//! computes Q8_0's, with no zero-point term (`QActs::o` is not read). The subtraction is one
//! instruction per 16 weight bytes, shared by the activation rows, where the `o` term costs a
//! multiply-add per block and row; and the integer sum is the block's exact dot rather than two
//! larger sums that cancel in f32.
//!
//! One row kernel, generic in the weight format and the number of activation rows, serves
//! `dot_rows` (a span of one row) and the span kernels alike, so each (weight row, activation
//! row) pair goes through the same float operations in the same order whatever the call: a
//! sequence decodes to the same bits alone and batched. The integer sums are exact, so the two
//! instruction sets give the same sums too; only their lanes differ (`sdot` adds four adjacent
//! products per lane, the widening path pairs), which moves the f32 rounding between them.
//!
//! No software prefetch: `prfm` has no stable intrinsic, and without an Arm machine to measure
//! on there is nothing to tune its distance against (the x86 kernels' distance was measured).

use std::arch::aarch64::*;
use std::arch::asm;

use super::fp::f16_to_f32;
use super::int8::{Isa, QActs, MAX_ROWS};
use super::ptq1_0::POW3;
use crate::tensor::GgmlType;

pub(super) fn neon() -> bool {
    std::arch::is_aarch64_feature_detected!("neon")
}

pub(super) fn dotprod() -> bool {
    neon() && std::arch::is_aarch64_feature_detected!("dotprod")
}

/// [`int8::dot_rows_isa`](super::int8::dot_rows_isa),
/// [`int8::dot_span_isa`](super::int8::dot_span_isa) and
/// [`int8::dot_span_rows_isa`](super::int8::dot_span_rows_isa)'s kernels: `out[r * n + i]` = the
/// row of `rb` bytes at `rows[r * rb..]` against activation row `t0 + i`, for `n` (1 to
/// [`MAX_ROWS`]) activation rows; false when the CPU (or `isa`) has no NEON kernel. The caller
/// checked the shapes.
pub(super) fn dot_span(
    rows: &[u8],
    rb: usize,
    acts: &QActs,
    t0: usize,
    n: usize,
    out: &mut [f32],
    isa: Isa,
) -> bool {
    debug_assert!((1..=MAX_ROWS).contains(&n));
    debug_assert_eq!(rows.len() * n, rb * out.len());
    let sdot = if isa >= Isa::NeonDot && dotprod() {
        true
    } else if isa >= Isa::Neon && neon() {
        false
    } else {
        return false;
    };
    use GgmlType::*;
    match acts.ty {
        Q8_0 => span_of::<Q8>(sdot, rows, rb, acts, t0, n, out),
        Q4_0 => span_of::<Q4>(sdot, rows, rb, acts, t0, n, out),
        PQ2_0 | Q2_0Legacy => span_of::<Pq2>(sdot, rows, rb, acts, t0, n, out),
        PTQ1_0 => span_of::<Ptq1>(sdot, rows, rb, acts, t0, n, out),
        _ => return false,
    }
    true
}

/// The span kernel of format `F` for `n` activation rows, with `sdot` or without.
fn span_of<F: Format>(
    sdot: bool,
    rows: &[u8],
    rb: usize,
    a: &QActs,
    t0: usize,
    n: usize,
    out: &mut [f32],
) {
    // SAFETY: `sdot` only where `dotprod()` holds, the plain kernels where `neon()` does
    // (`dot_span`); `rows` holds `out.len() / n` whole rows of `rb` bytes of `a`'s type and
    // `t0..t0 + n` are rows of `a` (`int8::dot_rows_isa` / `dot_span_isa` checked both).
    unsafe {
        match (sdot, n) {
            (true, 1) => span_sdot::<F, 1>(rows, rb, a, t0, out),
            (true, 2) => span_sdot::<F, 2>(rows, rb, a, t0, out),
            (true, 3) => span_sdot::<F, 3>(rows, rb, a, t0, out),
            (true, _) => span_sdot::<F, 4>(rows, rb, a, t0, out),
            (false, 1) => span_neon::<F, 1>(rows, rb, a, t0, out),
            (false, 2) => span_neon::<F, 2>(rows, rb, a, t0, out),
            (false, 3) => span_neon::<F, 3>(rows, rb, a, t0, out),
            (false, _) => span_neon::<F, 4>(rows, rb, a, t0, out),
        }
    }
}

/// The weight-row loop inside the target-feature function, so that the row kernel (and `sdot`)
/// inline into it and the dispatch is paid once per span. Two of them: `sdot` must not reach
/// code compiled for (and run on) a CPU without the dot-product extension.
macro_rules! span_fn {
    ($name:ident, $feat:literal, $sdot:literal) => {
        #[target_feature(enable = $feat)]
        unsafe fn $name<F: Format, const N: usize>(
            rows: &[u8],
            rb: usize,
            a: &QActs,
            t0: usize,
            out: &mut [f32],
        ) {
            for (o, row) in out.chunks_exact_mut(N).zip(rows.chunks_exact(rb)) {
                row_kernel::<F, $sdot, N>(row.as_ptr(), a, t0, o);
            }
        }
    };
}

span_fn!(span_sdot, "neon,dotprod", true);
span_fn!(span_neon, "neon", false);

/// A weight format as the row kernel reads it: blocks of `BYTES` bytes, an f16 scale at
/// `SCALE`, and `16 * V` signed levels that meet the block's activations in order.
trait Format {
    const BYTES: usize;
    const SCALE: usize;
    /// 16-byte vectors of levels per block (2 for 32-element blocks, 8 for 128).
    const V: usize;

    /// The block's levels into `l[..V]`.
    ///
    /// # Safety
    /// `blk` points at `BYTES` readable bytes.
    unsafe fn levels(blk: *const u8, l: &mut [int8x16_t; 8]);
}

struct Q8;
struct Q4;
struct Pq2;
struct Ptq1;

impl Format for Q8 {
    const BYTES: usize = 34;
    const SCALE: usize = 0;
    const V: usize = 2;

    #[inline(always)]
    unsafe fn levels(blk: *const u8, l: &mut [int8x16_t; 8]) {
        let q = blk.add(2) as *const i8;
        l[0] = vld1q_s8(q);
        l[1] = vld1q_s8(q.add(16));
    }
}

impl Format for Q4 {
    const BYTES: usize = 18;
    const SCALE: usize = 0;
    const V: usize = 2;

    /// Byte j's low nibble is element j, its high one element j + 16.
    #[inline(always)]
    unsafe fn levels(blk: *const u8, l: &mut [int8x16_t; 8]) {
        let q = vld1q_u8(blk.add(2));
        let eight = vdupq_n_s8(8);
        l[0] = vsubq_s8(vreinterpretq_s8_u8(vandq_u8(q, vdupq_n_u8(15))), eight);
        l[1] = vsubq_s8(vreinterpretq_s8_u8(vshrq_n_u8::<4>(q)), eight);
    }
}

impl Format for Pq2 {
    const BYTES: usize = 34;
    const SCALE: usize = 0;
    const V: usize = 8;

    /// Code plane `s` of the block's bytes `16h..16h + 16` meets the interleaved activations
    /// `32s + 16h..` (`QActs`: position `32s + m` holds element `4m + s`).
    #[inline(always)]
    unsafe fn levels(blk: *const u8, l: &mut [int8x16_t; 8]) {
        let (m3, one) = (vdupq_n_u8(3), vdupq_n_u8(1));
        let level = |c: uint8x16_t| vreinterpretq_s8_u8(vsubq_u8(vandq_u8(c, m3), one));
        for h in 0..2 {
            let q = vld1q_u8(blk.add(2 + 16 * h));
            l[h] = level(q);
            l[2 + h] = level(vshrq_n_u8::<2>(q));
            l[4 + h] = level(vshrq_n_u8::<4>(q));
            l[6 + h] = level(vshrq_n_u8::<6>(q));
        }
    }
}

impl Format for Ptq1 {
    const BYTES: usize = 28;
    const SCALE: usize = 26;
    const V: usize = 8;

    /// The trits of `ptq1_0.rs`'s packing, 16 at a time: trit n of a byte is the high byte of
    /// `(byte * 3^n mod 256) * 3`. Bytes 0..16 give elements `16n + m`, one vector per n;
    /// bytes 16..24 give `80 + 8n + m`, two n per vector; the two `qh` bytes give `120 + 2n + h`,
    /// alternating in one half vector against multipliers 1, 1, 3, 3, 9, 9, 27, 27.
    #[inline(always)]
    unsafe fn levels(blk: *const u8, l: &mut [int8x16_t; 8]) {
        let three = vdup_n_u8(3);
        let one = vdupq_n_u8(1);
        let level = |q: uint8x16_t, pow: uint8x16_t| {
            let p = vmulq_u8(q, pow);
            let t = vshrn_n_u16::<8>(vmull_u8(vget_low_u8(p), three));
            let t = vshrn_high_n_u16::<8>(t, vmull_high_u8(p, vdupq_n_u8(3)));
            vreinterpretq_s8_u8(vsubq_u8(t, one))
        };
        let q = vld1q_u8(blk);
        for (n, &p) in POW3.iter().enumerate() {
            l[n] = level(q, vdupq_n_u8(p));
        }
        let mid = vld1_u8(blk.add(16));
        let pair = |a: u8, b: u8| vcombine_u8(vdup_n_u8(a), vdup_n_u8(b));
        let q = vcombine_u8(mid, mid);
        l[5] = level(q, pair(POW3[0], POW3[1]));
        l[6] = level(q, pair(POW3[2], POW3[3]));
        let qh = vreinterpret_u8_u16(vdup_n_u16(u16::from_le_bytes([*blk.add(24), *blk.add(25)])));
        const MUL: [u8; 16] = [81, 81, 81, 81, 81, 81, 81, 81, 1, 1, 3, 3, 9, 9, 27, 27];
        l[7] = level(vcombine_u8(mid, qh), vld1q_u8(MUL.as_ptr()));
    }
}

/// `Σ a·b` of 16 signed bytes added into four i32 lanes: `sdot`, or widening multiplies whose
/// pairs add into the lanes (each product fits an i16, even -128 · -128).
#[inline(always)]
unsafe fn dot16<const SDOT: bool>(acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    if SDOT {
        sdot(acc, a, b)
    } else {
        let lo = vmull_s8(vget_low_s8(a), vget_low_s8(b));
        vpadalq_s16(vpadalq_s16(acc, lo), vmull_high_s8(a, b))
    }
}

/// `vdotq_s32`, which is still unstable in `core::arch` (`stdarch_neon_dotprod`).
#[target_feature(enable = "neon,dotprod")]
#[inline]
unsafe fn sdot(mut acc: int32x4_t, a: int8x16_t, b: int8x16_t) -> int32x4_t {
    // SAFETY: a register-only instruction of the `dotprod` feature this function enables.
    asm!(
        "sdot {acc:v}.4s, {a:v}.16b, {b:v}.16b",
        acc = inout(vreg) acc,
        a = in(vreg) a,
        b = in(vreg) b,
        options(pure, nomem, nostack, preserves_flags)
    );
    acc
}

/// One weight row of format `F` at `row` against activation rows `t0..t0 + N`: per block, its
/// levels decoded once for the `N` rows, each row's exact integer sum in four lanes, scaled by
/// `dw * dx` into four f32 lanes, summed across at the end.
///
/// # Safety
/// `row` points at a whole row of `a`'s type (`a.k` elements), `t0 + N <= a.rows()`,
/// `out.len() == N`, and the CPU has NEON (and `dotprod` where `SDOT`), enabled in the caller.
#[inline(always)]
unsafe fn row_kernel<F: Format, const SDOT: bool, const N: usize>(
    row: *const u8,
    a: &QActs,
    t0: usize,
    out: &mut [f32],
) {
    let qk = 16 * F::V;
    let (k, nb) = (a.k, a.k / qk);
    let (qs, d) = (a.qs.as_ptr(), a.d.as_ptr());
    let mut acc = [vdupq_n_f32(0.0); N];
    let mut l = [vdupq_n_s8(0); 8];
    for b in 0..nb {
        let blk = row.add(b * F::BYTES);
        F::levels(blk, &mut l);
        let dw = f16_to_f32(u16::from_le_bytes([
            *blk.add(F::SCALE),
            *blk.add(F::SCALE + 1),
        ]));
        for (i, acc) in acc.iter_mut().enumerate() {
            let t = t0 + i;
            let x = qs.add(t * k + b * qk);
            // Two chains, so a 128-element block's eight products do not wait on one another
            // eight deep; integer sums, so the split changes nothing in the result.
            let mut s = [vdupq_n_s32(0); 2];
            for (v, &l) in l[..F::V].iter().enumerate() {
                s[v % 2] = dot16::<SDOT>(s[v % 2], l, vld1q_s8(x.add(16 * v)));
            }
            // Each lane's sum is below 2^24 (at most 32 products of 2^14), exact in f32.
            let s = vcvtq_f32_s32(vaddq_s32(s[0], s[1]));
            *acc = vfmaq_n_f32(*acc, s, dw * *d.add(t * nb + b));
        }
    }
    for (o, acc) in out.iter_mut().zip(acc) {
        *o = vaddvq_f32(acc);
    }
}
