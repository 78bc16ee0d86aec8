//! Integer dot products for the serving path, as llama.cpp computes them: the activations of a
//! matmul are quantized to int8 once (a scale per block, like ggml's `Q8_0` / `Q8_K`
//! activation blocks), then every stored row is dotted with them in integers and scaled once
//! per block. The f32 kernels in `mod.rs` stay the reference (`tern logits`, `--cpu-exact`).
//!
//! Every weight type is read as unsigned codes `c` with a zero point `z` (value = `(c - z) * d`):
//! Q8_0 as `q + 128` (the bias turns its signed bytes into the unsigned operand of
//! `vpdpbusd` / `vpmaddubsw`), Q4_0 as its nibbles with `z = 8`, PQ2_0 and PTQ1_0 as their codes
//! with `z = 1`. So a block's dot is `dw * (dx * Σ c·q - z * dx * Σ q)`, and the second term is
//! computed once per activation block when quantizing (`QActs::o`). The NEON kernels
//! (`arm_int8.rs`) read signed levels `c - z` instead, since `sdot` is signed by signed, and
//! need no second term.
//!
//! Activation blocks: 32 elements for Q8_0 and Q4_0 (the weight block), 128 for PQ2_0 and PTQ1_0
//! (one scale pair per ternary block). PQ2_0's activations are stored interleaved within each
//! block, position `32s + m` holding element `4m + s`, so that the code plane `(qs >> 2s) & 3`
//! of the block's 32 bytes meets its activations in order, with no shuffle.
//!
//! The kernels take 1 to [`MAX_ROWS`] activation rows per call: a weight block is loaded and
//! decoded once for all of them (several decoding sequences, a verify batch).

use rayon::prelude::*;

use crate::tensor::GgmlType;

use super::fp::le_f16;

/// Activation rows one kernel call serves.
pub const MAX_ROWS: usize = 4;

/// Elements [`QActs::quantize`] quantizes on the calling thread rather than in parallel.
const SERIAL_ELEMS: usize = 1 << 15;

/// Whether `ty` has integer kernels.
pub fn supported(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::Q8_0 | GgmlType::Q4_0 | GgmlType::PQ2_0 | GgmlType::Q2_0Legacy | GgmlType::PTQ1_0
    )
}

/// Elements per activation block for weights of type `ty`.
fn act_block(ty: GgmlType) -> usize {
    match ty {
        GgmlType::Q8_0 | GgmlType::Q4_0 => 32,
        _ => 128,
    }
}

/// The zero point of `ty`'s codes.
fn zero_point(ty: GgmlType) -> f32 {
    match ty {
        GgmlType::Q8_0 => 128.0,
        GgmlType::Q4_0 => 8.0,
        _ => 1.0,
    }
}

/// Rows of activations quantized to int8 for weights of one type.
pub struct QActs {
    pub(super) ty: GgmlType,
    pub(super) k: usize,
    pub(super) rows: usize,
    /// `rows * k` levels, each block in the weight type's element order.
    pub(super) qs: Vec<i8>,
    /// The scale of each block, `rows * k / qk`.
    pub(super) d: Vec<f32>,
    /// Each block's zero-point term `z * d * Σ q`.
    pub(super) o: Vec<f32>,
    /// For 32-element blocks: `d` and `o / 8`, eight copies per block, the lanes of one
    /// block's eight i32 partial sums.
    pub(super) d8: Vec<f32>,
    pub(super) o8: Vec<f32>,
    /// For Q8_0 on x86 (see [`quad_levels`]): each row's whole groups of four blocks with the
    /// first 16 levels of the four blocks, then their last 16; per group `d` and `o / 4` of
    /// each block four times, the lanes its levels meet in that order. For PQ2_0 where its
    /// rows are packed (see [`pq2_quad_levels`]): the same per group of four 128-element
    /// blocks, eight vectors of levels.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) quads: Vec<i8>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) d4: Vec<f32>,
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) o4: Vec<f32>,
    /// For PQ2_0 (see [`pair_levels`]): each row's levels with the blocks taken in pairs, and
    /// per pair `d` and `o / 8` of its first block in lanes 0..8, of its second in 8..16.
    pub(super) pairs: Vec<i8>,
    pub(super) d16: Vec<f32>,
    pub(super) o16: Vec<f32>,
    /// For PTQ1_0 on x86 (see [`digit_levels`]): per row and block, 5 × 32 i16 levels
    /// `y[n][j]`.
    #[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
    pub(super) digits: Vec<i16>,
}

/// The i16 lanes of one PTQ1_0 activation block that meet the base-3 digit prefixes of its
/// weight bytes: lane `j` of vector `n` (byte j of the block, trit n, 26 bytes in 32 lanes) holds
/// `x[n][j] - 3 * x[n + 1][j]`, `x[n][j]` the level of the element that trit n of byte j encodes
/// (0 where none: lanes 26..32, the fifth trit of the two `qh` bytes). With `A_n(j) = floor(byte_j
/// * 3^(n+1) / 256)`, the prefix of byte j's first n + 1 trits, trit n is `A_n - 3 * A_(n-1)`, so
/// `Σ_n A_n · y_n = Σ_n trit_n · x_n`: the block's integer sum with no trit decoded.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(crate) fn digit_levels(q: &[i8], y: &mut [i16]) {
    debug_assert_eq!((q.len(), y.len()), (128, 160));
    // x[n][j], with a sixth row of zeros for x[n + 1] of the last trit.
    let mut x = [[0i16; 32]; 6];
    for (e, &l) in q.iter().enumerate() {
        let (j, n) = super::ptq1_0::place(e);
        x[n][j] = l as i16;
    }
    for n in 0..5 {
        for j in 0..32 {
            y[32 * n + j] = x[n][j] - 3 * x[n + 1][j];
        }
    }
}

/// PQ2_0's levels for the one-row kernels, a row's blocks taken two at a time: code plane `s`
/// of a pair's two stored blocks, loaded as one 64-byte vector (32 bytes of each block), and
/// shifted by `2s` and masked, meets its 64 levels in one load, plane `s` of the first block
/// then of the second (`64s + 32h + m` holding element `4m + s` of block `h` of the pair). So
/// the lanes 0..8 of the integer sums are the first block's and 8..16 the second's, scaled
/// lane-wise as Q8_0's pairs of blocks are, with no per-block scalar work. A last odd block
/// keeps the plain interleaved layout (`qs`).
fn pair_levels(qs: &[i8], k: usize, pairs: &mut [i8]) {
    for (q, p) in qs.chunks_exact(k).zip(pairs.chunks_exact_mut(k)) {
        let whole = k / 256 * 256;
        for (q, p) in q[..whole].chunks_exact(256).zip(p.chunks_exact_mut(256)) {
            for h in 0..2 {
                for s in 0..4 {
                    let at = 64 * s + 32 * h;
                    p[at..at + 32].copy_from_slice(&q[128 * h + 32 * s..128 * h + 32 * s + 32]);
                }
            }
        }
        p[whole..].copy_from_slice(&q[whole..]);
    }
}

/// Per row of `nbr` blocks, each of its first `whole` blocks' values `/ div`, `N` times: the
/// per-lane scales of the kernels that take blocks in pairs or fours.
fn lanes<const N: usize>(v: &[f32], nbr: usize, whole: usize, div: f32) -> Vec<f32> {
    v.chunks_exact(nbr)
        .flat_map(|r| r[..whole].iter().flat_map(move |&v| [v / div; N]))
        .collect()
}

/// One row's Q8_0 levels for the four-block steps of `x86_int8::q8_0_vnni_rows` and
/// `x86_int8::q8_0_avx2`: per whole group of four 32-level blocks, the first 16 levels of each
/// block in turn, then the last 16 of each. A 512-bit vector of either half then holds four
/// lanes of each block, so two `vpdpbusd` into the same lanes sum eight levels of one block, and
/// the scaling that follows covers four blocks at a time instead of two; a 256-bit vector holds
/// two blocks' halves, one in each 128-bit lane. `p` holds the whole groups only.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn quad_levels(q: &[i8], p: &mut [i8]) {
    for (g, pg) in q.chunks_exact(128).zip(p.chunks_exact_mut(128)) {
        for h in 0..2 {
            for c in 0..4 {
                pg[64 * h + 16 * c..][..16].copy_from_slice(&g[32 * c + 16 * h..][..16]);
            }
        }
    }
}

/// PQ2_0's levels for the packed kernel (`x86_int8::pq2_0_packed_span`), one group of four
/// 128-element blocks (`q`, each block in the interleaved order of `qs`: `32s + m` holds element
/// `4m + s`): vector `4h + s` of the group's eight holds, for each block `c`, the levels that
/// plane `s` of its code bytes `16h..16h + 16` meet, at bytes `16c..16c + 16`. So the lanes
/// 4c..4c + 4 of every `vpdpbusd` sum are block c's, as the packed rows put code bytes
/// `16h..16h + 16` of block c at `64h + 16c` of the group (`packed.rs`).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn pq2_quad_levels(q: &[i8], p: &mut [i8]) {
    for h in 0..2 {
        for s in 0..4 {
            for c in 0..4 {
                p[64 * (4 * h + s) + 16 * c..][..16]
                    .copy_from_slice(&q[128 * c + 32 * s + 16 * h..][..16]);
            }
        }
    }
}

impl QActs {
    /// Quantizes `x` (`rows` of `k`, `k` a whole number of `ty`'s blocks) for weights of type
    /// `ty`: per block, `d = max |x| / 127` and `q = round(x / d)`.
    pub fn quantize(ty: GgmlType, x: &[f32], k: usize) -> QActs {
        QActs::quantize_isa(ty, x, k, Isa::Avx512Vbmi)
    }

    /// [`QActs::quantize`] with the kernels of `isa` at most: the same levels, scales and
    /// zero-point terms bit for bit whichever runs.
    pub fn quantize_isa(ty: GgmlType, x: &[f32], k: usize, isa: Isa) -> QActs {
        assert!(supported(ty), "QActs: no integer kernels for {ty}");
        let qk = act_block(ty);
        assert!(
            k > 0 && k.is_multiple_of(qk) && k.is_multiple_of(ty.block_size()),
            "QActs: {k} columns is not a whole number of {ty} blocks"
        );
        assert_eq!(x.len() % k, 0, "QActs: input is not whole rows of {k}");
        let rows = x.len() / k;
        let nb = x.len() / qk;
        let z = zero_point(ty);
        let interleave = matches!(ty, GgmlType::PQ2_0 | GgmlType::Q2_0Legacy);
        let mut a = QActs {
            ty,
            k,
            rows,
            qs: vec![0; x.len()],
            d: vec![0.0; nb],
            o: vec![0.0; nb],
            d8: Vec::new(),
            o8: Vec::new(),
            quads: Vec::new(),
            d4: Vec::new(),
            o4: Vec::new(),
            pairs: Vec::new(),
            d16: Vec::new(),
            o16: Vec::new(),
            digits: Vec::new(),
        };
        let nbr = k / qk;
        #[cfg(target_arch = "x86_64")]
        let vector = isa >= Isa::Avx512Vnni && super::x86_int8::vnni();
        #[cfg(not(target_arch = "x86_64"))]
        let _ = isa;
        let row = |x: &[f32], q: &mut [i8], d: &mut [f32], o: &mut [f32]| {
            #[cfg(target_arch = "x86_64")]
            if vector {
                // SAFETY: AVX-512 F and BW (part of `vnni`) checked above; the row's buffers
                // are whole blocks of `qk` (16 or 128).
                return unsafe { super::x86_int8::quantize_row(qk, z, interleave, x, q, d, o) };
            }
            quantize_row(qk, z, interleave, x, q, d, o)
        };
        // A decode step's few rows are quicker than a fork (waking the pool from the engine
        // thread costs tens of microseconds, the rows of a few streams a few).
        if x.len() <= SERIAL_ELEMS {
            row(x, &mut a.qs, &mut a.d, &mut a.o);
        } else {
            x.par_chunks(k)
                .zip(a.qs.par_chunks_mut(k))
                .zip(a.d.par_chunks_mut(nbr).zip(a.o.par_chunks_mut(nbr)))
                .for_each(|((x, q), (d, o))| row(x, q, d, o));
        }
        // Only the x86 VNNI kernel reads them (`x86_int8::ptq1_0_vnni`).
        #[cfg(target_arch = "x86_64")]
        if ty == GgmlType::PTQ1_0 {
            a.digits = vec![0; nb * 160];
            for (q, y) in a.qs.chunks_exact(128).zip(a.digits.chunks_exact_mut(160)) {
                digit_levels(q, y);
            }
        }
        if qk == 32 {
            a.d8 = a.d.iter().flat_map(|&d| [d; 8]).collect();
            a.o8 = a.o.iter().flat_map(|&o| [o / 8.0; 8]).collect();
        }
        // Only the x86 kernels read them (`x86_int8::q8_0_vnni_rows` and, the levels alone,
        // `q8_0_avx2`): a CPU without AVX2 never runs either, so it does not pay for the copy.
        #[cfg(target_arch = "x86_64")]
        if ty == GgmlType::Q8_0 && super::x86_int8::avx2() {
            let ng = nbr / 4;
            a.quads = vec![0; rows * ng * 128];
            if ng > 0 {
                for (q, p) in a.qs.chunks_exact(k).zip(a.quads.chunks_exact_mut(ng * 128)) {
                    quad_levels(q, p);
                }
            }
            a.d4 = lanes::<4>(&a.d, nbr, 4 * ng, 1.0);
            a.o4 = lanes::<4>(&a.o, nbr, 4 * ng, 4.0);
        }
        // Only the packed PQ2_0 kernel reads them (`x86_int8::pq2_0_packed_span`).
        #[cfg(target_arch = "x86_64")]
        if super::packed::packs(ty, k) && ty == GgmlType::PQ2_0 {
            a.quads = vec![0; x.len()];
            for (q, p) in a.qs.chunks_exact(512).zip(a.quads.chunks_exact_mut(512)) {
                pq2_quad_levels(q, p);
            }
            a.d4 = lanes::<4>(&a.d, nbr, nbr, 1.0);
            a.o4 = lanes::<4>(&a.o, nbr, nbr, 4.0);
        }
        if interleave {
            a.pairs = vec![0; x.len()];
            pair_levels(&a.qs, k, &mut a.pairs);
            let np = nbr / 2;
            a.d16 = lanes::<8>(&a.d, nbr, 2 * np, 1.0);
            a.o16 = lanes::<8>(&a.o, nbr, 2 * np, 8.0);
        }
        a
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The levels, scales and zero-point terms (for the tests).
    pub fn contents(&self) -> (&[i8], &[f32], &[f32]) {
        (&self.qs, &self.d, &self.o)
    }

    /// The levels of row `t`.
    pub(super) fn row(&self, t: usize) -> &[i8] {
        &self.qs[t * self.k..(t + 1) * self.k]
    }

    /// Blocks per row.
    pub(super) fn blocks(&self) -> usize {
        self.k / act_block(self.ty)
    }
}

/// The instruction sets the kernels are written for. A caller's `isa` means "at most this" and
/// each architecture's kernels are compared with `>=` in their own order, so the Arm ones rank
/// below every x86 one: the public wrappers' x86 best (`Avx512Vnni`, `Avx512Vbmi`) selects the
/// best NEON kernel on aarch64, and a NEON variant on x86 the portable kernel.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub enum Isa {
    Portable,
    /// NEON without the dot-product extension (Armv8.0: Cortex-A53, A72).
    Neon,
    /// NEON with `sdot` (Armv8.2's dot-product extension).
    NeonDot,
    Avx2,
    Avx512Vnni,
    /// VNNI with VBMI's byte permutes (Ice Lake and later): the one-row kernels' PQ2_0 code
    /// planes by table lookup.
    Avx512Vbmi,
}

/// The kernels this CPU can run, the best last.
pub fn isas() -> Vec<Isa> {
    let mut v = vec![Isa::Portable];
    #[cfg(target_arch = "x86_64")]
    {
        if super::x86_int8::avx2() {
            v.push(Isa::Avx2);
        }
        if super::x86_int8::vnni() {
            v.push(Isa::Avx512Vnni);
        }
        if super::x86_int8::vbmi() {
            v.push(Isa::Avx512Vbmi);
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        if super::arm_int8::neon() {
            v.push(Isa::Neon);
        }
        if super::arm_int8::dotprod() {
            v.push(Isa::NeonDot);
        }
    }
    v
}

/// One row of [`QActs::quantize`]: its levels `q` (interleaved for PQ2_0), and per block of
/// `qk` the scale `d` and the zero-point term `o`.
fn quantize_row(
    qk: usize,
    z: f32,
    interleave: bool,
    x: &[f32],
    q: &mut [i8],
    d: &mut [f32],
    o: &mut [f32],
) {
    for (((xb, qb), d), o) in x
        .chunks_exact(qk)
        .zip(q.chunks_exact_mut(qk))
        .zip(d.iter_mut())
        .zip(o.iter_mut())
    {
        let amax = xb.iter().fold(0.0f32, |m, v| m.max(v.abs()));
        *d = amax / 127.0;
        let id = if *d > 0.0 { 1.0 / *d } else { 0.0 };
        let mut sum = 0i32;
        for (j, &v) in xb.iter().enumerate() {
            let l = (v * id).round() as i8;
            sum += l as i32;
            let at = if interleave { (j % 4) * 32 + j / 4 } else { j };
            qb[at] = l;
        }
        *o = z * *d * sum as f32;
    }
}

/// `out[i] = row · x[t0 + i]` for `out.len()` (1 to [`MAX_ROWS`]) activation rows, `row` one
/// stored row of the activations' weight type (`ty.row_bytes(k)` bytes).
pub fn dot_rows(row: &[u8], acts: &QActs, t0: usize, out: &mut [f32]) {
    dot_rows_isa(row, acts, t0, out, Isa::Avx512Vnni)
}

/// [`dot_rows`] with the kernels of `isa` at most (the tests run every path the CPU has).
pub fn dot_rows_isa(row: &[u8], acts: &QActs, t0: usize, out: &mut [f32], isa: Isa) {
    let n = out.len();
    assert!(
        (1..=MAX_ROWS).contains(&n) && t0 + n <= acts.rows,
        "int8::dot_rows: rows {t0}..{} of {}",
        t0 + n,
        acts.rows
    );
    assert_eq!(
        acts.ty.row_bytes(acts.k as u64),
        Some(row.len() as u64),
        "int8::dot_rows: a {} row of {} bytes against {} activations",
        acts.ty,
        row.len(),
        acts.k
    );
    #[cfg(target_arch = "x86_64")]
    if super::x86_int8::dot_rows(row, acts, t0, out, isa) {
        return;
    }
    // A span of one row: the same kernel as `dot_span`'s, so the same bits.
    #[cfg(target_arch = "aarch64")]
    if super::arm_int8::dot_span(row, row.len(), acts, t0, n, out, isa) {
        return;
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = isa;
    for (i, o) in out.iter_mut().enumerate() {
        *o = dot_portable(row, acts, t0 + i);
    }
}

/// `out[r] = row r · x[t]` for `out.len()` stored rows of the activations' weight type laid
/// back to back in `rows` (a task's slice of a matrix) against one activation row: a decode
/// step's product. Each result is bit for bit what [`dot_rows`] gives for that row alone, so a
/// sequence decodes the same alone and in a batch; the kernel is chosen and the shapes checked
/// once per span, not once per row, which on the short rows of small models (a ternary row of
/// 1,024 is 272 bytes) cost as much as the row's arithmetic.
pub fn dot_span(rows: &[u8], acts: &QActs, t: usize, out: &mut [f32]) {
    dot_span_isa(rows, acts, t, out, Isa::Avx512Vbmi)
}

/// [`dot_span`] with the kernels of `isa` at most.
pub fn dot_span_isa(rows: &[u8], acts: &QActs, t: usize, out: &mut [f32], isa: Isa) {
    assert!(t < acts.rows, "int8::dot_span: row {t} of {}", acts.rows);
    let rb = acts
        .ty
        .row_bytes(acts.k as u64)
        .expect("QActs::quantize admits whole blocks only") as usize;
    assert_eq!(
        rows.len(),
        rb * out.len(),
        "int8::dot_span: {} bytes for {} {} rows of {}",
        rows.len(),
        out.len(),
        acts.ty,
        acts.k
    );
    #[cfg(target_arch = "x86_64")]
    if super::x86_int8::dot_span(rows, rb, acts, t, 1, out, isa) {
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if super::arm_int8::dot_span(rows, rb, acts, t, 1, out, isa) {
        return;
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = isa;
    for (o, row) in out.iter_mut().zip(rows.chunks_exact(rb)) {
        *o = dot_portable(row, acts, t);
    }
}

/// [`dot_span`] for `n` (1 to [`MAX_ROWS`]) activation rows `t0..t0 + n`: `out[r * n + i]` =
/// row r · x[t0 + i], a few streams' step or a verify batch, each weight row read once for all
/// `n`. Each result is bit for bit what [`dot_rows`] and [`dot_span`] give it, so a sequence
/// decodes the same alone and beside others.
pub fn dot_span_rows(rows: &[u8], acts: &QActs, t0: usize, n: usize, out: &mut [f32]) {
    dot_span_rows_isa(rows, acts, t0, n, out, Isa::Avx512Vbmi)
}

/// [`dot_span_rows`] with the kernels of `isa` at most.
pub fn dot_span_rows_isa(
    rows: &[u8],
    acts: &QActs,
    t0: usize,
    n: usize,
    out: &mut [f32],
    isa: Isa,
) {
    assert!(
        (1..=MAX_ROWS).contains(&n) && t0 + n <= acts.rows,
        "int8::dot_span_rows: rows {t0}..{} of {}",
        t0 + n,
        acts.rows
    );
    let rb = acts
        .ty
        .row_bytes(acts.k as u64)
        .expect("QActs::quantize admits whole blocks only") as usize;
    assert_eq!(
        rows.len() * n,
        rb * out.len(),
        "int8::dot_span_rows: {} bytes for {} results of {} {} rows of {}",
        rows.len(),
        out.len(),
        n,
        acts.ty,
        acts.k
    );
    #[cfg(target_arch = "x86_64")]
    if super::x86_int8::dot_span(rows, rb, acts, t0, n, out, isa) {
        return;
    }
    #[cfg(target_arch = "aarch64")]
    if super::arm_int8::dot_span(rows, rb, acts, t0, n, out, isa) {
        return;
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    let _ = isa;
    for (o, row) in out.chunks_exact_mut(n).zip(rows.chunks_exact(rb)) {
        for (i, o) in o.iter_mut().enumerate() {
            *o = dot_portable(row, acts, t0 + i);
        }
    }
}

/// The integer kernel without SIMD: the reference the vector paths are tested against, and the
/// path of CPUs with neither AVX2 nor NEON.
pub fn dot_portable(row: &[u8], a: &QActs, t: usize) -> f32 {
    let q = a.row(t);
    let nb = a.blocks();
    let (d, o) = (&a.d[t * nb..(t + 1) * nb], &a.o[t * nb..(t + 1) * nb]);
    let mut acc = 0.0f32;
    match a.ty {
        GgmlType::Q8_0 => {
            for (b, (wb, qb)) in row.chunks_exact(34).zip(q.chunks_exact(32)).enumerate() {
                let s: i32 = wb[2..]
                    .iter()
                    .zip(qb)
                    .map(|(&w, &x)| w as i8 as i32 * x as i32)
                    .sum();
                acc += le_f16(wb, 0) * (d[b] * s as f32);
            }
        }
        GgmlType::Q4_0 => {
            for (b, (wb, qb)) in row.chunks_exact(18).zip(q.chunks_exact(32)).enumerate() {
                let mut s = 0i32;
                for (j, &c) in wb[2..].iter().enumerate() {
                    s += (c & 15) as i32 * qb[j] as i32 + (c >> 4) as i32 * qb[j + 16] as i32;
                }
                acc += le_f16(wb, 0) * (d[b] * s as f32 - o[b]);
            }
        }
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => {
            for (b, (wb, qb)) in row.chunks_exact(34).zip(q.chunks_exact(128)).enumerate() {
                let mut s = 0i32;
                for (m, &c) in wb[2..].iter().enumerate() {
                    for p in 0..4 {
                        s += ((c >> (2 * p)) & 3) as i32 * qb[32 * p + m] as i32;
                    }
                }
                acc += le_f16(wb, 0) * (d[b] * s as f32 - o[b]);
            }
        }
        GgmlType::PTQ1_0 => {
            let mut w = [0.0f32; 128];
            for (b, (wb, qb)) in row.chunks_exact(28).zip(q.chunks_exact(128)).enumerate() {
                let dw = super::ptq1_0::decode(wb.try_into().expect("PTQ1_0 block"), &mut w);
                // The decoder's levels are trits - 1, exact in f32.
                let s: i32 = w
                    .iter()
                    .zip(qb)
                    .map(|(&l, &x)| (l as i32 + 1) * x as i32)
                    .sum();
                acc += dw * (d[b] * s as f32 - o[b]);
            }
        }
        ty => unreachable!("QActs::quantize admits no {ty}"),
    }
    acc
}

/// Blocks per group of the tiled layout: the 16 i32 lanes of a 512-bit register.
pub(super) const GROUP: usize = 16;

/// The tiled product's layout of one row (weight codes or activation levels), written by
/// [`Panel::decode`] and [`TiledActs::new`]: the blocks in groups of [`GROUP`], and within a
/// group of width `w` blocks the blocks' 4-byte pieces interleaved, piece `j` of block `i` at
/// `(w * j + i) * 4`. So `vpdpbusd` over the group's successive 64-byte vectors accumulates
/// block `i`'s integer sum in the lanes `l` with `l % w == i`, and the per-block scaling is one
/// multiply-add per group (lane-wise against 16 contiguous scales) instead of one per block.
///
/// Every group is 16 blocks wide but the last, which is as wide as the next power of two of
/// the blocks it holds (at least 64 bytes): a ternary row of 1,024 (8 blocks of 128) is one
/// group 8 wide, each block's pieces in two lanes, not 16 with 8 of zeros, which cost the
/// kernel twice the work. Absent blocks are zero codes, levels and scales (they add nothing).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub(super) struct Tiling {
    /// Elements per block.
    pub qk: usize,
    /// Blocks per row.
    pub nb: usize,
    pub groups: usize,
    /// Width of the last group, in blocks.
    pub last: usize,
}

impl Tiling {
    pub fn new(qk: usize, nb: usize) -> Tiling {
        let groups = nb.div_ceil(GROUP).max(1);
        let held = nb - (groups - 1) * GROUP;
        let last = held.next_power_of_two().max(64 / qk).min(GROUP);
        Tiling {
            qk,
            nb,
            groups,
            last,
        }
    }

    /// Blocks in group `g`'s lanes.
    pub fn width(&self, g: usize) -> usize {
        if g + 1 == self.groups {
            self.last
        } else {
            GROUP
        }
    }

    /// Bytes (codes or levels) of a row.
    pub fn row_len(&self) -> usize {
        ((self.groups - 1) * GROUP + self.last) * self.qk
    }

    /// Where group `g` of a row starts.
    pub fn group_at(&self, g: usize) -> usize {
        g * GROUP * self.qk
    }

    /// Per-lane values of a row (scales, zero-point terms): 16 per group.
    pub fn lanes(&self) -> usize {
        self.groups * GROUP
    }

    /// Writes a row's blocks `src` (`nb * qk` elements) in this layout into `dst`.
    pub fn interleave<T: Copy + Default>(&self, src: &[T], dst: &mut [T]) {
        debug_assert_eq!(dst.len(), self.row_len());
        dst.fill(T::default());
        for (b, blk) in src.chunks_exact(self.qk).enumerate() {
            self.put(b, blk, dst);
        }
    }

    /// Writes block `b`'s elements in place in the row `dst`.
    #[inline]
    pub fn put<T: Copy>(&self, b: usize, blk: &[T], dst: &mut [T]) {
        let (g, i) = (b / GROUP, b % GROUP);
        let (base, w) = (self.group_at(g), self.width(g));
        for (j, piece) in blk.chunks_exact(4).enumerate() {
            let at = base + (w * j + i) * 4;
            dst[at..at + 4].copy_from_slice(piece);
        }
    }

    /// A row's per-block values `src` as its lanes: lane `l` of group `g` takes block
    /// `16g + l % w` (every lane of a block for scales, `all`; only its first for the
    /// zero-point terms, which the lanes' sum must count once), absent blocks 0.
    pub fn spread(&self, src: &[f32], dst: &mut [f32], all: bool) {
        for (g, lanes) in dst.chunks_exact_mut(GROUP).enumerate() {
            let w = self.width(g);
            for (l, v) in lanes.iter_mut().enumerate() {
                let b = g * GROUP + l % w;
                *v = if b < self.nb && (all || l < w) {
                    src[b]
                } else {
                    0.0
                };
            }
        }
    }
}

/// Weight rows decoded once for the tiled product ([`gemm_isa`]): each row's codes as unsigned
/// bytes in its activations' element order (so one code meets one level whatever the stored
/// packing), in the interleaved layout of [`Tiling`], and each block's scale as f32.
/// Decoding a task's rows once and reusing them for every token row takes the unpacking out of
/// the inner loop, which the row kernels pay per group of [`MAX_ROWS`] tokens.
#[derive(Default)]
pub struct Panel {
    pub(super) ty: Option<GgmlType>,
    pub(super) rows: usize,
    pub(super) k: usize,
    pub(super) tiling: Tiling,
    /// `rows * tiling.row_len()` codes.
    pub(super) codes: Vec<u8>,
    /// `rows * tiling.lanes()` block scales.
    pub(super) dw: Vec<f32>,
    /// One row's codes and scales in element order, before interleaving.
    scratch: (Vec<u8>, Vec<f32>),
    /// A packed row unpacked to the stored layout, where the packed decoder does not apply.
    stored: Vec<u8>,
}

impl Panel {
    /// Decodes `rows` stored rows of `k` elements of type `ty` (`w` holds them back to back),
    /// reusing this panel's buffers.
    pub fn decode(&mut self, ty: GgmlType, w: &[u8], rows: usize, k: usize) {
        self.decode_isa(ty, w, rows, k, Isa::Avx512Vnni)
    }

    /// [`Panel::decode`] with the kernels of `isa` at most (the tests check that every path
    /// writes the same panel).
    pub fn decode_isa(&mut self, ty: GgmlType, w: &[u8], rows: usize, k: usize, isa: Isa) {
        self.decode_rows(ty, w, rows, k, isa, false)
    }

    /// [`Panel::decode`] of `rows` Q8_0 or PQ2_0 rows of `k` in the serving path's packed
    /// layout (`quant::packed`): the panel their stored rows give. Q8_0's is gathered from the
    /// packed levels (already biased) where every group of the tiling is whole; otherwise, and
    /// for PQ2_0, each row is unpacked to the stored layout and decoded as stored.
    pub fn decode_packed(&mut self, ty: GgmlType, w: &[u8], rows: usize, k: usize) {
        self.decode_rows(ty, w, rows, k, Isa::Avx512Vnni, true)
    }

    fn decode_rows(
        &mut self,
        ty: GgmlType,
        w: &[u8],
        rows: usize,
        k: usize,
        isa: Isa,
        packed: bool,
    ) {
        assert!(supported(ty), "int8::Panel: no integer kernels for {ty}");
        let rb = ty.row_bytes(k as u64).expect("whole blocks") as usize;
        assert_eq!(w.len(), rb * rows, "int8::Panel: {rows} {ty} rows of {k}");
        let qk = act_block(ty);
        let nb = k / qk;
        let tiling = Tiling::new(qk, nb);
        let (gb, gs) = (tiling.row_len(), tiling.lanes());
        self.ty = Some(ty);
        self.rows = rows;
        self.k = k;
        self.tiling = tiling;
        self.codes.resize(rows * gb, 0);
        self.dw.resize(rows * gs, 0.0);
        let (c, d) = &mut self.scratch;
        c.resize(k, 0);
        d.resize(nb, 0.0);
        let stored = &mut self.stored;
        for ((row, codes), dw) in w
            .chunks_exact(rb)
            .zip(self.codes.chunks_exact_mut(gb))
            .zip(self.dw.chunks_exact_mut(gs))
        {
            let row = if packed {
                #[cfg(target_arch = "x86_64")]
                if super::x86_int8::panel_row_packed(ty, row, &tiling, codes, dw) {
                    continue;
                }
                stored.resize(rb, 0);
                super::packed::unpack_row(ty, row, k, stored);
                &stored[..]
            } else {
                row
            };
            #[cfg(target_arch = "x86_64")]
            if super::x86_int8::panel_row(ty, row, &tiling, codes, dw, isa) {
                continue;
            }
            #[cfg(target_arch = "x86_64")]
            let vector = super::x86_int8::decode_codes(ty, row, c, d, isa);
            #[cfg(not(target_arch = "x86_64"))]
            let vector = false;
            if !vector {
                decode_codes(ty, row, c, d);
            }
            tiling.interleave(c, codes);
            tiling.spread(d, dw, true);
        }
        #[cfg(not(target_arch = "x86_64"))]
        let _ = isa;
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The decoded codes and block scales, in the tiled layout (for the tests).
    pub fn contents(&self) -> (&[u8], &[f32]) {
        (&self.codes, &self.dw)
    }
}

/// Quantized activations in the tiled product's layout ([`Tiling`]), made from
/// [`QActs`] once per product.
#[derive(Default)]
pub struct TiledActs {
    pub(super) ty: Option<GgmlType>,
    pub(super) k: usize,
    pub(super) rows: usize,
    pub(super) tiling: Tiling,
    pub(super) qs: Vec<i8>,
    /// Per lane ([`Tiling::spread`]): the block scales and the zero-point terms.
    pub(super) d: Vec<f32>,
    pub(super) o: Vec<f32>,
}

impl TiledActs {
    /// `TiledActs::new(&QActs::quantize(ty, x, k))` in one pass, each row on its own task:
    /// prefill's activations, which the serving path quantizes once per product.
    pub fn quantize(ty: GgmlType, x: &[f32], k: usize) -> TiledActs {
        TiledActs::quantize_isa(ty, x, k, Isa::Avx512Vnni)
    }

    /// [`TiledActs::quantize`] with the kernels of `isa` at most: the same levels, scales and
    /// zero-point terms bit for bit whichever runs (the rounding is `f32::round`'s).
    pub fn quantize_isa(ty: GgmlType, x: &[f32], k: usize, isa: Isa) -> TiledActs {
        #[cfg(target_arch = "x86_64")]
        if isa >= Isa::Avx512Vnni && super::x86_int8::vnni() {
            assert!(supported(ty), "TiledActs: no integer kernels for {ty}");
            let qk = act_block(ty);
            assert!(
                k > 0 && k.is_multiple_of(qk) && k.is_multiple_of(ty.block_size()),
                "TiledActs: {k} columns is not a whole number of {ty} blocks"
            );
            assert_eq!(x.len() % k, 0, "TiledActs: input is not whole rows of {k}");
            let rows = x.len() / k;
            let tiling = Tiling::new(qk, k / qk);
            let (gb, gs) = (tiling.row_len(), tiling.lanes());
            let mut t = TiledActs {
                ty: Some(ty),
                k,
                rows,
                tiling,
                qs: vec![0; rows * gb],
                d: vec![0.0; rows * gs],
                o: vec![0.0; rows * gs],
            };
            let (z, interleave) = (
                zero_point(ty),
                matches!(ty, GgmlType::PQ2_0 | GgmlType::Q2_0Legacy),
            );
            x.par_chunks(k)
                .zip(t.qs.par_chunks_mut(gb))
                .zip(t.d.par_chunks_mut(gs).zip(t.o.par_chunks_mut(gs)))
                .for_each(|((x, q), (d, o))| {
                    // SAFETY: VNNI (AVX-512 F and BW) checked above; the row's buffers are
                    // its tiling's.
                    unsafe {
                        super::x86_int8::quantize_tiled_row(&tiling, z, interleave, x, q, d, o)
                    }
                });
            return t;
        }
        TiledActs::new(&QActs::quantize_isa(ty, x, k, isa))
    }

    pub fn new(a: &QActs) -> TiledActs {
        let qk = act_block(a.ty);
        let nb = a.blocks();
        let tiling = Tiling::new(qk, nb);
        let (gb, gs) = (tiling.row_len(), tiling.lanes());
        let mut t = TiledActs {
            ty: Some(a.ty),
            k: a.k,
            rows: a.rows,
            tiling,
            qs: vec![0; a.rows * gb],
            d: vec![0.0; a.rows * gs],
            o: vec![0.0; a.rows * gs],
        };
        for (r, ((q, d), o)) in
            t.qs.chunks_exact_mut(gb)
                .zip(t.d.chunks_exact_mut(gs))
                .zip(t.o.chunks_exact_mut(gs))
                .enumerate()
        {
            tiling.interleave(a.row(r), q);
            tiling.spread(&a.d[r * nb..(r + 1) * nb], d, true);
            tiling.spread(&a.o[r * nb..(r + 1) * nb], o, false);
        }
        t
    }

    pub fn rows(&self) -> usize {
        self.rows
    }

    /// The levels, scales and zero-point terms, in the tiled layout (for the tests).
    pub fn contents(&self) -> (&[i8], &[f32], &[f32]) {
        (&self.qs, &self.d, &self.o)
    }
}

/// One stored row's codes (in activation order) and block scales, for [`Panel`]. Written as
/// plain loops over fixed-size blocks, which the compiler vectorizes.
fn decode_codes(ty: GgmlType, row: &[u8], codes: &mut [u8], dw: &mut [f32]) {
    match ty {
        GgmlType::Q8_0 => {
            for ((b, c), d) in row.chunks_exact(34).zip(codes.chunks_exact_mut(32)).zip(dw) {
                *d = le_f16(b, 0);
                for (c, &q) in c.iter_mut().zip(&b[2..]) {
                    *c = q ^ 0x80;
                }
            }
        }
        GgmlType::Q4_0 => {
            for ((b, c), d) in row.chunks_exact(18).zip(codes.chunks_exact_mut(32)).zip(dw) {
                *d = le_f16(b, 0);
                let (lo, hi) = c.split_at_mut(16);
                for ((l, h), &q) in lo.iter_mut().zip(hi.iter_mut()).zip(&b[2..]) {
                    *l = q & 15;
                    *h = q >> 4;
                }
            }
        }
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => {
            for ((b, c), d) in row
                .chunks_exact(34)
                .zip(codes.chunks_exact_mut(128))
                .zip(dw)
            {
                *d = le_f16(b, 0);
                for (s, plane) in c.chunks_exact_mut(32).enumerate() {
                    for (c, &q) in plane.iter_mut().zip(&b[2..]) {
                        *c = (q >> (2 * s)) & 3;
                    }
                }
            }
        }
        GgmlType::PTQ1_0 => {
            for ((b, c), d) in row
                .chunks_exact(28)
                .zip(codes.chunks_exact_mut(128))
                .zip(dw)
            {
                *d = le_f16(b, 26);
                c.copy_from_slice(&super::ptq1_0::codes(b.try_into().expect("PTQ1_0 block")));
            }
        }
        ty => unreachable!("Panel::decode admits no {ty}"),
    }
}

/// Whether [`gemm_isa`] has a vector kernel on this CPU (else the row kernels are faster).
pub fn gemm_vectorized() -> bool {
    isas().contains(&Isa::Avx512Vnni)
}

/// Token rows from which the tiled product beats the row kernels on weights of type `ty`: it
/// decodes each weight row into a panel once per product, which only enough token rows repay.
/// `cargo xtask bench --kernels` measured the crossover (tiled over row kernels, decoding
/// included): Q8_0 0.51 at 16 rows and 1.41 at 64, Q4_0 0.64 and 1.86, PQ2_0 0.83 and 1.55.
/// PTQ1_0 read 0.28 and 1.07 while its panels decoded trits through f32; with the AVX-512
/// decoder (`x86_int8::decode_codes`) 0.82 at 16, 0.99 at 24, 1.39 at 32 and 2.11 at 64
/// (Zen 5), so it starts where Q8_0 does.
pub fn tiled_min_rows(ty: GgmlType) -> usize {
    match ty {
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => 24,
        _ => 32,
    }
}

/// The tiled product: `out[i * panel.rows() + r] = panel row r · x[t0 + i]` for `n` activation
/// rows from `t0`, every decoded weight row against every activation row, a register tile of
/// several of each at a time (each code and level loaded once per tile, not once per pair).
pub fn gemm_isa(p: &Panel, a: &TiledActs, t0: usize, n: usize, out: &mut [f32], isa: Isa) {
    assert_eq!(
        p.ty, a.ty,
        "int8::gemm: panel and activations of other types"
    );
    assert_eq!(
        p.k, a.k,
        "int8::gemm: panel rows of {} against {}",
        p.k, a.k
    );
    debug_assert_eq!(p.tiling, a.tiling);
    assert!(
        t0 + n <= a.rows,
        "int8::gemm: rows {t0}..{} of {}",
        t0 + n,
        a.rows
    );
    assert_eq!(
        out.len(),
        n * p.rows,
        "int8::gemm: output of {} for {n} x {}",
        out.len(),
        p.rows
    );
    #[cfg(target_arch = "x86_64")]
    if super::x86_int8::gemm(p, a, t0, n, out, isa) {
        return;
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = isa;
    gemm_portable(p, a, t0, n, out);
}

/// [`gemm_isa`] without SIMD, on the same layout: lane `i` of a group is block `i`.
fn gemm_portable(p: &Panel, a: &TiledActs, t0: usize, n: usize, out: &mut [f32]) {
    let tl = p.tiling;
    let (gb, gs) = (tl.row_len(), tl.lanes());
    let row = |v: usize, r: usize| r * v..(r + 1) * v;
    for i in 0..n {
        let t = t0 + i;
        let (q, d, o) = (&a.qs[row(gb, t)], &a.d[row(gs, t)], &a.o[row(gs, t)]);
        for r in 0..p.rows {
            let (c, dw) = (&p.codes[row(gb, r)], &p.dw[row(gs, r)]);
            let mut acc = 0.0f32;
            for g in 0..tl.groups {
                let mut s = [0i32; GROUP];
                let at = tl.group_at(g)..tl.group_at(g) + tl.width(g) * tl.qk;
                let (cg, qg) = (&c[at.clone()], &q[at]);
                for (v, (cv, qv)) in cg.chunks_exact(4).zip(qg.chunks_exact(4)).enumerate() {
                    s[v % GROUP] += cv
                        .iter()
                        .zip(qv)
                        .map(|(&c, &x)| c as i32 * x as i32)
                        .sum::<i32>();
                }
                for (l, &s) in s.iter().enumerate() {
                    let b = g * GROUP + l;
                    acc += dw[b] * (d[b] * s as f32 - o[b]);
                }
            }
            out[i * p.rows + r] = acc;
        }
    }
}
