//! Register-blocked products: the many-token matmul, and the two products of attention.
//!
//! `matmul` computes `y[t][r] = x[t] · w[r]` for every token row `t` and weight row `r`. Weight
//! rows are dequantized a tile at a time into f32 (one tile per rayon task, into a scratch
//! buffer reused by its worker thread) and dotted with every token row by `dots`. Both operands
//! keep their natural layout (contiguous along the shared dimension), so nothing is packed:
//! the kernel dots `MT` rows of one with `NR` rows of the other at once, eight lanes at a time,
//! which keeps `MT * NR` accumulators in registers and loads each vector once for several fused
//! multiply-adds.
//!
//! `outer` is the other shape, `out[m] = Σ_j a[j][m] · b[j]` (rows of `b` weighted and summed),
//! which attention needs for `P · V`.
//!
//! The sums are the same as the plain loops', taken in a different order: the results agree
//! to f32 rounding. Without AVX2 and FMA both fall back to those loops.

use std::cell::RefCell;

use rayon::prelude::*;

use crate::quant;
use crate::tensor::GgmlType;

/// Rows of the first operand per `dots` kernel call (the dispatch in `Dots::run` instantiates
/// the kernel for 1 to 4).
#[cfg(target_arch = "x86_64")]
const MT: usize = 4;
/// Rows of the second operand per `dots` kernel call (1 to 3 in `x86::dots_m`).
const NR: usize = 3;
/// Columns per pass (a multiple of every block size): a token block's slice of this many
/// columns stays in L1 while the kernel runs down the tile's rows.
const KC: usize = 1024;
/// Weight rows per tile: `TILE_ROWS * KC` f32 stay in L2 while every token block passes over
/// them. Each token row is read once per tile, so tall tiles keep that traffic low when the
/// token rows do not fit in the caches (long prompts).
const TILE_ROWS: usize = 96;
/// Output rows per `outer` kernel call, and 8-lane column vectors (the x86 kernel's shape; the
/// plain loops have none).
#[cfg(target_arch = "x86_64")]
const OM: usize = 6;
#[cfg(target_arch = "x86_64")]
const OV: usize = 2;
/// 16-lane column vectors per `outer` call where the CPU has AVX-512: `OM` x 4 accumulators,
/// 4 rows and a broadcast, 29 of the 32 registers.
#[cfg(target_arch = "x86_64")]
const OV_Z: usize = 4;

thread_local! {
    /// The dequantized slice of the current tile, reused by every task its thread runs.
    static TILE: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

#[cfg(target_arch = "x86_64")]
fn simd() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// The AVX-512 tiles (`x86::Elem`'s `wide`), where `simd()` holds too: 32 registers hold
/// `dots`' 4 x 4 tile (a decode step's 4 query heads per KV head in one pass over the keys,
/// where 3 + 1 converted each key row twice), and `outer` takes 16 lanes a register, 4 column
/// passes over a chunk of V rows instead of 16. Each output is the same sum in the same order
/// either way, so the bits do not depend on it. One token's attention at depth 2,048 over
/// bench-0.8b's heads (caches colder than L3, 2 threads, medians of alternated runs), with the
/// softmax's exponentials in long runs: 0.40-0.52 ms a layer before, 0.36-0.44 after.
#[cfg(target_arch = "x86_64")]
fn avx512() -> bool {
    is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("avx512vl")
}

/// Weight rows per tile: `TILE_ROWS`, but small enough that `n_out` rows make a few tiles per
/// thread to balance the work; a multiple of `NR`.
fn tile_rows(n_out: usize) -> usize {
    let balanced = n_out
        .div_ceil(8 * rayon::current_num_threads())
        .div_ceil(NR)
        * NR;
    TILE_ROWS.min(balanced).max(NR)
}

/// `out[t * n_out + r] = x[t] · w[r]` for `x` of `n_tok` rows of `k` and a weight of `n_out`
/// rows stored as `row_bytes`-byte rows of type `ty` in `bytes`.
pub(super) fn matmul(
    ty: GgmlType,
    bytes: &[u8],
    row_bytes: usize,
    n_out: usize,
    x: &[f32],
    k: usize,
    out: &mut [f32],
) {
    let n_tok = x.len() / k;
    assert_eq!(x.len(), n_tok * k);
    assert_eq!(out.len(), n_tok * n_out);
    assert!(bytes.len() >= n_out * row_bytes);
    let kc = if KC.is_multiple_of(ty.block_size()) {
        KC
    } else {
        k
    };
    let tile = tile_rows(n_out);
    let dst = OutPtr(out.as_mut_ptr());
    (0..n_out.div_ceil(tile)).into_par_iter().for_each(|c| {
        let (r0, r1) = (c * tile, ((c + 1) * tile).min(n_out));
        TILE.with_borrow_mut(|w| {
            for k0 in (0..k).step_by(kc) {
                let k1 = (k0 + kc).min(k);
                let (b0, b1) = (byte_offset(ty, k0), byte_offset(ty, k1));
                w.resize((r1 - r0) * (k1 - k0), 0.0);
                for (r, wr) in (r0..r1).zip(w.chunks_exact_mut(k1 - k0)) {
                    let row = &bytes[r * row_bytes..(r + 1) * row_bytes];
                    quant::dequantize_row(ty, &row[b0..b1], wr)
                        .expect("row length validated at load");
                }
                // SAFETY: the operands hold the rows read; `out` holds `n_tok` rows of
                // `n_out`, and this task alone writes their columns `r0..r1`, so the writes
                // of concurrent tasks never overlap.
                unsafe {
                    let p = Dots {
                        x: x[k0..].as_ptr(),
                        ldx: k,
                        n_x: n_tok,
                        w: w.as_ptr(),
                        ldw: k1 - k0,
                        n_w: r1 - r0,
                        k: k1 - k0,
                    };
                    p.run(dst.at(r0), n_out, k0 > 0)
                };
            }
        });
    });
}

/// Bytes of the first `n` elements of a row (`n` a multiple of the block size).
fn byte_offset(ty: GgmlType, n: usize) -> usize {
    ty.row_bytes(n as u64).expect("whole blocks") as usize
}

/// The output pointer shared by the tasks of one `matmul`; each writes its own columns.
#[derive(Copy, Clone)]
pub(super) struct OutPtr(pub(super) *mut f32);
// SAFETY: tasks write disjoint elements (see `matmul`).
unsafe impl Send for OutPtr {}
unsafe impl Sync for OutPtr {}

impl OutPtr {
    /// The element `i` places in (a method, so closures capture the whole `Sync` wrapper).
    pub(super) fn at(self, i: usize) -> *mut f32 {
        self.0.wrapping_add(i)
    }
}

/// `out[i * ldo + r] = x_i · w_r` over `k` columns for `n_x` rows of `x` (`ldx` apart) and `n_w`
/// rows of `w` (`ldw` apart).
#[allow(clippy::too_many_arguments)]
pub(super) fn dots(
    x: &[f32],
    ldx: usize,
    n_x: usize,
    w: &[f32],
    ldw: usize,
    n_w: usize,
    k: usize,
    out: &mut [f32],
    ldo: usize,
) {
    let need = |n: usize, ld: usize, width: usize| if n == 0 { 0 } else { (n - 1) * ld + width };
    assert!(x.len() >= need(n_x, ldx, k) && w.len() >= need(n_w, ldw, k));
    assert!(out.len() >= need(n_x, ldo, n_w));
    let p = Dots {
        x: x.as_ptr(),
        ldx,
        n_x,
        w: w.as_ptr(),
        ldw,
        n_w,
        k,
    };
    // SAFETY: the asserts above bound every read and write.
    unsafe { p.run(out.as_mut_ptr(), ldo, false) }
}

/// The operands of a `dots` product.
struct Dots {
    x: *const f32,
    ldx: usize,
    n_x: usize,
    w: *const f32,
    ldw: usize,
    n_w: usize,
    k: usize,
}

impl Dots {
    /// `out[i * ldo + r] (+)= x_i · w_r`; `acc` adds to the output instead of storing.
    ///
    /// # Safety
    /// The operands hold their `n` rows of `k` at their strides, and `out` is valid for reads
    /// and writes at `i * ldo + r` for every `i < n_x`, `r < n_w`.
    unsafe fn run(&self, out: *mut f32, ldo: usize, acc: bool) {
        let Dots {
            x,
            ldx,
            n_x,
            w,
            ldw,
            n_w,
            k,
        } = *self;
        #[cfg(target_arch = "x86_64")]
        if simd() {
            return x86::dots_tiles(x, ldx, n_x, w, ldw, n_w, k, out, ldo, acc, false, avx512());
        }
        for i in 0..n_x {
            let xi = std::slice::from_raw_parts(x.add(i * ldx), k);
            for r in 0..n_w {
                let s = super::dot(xi, std::slice::from_raw_parts(w.add(r * ldw), k));
                let o = out.add(i * ldo + r);
                *o = if acc { *o + s } else { s };
            }
        }
    }
}

/// `out[m * ldo + c] (+)= Σ_{j < n_j} a[j * lda + m] · b[j * ldb + c]` for `m < n_m`,
/// `c < n_c`; `acc` adds to the output instead of storing.
#[allow(clippy::too_many_arguments)]
pub(super) fn outer(
    a: &[f32],
    lda: usize,
    n_m: usize,
    b: &[f32],
    ldb: usize,
    n_c: usize,
    n_j: usize,
    out: &mut [f32],
    ldo: usize,
    acc: bool,
) {
    if n_m == 0 || n_c == 0 {
        return;
    }
    assert!(n_j == 0 || (a.len() >= (n_j - 1) * lda + n_m && b.len() >= (n_j - 1) * ldb + n_c));
    assert!(out.len() >= (n_m - 1) * ldo + n_c);
    #[cfg(target_arch = "x86_64")]
    if simd() && n_c.is_multiple_of(8 * OV) {
        // SAFETY: the asserts above bound every read and write.
        unsafe {
            x86::outer_tiles(
                a.as_ptr(),
                lda,
                n_m,
                b.as_ptr(),
                ldb,
                n_c,
                n_j,
                out.as_mut_ptr(),
                ldo,
                acc,
                false,
                avx512(),
            )
        };
        return;
    }
    for m in 0..n_m {
        let o = &mut out[m * ldo..m * ldo + n_c];
        if !acc {
            o.fill(0.0);
        }
        for j in 0..n_j {
            let p = a[j * lda + m];
            for (ov, &bv) in o.iter_mut().zip(&b[j * ldb..j * ldb + n_c]) {
                *ov += p * bv;
            }
        }
    }
}

/// `dots` with `x` the rows of an f16 cache: row `i`'s `k` values at byte `i * ldx` of `xh`,
/// converted in the kernel's loads, the same products in the same order as `dots` on their
/// f32 image (so the same bits), each row asked for `x86::AHEAD_ROWS` rows before it is read.
/// False (nothing written) where the CPU has no AVX2, FMA or F16C, or the rows are not
/// 2-byte strided.
#[allow(clippy::too_many_arguments)]
pub(super) fn dots_f16(
    xh: &[u8],
    ldx: usize,
    n_x: usize,
    w: &[f32],
    ldw: usize,
    n_w: usize,
    k: usize,
    out: &mut [f32],
    ldo: usize,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd() && is_x86_feature_detected!("f16c") && ldx.is_multiple_of(2) {
        if n_x == 0 || n_w == 0 {
            return true;
        }
        assert!(xh.len() >= (n_x - 1) * ldx + 2 * k && w.len() >= (n_w - 1) * ldw + k);
        assert!(out.len() >= (n_x - 1) * ldo + n_w);
        let (x, ldx) = (xh.as_ptr() as *const u16, ldx / 2);
        // SAFETY: the asserts above bound every read and write; a prefetch never faults.
        unsafe {
            x86::dots_tiles(
                x,
                ldx,
                n_x,
                w.as_ptr(),
                ldw,
                n_w,
                k,
                out.as_mut_ptr(),
                ldo,
                false,
                true,
                avx512(),
            )
        };
        return true;
    }
    let _ = (xh, ldx, n_x, w, ldw, n_w, k, out, ldo);
    false
}

/// `outer` with `b` the rows of an f16 cache (row `j` at byte `j * ldb` of `bh`), converted in
/// the kernel's loads: the same bits as `outer` on their f32 image. The first column pass asks
/// for each row `x86::AHEAD_ROWS` rows ahead. False (nothing written) where `outer` would not
/// take its AVX2 kernel, the CPU has no F16C or the rows are not 2-byte strided.
#[allow(clippy::too_many_arguments)]
pub(super) fn outer_f16(
    a: &[f32],
    lda: usize,
    n_m: usize,
    bh: &[u8],
    ldb: usize,
    n_c: usize,
    n_j: usize,
    out: &mut [f32],
    ldo: usize,
    acc: bool,
) -> bool {
    #[cfg(target_arch = "x86_64")]
    if simd()
        && is_x86_feature_detected!("f16c")
        && n_c.is_multiple_of(8 * OV)
        && ldb.is_multiple_of(2)
    {
        if n_m == 0 || n_c == 0 {
            return true;
        }
        assert!(
            n_j == 0 || (a.len() >= (n_j - 1) * lda + n_m && bh.len() >= (n_j - 1) * ldb + 2 * n_c)
        );
        assert!(out.len() >= (n_m - 1) * ldo + n_c);
        let (b, ldb) = (bh.as_ptr() as *const u16, ldb / 2);
        // SAFETY: the asserts above bound every read and write; a prefetch never faults.
        unsafe {
            x86::outer_tiles(
                a.as_ptr(),
                lda,
                n_m,
                b,
                ldb,
                n_c,
                n_j,
                out.as_mut_ptr(),
                ldo,
                acc,
                true,
                avx512(),
            )
        };
        return true;
    }
    let _ = (a, lda, n_m, bh, ldb, n_c, n_j, out, ldo, acc);
    false
}

#[cfg(target_arch = "x86_64")]
pub(super) use x86::{ask_ahead, AHEAD_ROWS};

#[cfg(target_arch = "x86_64")]
mod x86 {
    use std::arch::x86_64::*;

    /// `$k::<$c, N>(args)` for the run-time `N` in `$n` (1 to 4): the `dots`-shaped kernels
    /// take their count of `w` rows as a constant.
    macro_rules! by_n {
        ($n:expr, $k:ident::<$c:tt>($($a:expr),*)) => {
            match $n {
                4 => $k::<$c, 4>($($a),*),
                3 => $k::<$c, 3>($($a),*),
                2 => $k::<$c, 2>($($a),*),
                _ => $k::<$c, 1>($($a),*),
            }
        };
    }

    /// One `dots` body for two kinds of `x` rows (and `outer!` below for `b`'s): f32, or an
    /// f16 cache's rows converted in the loads. A conversion is exact, so the f16 kernels give
    /// the bits the f32 ones give on the rows' f32 image. `$ld8` loads 8 values at an element
    /// offset, `$ld1` one.
    macro_rules! kernels {
        ($feat:tt, $xt:ty, $ld8:ident, $ld1:ident, $dots_m:ident, $dots:ident) => {
            /// `dots::<M, N>` for a run-time `N` (1 to 4; 4 only where AVX-512VL gives the
            /// 21 registers it holds).
            ///
            /// # Safety
            /// As for `dots`.
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            pub(super) unsafe fn $dots_m<const M: usize>(
                n: usize,
                x: *const $xt,
                ldx: usize,
                w: *const f32,
                ldw: usize,
                k: usize,
                out: *mut f32,
                ldo: usize,
                acc_out: bool,
            ) {
                by_n!(n, $dots::<M>(x, ldx, w, ldw, k, out, ldo, acc_out))
            }

            /// `out[i * ldo + r] (+)= x_i · w_r` for `i < M`, `r < N` over `k` columns.
            ///
            /// # Safety
            /// The CPU has the features; `x` holds `M` rows `ldx` (elements) apart and `w` `N`
            /// rows `ldw` apart, each of `k`; `out` is valid for the reads and writes.
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn $dots<const M: usize, const N: usize>(
                x: *const $xt,
                ldx: usize,
                w: *const f32,
                ldw: usize,
                k: usize,
                out: *mut f32,
                ldo: usize,
                acc_out: bool,
            ) {
                let mut acc = [[_mm256_setzero_ps(); N]; M];
                let body = k / 8 * 8;
                let mut i = 0;
                while i < body {
                    let wv: [__m256; N] =
                        std::array::from_fn(|r| _mm256_loadu_ps(w.add(r * ldw + i)));
                    for (t, acc) in acc.iter_mut().enumerate() {
                        let xv = $ld8(x, t * ldx + i);
                        for r in 0..N {
                            acc[r] = _mm256_fmadd_ps(xv, wv[r], acc[r]);
                        }
                    }
                    i += 8;
                }
                for (t, acc) in acc.iter().enumerate() {
                    for (r, &a) in acc.iter().enumerate() {
                        let mut s = hsum(a);
                        for j in body..k {
                            s += $ld1(x, t * ldx + j) * *w.add(r * ldw + j);
                        }
                        let o = out.add(t * ldo + r);
                        *o = if acc_out { *o + s } else { s };
                    }
                }
            }
        };
    }

    kernels!("avx2,fma", f32, ld8_f32, ld1_f32, dots_m, dots);
    kernels!("avx2,fma,f16c", u16, ld8_f16, ld1_f16, dots_m_f16, dots_f16);
    // The same bodies where AVX-512VL gives 32 vector registers: `dots` takes 4 rows of `w` a
    // call (the 4 query heads of a KV head in a decode step) with `MT` = 4, 21 registers.
    kernels!(
        "avx512f,avx512vl,fma",
        f32,
        ld8_f32,
        ld1_f32,
        dots_m_vl,
        dots_vl
    );
    kernels!(
        "avx512f,avx512vl,fma,f16c",
        u16,
        ld8_f16,
        ld1_f16,
        dots_m_f16_vl,
        dots_f16_vl
    );

    /// `dots` with pairs of `x` rows in one 512-bit register: row `2p` in the low 8 lanes and
    /// `2p + 1` in the high 8, against 8 values of `w` repeated in both halves. Each half's
    /// lane sees the products the 8-lane kernel's lane sees, in the same order, and
    /// `hsum_halves` adds each half as `hsum` adds a register of 8, so the bits are `dots`'
    /// (`$ld8x2` loads 8 values of two rows). Half the multiply-add instructions and
    /// conversions of the 8-lane kernel. One token's attention over a 2,048-row f16 cache of
    /// bench-0.8b's shape (2 KV heads of 256, caches from memory, 2 threads, alternated in one
    /// process): 319 µs a layer with the 8-lane kernel, 301 with pairs; 924 and 866 for 3
    /// sequences.
    macro_rules! pairs {
        ($feat:tt, $xt:ty, $ld8x2:ident, $ld1:ident, $pairs:ident) => {
            /// `out[i * ldo + r] (+)= x_i · w_r` for `i < 2 * P`, `r < N` over `k` columns.
            ///
            /// # Safety
            /// As for `dots`, with `2 * P` rows of `x`.
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            unsafe fn $pairs<const P: usize, const N: usize>(
                x: *const $xt,
                ldx: usize,
                w: *const f32,
                ldw: usize,
                k: usize,
                out: *mut f32,
                ldo: usize,
                acc_out: bool,
            ) {
                let mut acc = [[_mm512_setzero_ps(); N]; P];
                let body = k / 8 * 8;
                let mut i = 0;
                while i < body {
                    let wv: [__m512; N] = std::array::from_fn(|r| {
                        let v = _mm256_castps_pd(_mm256_loadu_ps(w.add(r * ldw + i)));
                        _mm512_castpd_ps(_mm512_broadcast_f64x4(v))
                    });
                    for (p, acc) in acc.iter_mut().enumerate() {
                        let xv = $ld8x2(x, 2 * p * ldx + i, (2 * p + 1) * ldx + i);
                        for r in 0..N {
                            acc[r] = _mm512_fmadd_ps(xv, wv[r], acc[r]);
                        }
                    }
                    i += 8;
                }
                for (p, acc) in acc.iter().enumerate() {
                    for (r, &a) in acc.iter().enumerate() {
                        let (lo, hi) = hsum_halves(a);
                        for (t, mut s) in [(2 * p, lo), (2 * p + 1, hi)] {
                            for j in body..k {
                                s += $ld1(x, t * ldx + j) * *w.add(r * ldw + j);
                            }
                            let o = out.add(t * ldo + r);
                            *o = if acc_out { *o + s } else { s };
                        }
                    }
                }
            }
        };
    }
    pairs!("avx512f,avx512vl,fma", f32, ld8x2_f32, ld1_f32, pairs);
    pairs!(
        "avx512f,avx512vl,fma,f16c",
        u16,
        ld8x2_f16,
        ld1_f16,
        pairs_f16
    );

    /// `out[m * ldo + c] (+)= Σ_j a[j * lda + m] · b[j * ldb + c]` for `m < M`, `c < LV`
    /// (`L` lanes a register: 8 in AVX2's, 16 in AVX-512's). Each output lane is one fused
    /// multiply-add a row in `j` order from zero, then added to the output, whatever `L`: the
    /// same bits in both. With `ahead` > 0 each step also asks for row `j + AHEAD_ROWS` of `b`,
    /// `ahead` elements of it (the first of a chunk's column passes, which reads it from
    /// memory). `$ld` loads `L` values at an element offset; `ymm` and `zmm` name the
    /// intrinsics of 8 and 16 lanes.
    macro_rules! outer {
        (ymm $feat:tt, $xt:ty, $name:ident, $ld:ident) => {
            outer!(
                $feat,
                $xt,
                $name,
                $ld,
                __m256,
                8,
                _mm256_setzero_ps,
                _mm256_set1_ps,
                _mm256_fmadd_ps,
                _mm256_loadu_ps,
                _mm256_add_ps,
                _mm256_storeu_ps
            );
        };
        (zmm $feat:tt, $xt:ty, $name:ident, $ld:ident) => {
            outer!(
                $feat,
                $xt,
                $name,
                $ld,
                __m512,
                16,
                _mm512_setzero_ps,
                _mm512_set1_ps,
                _mm512_fmadd_ps,
                _mm512_loadu_ps,
                _mm512_add_ps,
                _mm512_storeu_ps
            );
        };
        ($feat:tt, $xt:ty, $name:ident, $ld:ident, $v:ty, $lanes:literal,
         $zero:ident, $set1:ident, $fma:ident, $loadu:ident, $add:ident, $storeu:ident) => {
            /// # Safety
            /// The CPU has the features; the operands hold `n_j` rows at their strides
            /// (elements); `out` is valid for the writes.
            #[target_feature(enable = $feat)]
            #[allow(clippy::too_many_arguments)]
            pub(super) unsafe fn $name<const M: usize, const V: usize>(
                a: *const f32,
                lda: usize,
                b: *const $xt,
                ldb: usize,
                n_j: usize,
                out: *mut f32,
                ldo: usize,
                acc_out: bool,
                ahead: usize,
            ) {
                let mut acc = [[$zero(); V]; M];
                for j in 0..n_j {
                    if ahead > 0 {
                        ask_ahead(
                            b.wrapping_add((j + AHEAD_ROWS) * ldb) as *const u8,
                            ahead * std::mem::size_of::<$xt>(),
                        );
                    }
                    let bv: [$v; V] = std::array::from_fn(|v| $ld(b, j * ldb + $lanes * v));
                    for (m, acc) in acc.iter_mut().enumerate() {
                        let p = $set1(*a.add(j * lda + m));
                        for v in 0..V {
                            acc[v] = $fma(p, bv[v], acc[v]);
                        }
                    }
                }
                for (m, acc) in acc.iter().enumerate() {
                    for (v, &x) in acc.iter().enumerate() {
                        let o = out.add(m * ldo + $lanes * v);
                        let x = if acc_out { $add($loadu(o), x) } else { x };
                        $storeu(o, x);
                    }
                }
            }
        };
    }
    outer!(ymm "avx2,fma", f32, outer, ld8_f32);
    outer!(ymm "avx2,fma,f16c", u16, outer_f16, ld8_f16);
    outer!(zmm "avx512f,fma", f32, outer_z, ld16_f32);
    outer!(zmm "avx512f,fma,f16c", u16, outer_f16_z, ld16_f16);

    /// A row operand's element as the tile loops below read it: f32, or f16 bits (the `f16c`
    /// kernels, which the caller checked the CPU has). `wide` takes the AVX-512 kernels
    /// (`avx512()`): `dots` for up to 4 rows of `w`, `outer` 64 columns a call.
    pub(super) trait Elem: Sized {
        /// # Safety
        /// As for the kernel it calls.
        #[allow(clippy::too_many_arguments)]
        unsafe fn dots_m<const M: usize>(
            wide: bool,
            n: usize,
            x: *const Self,
            ldx: usize,
            w: *const f32,
            ldw: usize,
            k: usize,
            out: *mut f32,
            ldo: usize,
            acc: bool,
        );
        /// # Safety
        /// As for the kernel it calls.
        #[allow(clippy::too_many_arguments)]
        unsafe fn outer<const M: usize>(
            wide: bool,
            a: *const f32,
            lda: usize,
            b: *const Self,
            ldb: usize,
            n_j: usize,
            out: *mut f32,
            ldo: usize,
            acc: bool,
            ahead: usize,
        );
    }

    macro_rules! elem {
        ($t:ty, $dots_m:ident, $dots_m_vl:ident, $pairs:ident, $outer:ident, $outer_z:ident) => {
            impl Elem for $t {
                unsafe fn dots_m<const M: usize>(
                    wide: bool,
                    n: usize,
                    x: *const Self,
                    ldx: usize,
                    w: *const f32,
                    ldw: usize,
                    k: usize,
                    out: *mut f32,
                    ldo: usize,
                    acc: bool,
                ) {
                    if wide {
                        // Pairs of rows where there are two, the 8-lane kernel for a last odd
                        // one: the same bits either way.
                        let t = M / 2 * 2;
                        match M / 2 {
                            2 => by_n!(n, $pairs::<2>(x, ldx, w, ldw, k, out, ldo, acc)),
                            1 => by_n!(n, $pairs::<1>(x, ldx, w, ldw, k, out, ldo, acc)),
                            _ => {}
                        }
                        if t < M {
                            let (x, out) = (x.add(t * ldx), out.add(t * ldo));
                            $dots_m_vl::<1>(n, x, ldx, w, ldw, k, out, ldo, acc)
                        }
                    } else {
                        $dots_m::<M>(n, x, ldx, w, ldw, k, out, ldo, acc)
                    }
                }
                unsafe fn outer<const M: usize>(
                    wide: bool,
                    a: *const f32,
                    lda: usize,
                    b: *const Self,
                    ldb: usize,
                    n_j: usize,
                    out: *mut f32,
                    ldo: usize,
                    acc: bool,
                    ahead: usize,
                ) {
                    if wide {
                        $outer_z::<M, { super::OV_Z }>(a, lda, b, ldb, n_j, out, ldo, acc, ahead)
                    } else {
                        $outer::<M, { super::OV }>(a, lda, b, ldb, n_j, out, ldo, acc, ahead)
                    }
                }
            }
        };
    }
    elem!(f32, dots_m, dots_m_vl, pairs, outer, outer_z);
    elem!(
        u16,
        dots_m_f16,
        dots_m_f16_vl,
        pairs_f16,
        outer_f16,
        outer_f16_z
    );

    /// `dots`' tiles: `MT` rows of `x` by `NR` rows of `w` a kernel call, 4 with `wide` (the
    /// AVX-512VL kernels; strides in elements). With `ahead`, each `x` row is asked for
    /// `AHEAD_ROWS` rows before it is read (an f16 cache, read once from memory).
    ///
    /// # Safety
    /// As for `Dots::run`, and the CPU has the kernels' features.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn dots_tiles<T: Elem>(
        x: *const T,
        ldx: usize,
        n_x: usize,
        w: *const f32,
        ldw: usize,
        n_w: usize,
        k: usize,
        out: *mut f32,
        ldo: usize,
        acc: bool,
        ahead: bool,
        wide: bool,
    ) {
        use super::{MT, NR};
        let nr = if wide { 4 } else { NR };
        for i0 in (0..n_x).step_by(MT) {
            let m = MT.min(n_x - i0);
            if ahead {
                for t in i0..i0 + m {
                    ask_ahead(
                        x.wrapping_add((t + AHEAD_ROWS) * ldx) as *const u8,
                        k * std::mem::size_of::<T>(),
                    );
                }
            }
            for r0 in (0..n_w).step_by(nr) {
                let n = nr.min(n_w - r0);
                let (xp, wp) = (x.add(i0 * ldx), w.add(r0 * ldw));
                let op = out.add(i0 * ldo + r0);
                match m {
                    4 => T::dots_m::<4>(wide, n, xp, ldx, wp, ldw, k, op, ldo, acc),
                    3 => T::dots_m::<3>(wide, n, xp, ldx, wp, ldw, k, op, ldo, acc),
                    2 => T::dots_m::<2>(wide, n, xp, ldx, wp, ldw, k, op, ldo, acc),
                    _ => T::dots_m::<1>(wide, n, xp, ldx, wp, ldw, k, op, ldo, acc),
                }
            }
        }
    }

    /// `outer`'s tiles: `OM` output rows by `8 * OV` columns a kernel call (`n_c` a multiple
    /// of `8 * OV`; strides in elements), or `16 * OV_Z` with `wide` (the AVX-512 kernel) where
    /// they divide `n_c`. With `ahead`, the first column pass (the one that reads `b` from
    /// memory) asks for each row `AHEAD_ROWS` rows ahead.
    ///
    /// # Safety
    /// As for `outer` after its asserts, and the CPU has the kernels' features.
    #[allow(clippy::too_many_arguments)]
    pub(super) unsafe fn outer_tiles<T: Elem>(
        a: *const f32,
        lda: usize,
        n_m: usize,
        b: *const T,
        ldb: usize,
        n_c: usize,
        n_j: usize,
        out: *mut f32,
        ldo: usize,
        acc: bool,
        ahead: bool,
        wide: bool,
    ) {
        use super::{OM, OV, OV_Z};
        let wide = wide && n_c.is_multiple_of(16 * OV_Z);
        let step = if wide { 16 * OV_Z } else { 8 * OV };
        for m0 in (0..n_m).step_by(OM) {
            for c0 in (0..n_c).step_by(step) {
                let ask = if ahead && m0 == 0 && c0 == 0 { n_c } else { 0 };
                let (ap, bp) = (a.add(m0), b.add(c0));
                let op = out.add(m0 * ldo + c0);
                match OM.min(n_m - m0) {
                    6 => T::outer::<6>(wide, ap, lda, bp, ldb, n_j, op, ldo, acc, ask),
                    5 => T::outer::<5>(wide, ap, lda, bp, ldb, n_j, op, ldo, acc, ask),
                    4 => T::outer::<4>(wide, ap, lda, bp, ldb, n_j, op, ldo, acc, ask),
                    3 => T::outer::<3>(wide, ap, lda, bp, ldb, n_j, op, ldo, acc, ask),
                    2 => T::outer::<2>(wide, ap, lda, bp, ldb, n_j, op, ldo, acc, ask),
                    _ => T::outer::<1>(wide, ap, lda, bp, ldb, n_j, op, ldo, acc, ask),
                }
            }
        }
    }

    /// How many cache rows ahead of the one read an f16 cache row is asked for (these kernels
    /// and `attention::f16_heads`). A decode step reads the whole cache from memory once, a
    /// head's slice of each row (512 bytes of bench-0.8b's 1 KiB rows) then a jump, and the
    /// conversion stalled on its loads: at depth 2,048 a profile put 6.7% of a decode step in
    /// `f16_heads`' loop, 86% of it on the two conversions waiting for their loads. The request
    /// runs past the chunk (and, for the last chunk, past the cache: a prefetch never faults, and
    /// the address is only formed, never read as a reference), so a chunk's first rows arrive
    /// warm too. `bench --engine --phases` with a 950-token prompt on bench-0.8b Q8_0 (Zen 5,
    /// alternated): the attention cores of a 1-stream step 1.35 / 1.31 ms without, 0.96 / 1.16
    /// with 16 rows ahead (0.91-0.96 with 16 or 32 in a second series, 1.03 with 8), of a
    /// 3-stream step 5.11 / 4.03 against 2.71 / 2.71.
    pub(in crate::backend::cpu) const AHEAD_ROWS: usize = 16;

    /// How far past the rows `ask_ahead` brings into L1 it asks for the same bytes into L2, in
    /// bytes (64 cache rows of bench-0.8b). Requests into L1 hold one of its few fill buffers
    /// each until the line arrives, which bounds how many lines one core has on their way; L2's
    /// queue is deeper. One token's `attend` over 48 layers' caches at depth 2,048 (bench-0.8b's
    /// heads, f16, 2 threads, Xeon, variants alternated in one process, medians of 16): 0.381 /
    /// 0.386 ms a layer without, 0.356 / 0.360 with 64 KiB, 0.359 with 32 KiB, 0.360 / 0.352
    /// with 128 / 256 KiB; at depth 8,192, 1.356 ms without, 1.253 with 64 KiB.
    pub(in crate::backend::cpu) const FAR_BYTES: usize = 64 << 10;

    /// Asks for `bytes` from `p` into L1, and the same run `FAR_BYTES` further on into L2 (a
    /// prefetch never faults: `p` may lie past the cache). SSE only, so every x86-64 caller may
    /// inline it.
    #[inline(always)]
    pub(in crate::backend::cpu) fn ask_ahead(p: *const u8, bytes: usize) {
        for l in (0..bytes).step_by(64) {
            // SAFETY: `_mm_prefetch` on any address is harmless.
            unsafe {
                _mm_prefetch::<_MM_HINT_T1>(p.wrapping_add(FAR_BYTES + l) as *const i8);
                _mm_prefetch::<_MM_HINT_T0>(p.wrapping_add(l) as *const i8);
            }
        }
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn ld8_f32(p: *const f32, i: usize) -> __m256 {
        _mm256_loadu_ps(p.add(i))
    }

    #[target_feature(enable = "avx2,fma")]
    #[inline]
    unsafe fn ld1_f32(p: *const f32, i: usize) -> f32 {
        *p.add(i)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn ld8_f16(p: *const u16, i: usize) -> __m256 {
        _mm256_cvtph_ps(_mm_loadu_si128(p.add(i) as *const __m128i))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    #[inline]
    unsafe fn ld1_f16(p: *const u16, i: usize) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(
            p.add(i).read_unaligned() as i32
        )))
    }

    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn ld16_f32(p: *const f32, i: usize) -> __m512 {
        _mm512_loadu_ps(p.add(i))
    }

    #[target_feature(enable = "avx512f,f16c")]
    #[inline]
    unsafe fn ld16_f16(p: *const u16, i: usize) -> __m512 {
        _mm512_cvtph_ps(_mm256_loadu_si256(p.add(i) as *const __m256i))
    }

    #[target_feature(enable = "avx512f,avx512vl")]
    #[inline]
    unsafe fn ld8x2_f32(p: *const f32, a: usize, b: usize) -> __m512 {
        let lo = _mm512_castps_pd(_mm512_castps256_ps512(_mm256_loadu_ps(p.add(a))));
        let hi = _mm256_castps_pd(_mm256_loadu_ps(p.add(b)));
        _mm512_castpd_ps(_mm512_insertf64x4::<1>(lo, hi))
    }

    #[target_feature(enable = "avx512f,avx512vl,f16c")]
    #[inline]
    unsafe fn ld8x2_f16(p: *const u16, a: usize, b: usize) -> __m512 {
        let lo = _mm_loadu_si128(p.add(a) as *const __m128i);
        let hi = _mm_loadu_si128(p.add(b) as *const __m128i);
        _mm512_cvtph_ps(_mm256_inserti128_si256::<1>(_mm256_castsi128_si256(lo), hi))
    }

    /// Each 256-bit half of `a` summed as `hsum` sums a register of 8: the 128-bit lanes
    /// added, then lanes 2 and 3 onto 0 and 1, then lane 1 onto 0.
    #[target_feature(enable = "avx512f")]
    #[inline]
    unsafe fn hsum_halves(a: __m512) -> (f32, f32) {
        let v = _mm512_add_ps(a, _mm512_shuffle_f32x4::<0b10_11_00_01>(a, a));
        let v = _mm512_add_ps(v, _mm512_permute_ps::<0b11_10_11_10>(v));
        let v = _mm512_add_ps(v, _mm512_movehdup_ps(v));
        (
            _mm512_cvtss_f32(v),
            _mm_cvtss_f32(_mm512_extractf32x4_ps::<2>(v)),
        )
    }

    #[target_feature(enable = "avx2,fma")]
    unsafe fn hsum(a: __m256) -> f32 {
        let v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
        let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
        _mm_cvtss_f32(_mm_add_ss(v, _mm_movehdup_ps(v)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vals(n: usize, a: usize, b: usize) -> Vec<f32> {
        (0..n)
            .map(|i| ((i * a) % b) as f32 / (b / 2) as f32 - 1.0)
            .collect()
    }

    fn close(got: f32, want: f32, k: usize) -> bool {
        (got - want).abs() <= 1e-5 * (k as f32).sqrt() * want.abs().max(1.0)
    }

    fn check_matmul(ty: GgmlType, k: usize, n_tok: usize, n_out: usize) {
        let x = vals(n_tok * k, 37, 101);
        let bytes = quant::quantize_row(ty, &vals(n_out * k, 53, 97)).unwrap();
        let row_bytes = bytes.len() / n_out;
        let mut w = vec![0f32; n_out * k];
        quant::dequantize_row(ty, &bytes, &mut w).unwrap();
        let mut out = vec![0f32; n_tok * n_out];
        matmul(ty, &bytes, row_bytes, n_out, &x, k, &mut out);
        for t in 0..n_tok {
            for r in 0..n_out {
                let want = super::super::dot(&x[t * k..(t + 1) * k], &w[r * k..(r + 1) * k]);
                let got = out[t * n_out + r];
                assert!(close(got, want, k), "{ty} k={k} [{t},{r}]: {got} vs {want}");
            }
        }
    }

    #[test]
    fn matmul_matches_row_dots_for_every_edge() {
        // Tails past the last 8 lanes, token and row blocks of every edge size, one and
        // several column passes (a short last one too).
        for (n_tok, n_out) in [(1, 1), (2, 5), (5, 7), (9, 64), (4, 3), (7, 200)] {
            check_matmul(GgmlType::F32, 203, n_tok, n_out);
            check_matmul(GgmlType::F32, KC + 300, n_tok, n_out);
            check_matmul(GgmlType::Q8_0, 2 * KC + 32, n_tok, n_out);
            check_matmul(GgmlType::PQ2_0, 2 * KC + 128, n_tok, n_out);
        }
    }

    #[test]
    fn strided_dots_and_outer_match_plain_loops() {
        let (k, ldx, ldw, ldo) = (37, 41, 50, 13);
        for (n_x, n_w) in [(1, 1), (5, 7), (9, 11), (4, 4)] {
            let x = vals(n_x * ldx, 7, 31);
            let w = vals(n_w * ldw, 11, 29);
            let mut out = vec![0f32; n_x * ldo];
            dots(&x, ldx, n_x, &w, ldw, n_w, k, &mut out, ldo);
            for i in 0..n_x {
                for r in 0..n_w {
                    let want = super::super::dot(&x[i * ldx..][..k], &w[r * ldw..][..k]);
                    assert!(close(out[i * ldo + r], want, k));
                }
            }
        }
        // 64 columns: the AVX-512 kernel's pass where the CPU has it.
        for (n_m, n_c, n_j) in [(1, 16, 1), (7, 32, 9), (13, 48, 30), (3, 5, 4), (4, 64, 17)] {
            let (lda, ldb, ldo) = (n_m + 2, n_c + 3, n_c + 1);
            let a = vals(n_j * lda, 7, 31);
            let b = vals(n_j * ldb, 11, 29);
            let mut out = vec![0.5f32; n_m * ldo];
            outer(&a, lda, n_m, &b, ldb, n_c, n_j, &mut out, ldo, false);
            outer(&a, lda, n_m, &b, ldb, n_c, n_j, &mut out, ldo, true);
            for m in 0..n_m {
                for c in 0..n_c {
                    let want: f32 = (0..n_j).map(|j| a[j * lda + m] * b[j * ldb + c]).sum();
                    assert!(close(out[m * ldo + c], 2.0 * want, n_j), "[{m},{c}]");
                }
            }
        }
    }

    /// The AVX-512 tiles (4 rows of `w` a `dots` call, two rows of `x` a register, 16 lanes a
    /// register in `outer`) give the bits of the AVX2 tiles, on f32 and f16 rows: every output
    /// is the same sum in the same order. Shapes with `dots`' edge tiles (5 x 7, 6 and 3 rows
    /// of `x` for a pair and an odd row left over, and a k with a scalar tail) and
    /// `outer`'s (7 output rows; 64 and 192 columns, which the wide kernel takes).
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn wide_tiles_give_the_narrow_bits() {
        use x86::{dots_tiles, outer_tiles, Elem};
        if !(simd() && avx512() && is_x86_feature_detected!("f16c")) {
            eprintln!("no AVX-512VL and F16C here: nothing to compare");
            return;
        }
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let halves = |v: &[f32]| -> Vec<u16> {
            v.iter()
                .map(|&x| half::f16::from_f32(x).to_bits())
                .collect()
        };
        // (rows, stride, count) of each operand and of the output.
        type Shape = (usize, usize, usize);
        /// `dots_tiles`, adding to an output of 0.25s.
        fn dots_of<T: Elem>(
            x: &[T],
            w: &[f32],
            (n_x, ldx, n_w): Shape,
            (ldw, k, ldo): Shape,
            wide: bool,
        ) -> Vec<f32> {
            let mut out = vec![0.25f32; n_x * ldo];
            // SAFETY: the operands hold their rows at their strides; the CPU has the features
            // (checked by the caller).
            let o = out.as_mut_ptr();
            unsafe {
                dots_tiles(
                    x.as_ptr(),
                    ldx,
                    n_x,
                    w.as_ptr(),
                    ldw,
                    n_w,
                    k,
                    o,
                    ldo,
                    true,
                    true,
                    wide,
                )
            };
            out
        }
        /// `outer_tiles` over an output of fixed values (added to with `acc`).
        fn outer_of<T: Elem>(
            a: &[f32],
            b: &[T],
            (n_m, lda, ldb): Shape,
            (n_c, n_j, ldo): Shape,
            acc: bool,
            wide: bool,
        ) -> Vec<f32> {
            let mut out = vals(n_m * ldo, 5, 23);
            let o = out.as_mut_ptr();
            // SAFETY: as above; `n_c` is a multiple of both kernels' widths.
            unsafe {
                outer_tiles(
                    a.as_ptr(),
                    lda,
                    n_m,
                    b.as_ptr(),
                    ldb,
                    n_c,
                    n_j,
                    o,
                    ldo,
                    acc,
                    true,
                    wide,
                )
            };
            out
        }
        for (n_x, n_w, k) in [
            (5usize, 7usize, 37usize),
            (4, 4, 256),
            (9, 12, 64),
            (6, 3, 45),
            (3, 2, 8),
        ] {
            let (ldx, ldw, ldo) = (k + 3, k + 1, n_w + 2);
            let x = vals(n_x * ldx, 7, 31);
            let w = vals(n_w * ldw, 11, 29);
            let (p, q) = ((n_x, ldx, n_w), (ldw, k, ldo));
            let msg = format!("dots {n_x}x{n_w}x{k}");
            assert_eq!(
                bits(&dots_of(&x, &w, p, q, true)),
                bits(&dots_of(&x, &w, p, q, false)),
                "{msg}"
            );
            let xh = halves(&x);
            assert_eq!(
                bits(&dots_of(&xh, &w, p, q, true)),
                bits(&dots_of(&xh, &w, p, q, false)),
                "{msg}, f16"
            );
        }
        for (n_m, n_c, n_j) in [(7usize, 192usize, 33usize), (4, 64, 300), (1, 128, 5)] {
            let (lda, ldb, ldo) = (n_m + 2, n_c + 3, n_c + 1);
            let a = vals(n_j * lda, 7, 31);
            let b = vals(n_j * ldb, 11, 29);
            let bh = halves(&b);
            let (p, q) = ((n_m, lda, ldb), (n_c, n_j, ldo));
            for acc in [false, true] {
                let msg = format!("outer {n_m}x{n_c}x{n_j}, acc {acc}");
                assert_eq!(
                    bits(&outer_of(&a, &b, p, q, acc, true)),
                    bits(&outer_of(&a, &b, p, q, acc, false)),
                    "{msg}"
                );
                assert_eq!(
                    bits(&outer_of(&a, &bh, p, q, acc, true)),
                    bits(&outer_of(&a, &bh, p, q, acc, false)),
                    "{msg}, f16"
                );
            }
        }
    }
}
