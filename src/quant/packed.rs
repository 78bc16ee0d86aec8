//! Q8_0 matrices repacked once at load for the serving path's VNNI row kernels.
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

use super::int8::{QActs, MAX_ROWS};
use crate::tensor::GgmlType;

/// Columns per packed group (four Q8_0 blocks).
const GROUP: usize = 128;

/// Whether the serving path packs a `ty` matrix of `k` columns: Q8_0, whole groups, and a CPU
/// with the packed kernel.
pub fn packs(ty: GgmlType, k: usize) -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        ty == GgmlType::Q8_0 && k > 0 && k.is_multiple_of(GROUP) && super::x86_int8::vnni_vl()
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        let _ = (ty, k);
        false
    }
}

/// Packs stored Q8_0 rows of `k` columns (`src`, whole rows) into `dst` (the same length).
pub fn pack_rows(src: &[u8], k: usize, dst: &mut [u8]) {
    let rb = row_bytes(k);
    assert!(
        k.is_multiple_of(GROUP) && src.len() == dst.len() && src.len().is_multiple_of(rb),
        "packed::pack_rows: {} bytes into {} for rows of {k}",
        src.len(),
        dst.len()
    );
    let ng = k / GROUP;
    for (s, d) in src.chunks_exact(rb).zip(dst.chunks_exact_mut(rb)) {
        let (levels, scales) = d.split_at_mut(ng * GROUP);
        for (g, (lv, sc)) in levels
            .chunks_exact_mut(GROUP)
            .zip(scales.chunks_exact_mut(8))
            .enumerate()
        {
            for c in 0..4 {
                let blk = &s[(4 * g + c) * 34..][..34];
                sc[2 * c..2 * c + 2].copy_from_slice(&blk[..2]);
                for h in 0..2 {
                    for (o, &w) in lv[64 * h + 16 * c..][..16]
                        .iter_mut()
                        .zip(&blk[2 + 16 * h..][..16])
                    {
                        *o = w ^ 0x80;
                    }
                }
            }
        }
    }
}

/// The stored Q8_0 row of `k` columns that `src` (one packed row) was packed from.
pub fn unpack_row(src: &[u8], k: usize, dst: &mut [u8]) {
    let rb = row_bytes(k);
    assert!(
        k.is_multiple_of(GROUP) && src.len() == rb && dst.len() == rb,
        "packed::unpack_row: {} bytes into {} for a row of {k}",
        src.len(),
        dst.len()
    );
    let ng = k / GROUP;
    let (levels, scales) = src.split_at(ng * GROUP);
    for (g, (lv, sc)) in levels
        .chunks_exact(GROUP)
        .zip(scales.chunks_exact(8))
        .enumerate()
    {
        for c in 0..4 {
            let blk = &mut dst[(4 * g + c) * 34..][..34];
            blk[..2].copy_from_slice(&sc[2 * c..2 * c + 2]);
            for h in 0..2 {
                for (o, &w) in blk[2 + 16 * h..][..16]
                    .iter_mut()
                    .zip(&lv[64 * h + 16 * c..][..16])
                {
                    *o = w ^ 0x80;
                }
            }
        }
    }
}

/// Bytes of a Q8_0 row of `k` columns, stored or packed (the file's row length).
fn row_bytes(k: usize) -> usize {
    GgmlType::Q8_0
        .row_bytes(k as u64)
        .expect("packed rows are whole Q8_0 blocks") as usize
}

/// [`int8::dot_span_rows`](super::int8::dot_span_rows) on packed rows: `out[r * n + i]` = packed
/// row r of `rows` against activation row `t0 + i`, for `n` (1 to [`MAX_ROWS`]) rows; the same
/// bits as `dot_span_rows` on the rows before packing. Only where [`packs`] is true.
pub fn dot_span(rows: &[u8], acts: &QActs, t0: usize, n: usize, out: &mut [f32]) {
    let k = acts.k;
    assert!(
        packs(acts.ty, k),
        "packed::dot_span: no packed kernel for {} rows of {k} on this CPU",
        acts.ty
    );
    assert!(
        (1..=MAX_ROWS).contains(&n) && t0 + n <= acts.rows(),
        "packed::dot_span: rows {t0}..{} of {}",
        t0 + n,
        acts.rows()
    );
    let rb = row_bytes(k);
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
        use super::x86_int8::q8_0_packed_span as span;
        match n {
            1 => span::<1>(rows, rb, acts, t0, out),
            2 => span::<2>(rows, rb, acts, t0, out),
            3 => span::<3>(rows, rb, acts, t0, out),
            _ => span::<4>(rows, rb, acts, t0, out),
        }
    }
}

/// An owned, 64-byte aligned byte buffer: a packed matrix, so that rows whose length is a
/// multiple of 64 (1,024 and 2,048 columns) start each group on a cache line.
pub struct AlignedBytes {
    buf: Vec<Line>,
    len: usize,
}

#[derive(Clone, Copy)]
#[repr(C, align(64))]
struct Line([u8; 64]);

impl AlignedBytes {
    pub fn zeroed(len: usize) -> AlignedBytes {
        AlignedBytes {
            buf: vec![Line([0; 64]); len.div_ceil(64)],
            len,
        }
    }
    pub fn as_slice(&self) -> &[u8] {
        // SAFETY: `buf` holds at least `len` initialized bytes; `Line` is plain bytes.
        unsafe { std::slice::from_raw_parts(self.buf.as_ptr() as *const u8, self.len) }
    }
    pub fn as_mut_slice(&mut self) -> &mut [u8] {
        // SAFETY: as `as_slice`, borrowed mutably.
        unsafe { std::slice::from_raw_parts_mut(self.buf.as_mut_ptr() as *mut u8, self.len) }
    }
    pub fn len(&self) -> usize {
        self.len
    }
    pub fn is_empty(&self) -> bool {
        self.len == 0
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

    /// Rows of random levels with scales of either sign between about 2^-9 and 2^-6.
    fn stored(rows: usize, k: usize, seed: &mut u64) -> Vec<u8> {
        let rb = row_bytes(k);
        let mut m = vec![0u8; rows * rb];
        for (i, b) in m.iter_mut().enumerate() {
            *b = match i % rb % 34 {
                1 => 0x18 + (rnd(seed) % 8) as u8 + if rnd(seed) & 1 == 0 { 0x80 } else { 0 },
                _ => rnd(seed) as u8,
            };
        }
        m
    }

    #[test]
    fn unpack_inverts_pack() {
        let mut s = 3u64;
        for k in [128, 384, 1024] {
            let m = stored(5, k, &mut s);
            let mut p = vec![0u8; m.len()];
            pack_rows(&m, k, &mut p);
            assert_ne!(p, m);
            let mut back = vec![0u8; row_bytes(k)];
            for (r, row) in p.chunks_exact(row_bytes(k)).enumerate() {
                unpack_row(row, k, &mut back);
                assert_eq!(
                    back,
                    m[r * row_bytes(k)..(r + 1) * row_bytes(k)],
                    "k {k} row {r}"
                );
            }
        }
    }

    /// Packed rows give `dot_span_rows`' bits on the stored rows, for 1 to 4 token rows from
    /// any first row, over spans that leave a remainder after the four-row passes (37 rows)
    /// and widths of one group, an odd number of groups and bench-0.8b's widths.
    #[test]
    fn packed_kernel_matches_stored_rows_bit_for_bit() {
        let mut s = 7u64;
        for k in [128, 384, 1024, 2048, 3584] {
            if !packs(GgmlType::Q8_0, k) {
                eprintln!("this CPU has no packed kernel: nothing to compare");
                return;
            }
            let rows = 37;
            let m = stored(rows, k, &mut s);
            let mut p = AlignedBytes::zeroed(m.len());
            pack_rows(&m, k, p.as_mut_slice());
            let x: Vec<f32> = (0..6 * k)
                .map(|_| (rnd(&mut s) % 2001) as f32 / 1000.0 - 1.0)
                .collect();
            let a = QActs::quantize(GgmlType::Q8_0, &x, k);
            for n in 1..=4 {
                for t0 in [0, 6 - n] {
                    let mut want = vec![0f32; rows * n];
                    int8::dot_span_rows(&m, &a, t0, n, &mut want);
                    let mut got = vec![1f32; rows * n];
                    dot_span(p.as_slice(), &a, t0, n, &mut got);
                    assert_eq!(bits(&want), bits(&got), "k {k}, {n} token rows from {t0}");
                }
            }
        }
    }

    /// The tiled product's panel decoded from packed rows is the panel of the stored rows:
    /// whole groups of 16 blocks (1,024 and 3,584 columns), a last group holding 12 blocks
    /// (384 and 896: its lanes masked), and narrow last groups that take the stored layout
    /// (128 and 2,176 columns: 4 blocks left over).
    #[test]
    fn packed_panel_is_the_stored_panel() {
        let mut s = 9u64;
        for k in [128, 384, 896, 1024, 2176, 3584] {
            let rows = 5;
            let m = stored(rows, k, &mut s);
            let mut p = vec![0u8; m.len()];
            pack_rows(&m, k, &mut p);
            let mut want = int8::Panel::default();
            want.decode(GgmlType::Q8_0, &m, rows, k);
            let mut got = int8::Panel::default();
            got.decode_packed(&p, rows, k);
            let (wc, wd) = want.contents();
            let (gc, gd) = got.contents();
            assert_eq!(wc, gc, "k {k}: codes");
            assert_eq!(bits(wd), bits(gd), "k {k}: scales");
        }
    }

    #[test]
    fn only_whole_groups_of_q8_0_pack() {
        assert!(!packs(GgmlType::Q8_0, 96));
        assert!(!packs(GgmlType::Q8_0, 0));
        assert!(!packs(GgmlType::PQ2_0, 1024));
        assert!(!packs(GgmlType::Q4_0, 1024));
    }
}
