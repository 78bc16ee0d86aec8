use super::hadamard::{
    fwht_blockwise, fwht_normalized, is_foldable_name, GdnPermutation, HadamardConfig,
    HadamardError, SignMode,
};
use super::*;
use crate::gguf::{Gguf, GgufWriter, Value};

/// splitmix64: a tiny deterministic generator so tests need no crate.
struct Rng(u64);

impl Rng {
    fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9e37_79b9_7f4a_7c15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
        z ^ (z >> 31)
    }

    /// Uniform in [-1, 1).
    fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }

    fn vec(&mut self, n: usize) -> Vec<f32> {
        (0..n).map(|_| self.f32()).collect()
    }

    fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

fn hex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

fn dequant(ty: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![0.0; n];
    dequantize_row(ty, bytes, &mut out).unwrap();
    out
}

const COMPUTABLE: [GgmlType; 8] = [
    GgmlType::F32,
    GgmlType::F16,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::PQ2_0,
    GgmlType::Q2_0Legacy,
    GgmlType::PTQ1_0,
];

// ---------------------------------------------------------------- hand-built blocks

#[test]
fn pq2_0_decodes_all_four_codes_with_scale_first() {
    // d = 2.0 (f16 0x4000) first, then bytes 0b11_10_01_00: codes 0,1,2,3 in element order.
    let mut b = vec![0x00, 0x40];
    b.extend(std::iter::repeat_n(0xe4u8, 32));
    let want: Vec<f32> = (0..32).flat_map(|_| [-2.0, 0.0, 2.0, 4.0]).collect();
    assert_eq!(dequant(GgmlType::PQ2_0, &b, 128), want);
    assert_eq!(dequant(GgmlType::Q2_0Legacy, &b, 128), want);

    // One code per element position: element j = 4*byte + s takes code (j / 3) % 4.
    let mut b = vec![0x00, 0x38]; // d = 0.5
    let codes: Vec<u8> = (0..128).map(|j| ((j / 3) % 4) as u8).collect();
    for quad in codes.chunks(4) {
        b.push(
            quad.iter()
                .enumerate()
                .fold(0u8, |acc, (s, &c)| acc | (c << (2 * s))),
        );
    }
    let got = dequant(GgmlType::PQ2_0, &b, 128);
    for (j, (&g, &c)) in got.iter().zip(&codes).enumerate() {
        assert_eq!(g, (c as f32 - 1.0) * 0.5, "element {j}");
    }

    // A negative scale flips every level; code 1 decodes to -0.0, as C's (0 * d) does.
    let mut b = vec![0x00, 0xc0];
    b.extend(std::iter::repeat_n(0xe4u8, 32));
    let got = dequant(GgmlType::PQ2_0, &b, 128);
    assert_eq!(&got[..4], &[2.0, 0.0, -2.0, -4.0]);
    assert!(got[1].is_sign_negative());
}

/// Packs trits per the spec's PTQ1_0 byte order, independently of the quantizer.
fn pack_ptq1_0(trits: &[u8; 128], d_bits: u16) -> Vec<u8> {
    let byte = |ts: &[u8]| -> u8 {
        let mut t = 0u32;
        for &x in ts {
            t = t * 3 + x as u32;
        }
        t *= 3u32.pow(5 - ts.len() as u32);
        (t * 256).div_ceil(243) as u8
    };
    let mut out = Vec::new();
    for m in 0..16 {
        out.push(byte(&(0..5).map(|n| trits[n * 16 + m]).collect::<Vec<_>>()));
    }
    for m in 0..8 {
        out.push(byte(
            &(0..5).map(|n| trits[80 + n * 8 + m]).collect::<Vec<_>>(),
        ));
    }
    for h in 0..2 {
        out.push(byte(
            &(0..4).map(|n| trits[120 + n * 2 + h]).collect::<Vec<_>>(),
        ));
    }
    out.extend_from_slice(&d_bits.to_le_bytes());
    out
}

#[test]
fn ptq1_0_trit_order_follows_the_spec() {
    let mut rng = Rng(7);
    for _ in 0..20 {
        let mut trits = [0u8; 128];
        for t in trits.iter_mut() {
            *t = rng.below(3) as u8;
        }
        let b = pack_ptq1_0(&trits, 0x3c00); // d = 1.0, stored last
        let got = dequant(GgmlType::PTQ1_0, &b, 128);
        for (j, (&g, &t)) in got.iter().zip(&trits).enumerate() {
            assert_eq!(g, t as f32 - 1.0, "element {j}");
        }
        // The quantizer writes the very same bytes for the exact ternary row.
        let x: Vec<f32> = trits.iter().map(|&t| t as f32 - 1.0).collect();
        let q = quantize_row(GgmlType::PTQ1_0, &x).unwrap();
        if trits.contains(&0) || trits.contains(&2) {
            assert_eq!(q, b);
        }
    }
    // Single trits at the stage boundaries, d = 0.5.
    for (j, want_byte) in [
        (0usize, 0usize),
        (79, 15),
        (80, 16),
        (119, 23),
        (120, 24),
        (127, 25),
    ] {
        let mut trits = [1u8; 128];
        trits[j] = 2;
        let b = pack_ptq1_0(&trits, 0x3800);
        let got = dequant(GgmlType::PTQ1_0, &b, 128);
        for (i, &g) in got.iter().enumerate() {
            assert_eq!(
                g,
                if i == j { 0.5 } else { 0.0 },
                "trit at {j}, element {i}"
            );
        }
        let all_zero = pack_ptq1_0(&[1u8; 128], 0x3800);
        let changed: Vec<usize> = (0..28).filter(|&i| b[i] != all_zero[i]).collect();
        assert_eq!(
            changed,
            vec![want_byte],
            "element {j} lives in byte {want_byte}"
        );
    }
}

/// Known-answer blocks produced by PrismML's own C (reported in a third-party test suite).
#[test]
fn ptq1_0_c_known_answer() {
    let b = hex("f2f2f2f2f2f2f2f2f2f2f2f2f2f2f2f2f2f2f2f2f2f2f2f20101003c");
    let got = dequant(GgmlType::PTQ1_0, &b, 128);
    let mut c = [0usize; 3];
    for v in &got {
        c[(*v + 1.0) as usize] += 1;
    }
    assert_eq!(c, [8, 72, 48]);
}

#[test]
fn q8_0_and_q4_0_decode_hand_built_blocks() {
    // Q8_0: d = 0.25 first, then signed bytes including both extremes.
    let mut b = vec![0x00, 0x34];
    let qs: Vec<i8> = vec![-128, -1, 0, 1, 127, 5, -5, 64]
        .into_iter()
        .cycle()
        .take(32)
        .collect();
    b.extend(qs.iter().map(|&q| q as u8));
    let got = dequant(GgmlType::Q8_0, &b, 32);
    for (g, q) in got.iter().zip(&qs) {
        assert_eq!(*g, *q as f32 * 0.25);
    }

    // Q4_0: byte j = low nibble (element j) | high nibble (element j + 16), value (n - 8) * d.
    let mut b = vec![0x00, 0xc0]; // d = -2
    for j in 0..16u8 {
        b.push(j | ((15 - j) << 4));
    }
    let got = dequant(GgmlType::Q4_0, &b, 32);
    for j in 0..16 {
        assert_eq!(got[j], (j as f32 - 8.0) * -2.0, "low nibble {j}");
        assert_eq!(
            got[j + 16],
            ((15 - j) as f32 - 8.0) * -2.0,
            "high nibble {j}"
        );
    }
}

#[test]
fn float_types_decode_hand_built_bytes() {
    let f16: Vec<u8> = [0x3c00u16, 0xc000, 0x7bff, 0x0001, 0x8000, 0x7c00]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let got = dequant(GgmlType::F16, &f16, 6);
    assert_eq!(&got[..4], &[1.0, -2.0, 65504.0, 5.960_464_5e-8]);
    assert!(got[4] == 0.0 && got[4].is_sign_negative());
    assert_eq!(got[5], f32::INFINITY);

    let bf16: Vec<u8> = [0x3f80u16, 0xc040, 0x4049]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    assert_eq!(dequant(GgmlType::BF16, &bf16, 3), vec![1.0, -3.0, 3.140625]);

    let x = [1.5f32, -0.0, 3.0e-39];
    let b = quantize_row(GgmlType::F32, &x).unwrap();
    assert_eq!(&b[..4], &1.5f32.to_le_bytes());
    assert_eq!(dequant(GgmlType::F32, &b, 3), x.to_vec());

    assert_eq!(
        quantize_row(GgmlType::F16, &[1.0, 65520.0]).unwrap(),
        vec![0x00, 0x3c, 0x00, 0x7c]
    );
    assert_eq!(
        quantize_row(GgmlType::BF16, &[f32::from_bits(0x3f81_8000)]).unwrap(),
        vec![0x82, 0x3f]
    );
}

// ---------------------------------------------------------------- quantizers

#[test]
fn pq2_0_quantizer_rules() {
    // d = amax, codes round(x/d)+1; x = +-d, +-d/2 (rounds away from zero), 0.
    let mut x = [0.0f32; 128];
    x[0] = -3.0;
    x[1] = 3.0;
    x[2] = 1.5;
    x[3] = -1.5;
    x[4] = 1.49;
    let b = quantize_row(GgmlType::PQ2_0, &x).unwrap();
    assert_eq!(&b[..2], &half::f16::from_f32(3.0).to_bits().to_le_bytes());
    assert_eq!(b[2], 0b00_10_10_00); // codes 0, 2, 2, 0
    assert_eq!(b[3] & 3, 1); // 1.49 / 3 rounds to 0
    assert!(b[4..].iter().all(|&q| q == 0x55));

    // An all-zero block: d = 0 and every code 1.
    let b = quantize_row(GgmlType::PQ2_0, &[0.0; 256]).unwrap();
    assert_eq!(b.len(), 68);
    for blk in b.chunks(34) {
        assert_eq!(&blk[..2], &[0, 0]);
        assert!(blk[2..].iter().all(|&q| q == 0x55));
    }
}

/// Blocks reported (by a third-party test suite) as emitted by PrismML's C
/// `quantize_row_pq2_0_ref` / `quantize_row_ptq1_0_ref` for these inputs. Every code byte
/// matches. The reported f16 scales are the f32 amax rounded toward zero (0x3def for amax
/// 1.4839059, 0x3a65 for 0.7997784), whereas ggml's `GGML_FP32_TO_FP16` (F16C, NEON or its
/// software path alike) rounds to nearest even, giving 0x3df0 and 0x3a66; we follow ggml.
#[test]
fn prism_quantizers_match_c_known_answers() {
    let x: Vec<f32> = (0..128)
        .map(|j| (0.37f32 * j as f32).sin() * (1.0 + 0.5 * (0.11f32 * j as f32).cos()))
        .collect();
    let want = hex("ef3da56a15405555555555a5550150a96a0140a55a55555555550155aa560050a95a");
    let got = quantize_row(GgmlType::PQ2_0, &x).unwrap();
    assert_eq!(&got[2..], &want[2..], "PQ2_0 codes");
    assert_eq!(&got[..2], &0x3df0u16.to_le_bytes());
    assert_eq!(&want[..2], &0x3defu16.to_le_bytes());

    let x: Vec<f32> = (0..128).map(|j| (0.29f32 * j as f32).sin() * 0.8).collect();
    let want = hex("6767bcb4d0cdcdcde6e69a9999444c30294545483f9493965600653a");
    let got = quantize_row(GgmlType::PTQ1_0, &x).unwrap();
    assert_eq!(&got[..26], &want[..26], "PTQ1_0 trits");
    assert_eq!(&got[26..], &0x3a66u16.to_le_bytes());
    assert_eq!(&want[26..], &0x3a65u16.to_le_bytes());
}

#[test]
fn q8_0_and_q4_0_quantizers_match_ggml_rules() {
    // Q8_0: d = amax/127, q = round(x / d) with halves away from zero.
    let mut x = [0.0f32; 32];
    x[0] = 127.0;
    x[1] = -63.5;
    x[2] = 0.5;
    x[3] = -127.0;
    let b = quantize_row(GgmlType::Q8_0, &x).unwrap();
    assert_eq!(&b[..2], &[0x00, 0x3c]); // d = 1
    assert_eq!(&b[2..6], &[127, (-64i8) as u8, 1, (-127i8) as u8]);

    // Q4_0: d = max / -8 where max is the signed value of largest magnitude.
    let mut x = [0.0f32; 32];
    x[0] = -16.0; // d = 2
    x[16] = 16.0; // +8 clamps to 15
    x[1] = 3.0; // 1.5 + 8.5 = 10 -> truncated
    x[17] = -0.9; // -0.45 + 8.5 = 8.05 -> 8
    let b = quantize_row(GgmlType::Q4_0, &x).unwrap();
    assert_eq!(&b[..2], &half::f16::from_f32(2.0).to_bits().to_le_bytes());
    assert_eq!(b[2], 15 << 4);
    assert_eq!(b[3], 10 | (8 << 4));
    // A zero block: d = 0, every nibble 8.
    let b = quantize_row(GgmlType::Q4_0, &[0.0; 32]).unwrap();
    assert!(b[2..].iter().all(|&q| q == 0x88));
}

#[test]
fn round_trip_error_bounds() {
    let mut rng = Rng(42);
    for ty in COMPUTABLE {
        let n = ty.block_size().max(32) * 12;
        let x: Vec<f32> = rng.vec(n).iter().map(|v| v * 3.0).collect();
        let b = quantize_row(ty, &x).unwrap();
        assert_eq!(b.len() as u64, ty.row_bytes(n as u64).unwrap());
        let y = dequant(ty, &b, n);
        let qk = ty.block_size().max(1);
        for (blk, (xs, ys)) in x.chunks(qk).zip(y.chunks(qk)).enumerate() {
            let amax = xs.iter().fold(0.0f32, |m, v| m.max(v.abs()));
            for (i, (&a, &r)) in xs.iter().zip(ys).enumerate() {
                let bound = match ty {
                    GgmlType::F32 => 0.0,
                    GgmlType::F16 => a.abs() * 2f32.powi(-11),
                    GgmlType::BF16 => a.abs() * 2f32.powi(-8),
                    // half a step, plus the f16 rounding of d times the largest level
                    GgmlType::Q8_0 => amax / 127.0 * (0.5 + 127.0 * 2f32.powi(-11)) * 1.001,
                    // a step at the clamped +8 end, else half a step
                    GgmlType::Q4_0 => amax / 8.0 * (1.0 + 8.0 * 2f32.powi(-11)) * 1.001,
                    // ternary: half of d = amax, plus d's f16 rounding
                    _ => amax * (0.5 + 2f32.powi(-11)) * 1.001,
                };
                assert!(
                    (a - r).abs() <= bound,
                    "{ty} block {blk} element {i}: {a} -> {r} (bound {bound})"
                );
            }
        }
    }
}

#[test]
fn exact_ternary_rows_round_trip_losslessly() {
    let mut rng = Rng(3);
    for ty in [GgmlType::PQ2_0, GgmlType::PTQ1_0] {
        let d = 0.375f32; // exact in f16
        let x: Vec<f32> = (0..384).map(|_| (rng.below(3) as f32 - 1.0) * d).collect();
        let y = dequant(ty, &quantize_row(ty, &x).unwrap(), 384);
        assert_eq!(x, y, "{ty}");
    }
}

#[test]
fn length_errors() {
    let mut out = [0.0f32; 32];
    assert_eq!(
        dequantize_row(GgmlType::Q8_0, &[0; 33], &mut out),
        Err(QuantError::BadLength {
            ty: GgmlType::Q8_0,
            elements: 32,
            bytes: 33,
            expected: 34
        })
    );
    let mut out = [0.0f32; 100];
    assert_eq!(
        dequantize_row(GgmlType::PQ2_0, &[0; 34], &mut out),
        Err(QuantError::PartialBlock {
            ty: GgmlType::PQ2_0,
            elements: 100,
            block: 128
        })
    );
    assert_eq!(
        quantize_row(GgmlType::Q4K, &[0.0; 256]),
        Err(QuantError::Unsupported(GgmlType::Q4K))
    );
    assert_eq!(
        quantize_row(GgmlType::Q4_0, &[0.0; 31])
            .unwrap_err()
            .to_string(),
        "Q4_0: a row of 31 elements is not a whole number of 32-element blocks"
    );
    assert!(dequantize_row(GgmlType::F16, &[], &mut []).is_ok());
}

#[test]
#[should_panic(expected = "no CPU kernel for tensor type Q4_K")]
fn dot_row_refuses_unsupported_types() {
    dot_row(GgmlType::Q4K, &[0; 144], &[0.0; 256]);
}

// ---------------------------------------------------------------- dot_row

/// Random stored bytes for `ty`: quantized random rows, plus raw random codes for the
/// ternary formats so that PQ2_0's code 3 is exercised.
fn random_row(rng: &mut Rng, ty: GgmlType, n: usize) -> Vec<u8> {
    let x: Vec<f32> = rng.vec(n);
    let mut b = quantize_row(ty, &x).unwrap();
    if matches!(ty, GgmlType::PQ2_0 | GgmlType::Q2_0Legacy) {
        for blk in b.chunks_mut(34) {
            for q in &mut blk[2..] {
                *q = rng.next_u64() as u8;
            }
        }
    }
    b
}

#[test]
fn dot_row_matches_dequantize_then_dot() {
    let mut rng = Rng(11);
    for ty in COMPUTABLE {
        let qk = ty.block_size();
        let mut lens: Vec<usize> = [1, 3, 7, 13].iter().map(|b| b * qk.max(32)).collect();
        if qk == 1 {
            lens.extend([1, 3, 31, 33, 65, 1000]);
        }
        for n in lens {
            for _ in 0..4 {
                let row = random_row(&mut rng, ty, n);
                let x = rng.vec(n);
                let w = dequant(ty, &row, n);
                let exact: f64 = w.iter().zip(&x).map(|(&a, &b)| a as f64 * b as f64).sum();
                let mag: f64 = w
                    .iter()
                    .zip(&x)
                    .map(|(&a, &b)| (a as f64 * b as f64).abs())
                    .sum();
                let got = dot_row(ty, &row, &x) as f64;
                assert!(
                    (got - exact).abs() <= 1e-5 * mag + 1e-30,
                    "{ty} n={n}: {got} vs {exact} (mag {mag})"
                );
            }
        }
    }
}

#[test]
fn simd_and_portable_dot_agree_bit_for_bit() {
    let mut rng = Rng(12);
    for ty in COMPUTABLE {
        let qk = ty.block_size().max(32);
        for n in [qk, 3 * qk, 7 * qk, 16 * qk] {
            for extra in [0, if ty.block_size() == 1 { 13 } else { 0 }] {
                let n = n + extra;
                let row = random_row(&mut rng, ty, n);
                let x = rng.vec(n);
                let a = dot_row(ty, &row, &x);
                let b = dot_row_portable(ty, &row, &x);
                assert_eq!(a.to_bits(), b.to_bits(), "{ty} n={n}: {a} vs {b}");
            }
        }
    }
}

#[test]
fn dot_row_is_exact_on_small_integers() {
    // Levels and activations small enough that every partial sum is exact in f32.
    let mut rng = Rng(5);
    let n = 7 * 128;
    let x: Vec<f32> = (0..n).map(|_| rng.below(9) as f32 - 4.0).collect();
    for ty in [
        GgmlType::PQ2_0,
        GgmlType::PTQ1_0,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
    ] {
        let row = random_row(&mut rng, ty, n);
        // force every scale to 1.0 so the sum is an integer
        let (qk, bs) = ty.block();
        let mut row = row;
        for blk in row.chunks_mut(bs) {
            let at = if ty == GgmlType::PTQ1_0 { bs - 2 } else { 0 };
            blk[at..at + 2].copy_from_slice(&[0x00, 0x3c]);
        }
        let w = dequant(ty, &row, n);
        let want: f32 = w.iter().zip(&x).map(|(a, b)| a * b).sum();
        assert_eq!(dot_row(ty, &row, &x), want, "{ty} (block {qk})");
    }
}

// ---------------------------------------------------------------- Hadamard

fn sylvester(n: usize) -> Vec<Vec<f32>> {
    let s = 1.0 / (n as f32).sqrt();
    (0..n)
        .map(|r| {
            (0..n)
                .map(|c| if (r & c).count_ones() % 2 == 1 { -s } else { s })
                .collect()
        })
        .collect()
}

#[test]
fn fwht_equals_sylvester_matrix_at_1024() {
    let n = 1024;
    let h = sylvester(n);
    assert_eq!(h[0][0], 1.0 / 32.0);
    let mut rng = Rng(9);
    let x = rng.vec(n);
    let mut y = x.clone();
    fwht_normalized(&mut y);
    for r in 0..n {
        let want: f64 = (0..n).map(|c| h[r][c] as f64 * x[c] as f64).sum();
        assert!(
            (y[r] as f64 - want).abs() < 1e-5,
            "row {r}: {} vs {want}",
            y[r]
        );
    }
    // H·H = I, checked on a few columns of H itself and by the transform being an involution.
    for c in [0usize, 1, 77, 512, 1023] {
        let mut col: Vec<f32> = (0..n).map(|r| h[r][c]).collect();
        fwht_normalized(&mut col);
        for (r, v) in col.iter().enumerate() {
            let want = if r == c { 1.0 } else { 0.0 };
            assert!((v - want).abs() < 1e-6, "(H·H)[{r}][{c}] = {v}");
        }
    }
    let mut z = y.clone();
    fwht_normalized(&mut z);
    for (a, b) in z.iter().zip(&x) {
        assert!((a - b).abs() < 1e-6);
    }
}

#[test]
fn fwht_small_sizes() {
    let mut x = [3.0f32];
    fwht_normalized(&mut x);
    assert_eq!(x, [3.0]);
    let mut x = [1.0f32, 2.0, 3.0, 4.0];
    fwht_normalized(&mut x);
    assert_eq!(x, [5.0, -1.0, -2.0, 0.0]);
    let mut x = [1.0f32, 2.0, 3.0, 4.0, 1.0, 2.0, 3.0, 4.0];
    fwht_blockwise(&mut x, 4);
    assert_eq!(x, [5.0, -1.0, -2.0, 0.0, 5.0, -1.0, -2.0, 0.0]);
}

#[test]
#[should_panic(expected = "not a power of two")]
fn fwht_rejects_non_power_of_two() {
    fwht_normalized(&mut [0.0; 12]);
}

// A fixture file: a couple of layers of a tiny qwen35 with block size 64 and widths 128 / 192.

const BLOCK: usize = 64;
const N_EMBD: u64 = 128;
const N_FF: u64 = 192;

fn signs(rng: &mut Rng, n: usize) -> Vec<i32> {
    (0..n)
        .map(|_| if rng.below(2) == 0 { 1 } else { -1 })
        .collect()
}

fn fixture(edit: impl FnOnce(&mut GgufWriter)) -> Gguf {
    let mut rng = Rng(1234);
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("qwen35".into()));
    w.set("prism.hadamard.version", Value::U32(1));
    w.set("prism.hadamard.block_size", Value::U32(BLOCK as u32));
    w.set(
        "prism.hadamard.transform",
        Value::String("normalized-sylvester-walsh-hadamard".into()),
    );
    w.set(
        "prism.hadamard.axis",
        Value::String("input-last-dimension".into()),
    );
    w.set("prism.hadamard.sign_mode", Value::String("explicit".into()));
    w.set(
        "prism.hadamard.sign_widths",
        Value::i32_array(&[N_EMBD as i32, N_FF as i32]),
    );
    let mut sv = signs(&mut rng, N_EMBD as usize);
    sv.extend(signs(&mut rng, N_FF as usize));
    w.set("prism.hadamard.sign_values", Value::i32_array(&sv));
    w.set(
        "prism.hadamard.weight_names",
        Value::str_array(&[
            "blk.0.attn_qkv.weight",
            "blk.0.ffn_down.weight",
            "blk.1.ssm_out.weight",
            "output.weight",
        ]),
    );
    w.set(
        "prism.hadamard.inverse_weight_names",
        Value::str_array(&["token_embd.weight"]),
    );
    w.set("prism.hadamard.gdn_v_grouped", Value::Bool(true));
    for (name, ne0, ne1) in [
        ("token_embd.weight", N_EMBD, 8),
        ("blk.0.attn_norm.weight", N_EMBD, 1),
        ("blk.0.attn_qkv.weight", N_EMBD, 4),
        ("blk.0.ffn_down.weight", N_FF, 4),
        ("blk.1.ssm_out.weight", N_FF, 4),
        ("output.weight", N_EMBD, 8),
        ("blk.0.odd.weight", 96, 2),
    ] {
        let data = rng.vec((ne0 * ne1) as usize);
        w.add_f32(name, &[ne0, ne1], &data);
    }
    edit(&mut w);
    Gguf::from_bytes("fixture.gguf", w.to_bytes()).unwrap()
}

fn load(edit: impl FnOnce(&mut GgufWriter)) -> Result<Option<HadamardConfig>, HadamardError> {
    HadamardConfig::from_gguf(&fixture(edit))
}

#[test]
fn hadamard_config_accepts_a_valid_file() {
    let cfg = load(|_| {}).unwrap().expect("config");
    assert_eq!(cfg.version, 1);
    assert_eq!(cfg.block_size, BLOCK);
    assert!(cfg.gdn_v_grouped);
    assert_eq!(cfg.sign_mode, SignMode::Explicit);
    assert!(cfg.is_folded("blk.0.attn_qkv.weight"));
    assert!(!cfg.is_folded("blk.0.attn_norm.weight"));
    assert!(!cfg.is_folded("token_embd.weight"));
    assert!(cfg.is_inverse("token_embd.weight"));
    assert_eq!(
        cfg.folded_names().collect::<Vec<_>>(),
        vec![
            "blk.0.attn_qkv.weight",
            "blk.0.ffn_down.weight",
            "blk.1.ssm_out.weight",
            "output.weight"
        ]
    );
    assert_eq!(
        cfg.folded_width("blk.0.ffn_down.weight"),
        Some(N_FF as usize)
    );
    assert_eq!(
        cfg.sign_widths().collect::<Vec<_>>(),
        vec![N_EMBD as usize, N_FF as usize]
    );
    assert_eq!(cfg.signs(N_EMBD as usize).unwrap().len(), N_EMBD as usize);
    assert!(cfg
        .signs(N_FF as usize)
        .unwrap()
        .iter()
        .all(|&s| s == 1.0 || s == -1.0));
    assert!(cfg.signs(64).is_none());
    assert!(cfg.needs_gdn_permutation("blk.1.ssm_out.weight"));
    assert!(!cfg.needs_gdn_permutation("blk.0.ffn_down.weight"));

    // Identity mode needs no sign arrays at all.
    let cfg = load(|w| {
        w.set("prism.hadamard.sign_mode", Value::String("identity".into()));
        w.set("prism.hadamard.sign_widths", Value::i32_array(&[]));
        w.set("prism.hadamard.sign_values", Value::i32_array(&[]));
    })
    .unwrap()
    .unwrap();
    assert_eq!(cfg.sign_mode, SignMode::Identity);
    assert!(cfg.signs(N_EMBD as usize).is_none());

    // qwen35moe is whitelisted too.
    assert!(load(|w| {
        w.set("general.architecture", Value::String("qwen35moe".into()));
    })
    .unwrap()
    .is_some());
}

#[test]
fn hadamard_config_absent_without_keys() {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("qwen35".into()));
    w.add_f32("token_embd.weight", &[64, 2], &[0.0; 128]);
    let g = Gguf::from_bytes("plain.gguf", w.to_bytes()).unwrap();
    assert!(HadamardConfig::from_gguf(&g).unwrap().is_none());
}

#[test]
fn hadamard_config_refuses_bad_files() {
    use HadamardError as E;
    type Edit = Box<dyn FnOnce(&mut GgufWriter)>;
    let cases: Vec<(&str, Edit, E)> = vec![
        (
            "non-power-of-two block",
            Box::new(|w| {
                w.set("prism.hadamard.block_size", Value::U32(96));
            }),
            E::BlockSizeNotPowerOfTwo(96),
        ),
        (
            "zero block",
            Box::new(|w| {
                w.set("prism.hadamard.block_size", Value::U32(0));
            }),
            E::BlockSizeNotPowerOfTwo(0),
        ),
        (
            "bad sign value",
            Box::new(|w| {
                let mut v = vec![1i32; (N_EMBD + N_FF) as usize];
                v[130] = 2;
                w.set("prism.hadamard.sign_values", Value::i32_array(&v));
            }),
            E::BadSignValue {
                index: 130,
                value: 2.0,
            },
        ),
        (
            "zero sign value",
            Box::new(|w| {
                let mut v = vec![-1i32; (N_EMBD + N_FF) as usize];
                v[0] = 0;
                w.set("prism.hadamard.sign_values", Value::i32_array(&v));
            }),
            E::BadSignValue {
                index: 0,
                value: 0.0,
            },
        ),
        (
            "sign length mismatch",
            Box::new(|w| {
                w.set(
                    "prism.hadamard.sign_values",
                    Value::i32_array(&vec![1; (N_EMBD + N_FF) as usize - 1]),
                );
            }),
            E::SignLengthMismatch {
                expected: N_EMBD + N_FF,
                actual: (N_EMBD + N_FF) as usize - 1,
            },
        ),
        (
            "unknown weight name",
            Box::new(|w| {
                w.set(
                    "prism.hadamard.weight_names",
                    Value::str_array(&["blk.7.attn_q.weight"]),
                );
            }),
            E::UnknownTensor {
                key: "prism.hadamard.weight_names",
                name: "blk.7.attn_q.weight".into(),
            },
        ),
        (
            "non-foldable name",
            Box::new(|w| {
                w.set(
                    "prism.hadamard.weight_names",
                    Value::str_array(&["blk.0.attn_norm.weight"]),
                );
            }),
            E::NotFoldable("blk.0.attn_norm.weight".into()),
        ),
        (
            "embedding as a folded weight",
            Box::new(|w| {
                w.set(
                    "prism.hadamard.weight_names",
                    Value::str_array(&["token_embd.weight"]),
                );
            }),
            E::NotFoldable("token_embd.weight".into()),
        ),
        (
            "inverse name other than token_embd",
            Box::new(|w| {
                w.set(
                    "prism.hadamard.inverse_weight_names",
                    Value::str_array(&["output.weight"]),
                );
            }),
            E::BadInverseName("output.weight".into()),
        ),
        (
            "missing sign width",
            Box::new(|w| {
                w.set(
                    "prism.hadamard.sign_widths",
                    Value::i32_array(&[N_EMBD as i32]),
                );
                w.set(
                    "prism.hadamard.sign_values",
                    Value::i32_array(&vec![1; N_EMBD as usize]),
                );
            }),
            E::MissingSignWidth {
                name: "blk.0.ffn_down.weight".into(),
                width: N_FF,
            },
        ),
        (
            "wrong arch",
            Box::new(|w| {
                w.set("general.architecture", Value::String("llama".into()));
            }),
            E::UnsupportedArchitecture(Some("llama".into())),
        ),
        (
            "ne0 not a block multiple",
            Box::new(|w| {
                w.set("prism.hadamard.block_size", Value::U32(128));
            }),
            E::NotBlockMultiple {
                name: "blk.0.ffn_down.weight".into(),
                ne0: N_FF,
                block_size: 128,
            },
        ),
        (
            "bad transform",
            Box::new(|w| {
                w.set("prism.hadamard.transform", Value::String("dct".into()));
            }),
            E::UnsupportedTransform("dct".into()),
        ),
        (
            "bad axis",
            Box::new(|w| {
                w.set("prism.hadamard.axis", Value::String("output".into()));
            }),
            E::UnsupportedAxis("output".into()),
        ),
        (
            "bad sign mode",
            Box::new(|w| {
                w.set("prism.hadamard.sign_mode", Value::String("random".into()));
            }),
            E::UnsupportedSignMode("random".into()),
        ),
        (
            "bad version",
            Box::new(|w| {
                w.set("prism.hadamard.version", Value::U32(3));
            }),
            E::UnsupportedVersion(3),
        ),
        (
            "duplicate width",
            Box::new(|w| {
                w.set(
                    "prism.hadamard.sign_widths",
                    Value::i32_array(&[64, 64, 64, 128]),
                );
            }),
            E::DuplicateSignWidth(64),
        ),
        (
            "second inverse name",
            Box::new(|w| {
                w.set(
                    "prism.hadamard.inverse_weight_names",
                    Value::str_array(&["token_embd.weight", "x"]),
                );
            }),
            E::BadInverseName("x".into()),
        ),
        (
            "block size as a string",
            Box::new(|w| {
                w.set("prism.hadamard.block_size", Value::String("1024".into()));
            }),
            E::WrongType {
                key: "prism.hadamard.block_size",
                expected: "integer",
                found: "string".into(),
            },
        ),
    ];
    for (what, edit, want) in cases {
        match load(edit) {
            Err(e) => assert_eq!(e, want, "{what}: {e}"),
            Ok(_) => panic!("{what}: accepted"),
        }
    }

    // A missing key is named.
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("qwen35".into()));
    w.set("prism.hadamard.version", Value::U32(1));
    let g = Gguf::from_bytes("partial.gguf", w.to_bytes()).unwrap();
    let e = HadamardConfig::from_gguf(&g).unwrap_err();
    assert_eq!(e, HadamardError::MissingKey("prism.hadamard.block_size"));
    assert!(e.to_string().contains("prism.hadamard.block_size"), "{e}");

    // The missing inverse tensor case.
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("qwen35".into()));
    for (k, v) in [
        ("prism.hadamard.version", Value::U32(1)),
        ("prism.hadamard.block_size", Value::U32(64)),
        (
            "prism.hadamard.transform",
            Value::String("normalized-sylvester-walsh-hadamard".into()),
        ),
        (
            "prism.hadamard.axis",
            Value::String("input-last-dimension".into()),
        ),
        ("prism.hadamard.sign_mode", Value::String("identity".into())),
        ("prism.hadamard.weight_names", Value::str_array::<&str>(&[])),
        (
            "prism.hadamard.inverse_weight_names",
            Value::str_array(&["token_embd.weight"]),
        ),
    ] {
        w.set(k, v);
    }
    let g = Gguf::from_bytes("noembd.gguf", w.to_bytes()).unwrap();
    assert_eq!(
        HadamardConfig::from_gguf(&g).unwrap_err(),
        HadamardError::UnknownTensor {
            key: "prism.hadamard.inverse_weight_names",
            name: "token_embd.weight".into()
        }
    );
}

#[test]
fn foldable_names() {
    for ok in [
        "blk.0.attn_q.weight",
        "blk.12.attn_output.weight",
        "blk.63.ffn_down.weight",
        "blk.3.ssm_alpha.weight",
        "blk.64.nextn.eh_proj.weight",
        "blk.64.nextn.shared_head_head.weight",
        "output.weight",
    ] {
        assert!(is_foldable_name(ok), "{ok}");
    }
    for bad in [
        "blk.0.attn_norm.weight",
        "blk.0.ssm_conv1d.weight",
        "blk.0.ssm_a",
        "token_embd.weight",
        "blk.x.attn_q.weight",
        "blk..attn_q.weight",
        "blk.0.attn_q.bias",
        "output_norm.weight",
    ] {
        assert!(!is_foldable_name(bad), "{bad}");
    }
}

fn dot(a: &[f32], b: &[f32]) -> f64 {
    a.iter().zip(b).map(|(&x, &y)| x as f64 * y as f64).sum()
}

#[test]
fn fold_identity_through_forward_in_place() {
    let cfg = load(|_| {}).unwrap().unwrap();
    let mut rng = Rng(77);
    for width in [N_EMBD as usize, N_FF as usize] {
        let w = rng.vec(width);
        let x = rng.vec(width);
        // Fold the weight the way the converter does: H_blk(s ⊙ w) — the same operation.
        let mut w_latent = w.clone();
        cfg.forward_in_place(&mut w_latent);
        let mut x_t = x.clone();
        cfg.forward_in_place(&mut x_t);
        let want = dot(&w, &x);
        let got = dot(&w_latent, &x_t);
        assert!((got - want).abs() < 1e-5, "width {width}: {got} vs {want}");
        // And the same through a quantized folded row and dot_row.
        let row = quantize_row(GgmlType::F32, &w_latent).unwrap();
        assert!((dot_row(GgmlType::F32, &row, &x_t) as f64 - want).abs() < 1e-4);
    }
}

#[test]
fn inverse_recovers_a_folded_embedding_row() {
    let cfg = load(|_| {}).unwrap().unwrap();
    let mut rng = Rng(78);
    let e = rng.vec(N_EMBD as usize);
    let mut z = e.clone();
    cfg.forward_in_place(&mut z); // stored row: H_blk(s ⊙ e)
    assert!(
        z.iter().zip(&e).any(|(a, b)| (a - b).abs() > 1e-3),
        "the fold must change the row"
    );
    cfg.inverse_in_place(&mut z);
    for (a, b) in z.iter().zip(&e) {
        assert!((a - b).abs() < 1e-6);
    }
    // And with an explicit sign vector check of the inverse order: s ⊙ H(z).
    let s = cfg.signs(N_EMBD as usize).unwrap();
    let mut z2 = e.clone();
    fwht_blockwise(&mut z2, BLOCK);
    let manual: Vec<f32> = z2.iter().zip(s).map(|(a, b)| a * b).collect();
    let mut z3 = e.clone();
    cfg.inverse_in_place(&mut z3);
    assert_eq!(z3, manual);
}

#[test]
fn gdn_permutation_round_trips_and_matches_the_formula() {
    let p = GdnPermutation::new(128 * 48, 48, 16).unwrap();
    assert_eq!(
        p,
        GdnPermutation {
            hd: 128,
            nk: 16,
            rep: 3
        }
    );
    assert!(!p.is_identity());
    let tiled: Vec<f32> = (0..p.len()).map(|i| i as f32).collect();
    let mut grouped = vec![0.0; p.len()];
    p.tiled_to_grouped(&tiled, &mut grouped);
    for k in 0..p.nk {
        for r in 0..p.rep {
            for i in 0..p.hd {
                assert_eq!(
                    grouped[i + p.hd * (r + p.rep * k)],
                    tiled[i + p.hd * (k + p.nk * r)]
                );
            }
        }
    }
    let mut back = vec![0.0; p.len()];
    p.grouped_to_tiled(&grouped, &mut back);
    assert_eq!(back, tiled);
    // A permutation: every source index appears exactly once.
    let mut seen = grouped.iter().map(|&v| v as usize).collect::<Vec<_>>();
    seen.sort_unstable();
    assert_eq!(seen, (0..p.len()).collect::<Vec<_>>());

    let id = GdnPermutation::new(64, 4, 4).unwrap();
    assert!(id.is_identity());
    let v: Vec<f32> = (0..64).map(|i| i as f32).collect();
    let mut out = vec![0.0; 64];
    id.tiled_to_grouped(&v, &mut out);
    assert_eq!(out, v);

    assert_eq!(
        GdnPermutation::new(100, 48, 16),
        Err(HadamardError::BadGdnGeometry {
            width: 100,
            n_v: 48,
            n_k: 16
        })
    );
}

/// The PTQ1_0 kernels' digit identity (`int8::digit_levels`): for random blocks, including
/// every byte value (bytes above 242 decode too, and must decode as the scalar decoder does),
/// `Σ_n Σ_j floor(byte_j * 3^(n+1) / 256) * y[n][j]` is the block's integer sum `Σ trit * level`.
#[test]
fn ptq1_0_digit_levels_give_the_trit_sum() {
    let mut rng = Rng(0xd161_7a11);
    let mut w = [0f32; 128];
    for round in 0..64 {
        let mut blk = [0u8; 28];
        for (i, b) in blk.iter_mut().enumerate() {
            // The first rounds walk every byte value through every position.
            *b = if round < 10 {
                (26 * round + i) as u8
            } else {
                rng.below(256) as u8
            };
        }
        let q: Vec<i8> = (0..128)
            .map(|_| (rng.below(255) as i32 - 127) as i8)
            .collect();
        ptq1_0::decode(&blk, &mut w);
        let want: i32 = w
            .iter()
            .zip(&q)
            .map(|(&l, &x)| (l as i32 + 1) * x as i32)
            .sum();
        let mut y = [0i16; 160];
        int8::digit_levels(&q, &mut y);
        let mut got = 0i32;
        for n in 0..5 {
            for j in 0..32 {
                // Lanes past the 26 code bytes meet the scale bytes and zeros in the kernel.
                let byte = if j < 28 { blk[j] as i32 } else { 0 };
                let a = (byte * 3i32.pow(n as u32 + 1)) >> 8;
                got += a * y[32 * n + j] as i32;
            }
        }
        assert_eq!(got, want, "round {round}: block {blk:?}");
    }
}
