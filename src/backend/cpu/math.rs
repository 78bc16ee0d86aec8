//! Elementwise functions over slices, written so that the compiler vectorizes them: `exp` by
//! range reduction and a polynomial (Cephes' `expf`, within 2 ulp of the correctly rounded
//! value) instead of a libm call per element, and the activations built on it.
//!
//! Each slice function has one body, compiled three times: for AVX-512 F, for AVX2 + FMA and
//! for the baseline target, the best the CPU has chosen at run time. The body uses no fused
//! multiply-adds and each element's operations do not depend on the vector width, so every
//! compilation returns the same bits.

/// `e^x`. Inputs below `ln(f32::MIN_POSITIVE)` give about `f32::MIN_POSITIVE` rather than a
/// subnormal or zero, inputs above 88 give `e^88`; NaN stays NaN.
#[inline(always)]
pub fn exp(x: f32) -> f32 {
    const LO: f32 = -87.33654;
    const HI: f32 = 88.0;
    let x = x.clamp(LO, HI);
    // x = n ln2 + r, |r| <= ln2 / 2, with ln2 split in two for an exact n ln2.
    let n = (x * std::f32::consts::LOG2_E + 0.5).floor();
    let r = x - n * 0.693_359_4 - n * -2.121_944_4e-4;
    let mut p = 1.987_569_1e-4;
    p = p * r + 1.398_199_9e-3;
    p = p * r + 8.333_452e-3;
    p = p * r + 4.166_579_6e-2;
    p = p * r + 1.666_666_5e-1;
    p = p * r + 5.0e-1;
    let e = p * (r * r) + r + 1.0;
    // n is in [-126, 127] after the clamp; a NaN input gives some power of two, and e is NaN.
    e * pow2i(n)
}

/// `2^n` for an integral `n` in [-126, 127], from the exponent bits. Not by `n as i32`: its
/// saturating conversion does not vectorize (LLVM emitted a scalar `cvttss2si` and two compares
/// per lane, about 3 ns an element in SwiGLU). Adding 1.5 * 2^23 puts the integer n in the low
/// mantissa bits, and their low nine bits plus 127 are the exponent field.
#[inline(always)]
fn pow2i(n: f32) -> f32 {
    let biased = (n + 12_582_912.0).to_bits().wrapping_add(127);
    f32::from_bits(biased << 23)
}

/// `x · sigmoid(x)`.
#[inline(always)]
pub fn silu(x: f32) -> f32 {
    x / (1.0 + exp(-x))
}

/// `1 / (1 + e^-x)`.
#[inline(always)]
pub fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + exp(-x))
}

/// `Σ x²` in f64, in eight independent partial sums (so that it vectorizes).
pub fn sum_sq(x: &[f32]) -> f64 {
    let mut acc = [0f64; 8];
    let chunks = x.chunks_exact(8);
    let tail: f64 = chunks
        .remainder()
        .iter()
        .map(|&v| v as f64 * v as f64)
        .sum();
    for c in chunks {
        for (a, &v) in acc.iter_mut().zip(c) {
            *a += v as f64 * v as f64;
        }
    }
    acc.iter().sum::<f64>() + tail
}

/// Defines `$name(args)` that runs `$body` compiled for AVX-512 F or AVX2 + FMA where
/// available. Sixteen lanes instead of eight: SwiGLU of a 3-stream step (24 layers of 3 x
/// 3,584) took 0.33 ms at eight, and the attention softmax's `exp_sub_rows` runs per stream.
macro_rules! dispatch {
    ($(#[$m:meta])* $name:ident($($arg:ident: $ty:ty),*) $body:block) => {
        $(#[$m])*
        pub fn $name($($arg: $ty),*) {
            #[inline(always)]
            fn body($($arg: $ty),*) $body
            #[cfg(target_arch = "x86_64")]
            {
                #[target_feature(enable = "avx512f,avx2,fma")]
                unsafe fn avx512($($arg: $ty),*) {
                    body($($arg),*)
                }
                #[target_feature(enable = "avx2,fma")]
                unsafe fn avx2($($arg: $ty),*) {
                    body($($arg),*)
                }
                if is_x86_feature_detected!("avx512f")
                    && is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                {
                    // SAFETY: the features are present.
                    return unsafe { avx512($($arg),*) };
                }
                if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
                    // SAFETY: the features are present.
                    return unsafe { avx2($($arg),*) };
                }
            }
            body($($arg),*)
        }
    };
}

dispatch!(
    /// `x[i] = silu(x[i])`.
    silu_in_place(x: &mut [f32]) {
        x.iter_mut().for_each(|v| *v = silu(*v));
    }
);

dispatch!(
    /// `out[i] = silu(gate[i]) · up[i]`.
    swiglu(out: &mut [f32], gate: &[f32], up: &[f32]) {
        for ((o, &g), &u) in out.iter_mut().zip(gate).zip(up) {
            *o = silu(g) * u;
        }
    }
);

dispatch!(
    /// `x[i] *= sigmoid(gate[i])`.
    mul_sigmoid(x: &mut [f32], gate: &[f32]) {
        x.iter_mut().zip(gate).for_each(|(v, &g)| *v *= sigmoid(g));
    }
);

dispatch!(
    /// `x[i] = e^(x[i] - max[i % max.len()])`, `x` taken in runs of `max.len()` (the loop
    /// over a run vectorizes, so callers make `max` long: rows of columns tiled).
    exp_sub_rows(x: &mut [f32], max: &[f32]) {
        if max.is_empty() {
            return;
        }
        for run in x.chunks_mut(max.len()) {
            for (v, &m) in run.iter_mut().zip(max) {
                *v = exp(*v - m);
            }
        }
    }
);

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exp_is_within_two_ulp_of_std() {
        let mut worst = 0f64;
        let mut x = -87.3f32;
        while x < 88.0 {
            let (got, want) = (exp(x) as f64, (x as f64).exp());
            worst = worst.max(((got - want) / want).abs());
            x += 0.000_37;
        }
        assert!(
            worst < 2.0 * f32::EPSILON as f64,
            "max relative error {worst:e}"
        );
        assert_eq!(exp(0.0), 1.0);
        assert!((exp(-1000.0) / f32::MIN_POSITIVE - 1.0).abs() < 1e-5);
        assert!(exp(f32::NAN).is_nan());
        assert!(silu(-1000.0).abs() < 1e-30 && silu(1000.0) == 1000.0);
    }

    #[test]
    fn pow2i_is_the_integer_conversions_power() {
        for n in -126..=127i32 {
            let want = f32::from_bits(((n + 127) as u32) << 23);
            assert_eq!(pow2i(n as f32).to_bits(), want.to_bits(), "2^{n}");
            assert_eq!(want, 2f32.powi(n));
        }
    }

    #[test]
    fn slice_forms_match_the_scalar_functions() {
        let g: Vec<f32> = (0..1000).map(|i| (i as f32 - 500.0) * 0.037).collect();
        let u: Vec<f32> = (0..1000).map(|i| (i % 7) as f32 - 3.0).collect();
        let mut s = g.clone();
        silu_in_place(&mut s);
        let mut w = vec![0f32; 1000];
        swiglu(&mut w, &g, &u);
        let mut m = u.clone();
        mul_sigmoid(&mut m, &g);
        let mut e = g.clone();
        // Runs of 200 (a row of 8 columns 25 times), the last one short.
        let mut e_rows = g[..990].to_vec();
        exp_sub_rows(&mut e, &u);
        exp_sub_rows(&mut e_rows, &u[..200]);
        for i in 0..1000 {
            assert_eq!(s[i].to_bits(), silu(g[i]).to_bits());
            assert_eq!(w[i].to_bits(), (silu(g[i]) * u[i]).to_bits());
            assert_eq!(m[i].to_bits(), (u[i] * sigmoid(g[i])).to_bits());
            assert_eq!(e[i].to_bits(), exp(g[i] - u[i]).to_bits());
            if i < 990 {
                assert_eq!(e_rows[i].to_bits(), exp(g[i] - u[i % 200]).to_bits());
            }
        }
    }
}
