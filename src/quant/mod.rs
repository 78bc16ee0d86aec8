//! Block formats: reference quantizers, dequantizers and the f32-activation dot products the
//! CPU backend's matvec runs on, plus the PrismML Hadamard fold (`hadamard`).
//!
//! Quantizers follow ggml's `*_ref` functions byte for byte (and PrismML's fork for PQ2_0 and
//! PTQ1_0), so files we write load in llama.cpp and files we read decode to the same numbers.

#[cfg(target_arch = "aarch64")]
mod arm_int8;
mod fp;
pub mod hadamard;
pub mod int8;
pub mod packed;
mod pq2_0;
mod ptq1_0;
mod q4_0;
mod q8_0;
#[cfg(target_arch = "x86_64")]
mod x86;
#[cfg(target_arch = "x86_64")]
mod x86_int8;

#[cfg(test)]
mod tests;

use crate::tensor::GgmlType;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("no quantization kernels for tensor type {0} (tern computes F32, F16, BF16, Q8_0, Q4_0, PQ2_0, PTQ1_0)")]
    Unsupported(GgmlType),
    #[error("{ty}: a row of {elements} elements is not a whole number of {block}-element blocks")]
    PartialBlock {
        ty: GgmlType,
        elements: usize,
        block: usize,
    },
    #[error("{ty}: a row of {elements} elements takes {expected} bytes, got {bytes}")]
    BadLength {
        ty: GgmlType,
        elements: usize,
        bytes: usize,
        expected: usize,
    },
}

/// Checks that `ty` has kernels here and that `elements` fills whole blocks; returns the row's
/// byte length.
fn checked_row_bytes(ty: GgmlType, elements: usize) -> Result<usize, QuantError> {
    if !ty.can_compute() {
        return Err(QuantError::Unsupported(ty));
    }
    ty.row_bytes(elements as u64)
        .map(|b| b as usize)
        .ok_or(QuantError::PartialBlock {
            ty,
            elements,
            block: ty.block_size(),
        })
}

/// Dequantize one row: `src` is exactly `ty.row_bytes(dst.len())` bytes.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let expected = checked_row_bytes(ty, dst.len())?;
    if src.len() != expected {
        return Err(QuantError::BadLength {
            ty,
            elements: dst.len(),
            bytes: src.len(),
            expected,
        });
    }
    match ty {
        GgmlType::F32 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(4)) {
                *y = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = fp::f16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        GgmlType::BF16 => {
            for (y, b) in dst.iter_mut().zip(src.chunks_exact(2)) {
                *y = fp::bf16_to_f32(u16::from_le_bytes([b[0], b[1]]));
            }
        }
        GgmlType::Q8_0 => dequantize_blocks(src, dst, q8_0::decode),
        GgmlType::Q4_0 => dequantize_blocks(src, dst, q4_0::decode),
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => dequantize_blocks(src, dst, pq2_0::decode),
        GgmlType::PTQ1_0 => dequantize_blocks(src, dst, ptq1_0::decode),
        _ => unreachable!("checked_row_bytes admits only computable types"),
    }
    Ok(())
}

/// Reference quantization of one row, byte-identical to ggml's `*_ref` quantizers.
pub fn quantize_row(ty: GgmlType, src: &[f32]) -> Result<Vec<u8>, QuantError> {
    let bytes = checked_row_bytes(ty, src.len())?;
    let out = match ty {
        GgmlType::F32 => src.iter().flat_map(|v| v.to_le_bytes()).collect(),
        GgmlType::F16 => src
            .iter()
            .flat_map(|&v| fp::f32_to_f16(v).to_le_bytes())
            .collect(),
        GgmlType::BF16 => src
            .iter()
            .flat_map(|&v| fp::f32_to_bf16(v).to_le_bytes())
            .collect(),
        GgmlType::Q8_0 => quantize_blocks(src, q8_0::quantize_block),
        GgmlType::Q4_0 => quantize_blocks(src, q4_0::quantize_block),
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => quantize_blocks(src, pq2_0::quantize_block),
        GgmlType::PTQ1_0 => quantize_blocks(src, ptq1_0::quantize_block),
        _ => unreachable!("checked_row_bytes admits only computable types"),
    };
    debug_assert_eq!(out.len(), bytes);
    Ok(out)
}

/// Hot path for the CPU backend's matvec: dot product of one stored row with an f32 vector,
/// f32 activations (no activation quantization).
///
/// The caller has validated lengths (`row.len() == ty.row_bytes(x.len())`) and that
/// `ty.can_compute()`; any other type panics. Mismatched lengths are a debug assertion; in
/// release the kernels only ever read the whole blocks both slices hold.
pub fn dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(
        ty.row_bytes(x.len() as u64),
        Some(row.len() as u64),
        "dot_row: {ty} row of {} bytes against {} activations",
        row.len(),
        x.len()
    );
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        // SAFETY: `available` checked that the CPU has AVX2 and F16C.
        unsafe {
            return match ty {
                GgmlType::F32 => x86::dot_f32(row, x),
                GgmlType::F16 => x86::dot_f16(row, x),
                GgmlType::BF16 => x86::dot_bf16(row, x),
                GgmlType::Q8_0 => x86::dot_q8_0(row, x),
                GgmlType::Q4_0 => x86::dot_q4_0(row, x),
                GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => x86::dot_pq2_0(row, x),
                GgmlType::PTQ1_0 => x86::dot_ptq1_0(row, x),
                _ => unsupported_dot(ty),
            };
        }
    }
    dot_row_portable(ty, row, x)
}

/// `dot_row` of one stored row with each of `T` activation rows, the row's blocks decoded once
/// for all of them (a few tokens of a batch). Every result is bit-identical to
/// `dot_row(ty, row, xs[t])`.
pub fn dot_rows<const T: usize>(ty: GgmlType, row: &[u8], xs: [&[f32]; T]) -> [f32; T] {
    #[cfg(target_arch = "x86_64")]
    if x86::available() {
        debug_assert!(xs
            .iter()
            .all(|x| ty.row_bytes(x.len() as u64) == Some(row.len() as u64)));
        // SAFETY: `available` checked that the CPU has AVX2 and F16C.
        unsafe {
            match ty {
                GgmlType::Q8_0 => return x86::dot_q8_0_n(row, xs),
                GgmlType::Q4_0 => return x86::dot_q4_0_n(row, xs),
                GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => return x86::dot_pq2_0_n(row, xs),
                GgmlType::PTQ1_0 => return x86::dot_ptq1_0_n(row, xs),
                _ => {}
            }
        }
    }
    xs.map(|x| dot_row(ty, row, x))
}

/// `dot_row` without SIMD intrinsics. It performs the same float operations in the same order
/// as the AVX2 kernels, so both return bit-identical sums.
pub(crate) fn dot_row_portable(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    match ty {
        GgmlType::F32 => dot_elements::<4>(row, x, f32::from_le_bytes),
        GgmlType::F16 => dot_elements::<2>(row, x, |b| fp::f16_to_f32(u16::from_le_bytes(b))),
        GgmlType::BF16 => dot_elements::<2>(row, x, |b| fp::bf16_to_f32(u16::from_le_bytes(b))),
        GgmlType::Q8_0 => dot_blocks(row, x, q8_0::decode),
        GgmlType::Q4_0 => dot_blocks(row, x, q4_0::decode),
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => dot_blocks(row, x, pq2_0::decode),
        GgmlType::PTQ1_0 => dot_blocks(row, x, ptq1_0::decode),
        _ => unsupported_dot(ty),
    }
}

#[cold]
fn unsupported_dot(ty: GgmlType) -> ! {
    panic!("dot_row: no CPU kernel for tensor type {ty} (check GgmlType::can_compute first)")
}

fn dequantize_blocks<const QK: usize, const B: usize>(
    src: &[u8],
    dst: &mut [f32],
    decode: impl Fn(&[u8; B], &mut [f32; QK]) -> f32,
) {
    for (b, y) in src.chunks_exact(B).zip(dst.chunks_exact_mut(QK)) {
        let y: &mut [f32; QK] = y.try_into().expect("chunk of QK");
        let d = decode(b.try_into().expect("chunk of B"), y);
        // Level times scale, the same single rounding as ggml's `(float)q * d`.
        for v in y.iter_mut() {
            *v *= d;
        }
    }
}

fn quantize_blocks<const QK: usize, const B: usize>(
    src: &[f32],
    quantize: fn(&[f32; QK], &mut [u8; B]),
) -> Vec<u8> {
    let mut out = vec![0u8; src.len() / QK * B];
    for (x, y) in src.chunks_exact(QK).zip(out.chunks_exact_mut(B)) {
        quantize(
            x.try_into().expect("chunk of QK"),
            y.try_into().expect("chunk of B"),
        );
    }
    out
}

// ---------------------------------------------------------------------------------------------
// portable dot kernels
//
// The summation order is fixed and shared with `x86.rs`: products are formed in groups of 8
// lanes; group g goes to chain g % 4 (the first four groups initialise the chains); a block's
// sum is (c0 + c1) + (c2 + c3) lane-wise, scaled once and added to the row accumulator; the
// final 8 lanes are reduced as ((a0+a4) + (a2+a6)) + ((a1+a5) + (a3+a7)). No fused
// multiply-adds anywhere, so every path rounds identically.

const LANES: usize = 8;
type Lanes = [f32; LANES];

#[inline(always)]
fn add_lanes(a: Lanes, b: Lanes) -> Lanes {
    std::array::from_fn(|k| a[k] + b[k])
}

/// A block's lane sums (QK a multiple of 32).
#[inline(always)]
fn block_lanes<const QK: usize>(w: &[f32; QK], x: &[f32; QK]) -> Lanes {
    let mut c = [[0.0f32; LANES]; 4];
    for (g, (wg, xg)) in w.chunks_exact(LANES).zip(x.chunks_exact(LANES)).enumerate() {
        for k in 0..LANES {
            let p = wg[k] * xg[k];
            if g < 4 {
                c[g][k] = p;
            } else {
                c[g % 4][k] += p;
            }
        }
    }
    add_lanes(add_lanes(c[0], c[1]), add_lanes(c[2], c[3]))
}

#[inline(always)]
fn hsum(a: Lanes) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Dot product over a row of `B`-byte blocks of `QK` elements; `decode` writes the levels and
/// returns the block scale.
#[inline(always)]
fn dot_blocks<const QK: usize, const B: usize>(
    row: &[u8],
    x: &[f32],
    decode: impl Fn(&[u8; B], &mut [f32; QK]) -> f32,
) -> f32 {
    let mut acc = [0.0f32; LANES];
    let mut w = [0.0f32; QK];
    for (b, xb) in row.chunks_exact(B).zip(x.chunks_exact(QK)) {
        let d = decode(b.try_into().expect("chunk of B"), &mut w);
        let s = block_lanes(&w, xb.try_into().expect("chunk of QK"));
        for k in 0..LANES {
            acc[k] += d * s[k];
        }
    }
    hsum(acc)
}

/// Dot product over a row of plain `ES`-byte elements converted by `conv`: four chains over
/// 32-element chunks, then the leftover elements one by one.
#[inline(always)]
fn dot_elements<const ES: usize>(row: &[u8], x: &[f32], conv: impl Fn([u8; ES]) -> f32) -> f32 {
    let n = (row.len() / ES).min(x.len());
    let body = n / 32 * 32;
    let mut c = [[0.0f32; LANES]; 4];
    for (b, xc) in row[..body * ES]
        .chunks_exact(ES * 32)
        .zip(x[..body].chunks_exact(32))
    {
        let groups = b.chunks_exact(ES * LANES).zip(xc.chunks_exact(LANES));
        for (cg, (bg, xg)) in c.iter_mut().zip(groups) {
            for ((ck, e), &xv) in cg.iter_mut().zip(bg.chunks_exact(ES)).zip(xg) {
                *ck += conv(e.try_into().expect("element")) * xv;
            }
        }
    }
    let mut tail = 0.0f32;
    for (e, &xv) in row[body * ES..n * ES].chunks_exact(ES).zip(&x[body..n]) {
        tail += conv(e.try_into().expect("element")) * xv;
    }
    hsum(add_lanes(add_lanes(c[0], c[1]), add_lanes(c[2], c[3]))) + tail
}
