//! PTQ1_0: `{ u8 qs[24]; u8 qh[2]; f16 d; }`, base-3 trits (TQ1_0's packing at group 128),
//! value = (trit - 1) * d.
//!
//! A byte stores up to five trits as a fixed-point fraction `ceil(t * 256 / 243)` of the base-3
//! number `t` whose most significant trit comes first, so trit n is the integer part of
//! `3 * frac(byte * 3^n / 256)`: `((byte * 3^n) as u8 as u16 * 3) >> 8`. The bytes are filled in
//! stages: bytes 0..16 hold elements `n*16 + m` (trit n of byte m), bytes 16..24 hold
//! `80 + n*8 + m`, and the two `qh` bytes hold four trits each, elements `120 + n*2 + h`.

use super::fp::{c_max, f32_to_f16, le_f16};

pub(crate) const QK: usize = 128;
pub(crate) const BYTES: usize = 28;

pub(crate) const POW3: [u8; 5] = [1, 3, 9, 27, 81];

/// Where element `e` of a block lies: the byte that holds it and its trit's place in that byte
/// (the packing in the module doc).
pub(crate) const fn place(e: usize) -> (usize, usize) {
    if e < 80 {
        (e % 16, e / 16)
    } else if e < 120 {
        (16 + (e - 80) % 8, (e - 80) / 8)
    } else {
        (24 + (e - 120) % 2, (e - 120) / 2)
    }
}

/// Trit `n` (0, 1 or 2) of a byte, for any byte value.
#[inline(always)]
fn trit_code(byte: u8, n: usize) -> u8 {
    let q = byte.wrapping_mul(POW3[n]);
    ((q as u16 * 3) >> 8) as u8
}

#[inline(always)]
fn trit(byte: u8, n: usize) -> f32 {
    trit_code(byte, n) as f32
}

/// The block's 128 trits (levels + 1) in element order.
pub(crate) fn codes(b: &[u8; BYTES]) -> [u8; QK] {
    std::array::from_fn(|e| {
        let (byte, n) = place(e);
        trit_code(b[byte], n)
    })
}

/// Writes the block's levels (-1, 0, +1) into `w` and returns its scale.
#[inline(always)]
pub(crate) fn decode(b: &[u8; BYTES], w: &mut [f32; QK]) -> f32 {
    for n in 0..5 {
        for m in 0..16 {
            w[n * 16 + m] = trit(b[m], n) - 1.0;
        }
    }
    for n in 0..5 {
        for m in 0..8 {
            w[80 + n * 8 + m] = trit(b[16 + m], n) - 1.0;
        }
    }
    for n in 0..4 {
        for h in 0..2 {
            w[120 + n * 2 + h] = trit(b[24 + h], n) - 1.0;
        }
    }
    le_f16(b, 26)
}

/// Packs trits (first one most significant) into one byte.
fn pack(trits: impl Iterator<Item = u8>) -> u8 {
    let t = trits.fold(0u16, |acc, t| acc * 3 + t as u16);
    // Ceiling division so that the decoder's truncating multiply recovers every trit.
    (t * 256).div_ceil(243) as u8
}

/// TQ1_0's reference quantizer at group 128: d = max |x|, trit = round(x / d) + 1 (as
/// `x * (1 / d)`, like the C).
pub(crate) fn quantize_block(x: &[f32; QK], out: &mut [u8; BYTES]) {
    let amax = x.iter().fold(0.0f32, |m, v| c_max(m, v.abs()));
    let d = amax;
    let id = if d != 0.0 { 1.0 / d } else { 0.0 };
    // The clamp only matters for NaN/inf input, where C's lroundf is unspecified anyway.
    let t = |v: f32| ((v * id).round() as i32 + 1).clamp(0, 2) as u8;
    for m in 0..16 {
        out[m] = pack((0..5).map(|n| t(x[n * 16 + m])));
    }
    for m in 0..8 {
        out[16 + m] = pack((0..5).map(|n| t(x[80 + n * 8 + m])));
    }
    for h in 0..2 {
        // Four trits, shifted up one place so the first still lands in the top trit.
        out[24 + h] = pack(
            (0..4)
                .map(|n| t(x[120 + n * 2 + h]))
                .chain(std::iter::once(0)),
        );
    }
    out[26..28].copy_from_slice(&f32_to_f16(d).to_le_bytes());
}
