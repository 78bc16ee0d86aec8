//! Q8_0 and PQ2_0 matrices repacked once at load for the serving path's VNNI row kernels.
//!
//! A stored Q8_0 row is 34-byte blocks (an f16 scale, then 32 levels), so the AVX-512 kernel
//! (`x86_int8::q8_0_vnni_rows`) assembles each group of four blocks from four unaligned
//! 256-bit loads with two inserts, two shuffles and two XORs (the bias that makes the levels
//! `vpdpbusd`'s unsigned operand), and widens the scales with a two-source word permute: work
//! on the shuffle port for every weight row, which bound the kernel when several token rows
//! (a few streams' step, a verify batch) share each weight row. Packed, a row of `k` columns is
//! its `k / 128` groups of levels, each 128 bytes (the first 16 levels of blocks 0 to 3, then
//! the last 16 of each, every level XORed with 0x80), then the groups' scales, four f16 each:
//! the same `34 * k / 32` bytes as the stored row, read by two plain loads and one permute a
//! group. Single-threaded in L2 on the Xeon bench machine (`bench --kernels` shape, medians of
//! 7), three token rows went from 16.9 to 20.9 GB/s at 3,584 columns and from 13.8 to 16.7 at
//! 1,024, one token row from 19.1 to 21.6 and 15.6 to 17.3.
//!
//! The kernel does the same integer and float operations per (weight row, token row) pair in
//! the same order as the kernel on the stored rows, so the results are the same bits; only
//! matrices whose width is a whole number of 128-column groups are packed (every matrix of the
//! Qwen3.5 sizes), on CPUs with that kernel ([`packs`]).
//!
//! PQ2_0 blocks have the same shape (an f16 scale, then 32 code bytes of four 2-bit codes, 128
//! columns), and pack by the same byte permutation without the bias: per group of four blocks
//! (512 columns) code bytes 0..16 of each block, then bytes 16..32 of each. The stored rows'
//! kernel (`x86_int8::pq2_0_span_body`) takes blocks in pairs, so every (weight row, token row)
//! pair pays a conversion and a scaled multiply-add per two blocks; on the packed rows each of
//! a group's eight code planes meets a vector of activations laid out to match
//! (`int8::pq2_quad_levels`) with every i32 lane inside one block, and those operations cover
//! four blocks. That changes the order of the f32 sums against the stored rows' kernel (not the
//! precision), so PQ2_0's packed results are not the stored kernel's bits; they are the same
//! bits for a token row whatever rows run beside it. Single-threaded in L2 (`bench --kernels
//! --span`, three runs): one token row 7.4-11.7 -> 10.4-19.1 GB/s at 1,024 columns, three
//! token rows 4.0-7.4 -> 5.4-9.1; at 2,048, three rows 6.3-8.6 -> 7.7-10.5. A decode step of
//! bench-0.8b PQ2_0 (an ignored probe alternating the packed and unpacked backends in one
//! process, medians of 60 steps each, two runs): one stream 17.57 / 18.73 -> 16.78 / 17.50 ms,
//! three streams 28.26 / 31.42 -> 25.93 / 28.85 ms.
//!
//! PTQ1_0 rows are transcoded to PQ2_0 blocks as they pack (each trit becomes the 2-bit code
//! of the same value, the scale moves to the front) and then packed as PQ2_0: the values are
//! exactly the stored ones, and the matrix runs on the packed PQ2_0 kernel, at 34 bytes a
//! block instead of 28. PTQ1_0's own kernel spends about three times PQ2_0's arithmetic per
//! weight pulling five trits out of each byte (`x86_int8::ptq1_0_vnni`), so it bound the
//! decode step; see [`packed_type`].

use super::int8::{QActs, MAX_ROWS};
use crate::tensor::GgmlType;

/// Stored blocks per packed group: four 34-byte blocks (an f16 scale, then 32 payload bytes)
/// make 128 payload bytes and four scales.
const BLOCKS: usize = 4;

/// Columns per packed group of `ty`: four Q8_0 blocks of 32, or four PQ2_0 (or PTQ1_0) blocks
/// of 128.
fn group_cols(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 => 128,
        _ => 512,
    }
}

/// What each payload byte is XORed with: Q8_0's levels biased to `vpdpbusd`'s unsigned
/// operand; PQ2_0's code bytes (unsigned already) as they are.
fn bias(ty: GgmlType) -> u8 {
    match ty {
        GgmlType::Q8_0 => 0x80,
        _ => 0,
    }
}

/// Whether the serving path packs a `ty` matrix of `k` columns: Q8_0, PQ2_0 or PTQ1_0, whole
/// groups, and a CPU with the packed kernels.
pub fn packs(ty: GgmlType, k: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        matches!(ty, GgmlType::Q8_0 | GgmlType::PQ2_0 | GgmlType::PTQ1_0)
            && k > 0
            && k.is_multiple_of(group_cols(ty))
            && super::x86_int8::vnni_vl()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, k);
        false
    }
}

/// How the serving path holds a matrix it copies at load (see [`layout`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Layout {
    /// Repacked for the VNNI kernels ([`pack_rows`], read by [`dot_span`]).
    Packed,
    /// PTQ1_0 rows rewritten as stored PQ2_0 blocks of the same values ([`transcode_rows`]),
    /// read by the stored-row PQ2_0 kernels where the packed ones are missing: PTQ1_0's own
    /// kernels pull five trits out of each byte, and without VNNI that bound them far below
    /// the memory. Single-threaded in L2 on the Zen 4 bench machine (`bench --kernels
    /// --span`, AVX2 rows, 1,024 columns), PTQ1_0's AVX2 span kernel ran at 4.45 GB/s of its
    /// 28-byte blocks (20.3 G weights/s) and PQ2_0's at 14.88 GB/s of 34-byte blocks (56.0 G
    /// weights/s), the portable kernels at 0.17 and 1.28 GB/s.
    Transcoded,
}

/// How the serving path copies a `ty` matrix of `k` columns at load on this CPU, if at all:
/// packed where the packed kernels take it ([`packs`]); on x86 a PTQ1_0 matrix they do not
/// take (a CPU without AVX-512 VNNI, or a width that is not whole 512-column groups) is
/// transcoded to PQ2_0 blocks ([`Layout::Transcoded`]). Arm keeps PTQ1_0 as stored: its NEON
/// kernels are not measured against PQ2_0's yet.
pub fn layout(ty: GgmlType, k: usize) -> Option<Layout> {
    if packs(ty, k) {
        Some(Layout::Packed)
    } else if cfg!(target_arch = "x86_64") && transcodes(ty, k) {
        Some(Layout::Transcoded)
    } else {
        None
    }
}

/// Whether `ty` rows of `k` columns can be transcoded ([`Layout::Transcoded`]), on any CPU.
pub fn transcodes(ty: GgmlType, k: usize) -> bool {
    ty == GgmlType::PTQ1_0 && k > 0 && k.is_multiple_of(128)
}

/// Copies stored `ty` rows of `k` columns (`src`, whole rows) into `dst` in `layout`, one row of
/// [`packed_row_bytes`] per stored row.
pub fn copy_rows(layout: Layout, ty: GgmlType, src: &[u8], k: usize, dst: &mut [u8]) {
    match layout {
        Layout::Packed => pack_rows(ty, src, k, dst),
        Layout::Transcoded => transcode_rows(ty, src, k, dst),
    }
}

/// Rewrites stored PTQ1_0 rows of `k` columns as stored PQ2_0 rows of the same values (see
/// [`Layout::Transcoded`]).
fn transcode_rows(ty: GgmlType, src: &[u8], k: usize, dst: &mut [u8]) {
    let (rb, pb) = (row_bytes(ty, k), packed_row_bytes(ty, k));
    assert!(
        transcodes(ty, k) && src.len().is_multiple_of(rb) && dst.len() == src.len() / rb * pb,
        "packed::transcode_rows: {} bytes into {} for {ty} rows of {k}",
        src.len(),
        dst.len()
    );
    ptq1_0_as_pq2_0(src, dst);
}

/// The type of a packed `ty` matrix's blocks: PTQ1_0 packs as PQ2_0, the others as they are.
/// The packed rows' kernel, their activations, [`unpack_row`] and the panel decoder all take
/// this type.
pub fn packed_type(ty: GgmlType) -> GgmlType {
    match ty {
        GgmlType::PTQ1_0 => GgmlType::PQ2_0,
        ty => ty,
    }
}

/// Bytes of one packed row of a `ty` matrix of `k` columns (stored `ty` = [`packs`]' type).
pub fn packed_row_bytes(ty: GgmlType, k: usize) -> usize {
    row_bytes(packed_type(ty), k)
}

/// Bytes of the packed copy of `stored` bytes of whole `ty` rows of `k` columns.
pub fn packed_len(ty: GgmlType, k: usize, stored: usize) -> usize {
    stored / row_bytes(ty, k) * packed_row_bytes(ty, k)
}

/// Packs stored `ty` rows of `k` columns (`src`, whole rows) into `dst`, one packed row of
/// [`packed_row_bytes`] per stored row.
pub fn pack_rows(ty: GgmlType, src: &[u8], k: usize, dst: &mut [u8]) {
    let (rb, pb) = (row_bytes(ty, k), packed_row_bytes(ty, k));
    assert!(
        k.is_multiple_of(group_cols(ty))
            && src.len().is_multiple_of(rb)
            && dst.len() == src.len() / rb * pb,
        "packed::pack_rows: {} bytes into {} for {ty} rows of {k}",
        src.len(),
        dst.len()
    );
    let mut pq2 = Vec::new();
    for (s, d) in src.chunks_exact(rb).zip(dst.chunks_exact_mut(pb)) {
        let s = match ty {
            GgmlType::PTQ1_0 => {
                pq2.resize(pb, 0);
                ptq1_0_as_pq2_0(s, &mut pq2);
                &pq2[..]
            }
            _ => s,
        };
        permute_row(packed_type(ty), s, d, true);
    }
}

/// A stored PTQ1_0 row as PQ2_0 blocks of the same values: per block the scale first, then
/// trit `t` of element `e` as code `t` (value `(t - 1) * d` in both) at bits `2 * (e % 4)` of
/// byte `e / 4`. The trits are read as `ptq1_0::decode` reads them, whatever the bytes.
fn ptq1_0_as_pq2_0(src: &[u8], dst: &mut [u8]) {
    use super::{pq2_0, ptq1_0};
    for (s, d) in src
        .chunks_exact(ptq1_0::BYTES)
        .zip(dst.chunks_exact_mut(pq2_0::BYTES))
    {
        d[..2].copy_from_slice(&s[26..28]);
        let trits = ptq1_0::codes(s.try_into().expect("PTQ1_0 block"));
        for (byte, quad) in d[2..].iter_mut().zip(trits.chunks_exact(4)) {
            *byte = quad.iter().enumerate().map(|(i, &t)| t << (2 * i)).sum();
        }
    }
}

/// The stored `ty` row of `k` columns that `src` (one packed row) was packed from; `ty` is the
/// packed type ([`packed_type`]), so a PTQ1_0 row comes back as its PQ2_0 blocks.
pub fn unpack_row(ty: GgmlType, src: &[u8], k: usize, dst: &mut [u8]) {
    let rb = row_bytes(ty, k);
    assert!(
        k.is_multiple_of(group_cols(ty)) && src.len() == rb && dst.len() == rb,
        "packed::unpack_row: {} bytes into {} for a {ty} row of {k}",
        src.len(),
        dst.len()
    );
    permute_row(ty, src, dst, false);
}

/// One row between the stored layout (`a` when `pack`, else `b`) and the packed one: per group
/// of four blocks, payload bytes `16h..16h + 16` of block `c` at `64h + 16c` of the group's 128,
/// the scales at the row's end, four f16 a group.
fn permute_row(ty: GgmlType, a: &[u8], b: &mut [u8], pack: bool) {
    let (x, ng) = (bias(ty), a.len() / (34 * BLOCKS));
    for g in 0..ng {
        for c in 0..BLOCKS {
            let blk = (BLOCKS * g + c) * 34;
            let sc = ng * 128 + g * 8 + 2 * c;
            for h in 0..2 {
                let (st, pk) = (blk + 2 + 16 * h, 128 * g + 64 * h + 16 * c);
                let (from, to) = if pack { (st, pk) } else { (pk, st) };
                for (o, &w) in b[to..to + 16].iter_mut().zip(&a[from..from + 16]) {
                    *o = w ^ x;
                }
            }
            let (from, to) = if pack { (blk, sc) } else { (sc, blk) };
            b[to..to + 2].copy_from_slice(&a[from..from + 2]);
        }
    }
}

/// Bytes of a `ty` row of `k` columns, stored or packed (the file's row length).
fn row_bytes(ty: GgmlType, k: usize) -> usize {
    ty.row_bytes(k as u64)
        .expect("packed rows are whole blocks") as usize
}

/// [`int8::dot_span_rows`](super::int8::dot_span_rows) on packed rows: `out[r * n + i]` = packed
/// row r of `rows` against activation row `t0 + i`, for `n` (1 to [`MAX_ROWS`]) rows. For Q8_0
/// the same bits as `dot_span_rows` on the rows before packing; PQ2_0's four-block step scales
/// the integer sums four blocks at a time where the stored rows' kernel does two, so its sums
/// round differently (to f32's precision), the same bits whatever `n` and `t0`. Only where
/// [`packs`] is true.
pub fn dot_span(rows: &[u8], acts: &QActs, t0: usize, n: usize, out: &mut [f32]) {
    let (ty, k) = (acts.ty, acts.k);
    assert!(
        packs(ty, k),
        "packed::dot_span: no packed kernel for {ty} rows of {k} on this CPU"
    );
    assert!(
        (1..=MAX_ROWS).contains(&n) && t0 + n <= acts.rows(),
        "packed::dot_span: rows {t0}..{} of {}",
        t0 + n,
        acts.rows()
    );
    let rb = row_bytes(ty, k);
    assert_eq!(
        rows.len() * n,
        rb * out.len(),
        "packed::dot_span: {} bytes for {} results of {n} rows of {k}",
        rows.len(),
        out.len()
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: `packs` checked the CPU's features; the shapes are checked above.
    unsafe {
        use super::x86_int8::{pq2_0_packed_span as pq2, q8_0_packed_span as q8};
        match (ty, n) {
            (GgmlType::Q8_0, 1) => q8::<1>(rows, rb, acts, t0, out),
            (GgmlType::Q8_0, 2) => q8::<2>(rows, rb, acts, t0, out),
            (GgmlType::Q8_0, 3) => q8::<3>(rows, rb, acts, t0, out),
            (GgmlType::Q8_0, _) => q8::<4>(rows, rb, acts, t0, out),
            (_, 1) => pq2::<1>(rows, rb, acts, t0, out),
            (_, 2) => pq2::<2>(rows, rb, acts, t0, out),
            (_, 3) => pq2::<3>(rows, rb, acts, t0, out),
            (_, _) => pq2::<4>(rows, rb, acts, t0, out),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quant::int8;

    fn rnd(seed: &mut u64) -> u64 {
        *seed ^= *seed << 13;
        *seed ^= *seed >> 7;
        *seed ^= *seed << 17;
        *seed
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|v| v.to_bits()).collect()
    }

    /// Rows of random payload bytes with scales of either sign between about 2^-9 and 2^-6
    /// (Q8_0 and PQ2_0 blocks are an f16 scale and 32 bytes; PTQ1_0's are 26 bytes, then the
    /// scale, and every byte value is taken: those past 242 still decode to trits).
    fn stored(ty: GgmlType, rows: usize, k: usize, seed: &mut u64) -> Vec<u8> {
        let rb = row_bytes(ty, k);
        let (bb, hi) = match ty {
            GgmlType::PTQ1_0 => (28, 27),
            _ => (34, 1),
        };
        let mut m = vec![0u8; rows * rb];
        for (i, b) in m.iter_mut().enumerate() {
            *b = if i % rb % bb == hi {
                0x18 + (rnd(seed) % 8) as u8 + if rnd(seed) & 1 == 0 { 0x80 } else { 0 }
            } else {
                rnd(seed) as u8
            };
        }
        m
    }

    /// Block `b` of a stored row as its scale and 128 codes (levels + 1) in element order.
    fn block_codes(ty: GgmlType, row: &[u8], b: usize) -> (f64, Vec<i64>) {
        let mut w = vec![0f32; 128];
        let bb = row_bytes(ty, 128);
        crate::quant::dequantize_row(ty, &row[b * bb..][..bb], &mut w).unwrap();
        let at = if ty == GgmlType::PTQ1_0 { 26 } else { 0 };
        let d = crate::quant::fp::le_f16(&row[b * bb..][..bb], at);
        // The levels are (code - 1) * d exactly, d a nonzero f16.
        let codes = w.iter().map(|&v| (v / d + 1.0) as i64).collect();
        (d as f64, codes)
    }

    fn acts(ty: GgmlType, rows: usize, k: usize, seed: &mut u64) -> QActs {
        let x: Vec<f32> = (0..rows * k)
            .map(|_| (rnd(seed) % 2001) as f32 / 1000.0 - 1.0)
            .collect();
        QActs::quantize(ty, &x, k)
    }

    /// A PTQ1_0 row packs as PQ2_0 blocks of the same values, bit for bit after decoding,
    /// whatever the stored bytes (1 to 7 groups of 512).
    #[test]
    fn ptq1_0_packs_to_pq2_0_blocks_of_the_same_values() {
        let mut s = 5u64;
        for k in [512, 1024, 3584] {
            let (rb, pb) = (
                row_bytes(GgmlType::PTQ1_0, k),
                packed_row_bytes(GgmlType::PTQ1_0, k),
            );
            assert_eq!((rb, pb), (k / 128 * 28, k / 128 * 34));
            let m = stored(GgmlType::PTQ1_0, 5, k, &mut s);
            let mut p = vec![0u8; 5 * pb];
            pack_rows(GgmlType::PTQ1_0, &m, k, &mut p);
            let mut back = vec![0u8; pb];
            for r in 0..5 {
                unpack_row(
                    packed_type(GgmlType::PTQ1_0),
                    &p[r * pb..][..pb],
                    k,
                    &mut back,
                );
                let mut want = vec![0f32; k];
                let mut got = vec![1f32; k];
                crate::quant::dequantize_row(GgmlType::PTQ1_0, &m[r * rb..][..rb], &mut want)
                    .unwrap();
                crate::quant::dequantize_row(GgmlType::PQ2_0, &back, &mut got).unwrap();
                assert_eq!(bits(&want), bits(&got), "k {k} row {r}");
            }
        }
    }

    #[test]
    fn unpack_inverts_pack() {
        let mut s = 3u64;
        for (ty, k) in [
            (GgmlType::Q8_0, 128),
            (GgmlType::Q8_0, 384),
            (GgmlType::Q8_0, 1024),
            (GgmlType::PQ2_0, 512),
            (GgmlType::PQ2_0, 1536),
            (GgmlType::PQ2_0, 3584),
        ] {
            let rb = row_bytes(ty, k);
            let m = stored(ty, 5, k, &mut s);
            let mut p = vec![0u8; m.len()];
            pack_rows(ty, &m, k, &mut p);
            assert_ne!(p, m);
            let mut back = vec![0u8; rb];
            for (r, row) in p.chunks_exact(rb).enumerate() {
                unpack_row(ty, row, k, &mut back);
                assert_eq!(back, m[r * rb..(r + 1) * rb], "{ty} k {k} row {r}");
            }
        }
    }

    /// Packed Q8_0 rows give `dot_span_rows`' bits on the stored rows, for 1 to 4 token rows
    /// from any first row, over spans that leave a remainder after the four-row passes (37
    /// rows) and widths of one group, an odd number of groups and bench-0.8b's widths.
    #[test]
    fn packed_kernel_matches_stored_rows_bit_for_bit() {
        let mut s = 7u64;
        for k in [128, 384, 1024, 2048, 3584] {
            if !packs(GgmlType::Q8_0, k) {
                eprintln!("this CPU has no packed kernel: nothing to compare");
                return;
            }
            let rows = 37;
            let m = stored(GgmlType::Q8_0, rows, k, &mut s);
            let mut p = crate::alloc::Lines::<u8>::zeroed(m.len());
            pack_rows(GgmlType::Q8_0, &m, k, &mut p);
            let a = acts(GgmlType::Q8_0, 6, k, &mut s);
            for n in 1..=4 {
                for t0 in [0, 6 - n] {
                    let mut want = vec![0f32; rows * n];
                    int8::dot_span_rows(&m, &a, t0, n, &mut want);
                    let mut got = vec![1f32; rows * n];
                    dot_span(&p, &a, t0, n, &mut got);
                    assert_eq!(bits(&want), bits(&got), "k {k}, {n} token rows from {t0}");
                }
            }
        }
    }

    /// Packed PQ2_0 rows against the exact sums: per block the integer `Σ code · q` of the
    /// stored codes and the activations' levels, scaled in f64, `Σ_b w_b (x_b S_b - o_b)`. The
    /// kernel's f32 scaling and lane sums may round each term and the running sums (k / 512
    /// groups, then 16 lanes), so the bound is 1e-5 of the sum of the terms' magnitudes. And
    /// a token row's result is the same bits whether it runs alone or with 1 to 3 others,
    /// from any first row (37 rows: the two-row passes leave one).
    #[test]
    fn packed_pq2_0_kernel_gives_the_exact_sums_and_the_same_bits_for_any_rows() {
        let mut s = 11u64;
        let sizes = [512, 1024, 1536, 3584];
        let cases = sizes
            .map(|k| (GgmlType::PQ2_0, k))
            .into_iter()
            .chain(sizes.map(|k| (GgmlType::PTQ1_0, k)));
        for (ty, k) in cases {
            if !packs(ty, k) {
                eprintln!("this CPU has no packed kernel: nothing to compare");
                return;
            }
            let (rows, rb, nb) = (37, row_bytes(ty, k), k / 128);
            let m = stored(ty, rows, k, &mut s);
            let mut p = crate::alloc::Lines::<u8>::zeroed(packed_len(ty, k, m.len()));
            pack_rows(ty, &m, k, &mut p);
            let a = acts(packed_type(ty), 6, k, &mut s);
            let (qs, d, o) = a.contents();
            for t in 0..6 {
                let mut alone = vec![0f32; rows];
                dot_span(&p, &a, t, 1, &mut alone);
                for (r, &got) in alone.iter().enumerate() {
                    let (mut want, mut mag) = (0f64, 0f64);
                    for b in 0..nb {
                        let (w, codes) = block_codes(ty, &m[r * rb..][..rb], b);
                        let q = &qs[t * k + b * 128..][..128];
                        // Element 4m + s is code s of byte m; `qs` holds it at 32s + m.
                        let sum: i64 = (0..128)
                            .map(|e| codes[e] * q[32 * (e % 4) + e / 4] as i64)
                            .sum();
                        let (x, ob) = (d[t * nb + b] as f64, o[t * nb + b] as f64);
                        want += w * (x * sum as f64 - ob);
                        mag += w.abs() * ((x * sum as f64).abs() + ob.abs());
                    }
                    assert!(
                        (got as f64 - want).abs() <= 1e-5 * mag + 1e-30,
                        "{ty} k {k} row {r} token {t}: {got} against {want} (terms {mag})"
                    );
                }
                for n in 1..=4usize {
                    let t0 = t.saturating_sub(n - 1).min(6 - n);
                    let mut got = vec![1f32; rows * n];
                    dot_span(&p, &a, t0, n, &mut got);
                    let mine: Vec<f32> = got.chunks_exact(n).map(|g| g[t - t0]).collect();
                    assert_eq!(
                        bits(&alone),
                        bits(&mine),
                        "{ty} k {k}: token {t} among {n} from {t0}"
                    );
                }
            }
        }
    }

    /// The tiled product's panel decoded from packed rows is the panel of the stored rows.
    /// Q8_0: whole groups of 16 blocks (1,024 and 3,584 columns), a last group holding 12
    /// blocks (384 and 896: its lanes masked), and narrow last groups that take the stored
    /// layout (128 and 2,176 columns: 4 blocks left over). PQ2_0 (unpacked to the stored
    /// layout, then decoded): one to seven packed groups.
    #[test]
    fn packed_panel_is_the_stored_panel() {
        let mut s = 9u64;
        let q8 = [128, 384, 896, 1024, 2176, 3584].map(|k| (GgmlType::Q8_0, k));
        let pq2 = [512, 1024, 3584].map(|k| (GgmlType::PQ2_0, k));
        for (ty, k) in q8.into_iter().chain(pq2) {
            let rows = 5;
            let m = stored(ty, rows, k, &mut s);
            let mut p = vec![0u8; m.len()];
            pack_rows(ty, &m, k, &mut p);
            let mut want = int8::Panel::default();
            want.decode(ty, &m, rows, k);
            let mut got = int8::Panel::default();
            got.decode_packed(ty, &p, rows, k);
            let (wc, wd) = want.contents();
            let (gc, gd) = got.contents();
            assert_eq!(wc, gc, "{ty} k {k}: codes");
            assert_eq!(bits(wd), bits(gd), "{ty} k {k}: scales");
        }
    }

    #[test]
    fn only_whole_groups_of_q8_0_and_ternary_types_pack() {
        assert!(!packs(GgmlType::Q8_0, 96));
        assert!(!packs(GgmlType::Q8_0, 0));
        assert!(!packs(GgmlType::PQ2_0, 384));
        assert!(!packs(GgmlType::PQ2_0, 0));
        assert!(!packs(GgmlType::PTQ1_0, 384));
        assert!(!packs(GgmlType::Q4_0, 1024));
        assert_eq!(packs(GgmlType::PQ2_0, 1024), packs(GgmlType::Q8_0, 1024));
        assert_eq!(packs(GgmlType::PTQ1_0, 1024), packs(GgmlType::Q8_0, 1024));
    }
}
