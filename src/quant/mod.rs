//! Block formats: reference quantizers, dequantizers and the f32-activation dot products the
//! CPU backend's matvec runs on, plus the PrismML Hadamard fold (`hadamard`).
//!
//! Quantizers are byte-identical to ggml's `*_ref` functions (and to PrismML's fork for PQ2_0 and
//! PTQ1_0), so files we write load in llama.cpp and files we read decode to the same numbers.

mod fp;
pub mod hadamard;
mod pq2_0;
mod ptq1_0;
mod q4_0;
mod q8_0;

#[cfg(test)]
mod tests;

use crate::tensor::GgmlType;

#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum QuantError {
    #[error("no quantization kernels for tensor type {0} (tern computes F32, F16, BF16, Q8_0, Q4_0, PQ2_0, PTQ1_0)")]
    Unsupported(GgmlType),
    #[error("{ty}: a row of {elements} elements is not a whole number of {block}-element blocks")]
    PartialBlock { ty: GgmlType, elements: usize, block: usize },
    #[error("{ty}: a row of {elements} elements takes {expected} bytes, got {bytes}")]
    BadLength { ty: GgmlType, elements: usize, bytes: usize, expected: usize },
}

/// Checks that `ty` has kernels here and that `elements` fills whole blocks; returns the row's
/// byte length.
fn checked_row_bytes(ty: GgmlType, elements: usize) -> Result<usize, QuantError> {
    if !ty.can_compute() {
        return Err(QuantError::Unsupported(ty));
    }
    ty.row_bytes(elements as u64)
        .map(|b| b as usize)
        .ok_or(QuantError::PartialBlock { ty, elements, block: ty.block_size() })
}

/// Dequantize one row: `src` is exactly `ty.row_bytes(dst.len())` bytes.
pub fn dequantize_row(ty: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), QuantError> {
    let expected = checked_row_bytes(ty, dst.len())?;
    if src.len() != expected {
        return Err(QuantError::BadLength { ty, elements: dst.len(), bytes: src.len(), expected });
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
        GgmlType::F16 => src.iter().flat_map(|&v| fp::f32_to_f16(v).to_le_bytes()).collect(),
        GgmlType::BF16 => src.iter().flat_map(|&v| fp::f32_to_bf16(v).to_le_bytes()).collect(),
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
/// `ty.can_compute()`; any other type panics.
pub fn dot_row(ty: GgmlType, row: &[u8], x: &[f32]) -> f32 {
    debug_assert_eq!(
        ty.row_bytes(x.len() as u64),
        Some(row.len() as u64),
        "dot_row: {ty} row of {} bytes against {} activations",
        row.len(),
        x.len()
    );
    match ty {
        GgmlType::F32 => dot_f32(row, x),
        GgmlType::F16 => dot_f16(row, x),
        GgmlType::BF16 => dot_bf16(row, x),
        GgmlType::Q8_0 => dot_q8_0(row, x),
        GgmlType::Q4_0 => dot_q4_0(row, x),
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => dot_pq2_0(row, x),
        GgmlType::PTQ1_0 => dot_ptq1_0(row, x),
        _ => panic!("dot_row: no CPU kernel for tensor type {ty} (check GgmlType::can_compute first)"),
    }
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

fn quantize_blocks<const QK: usize, const B: usize>(src: &[f32], quantize: fn(&[f32; QK], &mut [u8; B])) -> Vec<u8> {
    let mut out = vec![0u8; src.len() / QK * B];
    for (x, y) in src.chunks_exact(QK).zip(out.chunks_exact_mut(B)) {
        quantize(x.try_into().expect("chunk of QK"), y.try_into().expect("chunk of B"));
    }
    out
}

// ---------------------------------------------------------------------------------------------
// dot kernels
//
// Every kernel decodes a block into a stack array of f32 levels and multiplies it against the
// activations into 2 x 8 independent lane accumulators. Lane-wise sums need no reassociation,
// so LLVM vectorises them without fast-math, and the result does not depend on the vector
// width: the AVX2 build and the baseline build below return bit-identical sums.

const LANES: usize = 8;
type Lanes = [f32; LANES];

/// Lane-wise partial products of `w` and `x` (N a multiple of 16).
#[inline(always)]
fn block_lanes<const N: usize>(w: &[f32; N], x: &[f32; N]) -> Lanes {
    let mut s0 = [0.0f32; LANES];
    let mut s1 = [0.0f32; LANES];
    for (w, x) in w.chunks_exact(2 * LANES).zip(x.chunks_exact(2 * LANES)) {
        for k in 0..LANES {
            s0[k] += w[k] * x[k];
            s1[k] += w[LANES + k] * x[LANES + k];
        }
    }
    for k in 0..LANES {
        s0[k] += s1[k];
    }
    s0
}

#[inline(always)]
fn hsum(a: Lanes) -> f32 {
    ((a[0] + a[4]) + (a[2] + a[6])) + ((a[1] + a[5]) + (a[3] + a[7]))
}

/// Dot product over a row of `B`-byte blocks of `QK` elements; `decode` writes the levels and
/// returns the block scale, which is applied once per block.
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

/// Dot product over a row of plain `ES`-byte elements converted by `conv`.
#[inline(always)]
fn dot_elements<const ES: usize>(row: &[u8], x: &[f32], conv: impl Fn([u8; ES]) -> f32) -> f32 {
    const CHUNK: usize = 32;
    let mut acc = [0.0f32; LANES];
    let mut w = [0.0f32; CHUNK];
    let body = row.len() / (ES * CHUNK) * CHUNK;
    for (b, xc) in row[..body * ES].chunks_exact(ES * CHUNK).zip(x[..body].chunks_exact(CHUNK)) {
        for (v, e) in w.iter_mut().zip(b.chunks_exact(ES)) {
            *v = conv(e.try_into().expect("element"));
        }
        let s = block_lanes(&w, xc.try_into().expect("chunk"));
        for k in 0..LANES {
            acc[k] += s[k];
        }
    }
    let mut tail = 0.0f32;
    for (e, &xv) in row[body * ES..].chunks_exact(ES).zip(&x[body..]) {
        tail += conv(e.try_into().expect("element")) * xv;
    }
    hsum(acc) + tail
}

/// Defines `fn $name(row: &[u8], x: &[f32]) -> f32` compiled twice, for the baseline target and
/// with AVX2, picking at run time. The crate builds for baseline x86-64 (SSE2), which has no
/// sign-extending byte loads or 8-wide floats; AVX2 roughly doubles these kernels.
macro_rules! dot_kernel {
    ($name:ident, |$row:ident, $x:ident| $body:expr) => {
        fn $name($row: &[u8], $x: &[f32]) -> f32 {
            #[inline(always)]
            fn portable($row: &[u8], $x: &[f32]) -> f32 {
                $body
            }
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx2")]
                unsafe fn avx2(row: &[u8], x: &[f32]) -> f32 {
                    portable(row, x)
                }
                if std::arch::is_x86_feature_detected!("avx2") {
                    // SAFETY: the CPU supports AVX2, checked just above.
                    return unsafe { avx2($row, $x) };
                }
            }
            portable($row, $x)
        }
    };
}

dot_kernel!(dot_f32, |row, x| dot_elements::<4>(row, x, f32::from_le_bytes));
dot_kernel!(dot_f16, |row, x| dot_elements::<2>(row, x, |b| fp::f16_to_f32(u16::from_le_bytes(b))));
dot_kernel!(dot_bf16, |row, x| dot_elements::<2>(row, x, |b| fp::bf16_to_f32(u16::from_le_bytes(b))));
dot_kernel!(dot_q8_0, |row, x| dot_blocks(row, x, q8_0::decode));
dot_kernel!(dot_q4_0, |row, x| dot_blocks(row, x, q4_0::decode));
dot_kernel!(dot_pq2_0, |row, x| dot_blocks(row, x, pq2_0::decode));
dot_kernel!(dot_ptq1_0, |row, x| dot_blocks(row, x, ptq1_0::decode));
