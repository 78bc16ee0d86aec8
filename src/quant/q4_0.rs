//! Q4_0: `{ f16 d; u8 qs[16]; }`. Byte j holds element j in its low nibble and element j + 16
//! in its high nibble; value = (nibble - 8) * d.

use super::fp::{f32_to_f16, le_f16};

pub(crate) const QK: usize = 32;
pub(crate) const BYTES: usize = 18;

/// Writes the block's integer levels into `w` and returns its scale.
#[inline(always)]
pub(crate) fn decode(b: &[u8; BYTES], w: &mut [f32; QK]) -> f32 {
    let (lo, hi) = w.split_at_mut(QK / 2);
    for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..]) {
        *l = ((q & 0x0f) as i32 - 8) as f32;
        *h = ((q >> 4) as i32 - 8) as f32;
    }
    le_f16(b, 0)
}

/// `quantize_row_q4_0_ref` for one block: the scale is the signed value of largest magnitude
/// over -8, so that value lands exactly on level -8 and the other side clamps at +7.
pub(crate) fn quantize_block(x: &[f32; QK], out: &mut [u8; BYTES]) {
    let mut amax = 0.0f32;
    let mut max = 0.0f32;
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    out[..2].copy_from_slice(&f32_to_f16(d).to_le_bytes());
    for j in 0..QK / 2 {
        // C truncates `(int8_t)(x + 8.5f)` toward zero; `as i8` does the same in range.
        let q0 = 15i8.min((x[j] * id + 8.5) as i8) as u8;
        let q1 = 15i8.min((x[j + QK / 2] * id + 8.5) as i8) as u8;
        out[2 + j] = q0 | (q1 << 4);
    }
}
