//! The generator's own, independent PQ2_0 codec and Hadamard unfold: a dense Sylvester matrix,
//! deliberately not an FWHT and not tern's code, so the twins do not come from the code under test.

/// The normalized Sylvester–Walsh–Hadamard matrix of size n (row-major), in f64:
/// `H[r][c] = (-1)^popcount(r & c) / sqrt(n)`.
pub fn dense_h(n: usize) -> Vec<f64> {
    assert!(n.is_power_of_two());
    let inv = 1.0 / (n as f64).sqrt();
    let mut h = vec![0.0; n * n];
    for r in 0..n {
        for c in 0..n {
            h[r * n + c] = if (r & c).count_ones() % 2 == 0 {
                inv
            } else {
                -inv
            };
        }
    }
    h
}

/// `H_blk(x)`: the dense H applied to each `blk`-wide block of `x`, in f64.
pub fn apply_h_blk(h: &[f64], blk: usize, x: &[f64]) -> Vec<f64> {
    assert_eq!(h.len(), blk * blk);
    assert_eq!(x.len() % blk, 0);
    let mut out = vec![0.0; x.len()];
    for (xb, ob) in x.chunks(blk).zip(out.chunks_mut(blk)) {
        for r in 0..blk {
            let row = &h[r * blk..(r + 1) * blk];
            ob[r] = row.iter().zip(xb).map(|(a, b)| a * b).sum();
        }
    }
    out
}

/// The plain weight row of a folded row: `w = s ⊙ H_blk(latent)` (also the embedding rule
/// `e = s ⊙ H_blk(z)`).
pub fn unfold_row(h: &[f64], blk: usize, signs: &[i32], latent: &[f32]) -> Vec<f32> {
    assert_eq!(signs.len(), latent.len());
    let x: Vec<f64> = latent.iter().map(|&v| v as f64).collect();
    apply_h_blk(h, blk, &x)
        .iter()
        .zip(signs)
        .map(|(&v, &s)| (v * s as f64) as f32)
        .collect()
}

/// `ssm_out` rows of a `gdn_v_grouped` file are in grouped column order; permute to tiled:
/// `tiled[i + hd*(k + nk*r)] = grouped[i + hd*(r + rep*k)]`.
pub fn grouped_to_tiled(row: &[f32], hd: usize, nk: usize, rep: usize) -> Vec<f32> {
    assert_eq!(row.len(), hd * nk * rep);
    let mut out = vec![0.0; row.len()];
    for k in 0..nk {
        for r in 0..rep {
            for i in 0..hd {
                out[i + hd * (k + nk * r)] = row[i + hd * (r + rep * k)];
            }
        }
    }
    out
}

pub const PQ2_0_BLOCK: usize = 128;
pub const PQ2_0_BYTES: usize = 34;

/// One PQ2_0 block: f16 `d` first, then 32 bytes of 2-bit codes, four consecutive weights per
/// byte, LSB first.
pub fn encode_pq2_0_block(d: half::f16, codes: &[u8]) -> [u8; PQ2_0_BYTES] {
    assert_eq!(codes.len(), PQ2_0_BLOCK);
    let mut b = [0u8; PQ2_0_BYTES];
    b[..2].copy_from_slice(&d.to_bits().to_le_bytes());
    for (j, &q) in codes.iter().enumerate() {
        assert!(q < 4);
        b[2 + j / 4] |= q << (2 * (j % 4));
    }
    b
}

/// Dequantizes a PQ2_0 row: `w = (code - 1) * d`.
pub fn decode_pq2_0_row(bytes: &[u8]) -> Vec<f32> {
    assert_eq!(bytes.len() % PQ2_0_BYTES, 0);
    let mut out = Vec::with_capacity(bytes.len() / PQ2_0_BYTES * PQ2_0_BLOCK);
    for blk in bytes.chunks(PQ2_0_BYTES) {
        let d = half::f16::from_bits(u16::from_le_bytes([blk[0], blk[1]])).to_f32();
        for j in 0..PQ2_0_BLOCK {
            let q = (blk[2 + j / 4] >> (2 * (j % 4))) & 3;
            out.push((q as i32 - 1) as f32 * d);
        }
    }
    out
}

pub const PTQ1_0_BYTES: usize = 28;

/// Packs trits (each 0, 1 or 2; the first most significant) into one byte as the fixed-point
/// fraction `ceil(t · 256 / 243)` of their base-3 number t (format-pq2_0.md §4), so that trit n
/// reads back as `((byte · 3^n) mod 256 · 3) >> 8`.
fn pack_trits(trits: &[u8; 5]) -> u8 {
    let t = trits.iter().fold(0u32, |acc, &x| acc * 3 + x as u32);
    (t * 256).div_ceil(243) as u8
}

/// One PTQ1_0 block from ternary codes (0, 1, 2 = -1, 0, +1): bytes 0..16 hold elements
/// `n·16 + m` (trit n of byte m), bytes 16..24 elements `80 + n·8 + m`, the two `qh` bytes
/// elements `120 + n·2 + h` (four trits, shifted up one place), then f16 `d` last.
pub fn encode_ptq1_0_block(d: half::f16, codes: &[u8]) -> [u8; PTQ1_0_BYTES] {
    assert_eq!(codes.len(), 128);
    assert!(
        codes.iter().all(|&c| c < 3),
        "PTQ1_0 holds ternary codes only"
    );
    let mut b = [0u8; PTQ1_0_BYTES];
    for m in 0..16 {
        b[m] = pack_trits(&std::array::from_fn(|n| codes[n * 16 + m]));
    }
    for m in 0..8 {
        b[16 + m] = pack_trits(&std::array::from_fn(|n| codes[80 + n * 8 + m]));
    }
    for h in 0..2 {
        b[24 + h] = pack_trits(&std::array::from_fn(|n| {
            if n < 4 {
                codes[120 + n * 2 + h]
            } else {
                0
            }
        }));
    }
    b[26..28].copy_from_slice(&d.to_bits().to_le_bytes());
    b
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::rng::Rng;

    #[test]
    fn h_is_its_own_inverse() {
        for n in [1, 2, 4, 64] {
            let h = dense_h(n);
            for r in 0..n {
                for c in 0..n {
                    let v: f64 = (0..n).map(|k| h[r * n + k] * h[k * n + c]).sum();
                    let want = if r == c { 1.0 } else { 0.0 };
                    assert!((v - want).abs() < 1e-12, "n={n} ({r},{c}) = {v}");
                }
            }
        }
        // Sylvester recursion [[H, H], [H, -H]] (unnormalized) for n = 4.
        let h = dense_h(4);
        let signs: Vec<f64> = h.iter().map(|v| v.signum()).collect();
        assert_eq!(
            signs,
            [1., 1., 1., 1., 1., -1., 1., -1., 1., 1., -1., -1., 1., -1., -1., 1.]
        );
    }

    fn dot(a: &[f32], b: &[f64]) -> f64 {
        a.iter().zip(b).map(|(&x, &y)| x as f64 * y).sum()
    }

    /// The fold identity the runtime relies on: `<latent, H_blk(s ⊙ P(x))> = <w, x>` with
    /// `w = P⁻¹(s ⊙ H_blk(latent))`, for plain rows and for grouped `ssm_out` rows.
    #[test]
    fn unfold_matches_the_runtime_identity() {
        let (blk, hd, nk, rep) = (64usize, 32usize, 2usize, 2usize);
        let n = hd * nk * rep; // 128: two Hadamard blocks
        let h = dense_h(blk);
        let mut rng = Rng::new(3);
        let signs: Vec<i32> = (0..n)
            .map(|_| if rng.below(2) == 0 { -1 } else { 1 })
            .collect();
        let latent: Vec<f32> = (0..n).map(|_| rng.below(4) as f32 - 1.0).collect();
        let x: Vec<f64> = (0..n).map(|_| rng.uniform(-1.0, 1.0) as f64).collect();

        // Plain row.
        let sx: Vec<f64> = x.iter().zip(&signs).map(|(v, &s)| v * s as f64).collect();
        let runtime = dot(&latent, &apply_h_blk(&h, blk, &sx));
        let w = unfold_row(&h, blk, &signs, &latent);
        assert!((runtime - dot(&w, &x)).abs() < 1e-5);

        // Grouped ssm_out row: the runtime permutes the tiled activation to grouped order.
        let mut px = vec![0.0; n];
        for k in 0..nk {
            for r in 0..rep {
                for i in 0..hd {
                    px[i + hd * (r + rep * k)] = x[i + hd * (k + nk * r)];
                }
            }
        }
        let spx: Vec<f64> = px.iter().zip(&signs).map(|(v, &s)| v * s as f64).collect();
        let runtime = dot(&latent, &apply_h_blk(&h, blk, &spx));
        let w_tiled = grouped_to_tiled(&unfold_row(&h, blk, &signs, &latent), hd, nk, rep);
        assert!((runtime - dot(&w_tiled, &x)).abs() < 1e-5);
    }

    #[test]
    fn pq2_0_round_trip() {
        let codes: Vec<u8> = (0..128).map(|j| (j * 7 % 4) as u8).collect();
        let d = half::f16::from_f32(0.5);
        let b = encode_pq2_0_block(d, &codes);
        assert_eq!(&b[..2], &d.to_bits().to_le_bytes());
        assert_eq!(b[2] & 3, codes[0]);
        assert_eq!((b[2] >> 6) & 3, codes[3]);
        let w = decode_pq2_0_row(&b);
        for j in 0..128 {
            assert_eq!(w[j], (codes[j] as f32 - 1.0) * 0.5);
        }
    }

    #[test]
    fn ptq1_0_codes_read_back_through_tern() {
        let codes: Vec<u8> = (0..128).map(|j| (j * 5 % 3) as u8).collect();
        let d = half::f16::from_f32(0.25);
        let b = encode_ptq1_0_block(d, &codes);
        let mut w = vec![0f32; 128];
        tern::quant::dequantize_row(tern::tensor::GgmlType::PTQ1_0, &b, &mut w).unwrap();
        for j in 0..128 {
            assert_eq!(w[j], (codes[j] as f32 - 1.0) * 0.25, "element {j}");
        }
    }
}
