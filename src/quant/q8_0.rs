//! Q8_0: `{ f16 d; i8 qs[32]; }`, value = qs[j] * d.

use super::fp::{c_max, f32_to_f16, le_f16};

pub(crate) const QK: usize = 32;
pub(crate) const BYTES: usize = 34;

/// Writes the block's integer levels into `w` and returns its scale.
#[inline(always)]
pub(crate) fn decode(b: &[u8; BYTES], w: &mut [f32; QK]) -> f32 {
    for (v, &q) in w.iter_mut().zip(&b[2..]) {
        *v = q as i8 as f32;
    }
    le_f16(b, 0)
}

/// `quantize_row_q8_0_ref` for one block.
pub(crate) fn quantize_block(x: &[f32; QK], out: &mut [u8; BYTES]) {
    let amax = x.iter().fold(0.0f32, |m, v| c_max(m, v.abs()));
    let d = amax / 127.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for (q, &v) in out[2..].iter_mut().zip(x) {
        // `as i8` saturates where C's float-to-int8 conversion would be undefined; in range
        // (|v * id| <= 127) the two agree.
        *q = (v * id).round() as i8 as u8;
    }
}
