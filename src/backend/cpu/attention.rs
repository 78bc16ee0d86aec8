//! The causal grouped-query softmax attention over the cache (model-qwen35.md §5), after q/k
//! norms, RoPE and the cache append.
//!
//! The cache is taken in parts of `JC` rows from its start. For a block of `TB` query tokens,
//! one KV head and one part, the rows are the block's queries of every head that shares the KV
//! head, so each key and value row read serves all of them: `Sᵀ = K Qᵀ` (scores, one column
//! per query row), `e^(s - max)` down each column over the part, and `O = P V`, unnormalized.
//! The parts are then folded in order, each rescaled to the larger maximum, divided by the sum
//! of the exponentials once at the end, and gated by the sigmoid gate. A column's bits depend
//! on its own context only, not on the block, the batch or the thread that ran it.
//!
//! A quantized cache is read a chunk of one head at a time, dequantized into per-thread
//! scratch, so its f32 image is never held whole.

use std::cell::RefCell;

use rayon::prelude::*;

use super::{gemm, math, Tensor};
use crate::backend::AttnParams;
use crate::quant;
use crate::tensor::GgmlType;

/// A cache's rows as stored: f32, or ggml blocks of `row_bytes` per row.
pub(super) enum Rows<'a> {
    F32(&'a [f32]),
    Blocks {
        ty: GgmlType,
        data: &'a [u8],
        row_bytes: usize,
    },
}

impl Rows<'_> {
    /// An f16 cache's bytes from head `g` of row `j0` on, and the row stride in bytes: what
    /// `gemm::dots_f16` and `gemm::outer_f16` read without a decoded copy.
    fn f16_from(&self, g: usize, hd: usize, j0: usize) -> Option<(&[u8], usize)> {
        match *self {
            Rows::Blocks {
                ty: GgmlType::F16,
                data,
                row_bytes,
            } => Some((&data[j0 * row_bytes + g * hd * 2..], row_bytes)),
            _ => None,
        }
    }

    /// Head `g`'s `hd` values of rows `j0..j0 + n` (of `width`) as f32, with their row stride.
    /// f32 rows are borrowed in place; stored blocks are decoded into `buf` (and `row` when the
    /// head does not start on a block boundary).
    #[allow(clippy::too_many_arguments)]
    fn head<'s>(
        &'s self,
        g: usize,
        hd: usize,
        width: usize,
        j0: usize,
        n: usize,
        buf: &'s mut Vec<f32>,
        row: &mut Vec<f32>,
    ) -> (&'s [f32], usize) {
        match *self {
            Rows::F32(d) => (&d[j0 * width + g * hd..], width),
            Rows::Blocks {
                ty,
                data,
                row_bytes,
            } => {
                buf.resize(n * hd, 0.0);
                if ty == GgmlType::F16 && f16_heads(data, row_bytes, j0, g * hd * 2, hd, buf) {
                    return (&buf[..], hd);
                }
                let bs = ty.block_size();
                for (r, out) in buf.chunks_exact_mut(hd).enumerate() {
                    let src = &data[(j0 + r) * row_bytes..][..row_bytes];
                    if ty == GgmlType::F16 && f16_head(&src[g * hd * 2..][..hd * 2], out) {
                        continue;
                    }
                    if hd.is_multiple_of(bs) {
                        let hb = hd / bs * ty.type_size();
                        quant::dequantize_row(ty, &src[g * hb..][..hb], out)
                            .expect("cache rows are whole blocks");
                    } else {
                        row.resize(width, 0.0);
                        quant::dequantize_row(ty, src, row).expect("cache rows are whole blocks");
                        out.copy_from_slice(&row[g * hd..][..hd]);
                    }
                }
                (&buf[..], hd)
            }
        }
    }
}

/// An f16 cache row's head into f32 with the CPU's conversion instructions (F16C where the
/// CPU has it, through `half`), the same values `quant::dequantize_row` gives, which converts
/// one element at a time: at depth the cache's conversion is most of a decode step's attention.
/// False (nothing written) when the bytes are not 2-aligned.
fn f16_head(src: &[u8], out: &mut [f32]) -> bool {
    use half::slice::HalfFloatSliceExt;
    match bytemuck::try_cast_slice::<u8, half::f16>(src) {
        Ok(h) => {
            h.convert_to_f32_slice(out);
            true
        }
        Err(_) => false,
    }
}

/// Rows `j0..j0 + out.len() / hd` of an f16 cache, `hd` values from byte `off` of each, into
/// `out`, with F16C conversions in one call for the chunk; false (nothing
/// written) on a CPU without them. `f16_head`, called per row, went through `half`'s slice
/// conversion, which converts 8 values a call: with the row loop around it, that was 54% of a
/// one-token `attend` at depth 96 in a profile (Zen 5), 22-36 µs a call. Where the CPU has
/// AVX2, FMA and F16C, `attend` reads the cache in `gemm::dots_f16` and `gemm::outer_f16`
/// instead, so this serves the heads `outer_f16` declines (not a multiple of 16) and older CPUs.
fn f16_heads(
    data: &[u8],
    row_bytes: usize,
    j0: usize,
    off: usize,
    hd: usize,
    out: &mut [f32],
) -> bool {
    let n = out.len() / hd;
    if n == 0 {
        return true;
    }
    assert!(
        (j0 + n - 1) * row_bytes + off + 2 * hd <= data.len(),
        "cache rows {j0}..{} of {row_bytes} bytes, head at byte {off}, past the cache's {} bytes",
        j0 + n,
        data.len()
    );
    #[cfg(target_arch = "x86_64")]
    {
        use super::gemm::{ask_ahead, AHEAD_ROWS};
        use std::arch::x86_64::*;
        /// # Safety
        /// F16C and AVX; the rows lie in `data` (checked above), `out` holds `n * hd`.
        #[target_feature(enable = "avx,f16c")]
        unsafe fn narrow(src: *const u8, row_bytes: usize, hd: usize, out: &mut [f32]) {
            for (r, o) in out.chunks_exact_mut(hd).enumerate() {
                let s = src.add(r * row_bytes);
                ask_ahead(s.wrapping_add(AHEAD_ROWS * row_bytes), 2 * hd);
                for c in (0..hd).step_by(8) {
                    let h = _mm_loadu_si128(s.add(2 * c) as *const __m128i);
                    _mm256_storeu_ps(o.as_mut_ptr().add(c), _mm256_cvtph_ps(h));
                }
            }
        }
        let src = data[j0 * row_bytes + off..].as_ptr();
        if hd.is_multiple_of(8)
            && is_x86_feature_detected!("avx")
            && is_x86_feature_detected!("f16c")
        {
            // SAFETY: as above.
            unsafe { narrow(src, row_bytes, hd, out) };
            return true;
        }
    }
    false
}

/// Query tokens per block.
const TB: usize = 16;
/// Cache rows per part, counted from the cache's first row.
const JC: usize = 256;

/// Per-thread scratch of a task: its queries, its scores `Sᵀ`, its output rows, and the softmax
/// maxima and sums.
#[derive(Default)]
struct Scratch {
    qb: Vec<f32>,
    st: Vec<f32>,
    o: Vec<f32>,
    max: Vec<f32>,
    sum: Vec<f64>,
    /// A decoded chunk of a quantized cache, and one decoded row.
    buf: Vec<f32>,
    row: Vec<f32>,
}

thread_local! {
    static SCRATCH: RefCell<Scratch> = RefCell::new(Scratch::default());
}

/// One sequence of [`attend_many`]: `q` and `gate` are `[n_tok][n_head][head_dim]`; `kc` and
/// `vc` hold `pos0 + n_tok` cached rows of `width` (`n_head_kv * head_dim`), the sequence's
/// own rows last.
pub(super) struct Seq<'a> {
    pub q: &'a [f32],
    pub gate: &'a [f32],
    pub kc: Rows<'a>,
    pub vc: Rows<'a>,
    pub pos0: usize,
    pub n_tok: usize,
}

/// [`attend_many`] of one sequence.
#[cfg(test)]
#[allow(clippy::too_many_arguments)]
pub(super) fn attend(
    p: &AttnParams,
    q: &[f32],
    gate: &[f32],
    kc: Rows<'_>,
    vc: Rows<'_>,
    width: usize,
    pos0: usize,
    n_tok: usize,
) -> Tensor {
    let seq = Seq {
        q,
        gate,
        kc,
        vc,
        pos0,
        n_tok,
    };
    attend_many(p, width, &[seq])
}

/// One part's share of a block's attention (`Part::of`): per column its maximum score, the sum
/// of `e^(s - max)` over the part's rows (in row order) and `Σ e^(s - max) v`, `[m_rows][hd]`.
/// A column with none of its context in the part has the maximum -∞.
#[derive(Default)]
struct Part {
    max: Vec<f32>,
    sum: Vec<f64>,
    o: Vec<f32>,
}

impl Part {
    /// Rows `pp * JC..` of the cache (up to the block's last context row) against block `b` of
    /// `seq`'s queries of the heads that share KV head `g`.
    fn of(p: &AttnParams, width: usize, seq: &Seq<'_>, g: usize, b: usize, pp: usize) -> Part {
        let mut part = Part::default();
        part.fill(p, width, seq, g, b, pp);
        part
    }

    /// `Part::of` into this part's buffers (a prefill task reuses one for every part it folds).
    fn fill(&mut self, p: &AttnParams, width: usize, seq: &Seq<'_>, g: usize, b: usize, pp: usize) {
        let (hd, nh) = (p.head_dim, p.n_head);
        let group = nh / p.n_head_kv;
        let Seq {
            q, kc, vc, pos0, ..
        } = seq;
        let (t0, t1) = (b * TB, ((b + 1) * TB).min(seq.n_tok));
        // Row m of the block is token t0 + m / group, head g * group + m % group.
        let m_rows = (t1 - t0) * group;
        let j0 = pp * JC;
        let n = JC.min(pos0 + t1 - j0);
        SCRATCH.with_borrow_mut(
            |Scratch {
                 qb, st, buf, row, ..
             }| {
                qb.clear();
                for t in t0..t1 {
                    qb.extend_from_slice(&q[(t * nh + g * group) * hd..][..group * hd]);
                }
                // Sᵀ[j][m] = k_j · q_m
                st.resize(n * m_rows, 0.0);
                let fast = kc.f16_from(g, hd, j0).is_some_and(|(kh, ld)| {
                    gemm::dots_f16(kh, ld, n, qb, hd, m_rows, hd, st, m_rows)
                });
                if !fast {
                    let (keys, ld) = kc.head(g, hd, width, j0, n, buf, row);
                    gemm::dots(keys, ld, n, qb, hd, m_rows, hd, st, m_rows);
                }
                let ctx = |m: usize| (pos0 + t0 + m / group + 1).saturating_sub(j0).min(n);
                exp_columns(st, m_rows, ctx, p.scale, &mut self.max, &mut self.sum);
                let o = &mut self.o;
                o.resize(m_rows * hd, 0.0);
                let fast = vc.f16_from(g, hd, j0).is_some_and(|(vh, ld)| {
                    gemm::outer_f16(st, m_rows, m_rows, vh, ld, hd, n, o, hd, false)
                });
                if !fast {
                    let (values, ld) = vc.head(g, hd, width, j0, n, buf, row);
                    gemm::outer(st, m_rows, m_rows, values, ld, hd, n, o, hd, false);
                }
            },
        )
    }

    /// Folds the next part in: both rescaled to the larger maximum. A column the part holds
    /// none of is left as it is (its zero sum and output would leave it so too, but `math::exp`
    /// takes -∞ to about `f32::MIN_POSITIVE`, not 0).
    fn fold(&mut self, next: &Part) {
        let hd = self.o.len() / self.max.len().max(1);
        for (m, o) in self.o.chunks_exact_mut(hd).enumerate() {
            let nm = next.max[m];
            if nm == f32::NEG_INFINITY {
                continue;
            }
            let top = self.max[m].max(nm);
            let (a, b) = (math::exp(self.max[m] - top), math::exp(nm - top));
            self.max[m] = top;
            self.sum[m] = self.sum[m] * a as f64 + next.sum[m] * b as f64;
            for (x, &y) in o.iter_mut().zip(&next.o[m * hd..][..hd]) {
                *x = *x * a + y * b;
            }
        }
    }
}

/// The gated attention output of each sequence on its own cache, `[n_tok][n_head * head_dim]`
/// one sequence after another. Every sequence's work runs in one parallel region: a step of
/// several streams pays one fork and one join per layer, and a thread that finishes one
/// stream's work takes the next stream's instead of waiting at a join.
///
/// Where every sequence is one block (decode steps and verifies), each (sequence, part, KV
/// head) is a task and the parts are folded after the region; rayon splits the list in halves,
/// so with two threads each reads its own run of whole cache rows. One task per KV head, each
/// reading its head's half of every row, was slower: one token's attention over a 2,048-row
/// f16 cache of bench-0.8b's shape (2 KV heads of 256, 120 layers' caches in turn so they come
/// from memory, 2 threads, variants alternated in one process): 323 µs a layer against 283 in
/// parts of 256 rows (275 in parts of 512), and for 3 sequences 849 against 760 (740). Longer
/// sequences (prefill) take one task per (sequence, KV head, block), which folds its parts as
/// it goes: their outputs would not all fit in memory at once.
pub(super) fn attend_many(p: &AttnParams, width: usize, seqs: &[Seq<'_>]) -> Tensor {
    let (hd, nh) = (p.head_dim, p.n_head);
    let (group, nkv) = (nh / p.n_head_kv, p.n_head_kv);
    let mut row0 = Vec::with_capacity(seqs.len());
    let mut total = 0;
    for seq in seqs {
        row0.push(total);
        total += seq.n_tok;
    }
    let mut out = Tensor::zeros(total, nh * hd);
    // Writes block b of sequence s, KV head g, from its folded parts.
    let mut put = |s: usize, g: usize, b: usize, mut acc: Part| {
        let seq = &seqs[s];
        for m in 0..acc.max.len() {
            let inv = (1.0 / acc.sum[m]) as f32;
            let (t, h) = (b * TB + m / group, g * group + m % group);
            let om = &mut acc.o[m * hd..][..hd];
            om.iter_mut().for_each(|x| *x *= inv);
            math::mul_sigmoid(om, &seq.gate[(t * nh + h) * hd..][..hd]);
            out.data[((row0[s] + t) * nh + h) * hd..][..hd].copy_from_slice(om);
        }
    };
    let parts =
        |s: usize, b: usize| (seqs[s].pos0 + ((b + 1) * TB).min(seqs[s].n_tok)).div_ceil(JC);
    if seqs.iter().all(|s| s.n_tok <= TB) {
        let tasks: Vec<(usize, usize, usize)> = (0..seqs.len())
            .flat_map(|s| (0..parts(s, 0)).flat_map(move |pp| (0..nkv).map(move |g| (s, pp, g))))
            .collect();
        let done: Vec<Part> = tasks
            .par_iter()
            .map(|&(s, pp, g)| Part::of(p, width, &seqs[s], g, 0, pp))
            .collect();
        // In task order: each sequence's parts in turn, every KV head's within a part.
        let mut done = done.into_iter();
        for s in 0..seqs.len() {
            let mut accs: Vec<Part> = done.by_ref().take(nkv).collect();
            for _ in 1..parts(s, 0) {
                for acc in &mut accs {
                    acc.fold(&done.next().expect("a task for every part and KV head"));
                }
            }
            for (g, acc) in accs.into_iter().enumerate() {
                put(s, g, 0, acc);
            }
        }
    } else {
        let tasks: Vec<(usize, usize, usize)> = (0..nkv)
            .flat_map(|g| {
                seqs.iter()
                    .enumerate()
                    .flat_map(move |(s, seq)| (0..seq.n_tok.div_ceil(TB)).map(move |b| (s, g, b)))
            })
            .collect();
        let done: Vec<Part> = tasks
            .par_iter()
            .map(|&(s, g, b)| {
                let mut acc = Part::of(p, width, &seqs[s], g, b, 0);
                let mut next = Part::default();
                for pp in 1..parts(s, b) {
                    next.fill(p, width, &seqs[s], g, b, pp);
                    acc.fold(&next);
                }
                acc
            })
            .collect();
        for (&(s, g, b), acc) in tasks.iter().zip(done) {
            put(s, g, b, acc);
        }
    }
    out
}

/// Full (non-causal) attention of every query over every key, per head: the vision tower's.
/// `q` and `k` are `[n][n_head * hd]` (rotated); `v` holds the value rows `ldv` apart, head h
/// at `h * hd`. One task per (head, block of `TB` queries): `Sᵀ = K Qᵀ`, softmax of
/// `Sᵀ / sqrt(hd)` down each column (ggml's `soft_max_ext` of `kq`), then `O = P V`.
pub(super) fn attend_full(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    ldv: usize,
    n: usize,
    n_head: usize,
    hd: usize,
) -> Tensor {
    let width = n_head * hd;
    let scale = 1.0 / (hd as f32).sqrt();
    let tasks: Vec<(usize, usize)> = (0..n_head)
        .flat_map(|h| (0..n.div_ceil(TB)).map(move |b| (h, b)))
        .collect();
    let outs: Vec<Vec<f32>> = tasks
        .par_iter()
        .map(|&(h, b)| {
            let (t0, t1) = (b * TB, ((b + 1) * TB).min(n));
            let m_rows = t1 - t0;
            SCRATCH.with_borrow_mut(|sc| {
                let Scratch {
                    st, o, max, sum, ..
                } = sc;
                st.resize(n * m_rows, 0.0);
                for j0 in (0..n).step_by(JC) {
                    let c = JC.min(n - j0);
                    gemm::dots(
                        &k[j0 * width + h * hd..],
                        width,
                        c,
                        &q[t0 * width + h * hd..],
                        width,
                        m_rows,
                        hd,
                        &mut st[j0 * m_rows..],
                        m_rows,
                    );
                }
                softmax_columns(st, m_rows, |_| n, scale, max, sum);
                o.resize(m_rows * hd, 0.0);
                for j0 in (0..n).step_by(JC) {
                    let c = JC.min(n - j0);
                    gemm::outer(
                        &st[j0 * m_rows..],
                        m_rows,
                        m_rows,
                        &v[j0 * ldv + h * hd..],
                        ldv,
                        hd,
                        c,
                        o,
                        hd,
                        j0 > 0,
                    );
                }
                o.clone()
            })
        })
        .collect();
    let mut out = Tensor::zeros(n, width);
    for (&(h, b), o) in tasks.iter().zip(&outs) {
        for (m, om) in o.chunks_exact(hd).enumerate() {
            out.data[(b * TB + m) * width + h * hd..][..hd].copy_from_slice(om);
        }
    }
    out
}

/// Softmax of `scale ·` each column of `st` (`[n_ctx][m_rows]`) over its first `ctx(m)` rows;
/// the rows past them get 0. Rows are contiguous across the columns, so each pass runs down the
/// rows with every column at once.
fn softmax_columns(
    st: &mut [f32],
    m_rows: usize,
    ctx: impl Fn(usize) -> usize,
    scale: f32,
    max: &mut Vec<f32>,
    sum: &mut Vec<f64>,
) {
    exp_columns(st, m_rows, ctx, scale, max, sum);
    let tiled = tile(m_rows);
    // Each column's reciprocal, repeated over the tile as the maxima were.
    max.clear();
    max.extend(sum.iter().map(|&s| (1.0 / s) as f32));
    repeat_columns(max, m_rows, tiled);
    for chunk in st.chunks_mut(tiled) {
        chunk.iter_mut().zip(max.iter()).for_each(|(s, &i)| *s *= i);
    }
}

/// `softmax_columns` without the division: `e^(scale · s - max)` down each column over its
/// first `ctx(m)` rows (0 past them), with each column's maximum left in `max` (-∞ for a column
/// of no rows) and the sum of its exponentials, in row order, in `sum`.
fn exp_columns(
    st: &mut [f32],
    m_rows: usize,
    ctx: impl Fn(usize) -> usize,
    scale: f32,
    max: &mut Vec<f32>,
    sum: &mut Vec<f64>,
) {
    let n_ctx = st.len() / m_rows;
    // Rows below every column's end; the rest hold the causal mask's edge.
    let full = (0..m_rows).map(&ctx).min().unwrap_or(0).min(n_ctx);
    let (body, edge) = st.split_at_mut(full * m_rows);
    // The body's rows scaled and their maxima taken over a tile of `tiled` lanes (`m_rows`
    // columns repeated over 64 values or more), folded to the columns after: a maximum is the
    // same whichever order it is taken in, and runs of 64 vectorize where rows of a one-token
    // decode's 4 columns did not. The tile then repeats the columns' maxima, so that
    // `exp_sub_rows` runs many rows a call (one call per row was 57 µs of a head's 310 at depth
    // 2,048). The sums stay down each column in row order, in f64.
    let tiled = tile(m_rows);
    max.clear();
    max.resize(tiled, f32::NEG_INFINITY);
    for chunk in body.chunks_mut(tiled) {
        for (m, s) in max.iter_mut().zip(chunk) {
            *s *= scale;
            *m = m.max(*s);
        }
    }
    for k in 1..tiled / m_rows.max(1) {
        for m in 0..m_rows {
            max[m] = max[m].max(max[k * m_rows + m]);
        }
    }
    max.truncate(m_rows);
    for (j, row) in (full..).zip(edge.chunks_exact_mut(m_rows)) {
        for (m, s) in row.iter_mut().enumerate() {
            if j < ctx(m) {
                *s *= scale;
                max[m] = max[m].max(*s);
            }
        }
    }
    repeat_columns(max, m_rows, tiled);
    math::exp_sub_rows(body, max);
    max.truncate(m_rows);
    sum.clear();
    sum.resize(m_rows, 0.0);
    for row in body.chunks_exact(m_rows) {
        sum.iter_mut().zip(row).for_each(|(s, &v)| *s += v as f64);
    }
    for (j, row) in (full..).zip(edge.chunks_exact_mut(m_rows)) {
        for (m, s) in row.iter_mut().enumerate() {
            if j < ctx(m) {
                *s = math::exp(*s - max[m]);
                sum[m] += *s as f64;
            } else {
                *s = 0.0;
            }
        }
    }
}

/// Lanes of `exp_columns`' tile: `m_rows` columns repeated over 64 values or more.
fn tile(m_rows: usize) -> usize {
    m_rows * 64usize.div_ceil(m_rows.max(1))
}

/// `v`'s first `m_rows` values (one per column) repeated until `v` holds `tiled` of them.
fn repeat_columns(v: &mut Vec<f32>, m_rows: usize, tiled: usize) {
    v.truncate(m_rows);
    while v.len() < tiled {
        v.extend_from_within(..m_rows);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::backend::cpu::tests::uniform;

    /// `softmax_columns` as it ran before its passes were tiled: a row at a time, `exp` per
    /// value. The reference for `tiled_softmax_is_the_rowwise_bits`.
    fn softmax_rowwise(st: &mut [f32], m_rows: usize, ctx: impl Fn(usize) -> usize, scale: f32) {
        let n_ctx = st.len() / m_rows;
        let mut max = vec![f32::NEG_INFINITY; m_rows];
        for (j, row) in st.chunks_exact_mut(m_rows).enumerate() {
            for (m, s) in row.iter_mut().enumerate() {
                if j < ctx(m) {
                    *s *= scale;
                    max[m] = max[m].max(*s);
                }
            }
        }
        let mut sum = vec![0f64; m_rows];
        for (j, row) in st.chunks_exact_mut(m_rows).enumerate().take(n_ctx) {
            for (m, s) in row.iter_mut().enumerate() {
                if j < ctx(m) {
                    *s = math::exp(*s - max[m]);
                    sum[m] += *s as f64;
                } else {
                    *s = 0.0;
                }
            }
        }
        let inv: Vec<f32> = sum.iter().map(|&s| (1.0 / s) as f32).collect();
        for row in st.chunks_exact_mut(m_rows) {
            row.iter_mut().zip(&inv).for_each(|(s, &i)| *s *= i);
        }
    }

    /// The tiled passes give the row-at-a-time bits: a decode's 4 columns, 1, a verify's 12,
    /// 48 and 80 (tiles of 96 and 80 lanes), over depths that do and do not fill the tile, with
    /// a causal edge where the columns end at different rows.
    #[test]
    fn tiled_softmax_is_the_rowwise_bits() {
        let mut rnd = uniform(0x1234_5678_9abc_def1u64);
        for (m_rows, group) in [(4, 4), (1, 1), (12, 4), (48, 16), (80, 80)] {
            for n_ctx in [1usize, 5, 16, 17, 300, 2049] {
                let base: Vec<f32> = (0..n_ctx * m_rows).map(|_| 40.0 * rnd()).collect();
                // Column m is query token m / group, the last token on the last row: the
                // columns end at different rows (the causal edge).
                let tokens = m_rows / group;
                let pos0 = n_ctx.saturating_sub(tokens);
                let ctx = |m: usize| (pos0 + m / group + 1).min(n_ctx);
                let (mut got, mut want) = (base.clone(), base);
                let (mut max, mut sum) = (Vec::new(), Vec::new());
                softmax_columns(&mut got, m_rows, ctx, 0.0625, &mut max, &mut sum);
                softmax_rowwise(&mut want, m_rows, ctx, 0.0625);
                let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
                assert_eq!(bits(&got), bits(&want), "{m_rows} columns, {n_ctx} rows");
            }
        }
    }

    /// Every f16 bit pattern (subnormals, infinities, NaNs included) reads back as
    /// `quant::dequantize_row` decodes it, through a head that does not start at the row's
    /// start and an odd number of rows.
    #[test]
    fn f16_cache_heads_match_dequantize_row() {
        // 96 and 88: F16C's 8 a step; 90: row by row.
        for hd in [96, 88, 90] {
            f16_cache_heads_match(hd);
        }
    }

    fn f16_cache_heads_match(hd: usize) {
        let width = 3 * hd;
        let n_rows = (1usize << 16).div_ceil(width) + 1;
        let bits: Vec<u16> = (0..n_rows * width)
            .map(|i| (i * 40_503 % 65_536) as u16)
            .collect();
        let data: Vec<u8> = bits.iter().flat_map(|b| b.to_le_bytes()).collect();
        let rows = Rows::Blocks {
            ty: GgmlType::F16,
            data: &data,
            row_bytes: width * 2,
        };
        let (mut buf, mut row) = (Vec::new(), Vec::new());
        for g in 0..3 {
            let (got, ld) = rows.head(g, hd, width, 1, n_rows - 1, &mut buf, &mut row);
            assert_eq!(ld, hd);
            for r in 0..n_rows - 1 {
                let src = &data[((1 + r) * width + g * hd) * 2..][..hd * 2];
                let mut want = vec![0f32; hd];
                quant::dequantize_row(GgmlType::F16, src, &mut want).unwrap();
                let got: Vec<u32> = got[r * hd..][..hd].iter().map(|v| v.to_bits()).collect();
                let want: Vec<u32> = want.iter().map(|v| v.to_bits()).collect();
                assert_eq!(got, want, "head {g} row {r}");
            }
        }
    }

    /// Attention of `n_head` query heads over `n_head_kv` cached heads of `hd`, rotated whole.
    fn params(n_head: usize, n_head_kv: usize, hd: usize) -> AttnParams {
        AttnParams {
            n_head,
            n_head_kv,
            head_dim: hd,
            n_rot: hd,
            rope_base: 1e4,
            rope_sections: [0; 4],
            eps: 1e-6,
            scale: 1.0 / (hd as f32).sqrt(),
        }
    }

    /// An f16 cache read in the kernels' loads (`gemm::dots_f16`, `gemm::outer_f16`) gives the
    /// bits attention over the cache's f32 image gives: one query and a verify's three, a
    /// block of `TB` + 1, at a chunk boundary + 1 and past two chunks; heads of 256 (both
    /// kernels), 88 (`outer` on a decoded chunk) and 90 (the dot's scalar tail).
    #[test]
    fn f16_cache_attention_is_its_f32_images_bits() {
        let mut rnd = uniform(0x2545_f491_4f6c_dd1du64);
        for hd in [256, 88, 90] {
            let (n_head, n_head_kv) = (8, 2);
            let p = params(n_head, n_head_kv, hd);
            let width = n_head_kv * hd;
            for (pos0, n_tok) in [(0, 1), (5, 3), (JC, 1), (JC - 2, TB + 1), (2 * JC + 1, 3)] {
                let n_ctx = pos0 + n_tok;
                let q: Vec<f32> = (0..n_tok * n_head * hd).map(|_| rnd()).collect();
                let gate: Vec<f32> = (0..n_tok * n_head * hd).map(|_| rnd()).collect();
                let half = |n: usize, rnd: &mut dyn FnMut() -> f32| -> (Vec<u8>, Vec<f32>) {
                    let h: Vec<half::f16> =
                        (0..n).map(|_| half::f16::from_f32(4.0 * rnd())).collect();
                    let f = h.iter().map(|v| v.to_f32()).collect();
                    (h.iter().flat_map(|v| v.to_le_bytes()).collect(), f)
                };
                let (kh, kf) = half(n_ctx * width, &mut rnd);
                let (vh, vf) = half(n_ctx * width, &mut rnd);
                let blocks = |data| Rows::Blocks {
                    ty: GgmlType::F16,
                    data,
                    row_bytes: width * 2,
                };
                let got = attend(&p, &q, &gate, blocks(&kh), blocks(&vh), width, pos0, n_tok);
                let want = attend(
                    &p,
                    &q,
                    &gate,
                    Rows::F32(&kf),
                    Rows::F32(&vf),
                    width,
                    pos0,
                    n_tok,
                );
                let bits = |t: &Tensor| t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                assert!(want.data.iter().all(|v| v.is_finite()));
                assert_eq!(
                    bits(&got),
                    bits(&want),
                    "hd {hd}, pos0 {pos0}, {n_tok} tokens"
                );
            }
        }
    }

    /// A query's output bits depend on its own context only: a token alone, in a verify's 3
    /// rows and in a prefill block of `TB` + 1 rows (the two ways `attend_many` divides its
    /// work) gives the same row, with its context ending just before, at and after a part's
    /// end.
    #[test]
    fn a_querys_bits_do_not_depend_on_its_block() {
        let mut rnd = uniform(0x5851_f42d_4c95_7f2du64);
        let (n_head, n_head_kv, hd) = (8, 2, 96);
        let p = params(n_head, n_head_kv, hd);
        let (width, qw) = (n_head_kv * hd, n_head * hd);
        let n_ctx = 2 * JC + TB + 2;
        let mut v = |n: usize| -> Vec<f32> { (0..n).map(|_| rnd()).collect() };
        let (q, gate, kf) = (v(n_ctx * qw), v(n_ctx * qw), v(n_ctx * width));
        let vh: Vec<u8> = v(n_ctx * width)
            .iter()
            .flat_map(|&x| half::f16::from_f32(4.0 * x).to_le_bytes())
            .collect();
        // Tokens from..from + n on the cache's first from + n rows.
        let run = |from: usize, n: usize| {
            let seq = Seq {
                q: &q[from * qw..(from + n) * qw],
                gate: &gate[from * qw..(from + n) * qw],
                kc: Rows::F32(&kf[..(from + n) * width]),
                vc: Rows::Blocks {
                    ty: GgmlType::F16,
                    data: &vh[..(from + n) * width * 2],
                    row_bytes: width * 2,
                },
                pos0: from,
                n_tok: n,
            };
            attend_many(&p, width, &[seq])
        };
        let bits = |t: &Tensor, r: usize| -> Vec<u32> {
            t.data[r * qw..(r + 1) * qw]
                .iter()
                .map(|x| x.to_bits())
                .collect()
        };
        for pos in [JC - 2, JC - 1, JC, JC + 1, 2 * JC - 1, 2 * JC + 1] {
            let alone = run(pos, 1);
            assert!(alone.data.iter().all(|x| x.is_finite()));
            let verify = run(pos - 1, 3);
            assert_eq!(bits(&verify, 1), bits(&alone, 0), "verify, token {pos}");
            let block = run(pos - TB, TB + 2);
            assert_eq!(
                bits(&block, TB),
                bits(&alone, 0),
                "prefill block, token {pos}"
            );
        }
    }

    /// Several sequences in one `attend_many` give each sequence's bits alone, in order: a
    /// decode row, a verify's three, a block of `TB` + 1 past a chunk boundary, on caches of
    /// their own lengths, f32 and f16.
    #[test]
    fn sequences_together_give_their_bits_alone() {
        let mut rnd = uniform(0x9e37_79b9_7f4a_7c15u64);
        let (n_head, n_head_kv, hd) = (8, 2, 96);
        let p = params(n_head, n_head_kv, hd);
        let width = n_head_kv * hd;
        let shapes = [(7, 1), (JC + 3, 3), (JC - 1, TB + 1), (0, 1)];
        let data: Vec<_> = shapes
            .iter()
            .map(|&(pos0, n_tok)| {
                let n_ctx = pos0 + n_tok;
                let v = |n: usize, rnd: &mut dyn FnMut() -> f32| -> Vec<f32> {
                    (0..n).map(|_| rnd()).collect()
                };
                let q = v(n_tok * n_head * hd, &mut rnd);
                let gate = v(n_tok * n_head * hd, &mut rnd);
                let kf = v(n_ctx * width, &mut rnd);
                let vh: Vec<u8> = v(n_ctx * width, &mut rnd)
                    .iter()
                    .flat_map(|&x| half::f16::from_f32(4.0 * x).to_le_bytes())
                    .collect();
                (q, gate, kf, vh)
            })
            .collect();
        let seq = |i: usize| {
            let (q, gate, kf, vh) = &data[i];
            Seq {
                q,
                gate,
                kc: Rows::F32(kf),
                vc: Rows::Blocks {
                    ty: GgmlType::F16,
                    data: vh,
                    row_bytes: width * 2,
                },
                pos0: shapes[i].0,
                n_tok: shapes[i].1,
            }
        };
        let bits = |t: &Tensor| t.data.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let together = attend_many(&p, width, &(0..shapes.len()).map(seq).collect::<Vec<_>>());
        let alone: Vec<u32> = (0..shapes.len())
            .flat_map(|i| bits(&attend_many(&p, width, &[seq(i)])))
            .collect();
        assert!(together.data.iter().all(|v| v.is_finite()));
        assert_eq!(together.rows, shapes.iter().map(|s| s.1).sum::<usize>());
        assert_eq!(bits(&together), alone);
    }
}
