//! The Gated DeltaNet core (model-qwen35.md §4) over consecutive tokens of one sequence.
//!
//! The batch runs in chunks of `CHUNK` tokens, each in two phases. The causal conv, SiLU, L2
//! norms and q scale depend only on the raw inputs, so they run for the chunk's tokens at once,
//! in parallel over (token, head). The recurrence is sequential in time but independent per V
//! head, so each head runs through the chunk's tokens in one task (one rayon split per chunk,
//! not per token), the gated RMSNorm included.

use rayon::prelude::*;

use super::{math, rms_scale, sigmoid, silu, softplus, Recurrent, Tensor};
use crate::backend::{GdnParams, GdnSeq};

/// Tokens per chunk: the conv output of a chunk stays small (and cached) while the heads scan
/// it, however long the prompt.
const CHUNK: usize = 128;

/// The per-layer weights of the core, decoded.
pub(super) struct Weights<'a> {
    /// The conv taps tap-major, `[d_conv][conv_dim]`.
    pub conv_taps: &'a [f32],
    pub dt_bias: &'a [f32],
    pub ssm_a: &'a [f32],
    pub norm: &'a [f32],
}

/// `x / max(||x||, eps)`, ggml's l2_norm.
fn l2_normalize(x: &mut [f32], eps: f32) {
    let scale = 1.0 / (math::sum_sq(x).sqrt() as f32).max(eps);
    x.iter_mut().for_each(|v| *v *= scale);
}

/// One sequence's share of [`gdn_batch`].
type Seq<'a> = GdnSeq<'a, Recurrent>;

/// The core over one sequence's consecutive rows.
#[allow(clippy::too_many_arguments)]
pub(super) fn gdn(
    p: &GdnParams,
    mixed: &Tensor,
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &Weights<'_>,
    st: &mut Recurrent,
) -> Tensor {
    let mut seqs = [Seq {
        rows: mixed.rows,
        state: st,
        cells: None,
    }];
    gdn_batch(p, mixed, z, b, a, w, &mut seqs, true)
}

/// The core over several sequences' rows at once: each chunk's conv for every sequence in one
/// parallel loop, then the recurrence of every (sequence, V head) in another, so a decode step
/// of many streams costs two parallel regions per layer, not two per stream. A sequence with
/// `cells` runs its rows out of place: row t reads the state row t - 1 left (the live state
/// for the first) and writes cell t (the live state for the last), so a verify batch keeps
/// the state after every row without copying one. `stream_cells` lets the AVX-512 sweep
/// write the cells by streaming stores (`head_scan_body`); the values are the same either
/// way, which a test checks.
#[allow(clippy::too_many_arguments)]
pub(super) fn gdn_batch(
    p: &GdnParams,
    mixed: &Tensor,
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &Weights<'_>,
    seqs: &mut [Seq<'_>],
    stream_cells: bool,
) -> Tensor {
    let (cd, d, dd) = (p.conv_dim(), p.d, p.d * p.d);
    assert_eq!(mixed.cols, cd);
    let total: usize = seqs.iter().map(|s| s.rows).sum();
    assert_eq!(
        mixed.rows, total,
        "gdn: the sequences' rows are the inputs' rows"
    );
    let starts: Vec<usize> = seqs
        .iter()
        .scan(0, |at, s| {
            let r = *at;
            *at += s.rows;
            Some(r)
        })
        .collect();
    for s in seqs.iter() {
        if let Some(c) = &s.cells {
            assert!(
                c.len() + 1 >= s.rows,
                "snapshot batch of {} rows needs {} cells, has {}",
                s.rows,
                s.rows.saturating_sub(1),
                c.len()
            );
        }
    }
    let n_rows: Vec<usize> = seqs.iter().map(|s| s.rows).collect();
    let out_of_place: Vec<bool> = seqs.iter().map(|s| s.cells.is_some()).collect();
    // Whole-line streaming stores need every row of a cell's heads on a 64-byte boundary.
    let stream: Vec<bool> = seqs
        .iter()
        .map(|s| {
            let lines = |c: &Recurrent| (c.ssm.as_ptr() as usize).is_multiple_of(64);
            stream_cells
                && s.rows > 1
                && d.is_multiple_of(32)
                && s.cells.as_ref().is_some_and(|c| c.iter().all(lines))
        })
        .collect();
    // Each task owns one V head's slice of a sequence's buffers: [live, cell 0, cell 1, ..].
    struct Task<'s> {
        seq: usize,
        j: usize,
        bufs: Vec<&'s mut [f32]>,
    }
    let mut tasks: Vec<Task<'_>> = Vec::with_capacity(seqs.len() * p.n_v);
    let mut convs: Vec<Conv<'_>> = Vec::with_capacity(seqs.len());
    let mut conv_new: Vec<Vec<Vec<f32>>> = Vec::with_capacity(seqs.len());
    for (i, s) in seqs.iter_mut().enumerate() {
        // A decode step's row: the conv tasks shift the state in place (`Conv::Shift`).
        let in_place = s.rows == 1 && s.cells.is_none();
        if in_place {
            conv_new.push(Vec::new());
        } else {
            // The conv states after each row that needs one (the cells' rows, then the last),
            // from the carried state before it is overwritten.
            let x = |k: usize| conv_input(p, &s.state.conv, mixed, starts[i], k);
            let kept: Vec<usize> = match &s.cells {
                Some(_) => (1..=s.rows).collect(),
                None => vec![s.rows],
            };
            conv_new.push(
                kept.iter()
                    .map(|&n| {
                        let mut c = Vec::with_capacity(p.conv_state_len());
                        (n..n + p.d_conv - 1).for_each(|r| c.extend_from_slice(x(r)));
                        c
                    })
                    .collect(),
            );
        }
        let mut heads: Vec<Vec<&mut [f32]>> = (0..p.n_v).map(|_| Vec::new()).collect();
        let live = s.state.ssm.chunks_exact_mut(dd);
        let cells = s.cells.iter_mut().flat_map(|c| c.iter_mut());
        let cell_heads = cells.flat_map(|c| c.ssm.chunks_exact_mut(dd).enumerate());
        for (j, h) in live.enumerate().chain(cell_heads) {
            heads[j].push(h);
        }
        tasks.extend(
            heads
                .into_iter()
                .enumerate()
                .map(|(j, bufs)| Task { seq: i, j, bufs }),
        );
        convs.push(match in_place {
            true => Conv::Shift(by_head(&mut s.state.conv, d, cd / d)),
            false => Conv::Carried(&s.state.conv),
        });
    }
    let mut out = Tensor::zeros(total, p.n_v * d);
    let longest = n_rows.iter().copied().max().unwrap_or(0);
    for t0 in (0..longest).step_by(CHUNK) {
        // This chunk's rows of each sequence: (sequence, first row, rows, offset in u).
        let mut parts = Vec::with_capacity(n_rows.len());
        let mut at = 0;
        for (i, &n) in n_rows.iter().enumerate() {
            if t0 < n {
                let m = (n - t0).min(CHUNK);
                parts.push((i, t0, m, at));
                at += m;
            }
        }
        let u = conv_silu_norm(p, mixed, &parts, &starts, at, w.conv_taps, &mut convs);
        // The recurrence and gated norm, one task per (sequence, V head) over its rows.
        let ys: Vec<(usize, usize, Vec<f32>)> = tasks
            .par_iter_mut()
            .filter_map(|task| {
                let &(i, _, m, off) = parts.iter().find(|q| q.0 == task.seq)?;
                let mut y = vec![0f32; m * d];
                let rows = Rows {
                    t0,
                    base: starts[i],
                    u: &u[off * cd..(off + m) * cd],
                    n: n_rows[i],
                    out_of_place: out_of_place[i],
                    stream_cells: stream[i],
                };
                head_scan(p, task.j, &rows, z, b, a, w, &mut task.bufs, &mut y);
                Some((starts[i] + t0, task.j, y))
            })
            .collect();
        for (r0, j, y) in ys {
            for (t, yt) in (r0..).zip(y.chunks_exact(d)) {
                out.data[(t * p.n_v + j) * d..][..d].copy_from_slice(yt);
            }
        }
    }
    drop(tasks);
    drop(convs);
    for (s, mut new) in seqs.iter_mut().zip(conv_new) {
        let Some(last) = new.pop() else {
            continue; // shifted in place by its conv tasks
        };
        s.state.conv.copy_from_slice(&last);
        if let Some(cells) = s.cells.as_mut() {
            for (c, v) in cells.iter_mut().zip(new) {
                c.conv.copy_from_slice(&v);
            }
        }
    }
    out
}

/// Row `i` of the conv input X of the sequence whose rows start at `base` in `mixed`: the
/// carried state rows, then its `mixed` rows.
fn conv_input<'a>(
    p: &GdnParams,
    state: &'a [f32],
    mixed: &'a Tensor,
    base: usize,
    i: usize,
) -> &'a [f32] {
    let (cd, kw1) = (p.conv_dim(), p.d_conv - 1);
    if i < kw1 {
        &state[i * cd..(i + 1) * cd]
    } else {
        mixed.row(base + i - kw1)
    }
}

/// A sequence's carried conv state as [`conv_silu_norm`] reads it.
enum Conv<'a> {
    /// Read only; the caller keeps the new states.
    Carried(&'a [f32]),
    /// A sequence of one row without cells (a decode step): per head, its columns of the
    /// `d_conv - 1` state rows. The task that convolves the row's head reads them, then shifts
    /// them one row and appends the row's raw input, in place. That spares the step a
    /// single-threaded copy of each sequence's state (72 KiB a layer at bench-0.8b's geometry)
    /// into a new buffer and back, and the writes land on lines the task has just read. With
    /// bench-0.8b's geometry (18 layers, states from memory, 2 threads), the GDN cores of a
    /// step took 7.64 / 7.81 -> 7.14 / 7.34 ms at three streams, 3.32 / 3.30 -> 3.09 / 3.18
    /// at one.
    Shift(Vec<Vec<&'a mut [f32]>>),
}

/// A conv state's `d`-wide chunks (`d_conv - 1` rows of `heads` heads) regrouped by head.
fn by_head(state: &mut [f32], d: usize, heads: usize) -> Vec<Vec<&mut [f32]>> {
    let mut out: Vec<Vec<&mut [f32]>> = (0..heads).map(|_| Vec::new()).collect();
    for (i, c) in state.chunks_exact_mut(d).enumerate() {
        out[i % heads].push(c);
    }
    out
}

/// `u[t] = silu(conv(X)[t])` for the rows `parts` name (`(sequence, first row, rows, offset in
/// u)`, `total` rows in all), with q and k heads L2-normalised and q scaled by `1/sqrt(d)`,
/// where X is a sequence's carried `d_conv - 1` raw inputs followed by its `mixed` rows.
/// A `Conv::Shift` state is taken and left holding the state after its row.
fn conv_silu_norm(
    p: &GdnParams,
    mixed: &Tensor,
    parts: &[(usize, usize, usize, usize)],
    starts: &[usize],
    total: usize,
    taps: &[f32],
    states: &mut [Conv<'_>],
) -> Vec<f32> {
    let (cd, d, kw) = (p.conv_dim(), p.d, p.d_conv);
    let q_scale = 1.0 / (d as f32).sqrt();
    let heads = cd / d; // n_k q heads, n_k k heads, n_v v heads
    let mut u = vec![0f32; total * cd];
    // Which part each row of u belongs to.
    let part_of: Vec<usize> = parts
        .iter()
        .enumerate()
        .flat_map(|(k, q)| std::iter::repeat_n(k, q.2))
        .collect();
    // Each (row, head) task's own columns of a shifted state: a `Shift` sequence has one row.
    let mut shift: Vec<Option<Vec<&mut [f32]>>> = (0..total * heads).map(|_| None).collect();
    let mut carried: Vec<Option<&[f32]>> = Vec::with_capacity(states.len());
    for (s, st) in states.iter_mut().enumerate() {
        match st {
            Conv::Carried(c) => carried.push(Some(*c)),
            Conv::Shift(by) => {
                carried.push(None);
                if let Some(k) = parts.iter().position(|q| q.0 == s) {
                    let r = parts[k].3;
                    for (h, cols) in std::mem::take(by).into_iter().enumerate() {
                        shift[r * heads + h] = Some(cols);
                    }
                }
            }
        }
    }
    // One task per (row, head): the conv, SiLU and that head's norm.
    let tasks = u.par_chunks_mut(d).zip(shift.par_iter_mut()).enumerate();
    tasks.for_each(|(i, (o, shift))| {
        let (r, h) = (i / heads, i % heads);
        let (s, first, _, off) = parts[part_of[r]];
        let t = first + r - off;
        let cols = h * d..(h + 1) * d;
        // A shifted state's sequence has one row: its raw input is X's last row.
        let input = &mixed.row(starts[s])[cols.clone()];
        let x = |k: usize| -> &[f32] {
            match (carried[s], &shift) {
                (Some(c), _) => &conv_input(p, c, mixed, starts[s], t + k)[cols.clone()],
                (None, Some(sh)) if k < kw - 1 => sh[k],
                (None, _) => input,
            }
        };
        let tap = |k: usize| &taps[k * cd..(k + 1) * cd][cols.clone()];
        // c = w[kw-1]·x[t] + Σ_{k<kw-1} w[k]·x[t-(kw-1)+k], then SiLU.
        for ((o, &wk), &xv) in o.iter_mut().zip(tap(kw - 1)).zip(x(kw - 1)) {
            *o = wk * xv;
        }
        for k in 0..kw - 1 {
            for ((o, &wk), &xv) in o.iter_mut().zip(tap(k)).zip(x(k)) {
                *o += wk * xv;
            }
        }
        if let Some(sh) = shift.as_mut() {
            for k in 1..sh.len() {
                let (done, rest) = sh.split_at_mut(k);
                done[k - 1].copy_from_slice(rest[0]);
            }
            if let Some(last) = sh.last_mut() {
                last.copy_from_slice(input);
            }
        }
        math::silu_in_place(o);
        if h < 2 * p.n_k {
            l2_normalize(o, p.eps);
        }
        if h < p.n_k {
            o.iter_mut().for_each(|v| *v *= q_scale);
        }
    });
    u
}

/// The rows one scan task runs: rows `t0..t0 + y.len() / d` of a sequence of `n` rows whose
/// first row is row `base` of the inputs, with their conv outputs `u`; `out_of_place` when the
/// sequence keeps the state after each row (see [`gdn_batch`]).
struct Rows<'a> {
    t0: usize,
    base: usize,
    u: &'a [f32],
    n: usize,
    out_of_place: bool,
    /// Out of place with cells on 64-byte lines: the AVX-512 sweep may stream the cells (see
    /// `head_scan_body`).
    stream_cells: bool,
}

/// V head `j` over `rows`: the delta rule on its state (`S[i][j']`, j' fastest; `bufs` is
/// the head's slice of the live state, then of each rollback cell), then the gated RMSNorm,
/// into `y`.
#[allow(clippy::too_many_arguments)]
fn head_scan(
    p: &GdnParams,
    j: usize,
    rows: &Rows<'_>,
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &Weights<'_>,
    bufs: &mut [&mut [f32]],
    y: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the features are present.
        return unsafe {
            if is_x86_feature_detected!("avx512f") {
                head_scan_avx512(p, j, rows, z, b, a, w, bufs, y)
            } else {
                head_scan_fma(p, j, rows, z, b, a, w, bufs, y)
            }
        };
    }
    head_scan_body::<false, false>(p, j, rows, z, b, a, w, bufs, y)
}

/// `head_scan_body` compiled for a set of x86 features: `$fma` fuses its multiply-adds,
/// `$avx512` sweeps the column blocks in AVX-512 registers (`sweep32_avx512`).
macro_rules! head_scan_for {
    ($(#[$doc:meta])* $name:ident, $features:literal, $fma:literal, $avx512:literal) => {
        $(#[$doc])*
        #[cfg(target_arch = "x86_64")]
        #[target_feature(enable = $features)]
        #[allow(clippy::too_many_arguments)]
        unsafe fn $name(
            p: &GdnParams,
            j: usize,
            rows: &Rows<'_>,
            z: &Tensor,
            b: &Tensor,
            a: &Tensor,
            w: &Weights<'_>,
            bufs: &mut [&mut [f32]],
            y: &mut [f32],
        ) {
            head_scan_body::<$fma, $avx512>(p, j, rows, z, b, a, w, bufs, y)
        }
    };
}

head_scan_for!(
    /// With AVX-512 F: the column blocks in AVX-512 registers.
    head_scan_avx512,
    "avx512f,avx2,fma",
    true,
    true
);
head_scan_for!(
    /// AVX2 with fused multiply-adds.
    head_scan_fma,
    "avx2,fma",
    true,
    false
);

/// `a * b + c`, fused when the caller is compiled with FMA.
#[inline(always)]
fn madd<const FMA: bool>(a: f32, b: f32, c: f32) -> f32 {
    if FMA {
        a.mul_add(b, c)
    } else {
        a * b + c
    }
}

/// What one token's sweep needs besides the state: the decay and β of the token, its q, k and
/// v, the next token's k, and (after the first token of a call) this token's `S_oldᵀk`.
struct Token<'a> {
    decay: f32,
    beta: f32,
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    k_next: &'a [f32],
    /// `None` for the first token: its `S_oldᵀk` is summed here, a column block at a time,
    /// just before the block's sweep reads the same rows again from L1.
    kv: Option<&'a [f32]>,
    /// On a call's last token, the live state of the V head after this one (the next in
    /// its buffer, and mostly the next task of this thread): the sweep brings it into L2,
    /// `COLS` floats a row, so the memory streams the next head while this one computes.
    next_head: Option<*const f32>,
}

/// How many rows of a head's state ahead of the one being read a sweep asks for (a row of
/// 128 is 512 bytes, so 8 rows is 4 KiB): the column blocks read the state 128 bytes a row
/// with a 512-byte stride, which the hardware prefetcher streamed at about half what the
/// memory gives.
const ROWS_AHEAD: usize = 8;

/// Asks for the `n` floats at `p` to be brought into cache (x86; elsewhere a no-op): into
/// L1 (`L2` false) or L2.
#[inline(always)]
fn prefetch_row<const L2: bool>(p: *const f32, n: usize) {
    #[cfg(target_arch = "x86_64")]
    for off in (0..n).step_by(16) {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0, _MM_HINT_T1};
        let at = p.wrapping_add(off).cast();
        // SAFETY: prefetching is a hint and never faults, whatever the address.
        unsafe {
            if L2 {
                _mm_prefetch::<_MM_HINT_T1>(at)
            } else {
                _mm_prefetch::<_MM_HINT_T0>(at)
            }
        };
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = (p, n);
}

/// Columns `c0..c0 + C` of one token's sweep down the rows of `S` (`d` wide), read from `src`
/// and written to `dst`: `δ = β(v − decay·S_oldᵀk)`, `S[i] = decay·S[i] + k[i]·δ`,
/// `o = Σ_i S[i]·q[i]`, `kv_next = Σ_i S[i]·k_next[i]`. Each row's block is loaded into
/// registers, updated and stored whole, so in place and out of place compile alike.
///
/// # Safety
/// `src` and `dst` each hold `d * d` values and are the same buffer or disjoint.
#[inline(always)]
unsafe fn sweep<const FMA: bool, const C: usize>(
    src: *const f32,
    dst: *mut f32,
    d: usize,
    c0: usize,
    tok: &Token<'_>,
    o: &mut [f32],
    kv_next: &mut [f32],
) {
    let load = |i: usize| std::ptr::read_unaligned(src.add(i * d + c0).cast::<[f32; C]>());
    // The first column block of a token is the first read of the state's rows: ask for whole
    // rows a few ahead, so the column blocks after it find them in cache.
    let ahead = |i: usize| {
        if c0 == 0 && i + ROWS_AHEAD < d {
            prefetch_row::<false>(src.add((i + ROWS_AHEAD) * d), d);
        }
    };
    // This block's share of the next head: `C` floats for each of its rows, so the blocks
    // of a sweep cover the next head's d x d once.
    let next = |i: usize| {
        if let Some(n) = tok.next_head {
            prefetch_row::<true>(n.wrapping_add((c0 / C * d + i) * C), C);
        }
    };
    let kv: [f32; C] = match tok.kv {
        Some(kv) => kv[c0..c0 + C].try_into().expect("C columns"),
        None => {
            let mut acc = [0f32; C];
            for i in 0..d {
                ahead(i);
                let (row, ki) = (load(i), tok.k[i]);
                for c in 0..C {
                    acc[c] = madd::<FMA>(row[c], ki, acc[c]);
                }
            }
            acc
        }
    };
    let dl: [f32; C] = std::array::from_fn(|c| tok.beta * (tok.v[c0 + c] - tok.decay * kv[c]));
    let mut oa = [0f32; C];
    let mut kn = [0f32; C];
    for i in 0..d {
        if tok.kv.is_some() {
            ahead(i);
        }
        next(i);
        let (ki, qi, kni) = (tok.k[i], tok.q[i], tok.k_next[i]);
        let mut row = load(i);
        for c in 0..C {
            row[c] = madd::<FMA>(ki, dl[c], row[c] * tok.decay);
            oa[c] = madd::<FMA>(row[c], qi, oa[c]);
            kn[c] = madd::<FMA>(row[c], kni, kn[c]);
        }
        std::ptr::write_unaligned(dst.add(i * d + c0).cast::<[f32; C]>(), row);
    }
    o[c0..c0 + C].copy_from_slice(&oa);
    kv_next[c0..c0 + C].copy_from_slice(&kn);
}

/// `sweep::<true, 32>` with its arrays held in two AVX-512 registers each: the same fused
/// multiply-adds lane for lane, so the same bits. The compiler kept `sweep`'s 32-float
/// accumulator of the first token's `S_oldᵀk` in scalars and rebuilt vectors from them every
/// row (`vinsertps` chains with stack spills, about half of the core's time in a profile of a
/// decode step), so a step's GDN cores ran at 18-21 GB/s of state, in cache as from memory.
///
/// # Safety
/// As `sweep`, and the CPU has AVX-512 F. `cell`, unless null, is a third `d * d` buffer on
/// 64-byte lines (and `d` a multiple of 16) that gets a copy of what `dst` gets, by streaming
/// stores.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn sweep32_avx512(
    src: *const f32,
    dst: *mut f32,
    cell: *mut f32,
    d: usize,
    c0: usize,
    tok: &Token<'_>,
    o: &mut [f32],
    kv_next: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (s, t) = (src.add(c0), dst.add(c0));
    let mut kv = [_mm512_setzero_ps(); 2];
    match tok.kv {
        Some(k) => {
            let k = k[c0..c0 + 32].as_ptr();
            kv = [_mm512_loadu_ps(k), _mm512_loadu_ps(k.add(16))];
        }
        None => {
            for i in 0..d {
                if c0 == 0 && i + ROWS_AHEAD < d {
                    prefetch_row::<false>(src.add((i + ROWS_AHEAD) * d), d);
                }
                let ki = _mm512_set1_ps(tok.k[i]);
                let r = s.add(i * d);
                kv[0] = _mm512_fmadd_ps(_mm512_loadu_ps(r), ki, kv[0]);
                kv[1] = _mm512_fmadd_ps(_mm512_loadu_ps(r.add(16)), ki, kv[1]);
            }
        }
    }
    let (beta, decay) = (_mm512_set1_ps(tok.beta), _mm512_set1_ps(tok.decay));
    let v = tok.v[c0..c0 + 32].as_ptr();
    let mut dl = [_mm512_setzero_ps(); 2];
    for h in 0..2 {
        let kd = _mm512_mul_ps(decay, kv[h]);
        dl[h] = _mm512_mul_ps(beta, _mm512_sub_ps(_mm512_loadu_ps(v.add(16 * h)), kd));
    }
    let mut oa = [_mm512_setzero_ps(); 2];
    let mut kn = [_mm512_setzero_ps(); 2];
    for i in 0..d {
        if tok.kv.is_some() && c0 == 0 && i + ROWS_AHEAD < d {
            prefetch_row::<false>(src.add((i + ROWS_AHEAD) * d), d);
        }
        if let Some(n) = tok.next_head {
            prefetch_row::<true>(n.wrapping_add((c0 / 32 * d + i) * 32), 32);
        }
        let (ki, qi, kni) = (
            _mm512_set1_ps(tok.k[i]),
            _mm512_set1_ps(tok.q[i]),
            _mm512_set1_ps(tok.k_next[i]),
        );
        for h in 0..2 {
            let row = _mm512_loadu_ps(s.add(i * d + 16 * h));
            let row = _mm512_fmadd_ps(ki, dl[h], _mm512_mul_ps(row, decay));
            oa[h] = _mm512_fmadd_ps(row, qi, oa[h]);
            kn[h] = _mm512_fmadd_ps(row, kni, kn[h]);
            _mm512_storeu_ps(t.add(i * d + 16 * h), row);
            if !cell.is_null() {
                _mm512_stream_ps(cell.add(c0 + i * d + 16 * h), row);
            }
        }
    }
    for h in 0..2 {
        _mm512_storeu_ps(o[c0 + 16 * h..c0 + 16 * h + 16].as_mut_ptr(), oa[h]);
        _mm512_storeu_ps(kv_next[c0 + 16 * h..c0 + 16 * h + 16].as_mut_ptr(), kn[h]);
    }
}

/// The recurrence of §4 step 9 for one head, per token:
/// ```text
/// S = S·exp(g);  kv = Sᵀk;  δ = β(v − kv);  S += k ⊗ δ;  o = Sᵀq
/// ```
/// computed as `kv = exp(g)·(S_oldᵀk)` followed by one pass over the rows of S that forms the
/// new row `S[i] = exp(g)·S[i] + k[i]·δ`, accumulates `o += S[i]·q[i]`, and already accumulates
/// the next token's `S_oldᵀk` from the same row: one sweep of the state per token.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
fn head_scan_body<const FMA: bool, const AVX512: bool>(
    p: &GdnParams,
    j: usize,
    rows: &Rows<'_>,
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &Weights<'_>,
    bufs: &mut [&mut [f32]],
    y: &mut [f32],
) {
    let (cd, d) = (p.conv_dim(), p.d);
    let n_tok = y.len() / d;
    let u = rows.u;
    let kh = j % p.n_k; // tiled V order
    let q_at = |t: usize| &u[t * cd + kh * d..][..d];
    let k_at = |t: usize| &u[t * cd + (p.n_k + kh) * d..][..d];
    let v_at = |t: usize| &u[t * cd + (2 * p.n_k + j) * d..][..d];
    // Row t of the sequence reads the state row t - 1 wrote: in place, or (out of place) the
    // live state for the first row, cell t - 1 after; it writes cell t, the live state last.
    let src_of = |t: usize| match (rows.out_of_place, t) {
        (false, _) | (true, 0) => 0,
        (true, t) => t,
    };
    let dst_of = |t: usize| match rows.out_of_place {
        true if t + 1 < rows.n => t + 1,
        _ => 0,
    };
    for buf in bufs.iter() {
        assert_eq!(buf.len(), d * d, "a head's state is d x d");
    }
    // Out of place, each row but the last writes a cell that the next row reads at once and
    // nothing else reads before a rollback. The cells are cold (a step's weights stream
    // through the caches between two rounds), so a plain store first reads each line of the
    // cell from memory, then writes it back: two state's worth of traffic per cell on top of
    // the live state's read and write-back. With the AVX-512 sweep the rows run on a scratch
    // copy of the head instead, which stays in cache, and the sweep copies each row's state
    // into its cell by streaming stores, which write whole lines without reading them.
    let stream = AVX512 && rows.stream_cells;
    let mut scratch = if stream {
        vec![0f32; d * d]
    } else {
        Vec::new()
    };
    // kv = S_oldᵀ k of the token being swept (the first token's is summed in its sweep).
    let mut kv = vec![0f32; d];
    let mut kv_next = vec![0f32; d];
    const COLS: usize = 32;
    for t in 0..n_tok {
        let (at, row) = (rows.t0 + t, rows.base + rows.t0 + t);
        let tok = Token {
            beta: sigmoid(b.row(row)[j]),
            decay: (w.ssm_a[j] * softplus(a.row(row)[j] + w.dt_bias[j])).exp(),
            q: q_at(t),
            k: k_at(t),
            v: v_at(t),
            k_next: k_at((t + 1).min(n_tok - 1)),
            kv: (t > 0).then_some(&kv[..]),
            next_head: (t + 1 == n_tok).then(|| bufs[0].as_ptr().wrapping_add(d * d)),
        };
        let o = &mut y[t * d..(t + 1) * d];
        let (si, di) = (src_of(at), dst_of(at));
        let (mut dst, mut cell) = (bufs[di].as_mut_ptr(), std::ptr::null_mut());
        let mut src = if si == di {
            dst.cast_const()
        } else {
            bufs[si].as_ptr()
        };
        if stream {
            // The call's first row reads its state where it lies; each row after it reads the
            // scratch copy the row before it left.
            if t > 0 {
                src = scratch.as_ptr();
            }
            if di != 0 {
                (dst, cell) = (scratch.as_mut_ptr(), dst);
            }
        }
        // Columns in blocks of COLS, so that δ, o and the next kv of a block stay in
        // registers while the sweep runs down the rows; then the leftover columns.
        let full = d / COLS * COLS;
        // Only the AVX-512 sweep streams (`stream` is false elsewhere).
        #[cfg(not(target_arch = "x86_64"))]
        let _ = cell;
        // SAFETY: every buffer holds d * d values (checked above); src and dst are one buffer
        // or two distinct ones of `bufs` and the scratch; `cell`, when not null, is a buffer
        // of `bufs` on 64-byte lines (`stream_cells`) distinct from both, d a multiple of 32.
        unsafe {
            for c0 in (0..full).step_by(COLS) {
                // AVX512 is set only by `head_scan_avx512`, after the feature check.
                #[cfg(target_arch = "x86_64")]
                if AVX512 {
                    const { assert!(COLS == 32) };
                    sweep32_avx512(src, dst, cell, d, c0, &tok, o, &mut kv_next);
                    continue;
                }
                sweep::<FMA, COLS>(src, dst, d, c0, &tok, o, &mut kv_next);
            }
            for c0 in full..d {
                sweep::<FMA, 1>(src, dst, d, c0, &tok, o, &mut kv_next);
            }
        }
        std::mem::swap(&mut kv, &mut kv_next);
        // Gated RMSNorm over the head.
        let sc = rms_scale(o, p.eps);
        let zj = &z.row(row)[j * d..(j + 1) * d];
        for ((ov, &g), &zv) in o.iter_mut().zip(w.norm).zip(zj) {
            *ov = *ov * sc * g * silu(zv);
        }
    }
    // Streaming stores are weakly ordered: fence them before another thread may read the
    // cells (the next chunk's task for this head, a rollback).
    #[cfg(target_arch = "x86_64")]
    if stream {
        // SAFETY: SSE is part of x86_64.
        unsafe { std::arch::x86_64::_mm_sfence() };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tensor(rows: usize, cols: usize, seed: usize) -> Tensor {
        let data = (0..rows * cols)
            .map(|i| (((i * 7919 + seed * 104_729) % 1000) as f32 / 500.0 - 1.0) * 0.5)
            .collect();
        Tensor { data, rows, cols }
    }

    /// The AVX-512 sweep gives `sweep::<true, 32>`'s bits: the state it writes (in place and
    /// out of place), the head's output and the next token's `S_oldᵀk`, with the first token's
    /// `S_oldᵀk` summed in the sweep or given.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn avx512_sweep_matches_the_fma_sweep_bit_for_bit() {
        if !(is_x86_feature_detected!("avx512f") && is_x86_feature_detected!("fma")) {
            eprintln!("no AVX-512 F here: the AVX-512 sweep is not run");
            return;
        }
        let d = 128;
        let v = |seed: usize, n: usize| tensor(1, n, seed).data;
        let state = v(1, d * d);
        let (k, q, vv, kn, kv0) = (v(2, d), v(3, d), v(4, d), v(5, d), v(6, d));
        let next = v(7, d * d);
        for given_kv in [false, true] {
            for in_place in [false, true] {
                let tok = Token {
                    decay: 0.93,
                    beta: 0.61,
                    q: &q,
                    k: &k,
                    v: &vv,
                    k_next: &kn,
                    kv: given_kv.then_some(&kv0[..]),
                    next_head: Some(next.as_ptr()),
                };
                let run = |wide: bool| {
                    let mut src = state.clone();
                    let mut dst = vec![0f32; d * d];
                    let (mut o, mut kvn) = (vec![0f32; d], vec![0f32; d]);
                    let sp = src.as_mut_ptr();
                    let dp = if in_place { sp } else { dst.as_mut_ptr() };
                    for c0 in (0..d).step_by(32) {
                        // SAFETY: both buffers hold d * d values; AVX-512 F checked above.
                        unsafe {
                            if wide {
                                sweep32_avx512(
                                    sp,
                                    dp,
                                    std::ptr::null_mut(),
                                    d,
                                    c0,
                                    &tok,
                                    &mut o,
                                    &mut kvn,
                                );
                            } else {
                                sweep::<true, 32>(sp, dp, d, c0, &tok, &mut o, &mut kvn);
                            }
                        }
                    }
                    let written = if in_place { src } else { dst };
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    (bits(&written), bits(&o), bits(&kvn))
                };
                assert!(
                    run(true) == run(false),
                    "kv given {given_kv}, in place {in_place}"
                );
            }
        }
    }

    /// A small core's parameters (two K heads, four V heads of 32: the tiled V order at work),
    /// `n` rows of its inputs from `seed` on, and its weights.
    struct Small {
        p: GdnParams,
        mixed: Tensor,
        z: Tensor,
        b: Tensor,
        a: Tensor,
        conv: Vec<f32>,
        dt_bias: Vec<f32>,
        ssm_a: Vec<f32>,
        norm: Vec<f32>,
    }

    impl Small {
        fn new(n: usize, seed: usize) -> Self {
            let p = GdnParams {
                n_k: 2,
                n_v: 4,
                d: 32,
                d_conv: 4,
                eps: 1e-6,
            };
            Small {
                mixed: tensor(n, p.conv_dim(), seed),
                z: tensor(n, p.n_v * p.d, seed + 1),
                b: tensor(n, p.n_v, seed + 2),
                a: tensor(n, p.n_v, seed + 3),
                conv: tensor(p.d_conv, p.conv_dim(), seed + 4).data,
                dt_bias: vec![0.3; p.n_v],
                ssm_a: vec![-0.7; p.n_v],
                norm: vec![1.1; p.d],
                p,
            }
        }

        fn weights(&self) -> Weights<'_> {
            Weights {
                conv_taps: &self.conv,
                dt_bias: &self.dt_bias,
                ssm_a: &self.ssm_a,
                norm: &self.norm,
            }
        }
    }

    /// Sequences batched together give what each gives alone: one-row sequences (whose conv
    /// state the conv tasks shift in place) beside a longer one and a one-row sequence with a
    /// cell (both through the copied conv states), in both orders, from distinct states.
    #[test]
    fn mixed_batch_matches_each_sequence_alone() {
        let rows = [1, 5, 1, 1];
        let n: usize = rows.iter().sum();
        let c = Small::new(n, 11);
        let (p, w) = (&c.p, c.weights());
        let (mixed, z, b, a) = (&c.mixed, &c.z, &c.b, &c.a);
        let fresh = |seed: usize| Recurrent {
            conv: tensor(1, p.conv_state_len(), 20 + seed).data,
            ssm: tensor(1, p.ssm_state_len(), 30 + seed).data.into(),
        };
        let slice = |t: &Tensor, r0: usize, m: usize| Tensor {
            data: t.data[r0 * t.cols..(r0 + m) * t.cols].to_vec(),
            rows: m,
            cols: t.cols,
        };
        for order in [[0, 1, 2, 3], [3, 2, 1, 0]] {
            let starts: Vec<usize> = (0..4).map(|i| rows[..i].iter().sum()).collect();
            // Alone: each sequence's rows through `gdn`; sequence 3 with a cell.
            let mut alone_st: Vec<Recurrent> = (0..4).map(fresh).collect();
            let mut alone_cell = [fresh(9)];
            let mut alone = Vec::new();
            for (i, st) in alone_st.iter_mut().enumerate() {
                let g = |t: &Tensor| slice(t, starts[i], rows[i]);
                let (m, zz, bb, aa) = (g(mixed), g(z), g(b), g(a));
                alone.push(if i == 3 {
                    let cells = Some(&mut alone_cell[..]);
                    let mut seqs = [Seq {
                        rows: 1,
                        state: st,
                        cells,
                    }];
                    gdn_batch(p, &m, &zz, &bb, &aa, &w, &mut seqs, true).data
                } else {
                    gdn(p, &m, &zz, &bb, &aa, &w, st).data
                });
            }
            // Together, in `order`: the inputs' rows laid out in that order.
            let pick = |t: &Tensor| {
                let data = order
                    .iter()
                    .flat_map(|&i| slice(t, starts[i], rows[i]).data)
                    .collect();
                Tensor {
                    data,
                    rows: n,
                    cols: t.cols,
                }
            };
            let (m, zz, bb, aa) = (pick(mixed), pick(z), pick(b), pick(a));
            let mut st: Vec<Recurrent> = (0..4).map(fresh).collect();
            let mut cell = [fresh(9)];
            let mut by_seq: Vec<Option<&mut Recurrent>> = st.iter_mut().map(Some).collect();
            let mut cell_slot = Some(&mut cell[..]);
            let mut seqs: Vec<Seq<'_>> = order
                .iter()
                .map(|&i| Seq {
                    rows: rows[i],
                    state: by_seq[i].take().expect("each sequence once"),
                    cells: if i == 3 { cell_slot.take() } else { None },
                })
                .collect();
            let y = gdn_batch(p, &m, &zz, &bb, &aa, &w, &mut seqs, true).data;
            drop(seqs);
            let width = p.n_v * p.d;
            let mut at = 0;
            for &i in &order {
                let got = &y[at * width..(at + rows[i]) * width];
                assert_eq!(
                    got,
                    &alone[i][..],
                    "sequence {i}'s outputs, order {order:?}"
                );
                assert_eq!(st[i].ssm, alone_st[i].ssm, "sequence {i}'s ssm state");
                assert_eq!(st[i].conv, alone_st[i].conv, "sequence {i}'s conv state");
                at += rows[i];
            }
            assert_eq!(cell[0].ssm, alone_cell[0].ssm);
            assert_eq!(cell[0].conv, alone_cell[0].conv);
        }
    }

    /// A snapshot batch (a verify batch's rows, out of place) keeps the state after each row:
    /// with the cells streamed from a scratch copy (the AVX-512 sweep) the outputs, the live
    /// state and every cell are the bits of the plain stores, and each cell is the state that
    /// feeding the rows one by one leaves after its row. Longer than a chunk, so a chunk's
    /// first row reads a streamed cell.
    #[test]
    fn snapshot_rows_stream_their_cells_with_the_same_values() {
        let n = CHUNK + 3;
        let c = Small::new(n, 5);
        let (p, w) = (&c.p, c.weights());
        let (mixed, z, b, a) = (&c.mixed, &c.z, &c.b, &c.a);
        let fresh = || Recurrent {
            conv: tensor(1, p.conv_state_len(), 40).data,
            ssm: tensor(1, p.ssm_state_len(), 41).data.into(),
        };
        let run = |stream: bool| {
            let mut live = fresh();
            let mut cells: Vec<Recurrent> = (0..n - 1).map(|_| fresh()).collect();
            let mut seqs = [Seq {
                rows: n,
                state: &mut live,
                cells: Some(&mut cells[..]),
            }];
            let y = gdn_batch(p, mixed, z, b, a, &w, &mut seqs, stream).data;
            (y, live, cells)
        };
        let (y, live, cells) = run(true);
        let (y0, live0, cells0) = run(false);
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&y) == bits(&y0), "outputs");
        assert!(bits(&live.ssm) == bits(&live0.ssm), "live state");
        assert_eq!(live.conv, live0.conv);
        for (t, (c, c0)) in cells.iter().zip(&cells0).enumerate() {
            assert!(bits(&c.ssm) == bits(&c0.ssm), "cell {t}");
            assert_eq!(c.conv, c0.conv, "cell {t}'s conv");
        }
        let mut st = fresh();
        let row = |t: &Tensor, i: usize| Tensor {
            data: t.row(i).to_vec(),
            rows: 1,
            cols: t.cols,
        };
        for (i, c) in cells.iter().enumerate() {
            let (m, zz, bb, aa) = (row(mixed, i), row(z, i), row(b, i), row(a, i));
            gdn(p, &m, &zz, &bb, &aa, &w, &mut st);
            let e = crate::backend::nmse(&c.ssm, &st.ssm);
            assert!(e < 1e-12, "cell {i}: nmse {e}");
            assert_eq!(c.conv, st.conv, "cell {i}'s conv");
        }
    }

    /// A batch longer than a chunk gives the outputs and state of feeding it token by token.
    #[test]
    fn batch_across_chunks_matches_token_by_token() {
        let n = 2 * CHUNK + 37;
        let c = Small::new(n, 1);
        let (p, w) = (&c.p, c.weights());
        let (mixed, z, b, a) = (&c.mixed, &c.z, &c.b, &c.a);
        let fresh = || Recurrent {
            conv: vec![0.1; p.conv_state_len()],
            ssm: vec![0.01; p.ssm_state_len()].into(),
        };
        let mut batch_st = fresh();
        let batch = gdn(p, mixed, z, b, a, &w, &mut batch_st);
        let mut step_st = fresh();
        let row = |t: &Tensor, i: usize| Tensor {
            data: t.row(i).to_vec(),
            rows: 1,
            cols: t.cols,
        };
        let mut steps = Vec::new();
        for i in 0..n {
            let (m, zz, bb, aa) = (row(mixed, i), row(z, i), row(b, i), row(a, i));
            steps.extend(gdn(p, &m, &zz, &bb, &aa, &w, &mut step_st).data);
        }
        let nmse = crate::backend::nmse;
        assert!(
            nmse(&batch.data, &steps) < 1e-12,
            "{}",
            nmse(&batch.data, &steps)
        );
        assert!(nmse(&batch_st.ssm, &step_st.ssm) < 1e-12);
        assert_eq!(batch_st.conv, step_st.conv);
    }
}
