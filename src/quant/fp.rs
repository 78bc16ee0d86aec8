//! Scalar conversions for the float storage types (F16, BF16) and the little-endian byte
//! readers the block formats share.

/// IEEE binary16 to binary32, exact for every input.
///
/// Written without branches on the value so that LLVM can vectorise it inside the F16 row
/// kernels; `half`'s own scalar conversion checks the CPU on every call.
#[inline(always)]
pub(crate) fn f16_to_f32(h: u16) -> f32 {
    let h = h as u32;
    let sign = (h & 0x8000) << 16;
    let exp = h & 0x7c00;
    let man = h & 0x03ff;
    let normal = ((h & 0x7fff) << 13) + ((127 - 15) << 23);
    // Inf/NaN keep their payload; NaNs come out quiet, as F16C (which ggml uses on x86) does.
    let special = 0x7f80_0000 | (man << 13) | if man != 0 { 0x0040_0000 } else { 0 };
    // Zero and subnormals are `man * 2^-24`, exact in binary32.
    let tiny = (man as f32 * (1.0 / 16_777_216.0)).to_bits();
    let bits = if exp == 0x7c00 {
        special
    } else if exp == 0 {
        tiny
    } else {
        normal
    };
    f32::from_bits(bits | sign)
}

/// IEEE round-to-nearest-even, the conversion ggml's `GGML_FP32_TO_FP16` performs.
#[inline]
pub(crate) fn f32_to_f16(x: f32) -> u16 {
    half::f16::from_f32(x).to_bits()
}

#[inline(always)]
pub(crate) fn bf16_to_f32(h: u16) -> f32 {
    f32::from_bits((h as u32) << 16)
}

/// ggml's `ggml_compute_fp32_to_bf16`: round to nearest even on the top 16 bits, and NaNs are
/// truncated with the quiet bit forced so that a payload living only in the low bits cannot
/// turn into infinity.
#[inline]
pub(crate) fn f32_to_bf16(x: f32) -> u16 {
    let u = x.to_bits();
    if (u & 0x7fff_ffff) > 0x7f80_0000 {
        return ((u >> 16) | 64) as u16;
    }
    (u.wrapping_add(0x7fff + ((u >> 16) & 1)) >> 16) as u16
}

#[inline(always)]
pub(crate) fn le_u16(b: &[u8], at: usize) -> u16 {
    u16::from_le_bytes([b[at], b[at + 1]])
}

#[inline(always)]
pub(crate) fn le_f16(b: &[u8], at: usize) -> f32 {
    f16_to_f32(le_u16(b, at))
}

/// C's `MAX(a, b)` macro, `a > b ? a : b`, which ggml's quantizers use for the block maximum.
/// Unlike `f32::max` it lets a NaN through when it is the second operand, and the quantized
/// bytes depend on that, so it is kept verbatim.
#[inline(always)]
pub(crate) fn c_max(a: f32, b: f32) -> f32 {
    if a > b {
        a
    } else {
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_decode_matches_half_for_every_non_nan_pattern() {
        for h in 0..=u16::MAX {
            let ours = f16_to_f32(h);
            let theirs = half::f16::from_bits(h).to_f32();
            if theirs.is_nan() {
                assert!(ours.is_nan(), "{h:#06x}");
                assert_eq!(
                    ours.to_bits() & 0x0040_0000,
                    0x0040_0000,
                    "{h:#06x} must be quiet"
                );
            } else {
                assert_eq!(ours.to_bits(), theirs.to_bits(), "{h:#06x}");
            }
        }
    }

    #[test]
    fn bf16_rounding_matches_ggml() {
        // Exactly halfway with an even lower half: stays.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8000)), 0x3f80);
        // Exactly halfway with an odd lower half: rounds up to even.
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f81_8000)), 0x3f82);
        assert_eq!(f32_to_bf16(f32::from_bits(0x3f80_8001)), 0x3f81);
        assert_eq!(f32_to_bf16(1.0), 0x3f80);
        assert_eq!(f32_to_bf16(-2.0), 0xc000);
        assert_eq!(f32_to_bf16(f32::INFINITY), 0x7f80);
        // The largest finite f32 rounds to infinity, as in ggml.
        assert_eq!(f32_to_bf16(f32::MAX), 0x7f80);
        // A signalling NaN whose payload is only in the low half must stay a NaN.
        assert_eq!(f32_to_bf16(f32::from_bits(0x7f80_0001)), 0x7fc0);
        assert_eq!(f32_to_bf16(f32::from_bits(0xffc0_0000)), 0xffc0);
        assert_eq!(f32_to_bf16(f32::from_bits(0x7fa1_2345)), 0x7fe1);
        assert_eq!(bf16_to_f32(0x3f80), 1.0);
        assert_eq!(bf16_to_f32(0xc040), -3.0);
    }

    #[test]
    fn c_max_keeps_c_semantics() {
        assert_eq!(c_max(1.0, 2.0), 2.0);
        assert!(c_max(1.0, f32::NAN).is_nan());
        assert_eq!(c_max(f32::NAN, 2.0), 2.0);
    }
}
