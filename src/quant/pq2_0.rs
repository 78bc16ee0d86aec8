//! PQ2_0 (and the legacy group-128 Q2_0, which has the same bytes): `{ f16 d; u8 qs[32]; }`.
//! Element j is the 2-bit code at bit 2*(j%4) of byte j/4; value = (code - 1) * d, so the codes
//! 0..3 mean -1, 0, +1, +2.

use super::fp::{f32_to_f16, le_f16};

pub(crate) const QK: usize = 128;
pub(crate) const BYTES: usize = 34;

/// The four levels of every possible code byte, in element order. A table lookup per byte
/// beats shifting out four codes and interleaving them back into element order.
pub(crate) static LEVELS: [[f32; 4]; 256] = {
    let mut t = [[0.0f32; 4]; 256];
    let mut b = 0;
    while b < 256 {
        let mut s = 0;
        while s < 4 {
            t[b][s] = ((b >> (2 * s)) & 3) as f32 - 1.0;
            s += 1;
        }
        b += 1;
    }
    t
};

/// Writes the block's levels (-1, 0, +1, +2) into `w` and returns its scale.
#[inline(always)]
pub(crate) fn decode(b: &[u8; BYTES], w: &mut [f32; QK]) -> f32 {
    for (quad, &q) in w.chunks_exact_mut(4).zip(&b[2..]) {
        quad.copy_from_slice(&LEVELS[q as usize]);
    }
    le_f16(b, 0)
}

/// `quantize_row_pq2_0_ref` for one block: d = max |x|, code = clamp(round(x / d) + 1, 0, 3),
/// computed as `x * (1 / d)` like the C. An all-zero block gets d = 0 and every code 1.
pub(crate) fn quantize_block(x: &[f32; QK], out: &mut [u8; BYTES]) {
    let mut amax = 0.0f32;
    for &v in x {
        if v.abs() > amax {
            amax = v.abs();
        }
    }
    let d = amax;
    let id = if d > 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (byte, quad) in out[2..].iter_mut().zip(x.chunks_exact(4)) {
        let mut packed = 0u8;
        for (s, &v) in quad.iter().enumerate() {
            let q = ((v * id).round() as i32 + 1).clamp(0, 3) as u8;
            packed |= q << (2 * s);
        }
        *byte = packed;
    }
}
