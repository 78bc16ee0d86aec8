//! AVX-512 VNNI and AVX2 versions of the integer kernels in `int8.rs`, chosen at run time.
//!
//! VNNI's `vpdpbusd` multiplies unsigned by signed bytes and adds each four products into an
//! i32 lane, so the weight codes (Q8_0 biased by 128) are the unsigned operand and the
//! activations the signed one. AVX2's `vpmaddubsw` does the same into i16 pairs, which would
//! saturate on Q8_0's biased codes: there Q8_0 takes ggml's sign trick instead (`|w|` times
//! `x` carrying `w`'s sign). The kernels agree with `int8::dot_portable` up to the order of the
//! float sums of blocks (the integer sums are exact).

use std::arch::x86_64::*;

use super::int8::{Isa, Panel, QActs, TiledActs, Tiling, GROUP, MAX_ROWS};
use super::ptq1_0::{place, POW3};
use crate::tensor::GgmlType;

pub(super) fn vnni() -> bool {
    is_x86_feature_detected!("avx512f")
        && is_x86_feature_detected!("avx512bw")
        && is_x86_feature_detected!("avx512vnni")
        && is_x86_feature_detected!("f16c")
}

/// What the packed Q8_0 and PQ2_0 kernels need (`packed.rs`): VNNI, and VL for the scales'
/// 256-bit permute.
pub(super) fn vnni_vl() -> bool {
    vnni() && is_x86_feature_detected!("avx512vl")
}

pub(super) fn vbmi() -> bool {
    vnni() && is_x86_feature_detected!("avx512vbmi")
}

pub(super) fn avx2() -> bool {
    is_x86_feature_detected!("avx2")
        && is_x86_feature_detected!("fma")
        && is_x86_feature_detected!("f16c")
}

/// Runs the best kernel this CPU has for `acts`' type, at most `isa`, into `out`; false when it
/// has none (the caller falls back to the portable kernel). The caller checked the shapes.
pub(super) fn dot_rows(row: &[u8], acts: &QActs, t0: usize, out: &mut [f32], isa: Isa) -> bool {
    debug_assert!((1..=MAX_ROWS).contains(&out.len()));
    macro_rules! rows {
        ($kernel:ident) => {{
            // SAFETY: the feature check above the call; the shapes were checked by
            // `int8::dot_rows` (whole blocks of one row, rows t0..t0 + n of the activations).
            unsafe {
                match out.len() {
                    1 => $kernel::<1>(row, acts, t0, out),
                    2 => $kernel::<2>(row, acts, t0, out),
                    3 => $kernel::<3>(row, acts, t0, out),
                    _ => $kernel::<4>(row, acts, t0, out),
                }
            }
            return true;
        }};
    }
    use GgmlType::*;
    if isa >= Isa::Avx512Vnni && vnni() {
        match acts.ty {
            Q8_0 => rows!(q8_0_vnni),
            PQ2_0 | Q2_0Legacy => rows!(pq2_0_vnni),
            PTQ1_0 => rows!(ptq1_0_vnni),
            // Q4_0 has no 512-bit kernel: its AVX2 one below.
            _ => {}
        }
    }
    if isa >= Isa::Avx2 && avx2() {
        match acts.ty {
            Q8_0 => rows!(q8_0_avx2),
            Q4_0 => rows!(q4_0_avx2),
            PQ2_0 | Q2_0Legacy => rows!(pq2_0_avx2),
            PTQ1_0 => rows!(ptq1_0_avx2),
            _ => {}
        }
    }
    false
}

/// [`int8::dot_span_isa`](super::int8::dot_span_isa) and
/// [`int8::dot_span_rows_isa`](super::int8::dot_span_rows_isa)'s kernels: `out[r * n + i]` = the
/// row of `rb` bytes at `rows[r * rb..]` against activation row `t0 + i`, for `n` (1 to
/// [`MAX_ROWS`]) activation rows, one kernel choice for the span; false when the CPU (or `isa`)
/// has none. The caller checked the shapes.
pub(super) fn dot_span(
    rows: &[u8],
    rb: usize,
    acts: &QActs,
    t0: usize,
    n: usize,
    out: &mut [f32],
    isa: Isa,
) -> bool {
    debug_assert!((1..=MAX_ROWS).contains(&n));
    macro_rules! span {
        ($kernel:ident) => {{
            // SAFETY: the feature check above the call; `rows` holds `out.len() / n` rows of
            // `rb` bytes and `t0..t0 + n` are rows of the activations (`int8::dot_span_isa`).
            unsafe {
                match n {
                    1 => $kernel::<1>(rows, rb, acts, t0, out),
                    2 => $kernel::<2>(rows, rb, acts, t0, out),
                    3 => $kernel::<3>(rows, rb, acts, t0, out),
                    _ => $kernel::<4>(rows, rb, acts, t0, out),
                }
            }
            return true;
        }};
    }
    use GgmlType::*;
    if isa >= Isa::Avx512Vbmi && vbmi() && matches!(acts.ty, PQ2_0 | Q2_0Legacy) {
        span!(pq2_0_vbmi_span)
    }
    if isa >= Isa::Avx512Vnni && vnni() {
        match acts.ty {
            Q8_0 => span!(q8_0_vnni_span),
            PQ2_0 | Q2_0Legacy => span!(pq2_0_vnni_span),
            PTQ1_0 => span!(ptq1_0_vnni_span),
            _ => {}
        }
    }
    if isa >= Isa::Avx2 && avx2() {
        match acts.ty {
            Q8_0 => span!(q8_0_avx2_span),
            Q4_0 => span!(q4_0_avx2_span),
            PQ2_0 | Q2_0Legacy => span!(pq2_0_avx2_span),
            PTQ1_0 => span!(ptq1_0_avx2_span),
            _ => {}
        }
    }
    false
}

/// A span kernel from a row kernel: the weight-row loop inside the target-feature function, so
/// the row kernel inlines into it (the same instructions per row as `dot_rows`, bit for bit)
/// and the dispatch is paid once per span. `out` holds `N` results per weight row, weight row
/// by weight row.
macro_rules! span_of {
    ($name:ident, $row:ident, $($feat:literal),+) => {
        #[target_feature(enable = $($feat),+)]
        unsafe fn $name<const N: usize>(
            rows: &[u8],
            rb: usize,
            a: &QActs,
            t0: usize,
            out: &mut [f32],
        ) {
            for (o, row) in out.chunks_exact_mut(N).zip(rows.chunks_exact(rb)) {
                $row::<N>(row, a, t0, o);
            }
        }
    };
}

/// Words 0 and 17 of a 68-byte pair of 34-byte blocks, eight times each: the two blocks' f16
/// scales in the lanes of their integer sums, by one `vpermw` of the pair's first 64 bytes
/// (instead of two scalar loads, two broadcasts and an insert).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn pair_scales34(blk: *const u8) -> __m512 {
    let idx = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 17, 17, 17, 17, 17, 17, 17, 17, 0, 0, 0, 0,
        0, 0, 0, 0,
    );
    let w = _mm512_permutexvar_epi16(idx, _mm512_loadu_si512(blk as *const _));
    _mm512_cvtph_ps(_mm512_castsi512_si256(w))
}

span_of!(
    ptq1_0_vnni_span,
    ptq1_0_vnni,
    "avx512f,avx512bw,avx512vnni,avx2,fma,f16c"
);
span_of!(q8_0_avx2_span, q8_0_avx2, "avx2,fma,f16c");
span_of!(q4_0_avx2_span, q4_0_avx2, "avx2,fma,f16c");
span_of!(pq2_0_avx2_span, pq2_0_avx2, "avx2,fma,f16c");
span_of!(ptq1_0_avx2_span, ptq1_0_avx2, "avx2,fma,f16c");

#[inline(always)]
unsafe fn f16_at(p: *const u8) -> u16 {
    u16::from_le_bytes([*p, *p.add(1)])
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn f16_scalar(p: *const u8) -> f32 {
    _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(f16_at(p) as i32)))
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn hsum256(a: __m256) -> f32 {
    let v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)))
}

/// The 128 PTQ1_0 trits (0, 1, 2) of the block at `b`, in element order (see `ptq1_0.rs` for
/// the packing, and `x86::ptq1_0_levels` for the multiply trick).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn ptq1_0_codes(b: *const u8) -> [u8; 128] {
    let mut out = [0u8; 128];
    let o = out.as_mut_ptr();
    let three = _mm256_set1_epi16(3);
    let v = _mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(_mm_loadu_si128(b as *const __m128i)));
    for (n, &p) in POW3.iter().enumerate() {
        let t = _mm256_mulhi_epu16(_mm256_mullo_epi16(v, _mm256_set1_epi16(p as i16)), three);
        let t = _mm_packus_epi16(_mm256_castsi256_si128(t), _mm256_extracti128_si256::<1>(t));
        _mm_storeu_si128(o.add(16 * n) as *mut __m128i, t);
    }
    let three = _mm_set1_epi16(3);
    let v = _mm_slli_epi16::<8>(_mm_cvtepu8_epi16(_mm_loadl_epi64(
        b.add(16) as *const __m128i
    )));
    for (n, &p) in POW3.iter().enumerate() {
        let t = _mm_mulhi_epu16(_mm_mullo_epi16(v, _mm_set1_epi16(p as i16)), three);
        _mm_storel_epi64(o.add(80 + 8 * n) as *mut __m128i, _mm_packus_epi16(t, t));
    }
    let v = _mm_set1_epi32(((*b.add(24) as i32) << 8) | ((*b.add(25) as i32) << 24));
    let t = _mm_mulhi_epu16(
        _mm_mullo_epi16(v, _mm_setr_epi16(1, 1, 3, 3, 9, 9, 27, 27)),
        three,
    );
    _mm_storel_epi64(o.add(120) as *mut __m128i, _mm_packus_epi16(t, t));
    out
}

/// How far ahead of the block being read the row kernels ask for the weights: rows are read
/// once per token from memory, and the hardware prefetcher alone kept a core's stream well
/// below what the memory delivers (the next rows of a task follow the current one, so running
/// past a row's end pays). Streaming 384 MiB through `dot_span` in 64 KiB tasks on the bench
/// machine (thread-CPU GB/s, load 5-6, distances alternated, medians of 5), 1 KiB gave 6.7 GB/s
/// on PQ2_0 and 7.9 on Q8_0 per thread, 2 KiB 7.8 and 8.7, 4 KiB 7.9 and 9.4, 8 and 16 KiB no
/// more. The 2-4-row kernels of a few streams' step or a verify stream the same way: in a
/// same-run ABAB of `bench --engine --phases`, 4 KiB over 1 KiB took a 3-stream step from
/// 71.2/91.0 ms to 70.6/73.8 ms. The multi-row span kernels read four (Q8_0) or two (PQ2_0)
/// consecutive rows a pass, so 4 KiB ahead of the first is barely past the last: on a Zen 5
/// (four ABAB pairs of the same bench), 8 KiB took the matmuls from 23.7 to 23.1 ms at 1 stream
/// and from 29.5 to 28.2 ms at 3, means of four.
///
/// A pass over R rows asks from one cursor that runs through the R rows' bytes in address
/// order, R blocks' worth a step (`q8_0_vnni_rows`, `pq2_0_span_body`), not from each row's
/// own read point: R interleaved streams 8 KiB ahead each prefetched the same lines but out of
/// address order. Streaming 780 MB of Q8_0 rows of 1,024 columns from memory on 2 threads (Zen
/// 5, the kernels alternated in one process, medians of 7-15, four runs): 3 token rows
/// 29.4 / 34.1 / 29.8 / 26.1 -> 33.2 / 40.4 / 31.3 / 33.2 GB/s, beside 1 token row (one row a
/// pass: the same addresses as before) at 35.7 / 51.2 / 37.8 / 36.1.
const PREFETCH_BYTES: usize = 8192;

#[inline(always)]
unsafe fn prefetch(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_BYTES) as *const i8);
}

/// A multi-row pass (several weight rows against several token rows) asks twice from its
/// cursor: into L1 `PREFETCH_NEAR` ahead and into L2 `PREFETCH_FAR` ahead. Such a pass spends
/// more time per byte than a one-row pass, and one request 8 KiB ahead kept too few lines on
/// their way: streaming 768 MiB of Q8_0 rows from memory on 2 threads with 4 weight rows
/// against 3 token rows a pass (Zen 5, the variants alternated in one process, medians of 8,
/// two runs), 1,024 columns went from 39.1 / 37.9 GB/s to 43.9 / 39.7, 3,584 columns from
/// 33.5 / 33.2 to 39.3 / 38.6 and 2,048 from 36.8 to 45.7; 16 KiB ahead into L1 alone gave
/// 40.0 / 37.7, 38.4 / 38.7 and 40.8. On bench-0.8b Q8_0 (`bench --step --rows 3`, the two
/// builds alternated four times) the matmuls of a 3-stream step took 25.4 / 25.1 / 27.1 /
/// 25.1 ms before and 23.0 / 22.3 / 22.2 / 22.1 with it, FFN down (3,584 columns) 3.35 / 3.29
/// / 3.95 / 3.65 and 2.47 / 2.32 / 2.70 / 2.35: about what one token row's matmuls take. One-row
/// passes keep `prefetch` (the probe showed no gain there), and so do PQ2_0's two-row passes,
/// whose 3-stream matmuls are bound by arithmetic (10.6-11.5 ms either way).
const PREFETCH_NEAR: usize = 4096;
const PREFETCH_FAR: usize = 16384;

#[inline(always)]
unsafe fn prefetch_pass(p: *const u8) {
    _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(PREFETCH_NEAR) as *const i8);
    _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(PREFETCH_FAR) as *const i8);
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI

/// Q8_0 for one weight row (`dot_rows`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn q8_0_vnni<const N: usize>(row: &[u8], a: &QActs, t0: usize, out: &mut [f32]) {
    q8_0_vnni_rows::<1, N>(row, row.len(), a, t0, out)
}

/// A Q8_0 span through `$rows::<R, N>`: one weight row a pass for one token row, else four
/// while four remain (`in_groups`), then one at a time.
macro_rules! q8_0_span_in_fours {
    ($rows:ident, $n:ident, $r:expr, $rb:expr, $a:expr, $t0:expr, $out:expr) => {{
        let (rb, a, t0) = ($rb, $a, $t0);
        let one = |r: &[u8], o: &mut [f32]| {
            for (o, row) in o.chunks_exact_mut($n).zip(r.chunks_exact(rb)) {
                $rows::<1, $n>(row, rb, a, t0, o);
            }
        };
        if $n == 1 {
            return one($r, $out);
        }
        let wide = |r: &[u8], o: &mut [f32]| {
            for (o, rr) in o.chunks_exact_mut(4 * $n).zip(r.chunks_exact(4 * rb)) {
                $rows::<4, $n>(rr, rb, a, t0, o);
            }
        };
        in_groups::<4>($r, rb, $n, $out, wide, one)
    }};
}

/// Q8_0 over a span of rows: four weight rows a pass against the `N` token rows when `N` > 1,
/// so that each token row's activations, scales and offsets are loaded once for the four (the
/// loads, not the arithmetic, bounded the 2-4-row kernels that took one weight row a pass: 3
/// token rows ran at half the one-row kernel's bytes per second in L2; two weight rows a pass
/// gave 0.61-0.74 of it, four 0.83-0.86). Each (weight row, token row) pair sees the same
/// instructions in the same order whichever way, so the results are the same bits.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn q8_0_vnni_span<const N: usize>(
    rows: &[u8],
    rb: usize,
    a: &QActs,
    t0: usize,
    out: &mut [f32],
) {
    q8_0_span_in_fours!(q8_0_vnni_rows, N, rows, rb, a, t0, out)
}

/// The four-block step of the Q8_0 VNNI kernels, on the file's rows and on packed ones alike:
/// each weight row's two level vectors (`lo`, `hi`: lanes 4c..4c + 4 hold block c's halves)
/// and lane-wise scales `dw` against group `g` of the `N` token rows' quads (`QActs::quads`,
/// `d4`, `o4`), added into `acc[j][i]`. Two `vpdpbusd` into the same lanes, one conversion and
/// one scaled multiply-add per (weight row, token row) pair.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
// i and j name a (token row, weight row) pair across four arrays (see q8_0_vnni_rows).
#[allow(clippy::needless_range_loop)]
unsafe fn q8_0_quad_step<const R: usize, const N: usize>(
    lo: &[__m512i; R],
    hi: &[__m512i; R],
    dw: &[__m512; R],
    a: &QActs,
    t0: usize,
    g: usize,
    acc: &mut [[__m512; N]; R],
) {
    let ng = a.k / 128;
    for i in 0..N {
        let at = (t0 + i) * ng + g;
        let xq = a.quads.as_ptr().add(at * 128);
        let xlo = _mm512_loadu_si512(xq as *const _);
        let xhi = _mm512_loadu_si512(xq.add(64) as *const _);
        let dx = _mm512_loadu_ps(a.d4.as_ptr().add(at * 16));
        let o = _mm512_loadu_ps(a.o4.as_ptr().add(at * 16));
        for j in 0..R {
            let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), lo[j], xlo);
            let s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(s, hi[j], xhi));
            acc[j][i] = _mm512_fmadd_ps(dw[j], _mm512_fmsub_ps(dx, s, o), acc[j][i]);
        }
    }
}

/// Q8_0, `R` weight rows of `rb` bytes (back to back in `rows`) against `N` token rows: four
/// blocks per step while four remain, each block's halves in four lanes of two vectors
/// (`QActs::quads`), summed into the same i32 lanes by two `vpdpbusd` and scaled by `dw * dx`
/// lane-wise (`d4`, `o4`); then two blocks per step, eight lanes a block (`d8`, `o8`); a last
/// odd block goes through the portable block sum. `out[j * N + i]` is weight row j against
/// token row t0 + i.
///
/// The four-block step converts and scales each pair's sums once per four blocks where the
/// two-block step did so per two: 5 vector operations per (weight row, token row) pair and
/// four blocks instead of 8. The scaling is what bound three token rows (`bench --kernels
/// --span`, one thread in L2, 4 weight rows a pass): 3 rows 21.4 -> 25.9-27.2 GB/s, 2 rows
/// 27.7 -> 32.0-34.2, 1 row about the same (memory-bound anyway). In a 3-stream step at depth
/// 2,048 on bench-0.8b (`bench --engine --phases`, the builds alternated twice) the matmuls
/// took 39.89 / 38.88 ms before and 38.28 / 37.39 after, beside one stream's 37.3-37.9.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
// i and j name a (token row, weight row) pair across three arrays; zipped iterators over the
// two-level accumulator would hide which is which.
#[allow(clippy::needless_range_loop)]
unsafe fn q8_0_vnni_rows<const R: usize, const N: usize>(
    rows: &[u8],
    rb: usize,
    a: &QActs,
    t0: usize,
    out: &mut [f32],
) {
    let (k, nb) = (a.k, a.k / 32);
    let p: [*const u8; R] = std::array::from_fn(|j| rows.as_ptr().add(j * rb));
    let bias = _mm512_set1_epi8(-128);
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    let mut b = 0;
    let ng = nb / 4;
    debug_assert_eq!(a.quads.len(), a.rows * ng * 128);
    // Block b + c's levels at 2 + 34c: its halves to lanes 4c..4c + 4 of `lo` and `hi`.
    let four = _mm512_set_epi16(
        0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 0, 49, 49, 49, 49, 32, 32, 32, 32, 17, 17, 17,
        17, 0, 0, 0, 0,
    );
    while b + 4 <= nb {
        let mut lo = [_mm512_setzero_si512(); R];
        let mut hi = [_mm512_setzero_si512(); R];
        let mut dw = [_mm512_setzero_ps(); R];
        for j in 0..R {
            let blk = p[j].add(b * 34);
            for h in 0..2 {
                let ahead = p[0].add((b * R + 4 * j + 2 * h) * 34);
                if R == 1 {
                    prefetch(ahead);
                } else {
                    prefetch_pass(ahead);
                }
            }
            let ld = |o: usize| _mm256_loadu_si256(blk.add(o) as *const __m256i);
            let w01 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld(2)), ld(36));
            let w23 = _mm512_inserti64x4::<1>(_mm512_castsi256_si512(ld(70)), ld(104));
            lo[j] = _mm512_xor_si512(_mm512_shuffle_i64x2::<0x88>(w01, w23), bias);
            hi[j] = _mm512_xor_si512(_mm512_shuffle_i64x2::<0xdd>(w01, w23), bias);
            let sc = _mm512_permutex2var_epi16(
                _mm512_loadu_si512(blk as *const _),
                four,
                _mm512_loadu_si512(blk.add(68) as *const _),
            );
            dw[j] = _mm512_cvtph_ps(_mm512_castsi512_si256(sc));
        }
        q8_0_quad_step(&lo, &hi, &dw, a, t0, b / 4, &mut acc);
        b += 4;
    }
    while b + 2 <= nb {
        let mut w = [_mm512_setzero_si512(); R];
        let mut dw = [_mm512_setzero_ps(); R];
        for j in 0..R {
            let blk = p[j].add(b * 34);
            let ahead = p[0].add((b * R + 2 * j) * 34);
            if R == 1 {
                prefetch(ahead);
            } else {
                prefetch_pass(ahead);
            }
            let w0 = _mm256_loadu_si256(blk.add(2) as *const __m256i);
            let w1 = _mm256_loadu_si256(blk.add(36) as *const __m256i);
            w[j] = _mm512_xor_si512(
                _mm512_inserti64x4::<1>(_mm512_castsi256_si512(w0), w1),
                bias,
            );
            dw[j] = pair_scales34(blk);
        }
        for i in 0..N {
            let t = t0 + i;
            let x = _mm512_loadu_si512(a.qs.as_ptr().add(t * k + b * 32) as *const _);
            let l = (t * nb + b) * 8;
            let dx = _mm512_loadu_ps(a.d8.as_ptr().add(l));
            let o = _mm512_loadu_ps(a.o8.as_ptr().add(l));
            for j in 0..R {
                let s = _mm512_cvtepi32_ps(_mm512_dpbusd_epi32(_mm512_setzero_si512(), w[j], x));
                acc[j][i] = _mm512_fmadd_ps(dw[j], _mm512_fmsub_ps(dx, s, o), acc[j][i]);
            }
        }
        b += 2;
    }
    for j in 0..R {
        let row = &rows[j * rb..(j + 1) * rb];
        for i in 0..N {
            let t = t0 + i;
            let mut r = _mm512_reduce_add_ps(acc[j][i]);
            if b < nb {
                let blk = &row[b * 34..(b + 1) * 34];
                let q = &a.row(t)[b * 32..(b + 1) * 32];
                let s: i32 = blk[2..]
                    .iter()
                    .zip(q)
                    .map(|(&w, &x)| w as i8 as i32 * x as i32)
                    .sum();
                r += f16_scalar(blk.as_ptr()) * (a.d[t * nb + b] * s as f32);
            }
            out[j * N + i] = r;
        }
    }
}

/// [`packed::dot_span`](super::packed::dot_span)'s kernel: Q8_0 rows in the packed layout
/// (`packed.rs`), `out[r * N + i]` = row r against token row t0 + i; four weight rows a pass
/// when `N` > 1, as `q8_0_vnni_span`. A group's levels are the two vectors
/// `q8_0_vnni_rows` builds with two inserts, two shuffles and two XORs per weight row, and
/// its four scales widen with one permute: per (weight row, token row) pair the same five
/// operations in the same order, so the same bits as the kernel on the file's rows.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn q8_0_packed_span<const N: usize>(
    rows: &[u8],
    rb: usize,
    a: &QActs,
    t0: usize,
    out: &mut [f32],
) {
    q8_0_span_in_fours!(q8_0_packed_rows, N, rows, rb, a, t0, out)
}

/// `R` packed rows of `rb` bytes against `N` token rows (`q8_0_packed_span`). The prefetch
/// cursor runs through the R rows' bytes in address order, as in `q8_0_vnni_rows`, and asks
/// for both cache lines of each row's group.
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
#[inline]
// i and j name a (token row, weight row) pair across three arrays (see q8_0_vnni_rows).
#[allow(clippy::needless_range_loop)]
unsafe fn q8_0_packed_rows<const R: usize, const N: usize>(
    rows: &[u8],
    rb: usize,
    a: &QActs,
    t0: usize,
    out: &mut [f32],
) {
    let ng = a.k / 128;
    debug_assert_eq!(rb, ng * 136);
    debug_assert_eq!(a.quads.len(), a.rows * ng * 128);
    let p: [*const u8; R] = std::array::from_fn(|j| rows.as_ptr().add(j * rb));
    let spread = _mm256_set_epi16(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
    let mut acc = [[_mm512_setzero_ps(); N]; R];
    for g in 0..ng {
        let mut lo = [_mm512_setzero_si512(); R];
        let mut hi = [_mm512_setzero_si512(); R];
        let mut dw = [_mm512_setzero_ps(); R];
        for j in 0..R {
            let lv = p[j].add(g * 128);
            for h in 0..2 {
                if R == 1 {
                    prefetch(lv.add(64 * h));
                } else {
                    prefetch_pass(p[0].add((g * R + j) * 136 + 64 * h));
                }
            }
            lo[j] = _mm512_loadu_si512(lv as *const _);
            hi[j] = _mm512_loadu_si512(lv.add(64) as *const _);
            let sc = _mm_loadl_epi64(p[j].add(ng * 128 + g * 8) as *const __m128i);
            dw[j] = _mm512_cvtph_ps(_mm256_permutexvar_epi16(spread, _mm256_castsi128_si256(sc)));
        }
        q8_0_quad_step(&lo, &hi, &dw, a, t0, g, &mut acc);
    }
    for j in 0..R {
        for i in 0..N {
            out[j * N + i] = _mm512_reduce_add_ps(acc[j][i]);
        }
    }
}

/// A closure that splits 64 PQ2_0 code bytes into their four code planes (plane s: the codes at
/// bits 2s..2s + 2 of each byte, one per byte) by shifts and masks. A macro, so the closure
/// takes the target features of the kernel it is written in.
macro_rules! pq2_planes_shift {
    () => {{
        let m3 = _mm512_set1_epi8(3);
        move |q: __m512i| {
            [
                _mm512_and_si512(q, m3),
                _mm512_and_si512(_mm512_srli_epi16::<2>(q), m3),
                _mm512_and_si512(_mm512_srli_epi16::<4>(q), m3),
                _mm512_and_si512(_mm512_srli_epi16::<6>(q), m3),
            ]
        }
    }};
}

/// `pq2_planes_shift` by `vpermb` (VBMI): it indexes a 64-byte table by each byte's low six
/// bits, so the tables `(i >> 2s) & 3` give planes 0 to 2 in one instruction each (no mask),
/// and plane 3 is the top two bits shifted down first. Four instructions on the shuffle port
/// plus one shift, against seven shifts and masks.
macro_rules! pq2_planes_vbmi {
    () => {{
        let table = |s: usize| {
            let v: [u8; 64] = std::array::from_fn(|i| ((i >> (2 * s)) & 3) as u8);
            _mm512_loadu_si512(v.as_ptr() as *const _)
        };
        let (l0, l1, l2) = (table(0), table(1), table(2));
        move |q: __m512i| {
            [
                _mm512_permutexvar_epi8(q, l0),
                _mm512_permutexvar_epi8(q, l1),
                _mm512_permutexvar_epi8(q, l2),
                _mm512_permutexvar_epi8(_mm512_srli_epi16::<6>(q), l0),
            ]
        }
    }};
}

/// PQ2_0 rows in the packed layout (`packed.rs`) against `N` token rows, four blocks (512
/// columns) a step: a group's two 64-byte code vectors hold 16 bytes of each of its four
/// blocks, so their eight code planes meet the token row's eight activation vectors
/// (`QActs::quads`) with each i32 lane inside one block (lanes 4c..4c + 4 block c), and one
/// conversion and one scaled multiply-add per (weight row, token row) pair cover four blocks
/// where the stored rows' kernel (`pq2_0_span_body`) spends them on two: per pair and 512
/// columns 8 `vpdpbusd` and 3 other operations (4 for one token row) instead of 8 and 8, and
/// per weight row one scale
/// permute instead of two pair-scale widenings. `$planes` splits a code vector into its four
/// planes. One weight row a pass for one token row, two for several (`in_groups`); each pair
/// sees the same operations in the same order either way, so the same bits.
macro_rules! pq2_0_packed_body {
    ($r:ident, $n:ident, $rows:expr, $rb:expr, $a:expr, $t0:expr, $out:expr, $planes:expr) => {{
        let (rows, rb, a, t0, out): (&[u8], usize, &QActs, usize, &mut [f32]) =
            ($rows, $rb, $a, $t0, $out);
        let ng = a.k / 512;
        debug_assert_eq!(rb, ng * 136);
        debug_assert_eq!(a.quads.len(), a.rows * a.k);
        let spread = _mm256_set_epi16(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0);
        for (out, rr) in out
            .chunks_exact_mut($r * $n)
            .zip(rows.chunks_exact($r * rb))
        {
            let p: [*const u8; $r] = std::array::from_fn(|j| rr.as_ptr().add(j * rb));
            let mut acc = [[_mm512_setzero_ps(); $n]; $r];
            for g in 0..ng {
                let mut c = [[_mm512_setzero_si512(); 8]; $r];
                let mut dw = [_mm512_setzero_ps(); $r];
                for j in 0..$r {
                    let cv = p[j].add(g * 128);
                    for h in 0..2 {
                        if $r == 1 {
                            prefetch(cv.add(64 * h));
                        } else {
                            prefetch_pass(p[0].add((g * $r + j) * 136 + 64 * h));
                        }
                        let pl: [__m512i; 4] =
                            $planes(_mm512_loadu_si512(cv.add(64 * h) as *const _));
                        c[j][4 * h..4 * h + 4].copy_from_slice(&pl);
                    }
                    let sc = _mm_loadl_epi64(p[j].add(ng * 128 + g * 8) as *const __m128i);
                    dw[j] = _mm512_cvtph_ps(_mm256_permutexvar_epi16(
                        spread,
                        _mm256_castsi128_si256(sc),
                    ));
                }
                for i in 0..$n {
                    let at = (t0 + i) * ng + g;
                    let x = a.quads.as_ptr().add(at * 512);
                    let dx = _mm512_loadu_ps(a.d4.as_ptr().add(at * 16));
                    let o = _mm512_loadu_ps(a.o4.as_ptr().add(at * 16));
                    for j in 0..$r {
                        let c = &c[j];
                        let xv = |v: usize| _mm512_loadu_si512(x.add(64 * v) as *const _);
                        // The integer sums are exact in any order, so the chains may differ
                        // with the row count. One token row has one pair in flight: two
                        // chains of four, so its sums do not wait eight deep. Several have
                        // other pairs to overlap, and one chain of eight saves the add: 3
                        // rows 5.9-9.5 -> 6.7-10.5 GB/s at 1,024 columns and 6.1-10.0 ->
                        // 7.6-12.4 at 3,584 (one thread, the two alternated in one process,
                        // four runs), where one row lost 7-11% to one chain.
                        let s = if $n == 1 {
                            let z = _mm512_setzero_si512();
                            let mut sa = _mm512_dpbusd_epi32(z, c[0], xv(0));
                            let mut sb = _mm512_dpbusd_epi32(z, c[1], xv(1));
                            for v in (2..8).step_by(2) {
                                sa = _mm512_dpbusd_epi32(sa, c[v], xv(v));
                                sb = _mm512_dpbusd_epi32(sb, c[v + 1], xv(v + 1));
                            }
                            _mm512_add_epi32(sa, sb)
                        } else {
                            let mut sa = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], xv(0));
                            for v in 1..8 {
                                sa = _mm512_dpbusd_epi32(sa, c[v], xv(v));
                            }
                            sa
                        };
                        let s = _mm512_cvtepi32_ps(s);
                        acc[j][i] = _mm512_fmadd_ps(dw[j], _mm512_fmsub_ps(dx, s, o), acc[j][i]);
                    }
                }
            }
            for j in 0..$r {
                for i in 0..$n {
                    out[j * $n + i] = _mm512_reduce_add_ps(acc[j][i]);
                }
            }
        }
    }};
}

/// A PQ2_0 span through the body macro `$body` (`pq2_0_span_body`, `pq2_0_packed_body`): one
/// weight row a pass for one token row (memory-bound, no loads to share), two a pass for
/// several (see `q8_0_vnni_span`).
macro_rules! pq2_0_in_twos {
    ($body:ident, $n:ident, $rows:expr, $rb:expr, $a:expr, $t0:expr, $out:expr, $planes:expr) => {{
        let (rows, rb, a, t0, out) = ($rows, $rb, $a, $t0, $out);
        if $n == 1 {
            $body!(ONE, $n, rows, rb, a, t0, out, $planes)
        } else {
            in_groups::<2>(
                rows,
                rb,
                $n,
                out,
                |r, o| $body!(TWO, $n, r, rb, a, t0, o, $planes),
                |r, o| $body!(ONE, $n, r, rb, a, t0, o, $planes),
            )
        }
    }};
}

/// [`packed::dot_span`](super::packed::dot_span)'s PQ2_0 kernel (`pq2_0_packed_body`): the
/// planes by `vpermb` where the CPU has VBMI, else by shifts and masks (the same planes).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx2,fma,f16c")]
pub(super) unsafe fn pq2_0_packed_span<const N: usize>(
    rows: &[u8],
    rb: usize,
    a: &QActs,
    t0: usize,
    out: &mut [f32],
) {
    if vbmi() {
        return pq2_0_packed_vbmi::<N>(rows, rb, a, t0, out);
    }
    let planes = pq2_planes_shift!();
    pq2_0_in_twos!(pq2_0_packed_body, N, rows, rb, a, t0, out, planes)
}

/// `pq2_0_packed_span` with the planes by table lookup (`pq2_planes_vbmi`).
#[target_feature(enable = "avx512f,avx512bw,avx512vl,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn pq2_0_packed_vbmi<const N: usize>(
    rows: &[u8],
    rb: usize,
    a: &QActs,
    t0: usize,
    out: &mut [f32],
) {
    let planes = pq2_planes_vbmi!();
    pq2_0_in_twos!(pq2_0_packed_body, N, rows, rb, a, t0, out, planes)
}

/// Dots 128 codes (two 64-byte vectors) with each row's 128 activations of block `b`, and
/// scales: the shared tail of the PQ2_0 and PTQ1_0 VNNI kernels.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn codes128_vnni<const N: usize>(
    c: [__m512i; 2],
    dw: f32,
    a: &QActs,
    t0: usize,
    b: usize,
    acc: &mut [__m512; N],
    off: &mut [f32; N],
) {
    let (k, nb) = (a.k, a.k / 128);
    for (i, (acc, off)) in acc.iter_mut().zip(off.iter_mut()).enumerate() {
        let t = t0 + i;
        let x = a.qs.as_ptr().add(t * k + b * 128);
        let x0 = _mm512_loadu_si512(x as *const _);
        let x1 = _mm512_loadu_si512(x.add(64) as *const _);
        let s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], x0);
        let s = _mm512_dpbusd_epi32(s, c[1], x1);
        *acc = _mm512_fmadd_ps(
            _mm512_cvtepi32_ps(s),
            _mm512_set1_ps(dw * a.d[t * nb + b]),
            *acc,
        );
        *off += dw * a.o[t * nb + b];
    }
}

/// PQ2_0: two blocks per step against the paired levels (`int8::pair_levels`): the two blocks'
/// 64 code bytes in one vector, split into four code planes by `$planes`, and the integer sums
/// (lanes 0..8 the first block's, 8..16 the second's) scaled lane-wise by `dw * (dx * S - o)`
/// as Q8_0's are. A last odd block goes through the one-block step. The planes are exact
/// whichever instructions make them, so both kernels below give the same bits.
macro_rules! pq2_0_span_body {
    ($r:ident, $n:ident, $rows:expr, $rb:expr, $a:expr, $t0:expr, $out:expr, $planes:expr) => {{
        let (rows, rb, a, t0, out): (&[u8], usize, &QActs, usize, &mut [f32]) =
            ($rows, $rb, $a, $t0, $out);
        let (k, nb) = (a.k, a.k / 128);
        let np = nb / 2;
        let m3 = _mm512_set1_epi8(3);
        for (out, rr) in out
            .chunks_exact_mut($r * $n)
            .zip(rows.chunks_exact($r * rb))
        {
            let p: [*const u8; $r] = std::array::from_fn(|j| rr.as_ptr().add(j * rb));
            let mut acc = [[_mm512_setzero_ps(); $n]; $r];
            for pp in 0..np {
                let mut c = [[_mm512_setzero_si512(); 4]; $r];
                let mut dw = [_mm512_setzero_ps(); $r];
                for j in 0..$r {
                    let blk = p[j].add(pp * 68);
                    prefetch(p[0].add((pp * $r + j) * 68));
                    let q = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_loadu_si256(blk.add(2) as *const __m256i)),
                        _mm256_loadu_si256(blk.add(36) as *const __m256i),
                    );
                    c[j] = $planes(q);
                    dw[j] = pair_scales34(blk);
                }
                for i in 0..$n {
                    let t = t0 + i;
                    let x = a.pairs.as_ptr().add(t * k + pp * 256);
                    let xv = [0, 1, 2, 3].map(|s| _mm512_loadu_si512(x.add(64 * s) as *const _));
                    let l = (t * np + pp) * 16;
                    let dx = _mm512_loadu_ps(a.d16.as_ptr().add(l));
                    let o = _mm512_loadu_ps(a.o16.as_ptr().add(l));
                    for j in 0..$r {
                        let c = &c[j];
                        // Two chains of two, so a row's sums do not wait on one another four
                        // deep.
                        let s01 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[0], xv[0]);
                        let s23 = _mm512_dpbusd_epi32(_mm512_setzero_si512(), c[2], xv[2]);
                        let s01 = _mm512_dpbusd_epi32(s01, c[1], xv[1]);
                        let s23 = _mm512_dpbusd_epi32(s23, c[3], xv[3]);
                        let s = _mm512_cvtepi32_ps(_mm512_add_epi32(s01, s23));
                        acc[j][i] = _mm512_fmadd_ps(dw[j], _mm512_fmsub_ps(dx, s, o), acc[j][i]);
                    }
                }
            }
            for j in 0..$r {
                let mut off = [0f32; $n];
                if nb % 2 == 1 {
                    // The last block in the one-block layout: planes 0 and 2 from the low 256
                    // bits of each 16-bit lane's shift, 1 and 3 from the high.
                    let b = nb - 1;
                    let blk = p[j].add(b * 34);
                    let sh01 =
                        _mm512_inserti64x4::<1>(_mm512_setzero_si512(), _mm256_set1_epi16(2));
                    let sh23 = _mm512_inserti64x4::<1>(
                        _mm512_castsi256_si512(_mm256_set1_epi16(4)),
                        _mm256_set1_epi16(6),
                    );
                    let q =
                        _mm512_broadcast_i64x4(_mm256_loadu_si256(blk.add(2) as *const __m256i));
                    let c = [
                        _mm512_and_si512(_mm512_srlv_epi16(q, sh01), m3),
                        _mm512_and_si512(_mm512_srlv_epi16(q, sh23), m3),
                    ];
                    codes128_vnni(c, f16_scalar(blk), a, t0, b, &mut acc[j], &mut off);
                }
                for i in 0..$n {
                    out[j * $n + i] = _mm512_reduce_add_ps(acc[j][i]) - off[i];
                }
            }
        }
    }};
}

/// A span in groups of `R` weight rows (`wide`) while whole groups last, then one at a time
/// (`one`): the multi-row kernels take two or four weight rows per pass when several token
/// rows share their activation loads.
#[inline(always)]
fn in_groups<const R: usize>(
    rows: &[u8],
    rb: usize,
    n: usize,
    out: &mut [f32],
    mut wide: impl FnMut(&[u8], &mut [f32]),
    mut one: impl FnMut(&[u8], &mut [f32]),
) {
    let whole = (out.len() / n / R) * R;
    let (ow, o1) = out.split_at_mut(whole * n);
    let (rw, r1) = rows.split_at(whole * rb);
    wide(rw, ow);
    one(r1, o1);
}

/// PQ2_0 over a span of rows, the planes by immediate shifts and masks; two weight rows a pass
/// for several token rows (see `q8_0_vnni_span`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn pq2_0_vnni_span<const N: usize>(
    rows: &[u8],
    rb: usize,
    a: &QActs,
    t0: usize,
    out: &mut [f32],
) {
    let planes = pq2_planes_shift!();
    pq2_0_in_twos!(pq2_0_span_body, N, rows, rb, a, t0, out, planes)
}

const ONE: usize = 1;
const TWO: usize = 2;

/// PQ2_0 for one weight row (`dot_rows`): the span kernel on a span of one.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn pq2_0_vnni<const N: usize>(row: &[u8], a: &QActs, t0: usize, out: &mut [f32]) {
    pq2_0_vnni_span::<N>(row, row.len(), a, t0, out)
}

/// PQ2_0 over a span of rows, the planes by `vpermb` (`pq2_planes_vbmi`).
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx512vbmi,avx2,fma,f16c")]
unsafe fn pq2_0_vbmi_span<const N: usize>(
    rows: &[u8],
    rb: usize,
    a: &QActs,
    t0: usize,
    out: &mut [f32],
) {
    let planes = pq2_planes_vbmi!();
    pq2_0_in_twos!(pq2_0_span_body, N, rows, rb, a, t0, out, planes)
}

/// Where each of a PTQ1_0 block's 128 trits lies (`ptq1_0.rs`): for element `e`, the byte of
/// the block that holds it and the power of three that brings its trit to the top of the byte.
/// In four tables of 32 16-bit lanes, elements `32v..32v + 32` in table `v`.
const fn ptq1_0_lanes(pow: bool) -> [[i16; 32]; 4] {
    let mut t = [[0i16; 32]; 4];
    let mut e = 0;
    while e < 128 {
        let (byte, n) = place(e);
        t[e / 32][e % 32] = if pow { POW3[n] as i16 } else { byte as i16 };
        e += 1;
    }
    t
}

const PTQ1_0_BYTE: [[i16; 32]; 4] = ptq1_0_lanes(false);
const PTQ1_0_POW3: [[i16; 32]; 4] = ptq1_0_lanes(true);

/// A PTQ1_0 block's 128 trits (0, 1, 2) in element order, in registers: each byte is put in the
/// high half of the 16-bit lanes of the elements it holds (`vpermw`), so that one `vpmullw` by
/// the lane's power of three leaves `byte * 3^n mod 256` there and one `vpmulhuw` by 3 the trit
/// (the scalar decoder's `((byte * 3^n) as u8 as u16 * 3) >> 8`, exact). 16-bit lanes back to
/// bytes: `vpermt2b` of two vectors' low bytes with VBMI, else `vpmovwb`. The tiled product's
/// panels take these codes (they decoded through f32 before); the row kernels skip decoding
/// altogether (`ptq1_0_vnni`).
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn ptq1_0_codes512<const VBMI: bool>(blk: *const u8) -> [__m512i; 2] {
    // The 28 bytes alone: a masked load does not touch (or fault on) what follows the block.
    let raw = _mm512_maskz_loadu_epi8(0x0fff_ffff, blk as *const i8);
    let hi = _mm512_slli_epi16::<8>(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(raw)));
    let three = _mm512_set1_epi16(3);
    let w: [__m512i; 4] = std::array::from_fn(|v| {
        let idx = _mm512_loadu_si512(PTQ1_0_BYTE[v].as_ptr() as *const _);
        let pow = _mm512_loadu_si512(PTQ1_0_POW3[v].as_ptr() as *const _);
        let t = _mm512_mullo_epi16(_mm512_permutexvar_epi16(idx, hi), pow);
        _mm512_mulhi_epu16(t, three)
    });
    if VBMI {
        // `VBMI` is the caller's word that the CPU has it (`ptq1_0_codes512_vbmi`).
        [pack_words_vbmi(w[0], w[1]), pack_words_vbmi(w[2], w[3])]
    } else {
        let pack = |a: __m512i, b: __m512i| {
            _mm512_inserti64x4::<1>(
                _mm512_castsi256_si512(_mm512_cvtepi16_epi8(a)),
                _mm512_cvtepi16_epi8(b),
            )
        };
        [pack(w[0], w[1]), pack(w[2], w[3])]
    }
}

/// The low bytes of `a`'s 32 16-bit lanes, then of `b`'s.
#[target_feature(enable = "avx512f,avx512bw,avx512vbmi")]
#[inline]
unsafe fn pack_words_vbmi(a: __m512i, b: __m512i) -> __m512i {
    const IDX: [u8; 64] = {
        let mut t = [0u8; 64];
        let mut p = 0;
        while p < 64 {
            t[p] = if p < 32 { 2 * p } else { 64 + 2 * (p - 32) } as u8;
            p += 1;
        }
        t
    };
    _mm512_permutex2var_epi8(a, _mm512_loadu_si512(IDX.as_ptr() as *const _), b)
}

/// PTQ1_0 for one weight row with no trit decoded (`int8::digit_levels`): per block, the 26
/// bytes in the high halves of 16-bit lanes, five `vpmulhuw` by `3^(n+1)` give each byte's
/// base-3 prefixes `A_n`, and five `vpdpwssd` against the activations' digit levels the
/// block's integer sum. Decoding the trits to bytes and dotting them (`ptq1_0_codes512`, the
/// panels' decoder) ran at 7.5 GB/s of rows per thread in L2 on a Zen 5, this at 8.2-9.4.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
#[inline]
unsafe fn ptq1_0_vnni<const N: usize>(row: &[u8], a: &QActs, t0: usize, out: &mut [f32]) {
    let nb = a.k / 128;
    let mut acc = [_mm512_setzero_ps(); N];
    let mut off = [0f32; N];
    let pow: [__m512i; 5] = std::array::from_fn(|n| _mm512_set1_epi16(POW3[n] as i16 * 3));
    for b in 0..nb {
        let blk = row.as_ptr().add(b * 28);
        prefetch(blk);
        // The 28 bytes alone: a masked load does not touch (or fault on) what follows.
        let raw = _mm512_maskz_loadu_epi8(0x0fff_ffff, blk as *const i8);
        let hi = _mm512_slli_epi16::<8>(_mm512_cvtepu8_epi16(_mm512_castsi512_si256(raw)));
        let pre: [__m512i; 5] = std::array::from_fn(|n| _mm512_mulhi_epu16(hi, pow[n]));
        let dw = f16_scalar(blk.add(26));
        for (i, (acc, off)) in acc.iter_mut().zip(off.iter_mut()).enumerate() {
            let t = t0 + i;
            let y = a.digits.as_ptr().add((t * nb + b) * 160);
            let mut s = _mm512_setzero_si512();
            for (n, p) in pre.iter().enumerate() {
                s = _mm512_dpwssd_epi32(s, *p, _mm512_loadu_si512(y.add(32 * n) as *const _));
            }
            *acc = _mm512_fmadd_ps(
                _mm512_cvtepi32_ps(s),
                _mm512_set1_ps(dw * a.d[t * nb + b]),
                *acc,
            );
            *off += dw * a.o[t * nb + b];
        }
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = _mm512_reduce_add_ps(acc[i]) - off[i];
    }
}

/// [`int8::Panel::decode_isa`](super::int8::Panel::decode_isa)'s vector path for the types
/// `panel_row` does not write in place: a row's codes (in element order) and block scales, for
/// PTQ1_0; false for the other types, or without AVX-512 BW or below `isa` VNNI.
pub(super) fn decode_codes(
    ty: GgmlType,
    row: &[u8],
    codes: &mut [u8],
    dw: &mut [f32],
    isa: Isa,
) -> bool {
    if ty != GgmlType::PTQ1_0 || isa < Isa::Avx512Vnni || !vnni() {
        return false;
    }
    // SAFETY: AVX-512 F and BW (part of `vnni`) checked above; each block's 28 bytes and
    // 128 codes are whole chunks of `row` and `codes`.
    unsafe {
        let vbmi = isa >= Isa::Avx512Vbmi && vbmi();
        for ((blk, c), d) in row
            .chunks_exact(28)
            .zip(codes.chunks_exact_mut(128))
            .zip(dw)
        {
            let blk = blk.as_ptr();
            let v = if vbmi {
                ptq1_0_codes512_vbmi(blk)
            } else {
                ptq1_0_codes512::<false>(blk)
            };
            _mm512_storeu_si512(c.as_mut_ptr() as *mut _, v[0]);
            _mm512_storeu_si512(c.as_mut_ptr().add(64) as *mut _, v[1]);
            *d = f16_scalar(blk.add(26));
        }
    }
    true
}

#[target_feature(enable = "avx512f,avx512bw,avx512vbmi,avx2,fma,f16c")]
unsafe fn ptq1_0_codes512_vbmi(blk: *const u8) -> [__m512i; 2] {
    ptq1_0_codes512::<true>(blk)
}

// ---------------------------------------------------------------------------------------------
// AVX-512 VNNI tiled product

/// Weight rows per register tile of the tiled product.
const MR: usize = 4;
/// Activation rows per register tile.
const NR: usize = 4;

/// [`int8::gemm_isa`](super::int8::gemm_isa)'s vector kernels: false when the CPU (or `isa`)
/// has none. The caller checked the shapes.
pub(super) fn gemm(
    p: &Panel,
    a: &TiledActs,
    t0: usize,
    n: usize,
    out: &mut [f32],
    isa: Isa,
) -> bool {
    if isa < Isa::Avx512Vnni || !vnni() {
        return false;
    }
    macro_rules! tile {
        ($r0:expr, $i0:expr, $m:literal, $n:literal) => {
            // SAFETY: VNNI checked above; rows r0..r0 + m of the panel and t0 + i0.. + n of
            // the activations exist (the loops below), and out holds n rows of p.rows.
            unsafe { tile_vnni::<$m, $n>(p, $r0, a, t0 + $i0, &mut out[$i0 * p.rows..], p.rows) }
        };
    }
    macro_rules! rows {
        ($r0:expr, $i0:expr, $n:literal) => {
            match (p.rows - $r0).min(MR) {
                1 => tile!($r0, $i0, 1, $n),
                2 => tile!($r0, $i0, 2, $n),
                3 => tile!($r0, $i0, 3, $n),
                _ => tile!($r0, $i0, 4, $n),
            }
        };
    }
    for r0 in (0..p.rows).step_by(MR) {
        for i0 in (0..n).step_by(NR) {
            match (n - i0).min(NR) {
                1 => rows!(r0, i0, 1),
                2 => rows!(r0, i0, 2),
                3 => rows!(r0, i0, 3),
                _ => rows!(r0, i0, 4),
            }
        }
    }
    true
}

/// A tile of `M` panel rows from `r0` by `N` activation rows from `t`: per group of 16 blocks,
/// `vpdpbusd` over its 64-byte vectors into one i32 accumulator per pair (lane `i` = block `i`'s
/// sum), then per pair one lane-wise `dw * (dx * S - o)` into the f32 accumulator.
#[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
unsafe fn tile_vnni<const M: usize, const N: usize>(
    p: &Panel,
    r0: usize,
    a: &TiledActs,
    t: usize,
    out: &mut [f32],
    ldo: usize,
) {
    let tl = p.tiling;
    let (rl, ls) = (tl.row_len(), tl.lanes());
    let mut facc = [[_mm512_setzero_ps(); N]; M];
    for g in 0..tl.groups {
        let (at, len) = (tl.group_at(g), tl.width(g) * tl.qk);
        let cp: [*const u8; M] = std::array::from_fn(|m| p.codes.as_ptr().add((r0 + m) * rl + at));
        let xp: [*const i8; N] = std::array::from_fn(|n| a.qs.as_ptr().add((t + n) * rl + at));
        let mut iacc = [[_mm512_setzero_si512(); N]; M];
        for j in (0..len).step_by(64) {
            let c: [__m512i; M] =
                std::array::from_fn(|m| _mm512_loadu_si512(cp[m].add(j) as *const _));
            let x: [__m512i; N] =
                std::array::from_fn(|n| _mm512_loadu_si512(xp[n].add(j) as *const _));
            for m in 0..M {
                for n in 0..N {
                    iacc[m][n] = _mm512_dpbusd_epi32(iacc[m][n], c[m], x[n]);
                }
            }
        }
        for n in 0..N {
            let l = (t + n) * ls + g * GROUP;
            let dx = _mm512_loadu_ps(a.d.as_ptr().add(l));
            let o = _mm512_loadu_ps(a.o.as_ptr().add(l));
            for m in 0..M {
                let dw = _mm512_loadu_ps(p.dw.as_ptr().add((r0 + m) * ls + g * GROUP));
                let v = _mm512_fmsub_ps(dx, _mm512_cvtepi32_ps(iacc[m][n]), o);
                facc[m][n] = _mm512_fmadd_ps(dw, v, facc[m][n]);
            }
        }
    }
    for (m, facc) in facc.iter().enumerate() {
        for (n, facc) in facc.iter().enumerate() {
            out[n * ldo + r0 + m] = _mm512_reduce_add_ps(*facc);
        }
    }
}

/// One block of `int8::quantize_row` (16 to 128 elements): its levels in element order into
/// `lv`, its scale and the sum of its levels, bit for bit. The rounding is `f32::round`'s, ties
/// away from zero, not the vector unit's ties to even; a NaN level is 0 and an infinite one
/// saturates, as Rust's `as i8` has them.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn quantize_block(xb: &[f32], lv: &mut [i8; 128]) -> (f32, i32) {
    let nv = xb.len() / 16;
    let xp = xb.as_ptr();
    let sign = _mm512_set1_epi32(i32::MIN);
    let (one, half) = (_mm512_set1_ps(1.0), _mm512_set1_ps(0.5));
    let (lo, hi) = (_mm512_set1_ps(-128.0), _mm512_set1_ps(127.0));
    // `abs` first: max_ps answers its second operand when one is NaN, so a NaN element is
    // skipped as `f32::max` skips it.
    let mut m = _mm512_setzero_ps();
    for v in 0..nv {
        m = _mm512_max_ps(_mm512_abs_ps(_mm512_loadu_ps(xp.add(16 * v))), m);
    }
    let db = _mm512_reduce_max_ps(m) / 127.0;
    let id = _mm512_set1_ps(if db > 0.0 { 1.0 / db } else { 0.0 });
    let mut sum = _mm512_setzero_si512();
    for v in 0..nv {
        let y = _mm512_mul_ps(_mm512_loadu_ps(xp.add(16 * v)), id);
        let y = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask::<_CMP_ORD_Q>(y, y), y);
        let t = _mm512_roundscale_ps::<{ _MM_FROUND_TO_ZERO | _MM_FROUND_NO_EXC }>(y);
        let up = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(_mm512_abs_ps(_mm512_sub_ps(y, t)), half);
        let away = _mm512_castsi512_ps(_mm512_or_si512(
            _mm512_and_si512(_mm512_castps_si512(y), sign),
            _mm512_castps_si512(one),
        ));
        let r = _mm512_min_ps(_mm512_max_ps(_mm512_mask_add_ps(t, up, t, away), lo), hi);
        let l = _mm512_cvtps_epi32(r);
        sum = _mm512_add_epi32(sum, l);
        _mm_storeu_si128(
            lv.as_mut_ptr().add(16 * v) as *mut __m128i,
            _mm512_cvtepi32_epi8(l),
        );
    }
    (db, _mm512_reduce_add_epi32(sum))
}

/// A ternary block's 128 levels in PQ2_0's interleaved order: position `32s + m` takes element
/// `4m + s`, byte `s` of the levels' dword `m`.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn interleave_block(lv: &[i8; 128], il: &mut [i8]) {
    debug_assert_eq!(il.len(), 128);
    for (h, half) in lv.chunks_exact(64).enumerate() {
        let w = _mm512_loadu_si512(half.as_ptr() as *const _);
        for s in 0..4 {
            let p = _mm512_cvtepi32_epi8(_mm512_srl_epi32(w, _mm_cvtsi32_si128(8 * s)));
            let at = il.as_mut_ptr().add(32 * s as usize + 16 * h);
            _mm_storeu_si128(at as *mut __m128i, p);
        }
    }
}

/// `int8::quantize_row` bit for bit ([`quantize_block`]): a decode step's activations, which
/// the scalar loop (`f32::round` a libm call per element without SSE4.1 in the baseline)
/// quantized in microseconds per product while the other threads waited.
///
/// # Safety
/// AVX-512 F and BW are available; `q` holds `x.len()` levels and `d`, `o` one value per block
/// of `qk` (16 to 128, a multiple of 16; 128 where `interleave`).
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn quantize_row(
    qk: usize,
    z: f32,
    interleave: bool,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    o: &mut [f32],
) {
    let mut lv = [0i8; 128];
    for (((xb, qb), d), o) in x
        .chunks_exact(qk)
        .zip(q.chunks_exact_mut(qk))
        .zip(d.iter_mut())
        .zip(o.iter_mut())
    {
        let (db, sum) = quantize_block(xb, &mut lv);
        if interleave {
            interleave_block(&lv, qb);
        } else {
            qb.copy_from_slice(&lv[..qk]);
        }
        *d = db;
        *o = z * db * sum as f32;
    }
}

/// Prefill's activations ([`TiledActs::quantize`]): one row, per block of `qk` the scale, the
/// levels and the zero-point term of `int8::quantize_row` bit for bit ([`quantize_block`]),
/// written straight into the tiled layout (`int8::Tiling`; PQ2_0's levels interleaved within
/// each block first).
///
/// # Safety
/// AVX-512 F and BW are available; `q`, `d` and `o` hold whole groups of the row's blocks.
#[target_feature(enable = "avx512f,avx512bw")]
pub(super) unsafe fn quantize_tiled_row(
    tl: &Tiling,
    z: f32,
    interleave: bool,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    o: &mut [f32],
) {
    let qk = tl.qk;
    let (mut db_row, mut o_row) = (vec![0f32; tl.nb], vec![0f32; tl.nb]);
    let mut lv = [0i8; 128];
    let mut il = [0i8; 128];
    for (b, xb) in x.chunks_exact(qk).enumerate() {
        let (db, sum) = quantize_block(xb, &mut lv);
        let src = if interleave {
            interleave_block(&lv, &mut il);
            &il[..]
        } else {
            &lv[..qk]
        };
        tl.put(b, src, q);
        db_row[b] = db;
        o_row[b] = z * db * sum as f32;
    }
    tl.spread(&db_row, d, true);
    tl.spread(&o_row, o, false);
}

/// [`Panel::decode_isa`]'s vector path for one row of Q8_0 or PQ2_0: each group's codes
/// gathered straight from the stored blocks into the tiled layout (lane `i` of a gather is
/// block `i`'s 4-byte piece), no scratch row; false for the other types, or without VNNI.
pub(super) fn panel_row(
    ty: GgmlType,
    row: &[u8],
    tl: &Tiling,
    codes: &mut [u8],
    dw: &mut [f32],
    isa: Isa,
) -> bool {
    if isa < Isa::Avx512Vnni || !vnni() {
        return false;
    }
    debug_assert_eq!(row.len(), tl.nb * 34);
    // SAFETY: AVX-512 checked above; `row` holds `nb` 34-byte blocks and `codes` / `dw` whole
    // groups of them (`Panel::decode_isa`).
    unsafe {
        match ty {
            GgmlType::Q8_0 => panel_row_q8_0(row, tl, codes, dw),
            GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => panel_row_pq2_0(row, tl, codes, dw),
            _ => return false,
        }
    }
    true
}

/// A last group narrower than 16 blocks ([`Tiling`]), of Q8_0 (`pq2` false) or PQ2_0 blocks
/// from `base`: lane `l` of its vector `v` is piece `(16v + l) / w` of block `l % w`, gathered
/// one vector at a time; the scales of every lane of a block.
#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn narrow_group34(tl: &Tiling, base: *const u8, pq2: bool, out: *mut u8, dw: *mut f32) {
    let w = tl.last;
    let held = tl.nb - (tl.groups - 1) * GROUP;
    let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let blk = _mm512_and_si512(lane, _mm512_set1_epi32(w as i32 - 1));
    let k = _mm512_cmplt_epi32_mask(blk, _mm512_set1_epi32(held as i32));
    let boff = _mm512_mullo_epi32(blk, _mm512_set1_epi32(34));
    let log_w = _mm_cvtsi32_si128(w.trailing_zeros() as i32);
    for v in 0..w * tl.qk / 64 {
        let j = _mm512_srl_epi32(
            _mm512_add_epi32(lane, _mm512_set1_epi32(16 * v as i32)),
            log_w,
        );
        let c = if pq2 {
            // Piece 8s + m: code plane s of the block's bytes 4m..4m + 4.
            let m = _mm512_and_si512(j, _mm512_set1_epi32(7));
            let idx = _mm512_add_epi32(
                boff,
                _mm512_add_epi32(_mm512_slli_epi32::<2>(m), _mm512_set1_epi32(2)),
            );
            let g = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), k, idx, base as _);
            let sh = _mm512_slli_epi32::<1>(_mm512_srli_epi32::<3>(j));
            _mm512_and_si512(_mm512_srlv_epi32(g, sh), _mm512_set1_epi8(3))
        } else {
            let idx = _mm512_add_epi32(
                boff,
                _mm512_add_epi32(_mm512_slli_epi32::<2>(j), _mm512_set1_epi32(2)),
            );
            let g = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), k, idx, base as _);
            _mm512_maskz_xor_epi32(k, g, _mm512_set1_epi8(-128))
        };
        _mm512_storeu_si512(out.add(64 * v) as *mut _, c);
    }
    group_scales34(base, k, boff, dw);
}

/// Lane `i`: the byte offset of block `i` of a group of 34-byte blocks.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn block_offsets34() -> __m512i {
    _mm512_mullo_epi32(
        _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15),
        _mm512_set1_epi32(34),
    )
}

/// The blocks of group `g` present in a row of `nb`, as a gather mask, and the group's first
/// block.
#[inline(always)]
fn group_mask(g: usize, nb: usize) -> __mmask16 {
    let n = (nb - g * GROUP).min(GROUP);
    ((1u32 << n) - 1) as __mmask16
}

/// The 16 f16 scales at the starts of a group's blocks (the masked lanes 0.0), as f32.
#[target_feature(enable = "avx512f,avx512bw")]
#[inline]
unsafe fn group_scales34(base: *const u8, k: __mmask16, off: __m512i, dw: *mut f32) {
    let s = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), k, off, base as _);
    _mm512_storeu_ps(dw, _mm512_cvtph_ps(_mm512_cvtepi32_epi16(s)));
}

/// [`Panel::decode_packed`](super::int8::Panel::decode_packed)'s row: false unless the row is
/// Q8_0 (packed PQ2_0 rows take the stored layout), the CPU has the packed kernel's features
/// and every group of the tiling is whole (the narrow last group of a short row takes the
/// stored layout).
pub(super) fn panel_row_packed(
    ty: GgmlType,
    row: &[u8],
    tl: &Tiling,
    codes: &mut [u8],
    dw: &mut [f32],
) -> bool {
    if ty != GgmlType::Q8_0 || !vnni_vl() || (0..tl.groups).any(|g| tl.width(g) < GROUP) {
        return false;
    }
    debug_assert_eq!(row.len(), tl.nb * 34);
    debug_assert_eq!(tl.nb % 4, 0);
    // SAFETY: AVX-512 F, BW and VL checked above; `row` is one packed row of `nb` blocks and
    // `codes` / `dw` whole groups of them.
    unsafe { panel_row_q8_0_packed(row, tl, codes, dw) };
    true
}

/// `panel_row_q8_0` on a packed row: lane l of a group gathers block l's four bytes from its
/// place among the group's four 128-byte quads (the first 16 levels of a block in the quad's
/// first 64 bytes, the last 16 in the second), already biased; the group's 16 scales are 32
/// contiguous bytes after the row's levels.
#[target_feature(enable = "avx512f,avx512bw,avx512vl")]
unsafe fn panel_row_q8_0_packed(row: &[u8], tl: &Tiling, codes: &mut [u8], dw: &mut [f32]) {
    let lane = _mm512_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15);
    let off = _mm512_add_epi32(
        _mm512_slli_epi32::<7>(_mm512_srli_epi32::<2>(lane)),
        _mm512_slli_epi32::<4>(_mm512_and_si512(lane, _mm512_set1_epi32(3))),
    );
    let scales = row.as_ptr().add(tl.nb * 32);
    for g in 0..tl.groups {
        let k = group_mask(g, tl.nb);
        let base = row.as_ptr().add(g * GROUP * 32);
        let out = codes.as_mut_ptr().add(tl.group_at(g));
        for j in 0..8 {
            let at = 64 * (j / 4) + 4 * (j % 4);
            let idx = _mm512_add_epi32(off, _mm512_set1_epi32(at as i32));
            let v = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), k, idx, base as _);
            _mm512_storeu_si512(out.add(64 * j) as *mut _, v);
        }
        let s = _mm256_maskz_loadu_epi16(k, scales.add(g * GROUP * 2) as *const _);
        _mm512_storeu_ps(dw.as_mut_ptr().add(g * GROUP), _mm512_cvtph_ps(s));
    }
}

#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn panel_row_q8_0(row: &[u8], tl: &Tiling, codes: &mut [u8], dw: &mut [f32]) {
    let off = block_offsets34();
    let bias = _mm512_set1_epi8(-128);
    for g in 0..tl.groups {
        let k = group_mask(g, tl.nb);
        let base = row.as_ptr().add(g * GROUP * 34);
        let out = codes.as_mut_ptr().add(tl.group_at(g));
        if tl.width(g) < GROUP {
            narrow_group34(tl, base, false, out, dw.as_mut_ptr().add(g * GROUP));
            continue;
        }
        for j in 0..8 {
            let idx = _mm512_add_epi32(off, _mm512_set1_epi32(2 + 4 * j as i32));
            let v = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), k, idx, base as _);
            // The codes are the levels biased to unsigned; absent blocks stay 0.
            let v = _mm512_maskz_xor_epi32(k, v, bias);
            _mm512_storeu_si512(out.add(64 * j) as *mut _, v);
        }
        group_scales34(base, k, off, dw.as_mut_ptr().add(g * GROUP));
    }
}

#[target_feature(enable = "avx512f,avx512bw")]
unsafe fn panel_row_pq2_0(row: &[u8], tl: &Tiling, codes: &mut [u8], dw: &mut [f32]) {
    let off = block_offsets34();
    let m3 = _mm512_set1_epi8(3);
    for g in 0..tl.groups {
        let k = group_mask(g, tl.nb);
        let base = row.as_ptr().add(g * GROUP * 34);
        let out = codes.as_mut_ptr().add(tl.group_at(g));
        if tl.width(g) < GROUP {
            narrow_group34(tl, base, true, out, dw.as_mut_ptr().add(g * GROUP));
            continue;
        }
        for m in 0..8 {
            let idx = _mm512_add_epi32(off, _mm512_set1_epi32(2 + 4 * m as i32));
            let v = _mm512_mask_i32gather_epi32::<1>(_mm512_setzero_si512(), k, idx, base as _);
            // Code plane s of bytes 4m..4m + 4 is the block's piece 8s + m (activation order).
            for s in 0..4 {
                let c = _mm512_and_si512(_mm512_srl_epi32(v, _mm_cvtsi32_si128(2 * s)), m3);
                _mm512_storeu_si512(out.add(64 * (8 * s as usize + m)) as *mut _, c);
            }
        }
        group_scales34(base, k, off, dw.as_mut_ptr().add(g * GROUP));
    }
}

// ---------------------------------------------------------------------------------------------
// AVX2

/// `Σ c·x` of 32 unsigned bytes and 32 signed levels, as eight i32 lanes: the pairs' i16 sums
/// must not saturate (codes below 64, or Q8_0's `|w|` against `x` carrying `w`'s sign).
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn madd_u8(c: __m256i, x: __m256i) -> __m256i {
    _mm256_madd_epi16(_mm256_maddubs_epi16(c, x), _mm256_set1_epi16(1))
}

/// Q8_0 against `N` token rows in AVX2, four blocks a step while four remain. A block's 32
/// products are `vpsignb` (ggml's sign trick), `vpmaddubsw` and `vpmaddwd` against ones, eight
/// i32 lanes of one block; with the activations in `QActs::quads` order a vector holds half of
/// each of two blocks (16 levels of one in its low 128 bits, of the next in its high), so the
/// four products of a step sum into `[b0 | b1]` and `[b2 | b3]`, and one 64-bit unpack of the
/// two (`[b0, b0, b2, b2 | b1, b1, b3, b3]`, each lane a sum within one block) leaves one
/// conversion and one scaled multiply-add per four blocks where the one-block step took four
/// of each. Those, the multiplies and the sign all issue on the same two ports of an Intel
/// core; the unpacks and integer adds on the third. The block sums are exact and only the order
/// of their float sums differs from the one-block step's. A last one to three blocks take the
/// one-block step. One thread, 1 MB of rows of 2,048 in L2, the kernels' spans alternated 41
/// times in one process (Xeon with AMX, two runs): 1 token row 11.6 / 12.6 -> 14.9 / 16.1 GB/s,
/// 3 token rows 5.8 / 6.4 -> 7.7 / 8.0 (paired ratios 1.28 / 1.29 and 1.34 / 1.27); called row
/// by row as `dot_rows` is, 1 row 4.9 -> 16.7 and 3 rows 3.8 -> 7.7.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q8_0_avx2<const N: usize>(row: &[u8], a: &QActs, t0: usize, out: &mut [f32]) {
    let (k, nb) = (a.k, a.k / 32);
    let ng = nb / 4;
    debug_assert_eq!(a.quads.len(), a.rows * ng * 128);
    // Block c's scale to the lanes its sums meet after the unpack.
    let order = _mm256_setr_epi32(0, 0, 2, 2, 1, 1, 3, 3);
    let mut acc = [_mm256_setzero_ps(); N];
    for g in 0..ng {
        let blk = row.as_ptr().add(g * 136);
        for ahead in [0, 64, 128] {
            prefetch(blk.add(ahead));
        }
        // Half h of blocks c and c + 1: [w_c[16h..16h + 16] | w_c+1[16h..16h + 16]].
        let ld = |c: usize, h: usize| {
            let at = |c: usize| blk.add(34 * c + 2 + 16 * h) as *const __m128i;
            _mm256_loadu2_m128i(at(c + 1), at(c))
        };
        // In `quads` order: the first halves of blocks 0-1, 2-3, then the second halves.
        let w = [ld(0, 0), ld(2, 0), ld(0, 1), ld(2, 1)];
        let aw = w.map(|v| _mm256_sign_epi8(v, v));
        let h = |c: usize| f16_at(blk.add(34 * c)) as i16;
        let dw4 = _mm_cvtph_ps(_mm_setr_epi16(h(0), h(1), h(2), h(3), 0, 0, 0, 0));
        let dw = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(dw4), order);
        for (i, acc) in acc.iter_mut().enumerate() {
            let t = t0 + i;
            let xq = a.quads.as_ptr().add((t * ng + g) * 128) as *const __m256i;
            let p: [__m256i; 4] = std::array::from_fn(|v| {
                let x = _mm256_loadu_si256(xq.add(v));
                madd_u8(aw[v], _mm256_sign_epi8(x, w[v]))
            });
            let (s01, s23) = (_mm256_add_epi32(p[0], p[2]), _mm256_add_epi32(p[1], p[3]));
            let s = _mm256_add_epi32(
                _mm256_unpacklo_epi64(s01, s23),
                _mm256_unpackhi_epi64(s01, s23),
            );
            let d4 = _mm_loadu_ps(a.d.as_ptr().add(t * nb + 4 * g));
            let dx = _mm256_permutevar8x32_ps(_mm256_castps128_ps256(d4), order);
            *acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s), *acc);
        }
    }
    for b in 4 * ng..nb {
        let blk = row.as_ptr().add(b * 34);
        let w = _mm256_loadu_si256(blk.add(2) as *const __m256i);
        let aw = _mm256_sign_epi8(w, w);
        let dw = _mm256_set1_ps(f16_scalar(blk));
        for (i, acc) in acc.iter_mut().enumerate() {
            let t = t0 + i;
            let x = _mm256_loadu_si256(a.qs.as_ptr().add(t * k + b * 32) as *const __m256i);
            let s = madd_u8(aw, _mm256_sign_epi8(x, w));
            let dx = _mm256_loadu_ps(a.d8.as_ptr().add((t * nb + b) * 8));
            *acc = _mm256_fmadd_ps(_mm256_mul_ps(dw, dx), _mm256_cvtepi32_ps(s), *acc);
        }
    }
    for (o, &acc) in out.iter_mut().zip(&acc) {
        *o = hsum256(acc);
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn q4_0_avx2<const N: usize>(row: &[u8], a: &QActs, t0: usize, out: &mut [f32]) {
    let (k, nb) = (a.k, a.k / 32);
    let m15 = _mm_set1_epi8(15);
    let mut acc = [_mm256_setzero_ps(); N];
    for b in 0..nb {
        let blk = row.as_ptr().add(b * 18);
        prefetch(blk);
        let q = _mm_loadu_si128(blk.add(2) as *const __m128i);
        let c = _mm256_set_m128i(
            _mm_and_si128(_mm_srli_epi16::<4>(q), m15),
            _mm_and_si128(q, m15),
        );
        let dw = _mm256_set1_ps(f16_scalar(blk));
        for (i, acc) in acc.iter_mut().enumerate() {
            let t = t0 + i;
            let x = _mm256_loadu_si256(a.qs.as_ptr().add(t * k + b * 32) as *const __m256i);
            let s = _mm256_cvtepi32_ps(madd_u8(c, x));
            let l = (t * nb + b) * 8;
            let dx = _mm256_loadu_ps(a.d8.as_ptr().add(l));
            let o = _mm256_loadu_ps(a.o8.as_ptr().add(l));
            *acc = _mm256_fmadd_ps(dw, _mm256_fmsub_ps(dx, s, o), *acc);
        }
    }
    for (o, &acc) in out.iter_mut().zip(&acc) {
        *o = hsum256(acc);
    }
}

/// The AVX2 tail of the 128-element code kernels: four 32-code vectors against each row's
/// block `b`. A code is at most 2, so the four planes' i16 pair sums add without saturating.
#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn codes128_avx2<const N: usize>(
    c: [__m256i; 4],
    dw: f32,
    a: &QActs,
    t0: usize,
    b: usize,
    acc: &mut [__m256; N],
    off: &mut [f32; N],
) {
    let (k, nb) = (a.k, a.k / 128);
    for (i, (acc, off)) in acc.iter_mut().zip(off.iter_mut()).enumerate() {
        let t = t0 + i;
        let x = a.qs.as_ptr().add(t * k + b * 128) as *const __m256i;
        let p: [__m256i; 4] =
            std::array::from_fn(|j| _mm256_maddubs_epi16(c[j], _mm256_loadu_si256(x.add(j))));
        let p = _mm256_add_epi16(_mm256_add_epi16(p[0], p[1]), _mm256_add_epi16(p[2], p[3]));
        let s = _mm256_madd_epi16(p, _mm256_set1_epi16(1));
        *acc = _mm256_fmadd_ps(
            _mm256_cvtepi32_ps(s),
            _mm256_set1_ps(dw * a.d[t * nb + b]),
            *acc,
        );
        *off += dw * a.o[t * nb + b];
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn pq2_0_avx2<const N: usize>(row: &[u8], a: &QActs, t0: usize, out: &mut [f32]) {
    let nb = a.k / 128;
    let m3 = _mm256_set1_epi8(3);
    let mut acc = [_mm256_setzero_ps(); N];
    let mut off = [0f32; N];
    for b in 0..nb {
        let blk = row.as_ptr().add(b * 34);
        prefetch(blk);
        let q = _mm256_loadu_si256(blk.add(2) as *const __m256i);
        let c = [
            _mm256_and_si256(q, m3),
            _mm256_and_si256(_mm256_srli_epi16::<2>(q), m3),
            _mm256_and_si256(_mm256_srli_epi16::<4>(q), m3),
            _mm256_and_si256(_mm256_srli_epi16::<6>(q), m3),
        ];
        codes128_avx2(c, f16_scalar(blk), a, t0, b, &mut acc, &mut off);
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = hsum256(acc[i]) - off[i];
    }
}

#[target_feature(enable = "avx2,fma,f16c")]
#[inline]
unsafe fn ptq1_0_avx2<const N: usize>(row: &[u8], a: &QActs, t0: usize, out: &mut [f32]) {
    let nb = a.k / 128;
    let mut acc = [_mm256_setzero_ps(); N];
    let mut off = [0f32; N];
    for b in 0..nb {
        let blk = row.as_ptr().add(b * 28);
        prefetch(blk);
        let codes = ptq1_0_codes(blk);
        let c: [__m256i; 4] = std::array::from_fn(|j| {
            _mm256_loadu_si256(codes.as_ptr().add(32 * j) as *const __m256i)
        });
        codes128_avx2(c, f16_scalar(blk.add(26)), a, t0, b, &mut acc, &mut off);
    }
    for (i, o) in out.iter_mut().enumerate() {
        *o = hsum256(acc[i]) - off[i];
    }
}
