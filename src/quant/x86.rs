//! AVX2 + F16C versions of the portable dot kernels in `mod.rs`.
//!
//! LLVM's SLP vectoriser turned the portable block kernels into 2-wide vectors at best, so the
//! hot loops are spelled out with intrinsics. They perform exactly the portable kernels'
//! operations in the same order (no FMA), so the two paths agree bit for bit; the tests check
//! that.
//!
//! Every kernel reads only the whole blocks that both `row` and `x` hold, so a length mismatch
//! in release (the public entry point only debug-asserts) cannot read out of bounds.

use std::arch::x86_64::*;

use super::ptq1_0::POW3;

/// Whether the CPU runs these kernels. `is_x86_feature_detected!` caches its answer, so this
/// is two relaxed loads.
#[inline]
pub(super) fn available() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c")
}

#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn hsum(a: __m256) -> f32 {
    // [a0+a4, a1+a5, a2+a6, a3+a7] -> [(a0+a4)+(a2+a6), (a1+a5)+(a3+a7)] -> their sum
    let v = _mm_add_ps(_mm256_castps256_ps128(a), _mm256_extractf128_ps::<1>(a));
    let v = _mm_add_ps(v, _mm_movehl_ps(v, v));
    _mm_cvtss_f32(v) + _mm_cvtss_f32(_mm_movehdup_ps(v))
}

/// The f16 at `p` converted and broadcast to all 8 lanes. Converting 8 copies (rather than
/// converting one lane and broadcasting it) leaves no lane undefined, so the compiler does not
/// merge the load into an arbitrary register and chain every block on that register's last
/// writer (the accumulator, as it happened: a loop-carried dependency through every block).
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn f16_splat(p: *const u8) -> __m256 {
    let h = u16::from_le_bytes([*p, *p.add(1)]);
    _mm256_cvtph_ps(_mm_set1_epi16(h as i16))
}

/// Defines a block kernel `$name(row, x)` and its multi-token form `$multi::<T>(row, xs)`,
/// which decodes each group of levels once and multiplies it with all `T` activation rows, every
/// row's sum formed exactly as `$name` forms it. `$pre` runs once per block (starting at `$b`)
/// and is bound to `$buf`; `$levels` evaluates to the 8 levels of group `$g` (elements
/// 8g..8g+8).
macro_rules! block_kernel {
    ($name:ident, $multi:ident, qk: $qk:expr, bytes: $bytes:expr, scale_at: $scale_at:expr,
     |$b:ident, $buf:ident = $pre:expr, $g:ident| $levels:expr) => {
        #[target_feature(enable = "avx2,f16c")]
        #[inline]
        pub(super) unsafe fn $multi<const T: usize>(row: &[u8], xs: [&[f32]; T]) -> [f32; T] {
            const GROUPS: usize = $qk / 8;
            let nb = xs
                .iter()
                .fold(row.len() / $bytes, |n, x| n.min(x.len() / $qk));
            let mut acc = [_mm256_setzero_ps(); T];
            for i in 0..nb {
                let $b = row.as_ptr().add(i * $bytes);
                #[allow(clippy::let_unit_value)]
                let $buf = $pre;
                let mut c = [[_mm256_setzero_ps(); 4]; T];
                for $g in 0..GROUPS {
                    let levels = $levels;
                    for (c, x) in c.iter_mut().zip(xs) {
                        let xv = _mm256_loadu_ps(x.as_ptr().add(i * $qk + 8 * $g));
                        let p = _mm256_mul_ps(levels, xv);
                        c[$g % 4] = if $g < 4 {
                            p
                        } else {
                            _mm256_add_ps(c[$g % 4], p)
                        };
                    }
                }
                let d = f16_splat($b.add($scale_at));
                for (acc, c) in acc.iter_mut().zip(&c) {
                    let s = _mm256_add_ps(_mm256_add_ps(c[0], c[1]), _mm256_add_ps(c[2], c[3]));
                    *acc = _mm256_add_ps(*acc, _mm256_mul_ps(d, s));
                }
            }
            let mut out = [0.0; T];
            for (o, &a) in out.iter_mut().zip(&acc) {
                *o = hsum(a);
            }
            out
        }

        #[target_feature(enable = "avx2,f16c")]
        pub(super) unsafe fn $name(row: &[u8], x: &[f32]) -> f32 {
            $multi::<1>(row, [x])[0]
        }
    };
}

/// 8 signed bytes at `p` as floats.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn i8x8_to_f32(p: *const i8) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(_mm_loadl_epi64(p as *const __m128i)))
}

/// 8 signed 16-bit values at `p` as floats.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn i16x8_to_f32(p: *const i16) -> __m256 {
    _mm256_cvtepi32_ps(_mm256_cvtepi16_epi32(_mm_loadu_si128(p as *const __m128i)))
}

block_kernel!(dot_q8_0, dot_q8_0_n, qk: 32, bytes: 34, scale_at: 0, |b, _unused = (), g| {
    i8x8_to_f32(b.add(2 + 8 * g) as *const i8)
});

block_kernel!(dot_q4_0, dot_q4_0_n, qk: 32, bytes: 18, scale_at: 0, |b, _unused = (), g| {
    // groups 0, 1: low nibbles of bytes 0..8, 8..16; groups 2, 3: their high nibbles
    let v = _mm_loadl_epi64(b.add(2 + 8 * (g % 2)) as *const __m128i);
    let v = if g < 2 { v } else { _mm_srli_epi16::<4>(v) };
    let v = _mm_and_si128(v, _mm_set1_epi8(0x0f));
    _mm256_sub_ps(_mm256_cvtepi32_ps(_mm256_cvtepu8_epi32(v)), _mm256_set1_ps(8.0))
});

/// The levels (code - 1) of elements `8g..8g+8` of the PQ2_0 block at `b`, as floats.
///
/// The 16 code bits of the group are bytes `2 + 2g` and `3 + 2g`; the four bytes from `2g` on
/// (inside the block for every group) are broadcast to all lanes, lane `e` shifts its code to
/// the bottom, and a permute looks the level up. The permute reads three index bits, the third
/// being the next code's low bit, so the table holds the four levels twice.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn pq2_0_group(b: *const u8, g: usize) -> __m256 {
    let w = _mm256_set1_epi32(std::ptr::read_unaligned(b.add(2 * g) as *const i32));
    let idx = _mm256_srlv_epi32(w, _mm256_setr_epi32(16, 18, 20, 22, 24, 26, 28, 30));
    let table = _mm256_setr_ps(-1.0, 0.0, 1.0, 2.0, -1.0, 0.0, 1.0, 2.0);
    _mm256_permutevar8x32_ps(table, idx)
}

block_kernel!(dot_pq2_0, dot_pq2_0_n, qk: 128, bytes: 34, scale_at: 0, |b, _unused = (), g| {
    pq2_0_group(b, g)
});

/// The 128 PTQ1_0 levels (trit - 1) of the block at `b`, in element order.
///
/// With the byte in the high half of a 16-bit lane, `mullo(byte << 8, 3^n)` keeps exactly
/// `(byte * 3^n) mod 256` in the high half, and `mulhi(that, 3)` is `(q * 3) >> 8`: two
/// multiplies per trit for 16 bytes at once.
#[target_feature(enable = "avx2,f16c")]
#[inline]
unsafe fn ptq1_0_levels(b: *const u8) -> [i16; 128] {
    let mut out = [0i16; 128];
    let o = out.as_mut_ptr();
    let three = _mm256_set1_epi16(3);
    let one = _mm256_set1_epi16(1);
    // qs[0..16]: trit n of byte m is element 16n + m
    let v = _mm256_slli_epi16::<8>(_mm256_cvtepu8_epi16(_mm_loadu_si128(b as *const __m128i)));
    for (n, &p) in POW3.iter().enumerate() {
        let t = _mm256_mulhi_epu16(_mm256_mullo_epi16(v, _mm256_set1_epi16(p as i16)), three);
        _mm256_storeu_si256(o.add(16 * n) as *mut __m256i, _mm256_sub_epi16(t, one));
    }
    // qs[16..24]: trit n of byte m is element 80 + 8n + m
    let v = _mm_slli_epi16::<8>(_mm_cvtepu8_epi16(_mm_loadl_epi64(
        b.add(16) as *const __m128i
    )));
    for (n, &p) in POW3.iter().enumerate() {
        let t = _mm_mulhi_epu16(
            _mm_mullo_epi16(v, _mm_set1_epi16(p as i16)),
            _mm_set1_epi16(3),
        );
        _mm_storeu_si128(
            o.add(80 + 8 * n) as *mut __m128i,
            _mm_sub_epi16(t, _mm_set1_epi16(1)),
        );
    }
    // qh[0..2]: trit n of byte h is element 120 + 2n + h
    let v = _mm_set1_epi32(((*b.add(24) as i32) << 8) | ((*b.add(25) as i32) << 24));
    let t = _mm_mulhi_epu16(
        _mm_mullo_epi16(v, _mm_setr_epi16(1, 1, 3, 3, 9, 9, 27, 27)),
        _mm_set1_epi16(3),
    );
    _mm_storeu_si128(
        o.add(120) as *mut __m128i,
        _mm_sub_epi16(t, _mm_set1_epi16(1)),
    );
    out
}

block_kernel!(dot_ptq1_0, dot_ptq1_0_n, qk: 128, bytes: 28, scale_at: 26, |b, levels = ptq1_0_levels(b), g| {
    i16x8_to_f32(levels.as_ptr().add(8 * g))
});

/// Defines a kernel over plain elements of `$es` bytes: `$load8` converts the 8 elements at
/// `$p`, `$one` a single element (for the tail).
macro_rules! dense_kernel {
    ($name:ident, es: $es:expr, |$p:ident| $load8:expr, $one:expr) => {
        #[target_feature(enable = "avx2,f16c")]
        pub(super) unsafe fn $name(row: &[u8], x: &[f32]) -> f32 {
            let n = (row.len() / $es).min(x.len());
            let body = n / 32 * 32;
            let mut c = [_mm256_setzero_ps(); 4];
            let mut i = 0;
            while i < body {
                for g in 0..4 {
                    let $p = row.as_ptr().add((i + 8 * g) * $es);
                    let p = _mm256_mul_ps($load8, _mm256_loadu_ps(x.as_ptr().add(i + 8 * g)));
                    c[g] = _mm256_add_ps(c[g], p);
                }
                i += 32;
            }
            let mut tail = 0.0f32;
            for j in body..n {
                let e: [u8; $es] = row[j * $es..(j + 1) * $es].try_into().expect("element");
                tail += $one(e) * x[j];
            }
            hsum(_mm256_add_ps(
                _mm256_add_ps(c[0], c[1]),
                _mm256_add_ps(c[2], c[3]),
            )) + tail
        }
    };
}

dense_kernel!(dot_f32, es: 4, |p| _mm256_loadu_ps(p as *const f32), f32::from_le_bytes);
dense_kernel!(dot_f16, es: 2, |p| _mm256_cvtph_ps(_mm_loadu_si128(p as *const __m128i)), |e| {
    super::fp::f16_to_f32(u16::from_le_bytes(e))
});
dense_kernel!(dot_bf16, es: 2, |p| {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(_mm_loadu_si128(p as *const __m128i))))
}, |e| super::fp::bf16_to_f32(u16::from_le_bytes(e)));
