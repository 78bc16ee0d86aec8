//! The Gated DeltaNet core (model-qwen35.md §4) over consecutive tokens of one sequence.
//!
//! The batch runs in chunks of `CHUNK` tokens, each in two phases. The causal conv, SiLU, L2
//! norms and q scale depend only on the raw inputs, so they run for the chunk's tokens at once,
//! in parallel over (token, head). The recurrence is sequential in time but independent per V
//! head, so each head runs through the chunk's tokens in one task (one rayon split per chunk,
//! not per token), the gated RMSNorm included.

use std::mem::MaybeUninit;

use rayon::prelude::*;

use super::{math, rms_scale, sigmoid, silu, softplus, Recurrent, Tensor};
use crate::backend::{GdnParams, GdnSeq};

/// Tokens per chunk: the conv output of a chunk stays small (and cached) while the heads scan
/// it, however long the prompt.
const CHUNK: usize = 128;

/// Columns of a head's state one sweep holds in registers (its column block).
const COLS: usize = 32;

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
    gdn_batch(p, mixed, z, b, a, w, &mut seqs)
}

/// The rows of the last snapshot batch (a verify) that a state has not folded in yet, or, in
/// a rollback cell, how many of them the cell stands for.
///
/// A verify batch of n rows must be able to leave the state after any of its rows, and which
/// one is known only after every layer has run. Writing the state after each row into a cell
/// (18.9 MB a row on bench-0.8b, 1 MiB a layer) cost, at depth 2, a read of the live state and
/// writes of two cells and the live state: four states' worth of memory traffic, twice a plain
/// step's. But the delta rule changes the state by a decay and a rank-1 term per row,
/// `S = decay·S + k ⊗ δ`, so the rows run on a scratch (in cache) and only each row's decay, k
/// and δ (1 + 2d floats a head) are kept. A rollback keeps the first t + 1 of them, and the
/// next batch on the state folds them in with the same fused multiply-adds the sweep did (so
/// the same bits), in its first token's sweep, as each row of the state is read and written
/// back (see [`Token::fold`]). A verify reads the state once and the fold writes it once: the
/// traffic of a plain step. A depth-2 verify's GDN cores from memory on bench-0.8b PQ2_0 (`xtask bench
/// --step`, the builds alternated three times, Zen 4, 2 threads) went from 3.26 / 3.37 / 3.49
/// to 2.88 / 2.63 / 2.43 ms, where one row's take 1.15-1.33 ms.
#[derive(Debug, Default)]
pub struct Pending {
    /// Rows to fold in, oldest first (in a cell: the rows that restoring it keeps).
    rows: usize,
    /// Rows each head's records have room for.
    room: usize,
    /// The heads' state width.
    d: usize,
    /// Per V head, `room` records of `1 + 2d` floats: a row's decay, its k and its δ.
    data: Vec<f32>,
    /// The records a batch folded in, kept for the next verify batch's: a verify allocated
    /// and zeroed a fresh buffer every round before (48 KiB a layer at depth 2 on bench-0.8b),
    /// now two buffers take turns.
    spare: Vec<f32>,
}

/// A copy keeps the records to fold in, not the spare: it holds nothing a state reads.
impl Clone for Pending {
    fn clone(&self) -> Pending {
        Pending {
            rows: self.rows,
            room: self.room,
            d: self.d,
            data: self.data.clone(),
            spare: Vec::new(),
        }
    }
}

impl Pending {
    /// Floats of one row's record.
    fn record(d: usize) -> usize {
        1 + 2 * d
    }

    /// Rows to fold in: none in a rollback cell, which only marks how many rows restoring it
    /// keeps.
    fn to_fold(&self) -> usize {
        if self.data.is_empty() {
            0
        } else {
            self.rows
        }
    }
}

impl Recurrent {
    /// Restores the state after row `cell`'s mark of the last snapshot batch (see
    /// [`Pending`]): keeps that many of its rows and takes the cell's conv state (the cell gets
    /// the live one, as scratch).
    pub(super) fn restore(&mut self, cell: &mut Recurrent) {
        assert!(
            cell.pending.data.is_empty() && cell.pending.rows <= self.pending.rows,
            "gdn: restoring a cell of {} rows into a state with {} pending rows",
            cell.pending.rows,
            self.pending.rows
        );
        std::mem::swap(&mut self.conv, &mut cell.conv);
        self.pending.rows = cell.pending.rows;
    }

    /// The SSM state with the pending rows folded in (what the next batch starts from).
    pub fn settled_ssm(&self) -> Vec<f32> {
        let mut s = self.ssm.to_vec();
        let (d, dd) = (self.pending.d, self.pending.d * self.pending.d);
        let rec = self.pending.room * Pending::record(d);
        if self.pending.to_fold() > 0 {
            for (j, h) in s.chunks_exact_mut(dd).enumerate() {
                settle(
                    h,
                    &self.pending.data[j * rec..(j + 1) * rec],
                    self.pending.rows,
                    d,
                );
            }
        }
        s
    }
}

/// Folds the first `rows` records of `recs` (one head's [`Pending`]) into the head's state
/// `s`, with the arithmetic [`head_scan`] uses on this CPU (whose sweeps fold them the same
/// way, `Token::fold`): for a copy of the state ([`Recurrent::settled_ssm`]).
fn settle(s: &mut [f32], recs: &[f32], rows: usize, d: usize) {
    #[cfg(target_arch = "x86_64")]
    if fused_sweep() {
        // SAFETY: the features are present.
        return unsafe { settle_fma(s, recs, rows, d) };
    }
    settle_body::<false>(s, recs, rows, d)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn settle_fma(s: &mut [f32], recs: &[f32], rows: usize, d: usize) {
    settle_body::<true>(s, recs, rows, d)
}

/// The records folded into the state a row of S at a time (so the state is read and written
/// once however many records).
#[inline(always)]
fn settle_body<const FMA: bool>(s: &mut [f32], recs: &[f32], rows: usize, d: usize) {
    let rl = Pending::record(d);
    assert!(s.len() == d * d && recs.len() >= rows * rl);
    for (i, row) in s.chunks_exact_mut(d).enumerate() {
        fold_row::<FMA>(row, &recs[..rows * rl], i, 0, d);
    }
}

/// Folds whole [`Pending`] records, in order, into `row`, columns `c0..` of row `i` of a
/// head's state: `S[i] = decay·S[i] + k[i]·δ`, the sweep's update operation for operation
/// (`madd::<FMA>(k[i], δ, S·decay)`, fused where the sweep fuses it). For `settle` and the
/// first sweep of a call (`Token::fold`) alike.
#[inline(always)]
fn fold_row<const FMA: bool>(row: &mut [f32], recs: &[f32], i: usize, c0: usize, d: usize) {
    for r in recs.chunks_exact(Pending::record(d)) {
        let (decay, ki, dl) = (r[0], r[1 + i], &r[1 + d + c0..]);
        for (x, &dc) in row.iter_mut().zip(dl) {
            *x = madd::<FMA>(ki, dc, *x * decay);
        }
    }
}

/// The core over several sequences' rows at once: each chunk's conv for every sequence in one
/// parallel loop, then the recurrence of every (sequence, V head) in another, so a decode step
/// of many streams costs two parallel regions per layer, not two per stream. A state's
/// pending rows (see [`Pending`]) are folded in by the first chunk's task of each head. A
/// sequence with `cells` (a verify batch) runs its rows on a scratch copy of each head and
/// leaves the live state as it was, with all its rows pending; cell t is marked to keep rows
/// 0..=t when restored (`Recurrent::restore`), with the conv state after row t.
pub(super) fn gdn_batch(
    p: &GdnParams,
    mixed: &Tensor,
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &Weights<'_>,
    seqs: &mut [Seq<'_>],
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
    let rl = Pending::record(d);
    // Each state's pending rows, to fold in, and the records a verify batch leaves.
    let mut olds: Vec<Pending> = seqs
        .iter_mut()
        .map(|s| std::mem::take(&mut s.state.pending))
        .collect();
    let mut news: Vec<Pending> = seqs
        .iter()
        .zip(olds.iter_mut())
        .map(|(s, old)| match s.cells {
            Some(_) => {
                let mut data = std::mem::take(&mut old.spare);
                data.clear();
                data.resize(p.n_v * s.rows * rl, 0.0);
                Pending {
                    rows: s.rows,
                    room: s.rows,
                    d,
                    data,
                    spare: Vec::new(),
                }
            }
            None => Pending::default(),
        })
        .collect();
    // Each task owns one V head of a sequence: its live state, its pending records to fold in
    // and the records to write, and (out of place) a scratch its rows run on, allocated by the
    // task (in parallel, not zeroed: the first row's sweep of each column block writes the
    // block before any row reads it). The scratch of rows in one chunk (a verify) holds one
    // column block (16 KiB at d = 128, in L1 from the first row to the last); a longer
    // sequence's is a copy of the state that carries its rows from one chunk to the next.
    struct Task<'s> {
        seq: usize,
        j: usize,
        live: &'s mut [f32],
        old: &'s [f32],
        old_rows: usize,
        rec: &'s mut [f32],
        out_of_place: bool,
        scratch: Vec<MaybeUninit<f32>>,
    }
    let mut tasks: Vec<Task<'_>> = Vec::with_capacity(seqs.len() * p.n_v);
    let mut convs: Vec<Conv<'_>> = Vec::with_capacity(seqs.len());
    // A decode step's row: the conv tasks shift the state in place (`Conv::Shift`). Other
    // sequences' conv states are written after the scan, which reads the carried one.
    let shifted: Vec<bool> = seqs
        .iter()
        .map(|s| s.rows == 1 && s.cells.is_none())
        .collect();
    for (i, (s, new)) in seqs.iter_mut().zip(news.iter_mut()).enumerate() {
        let in_place = shifted[i];
        let old = &olds[i];
        let old_rec = old.room * rl;
        let new_rec = new.room * rl;
        let mut recs = new.data.chunks_exact_mut(new_rec.max(1));
        for (j, live) in s.state.ssm.chunks_exact_mut(dd).enumerate() {
            tasks.push(Task {
                seq: i,
                j,
                live,
                old: if old.to_fold() == 0 {
                    &[]
                } else {
                    &old.data[j * old_rec..(j + 1) * old_rec]
                },
                old_rows: old.to_fold(),
                rec: match new_rec {
                    0 => &mut [],
                    _ => recs.next().expect("a record block per head"),
                },
                out_of_place: out_of_place[i],
                scratch: Vec::new(),
            });
        }
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
                // The first chunk's sweeps fold the pending rows in.
                let fold = &task.old[..task.old_rows * rl];
                task.old_rows = 0;
                if task.out_of_place && task.scratch.is_empty() {
                    let len = match n_rows[i] <= CHUNK && COLS < d {
                        true => d * COLS,
                        false => dd,
                    };
                    task.scratch = Vec::with_capacity(len);
                    // SAFETY: MaybeUninit needs no initialisation.
                    unsafe { task.scratch.set_len(len) };
                }
                let mut y = vec![0f32; m * d];
                let rows = Rows {
                    t0,
                    base: starts[i],
                    u: &u[off * cd..(off + m) * cd],
                };
                let state = HeadState {
                    live: task.live,
                    fold,
                    scratch: task.out_of_place.then_some(&mut task.scratch[..]),
                    rec: task.rec,
                };
                head_scan(p, task.j, &rows, z, b, a, w, state, &mut y);
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
    let kw1 = p.d_conv - 1;
    for (i, (s, mut new)) in seqs.iter_mut().zip(news).enumerate() {
        // A sequence of no rows ran no task: its pending rows are still to fold in.
        s.state.pending = match s.rows {
            0 => std::mem::take(&mut olds[i]),
            _ => {
                // The folded records, or the spare a plain step carries, whichever is larger.
                let old = std::mem::take(&mut olds[i]);
                new.spare = if old.data.capacity() >= old.spare.capacity() {
                    old.data
                } else {
                    old.spare
                };
                new
            }
        };
        if shifted[i] {
            continue; // shifted in place by its conv tasks
        }
        // The conv state after row n - 1 is rows n..n + kw1 of X (the carried state, then
        // the rows): each cell's from the carried state, then the live one over it, in place.
        // They are written straight into the states, where building each and copying it in
        // moved twice the bytes, single-threaded (216 KiB a layer for a depth-2 verify on
        // bench-0.8b, whose conv states come from memory).
        let n = s.rows;
        if let Some(cells) = s.cells.as_mut() {
            for (t, c) in cells.iter_mut().take(n.saturating_sub(1)).enumerate() {
                for (k, dst) in c.conv.chunks_exact_mut(cd).enumerate() {
                    dst.copy_from_slice(conv_input(p, &s.state.conv, mixed, starts[i], t + 1 + k));
                }
                c.pending = Pending {
                    rows: t + 1,
                    ..Pending::default()
                };
            }
        }
        let conv = &mut s.state.conv;
        if n < kw1 {
            conv.copy_within(n * cd.., 0);
        }
        for k in kw1.saturating_sub(n)..kw1 {
            conv[k * cd..(k + 1) * cd].copy_from_slice(mixed.row(starts[i] + n + k - kw1));
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

/// The rows one scan task runs: rows `t0..t0 + y.len() / d` of a sequence whose first row is
/// row `base` of the inputs, with their conv outputs `u`.
struct Rows<'a> {
    t0: usize,
    base: usize,
    u: &'a [f32],
}

/// One V head's state for [`head_scan`]: the live state and the records of the last verify
/// still to fold into it (see [`Pending`]), and for a verify batch (out of place) the scratch
/// its rows run on (a column block of which its first row writes whole before any row reads
/// it) and their records.
struct HeadState<'a> {
    live: &'a mut [f32],
    fold: &'a [f32],
    scratch: Option<&'a mut [MaybeUninit<f32>]>,
    rec: &'a mut [f32],
}

/// Whether this CPU runs the sweep with fused multiply-adds (`head_scan`'s AVX2 + FMA and
/// AVX-512 kernels): the fold of a verify's records outside a sweep (`settle`) must round as
/// the sweep does, so both ask here.
#[cfg(target_arch = "x86_64")]
fn fused_sweep() -> bool {
    is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma")
}

/// V head `j` over `rows`: the delta rule on its state (`S[i][j']`, j' fastest), then the
/// gated RMSNorm, into `y`.
#[allow(clippy::too_many_arguments)]
fn head_scan(
    p: &GdnParams,
    j: usize,
    rows: &Rows<'_>,
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &Weights<'_>,
    st: HeadState<'_>,
    y: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if fused_sweep() {
        // SAFETY: the features are present.
        return unsafe {
            if is_x86_feature_detected!("avx512f") {
                head_scan_avx512(p, j, rows, z, b, a, w, st, y)
            } else {
                head_scan_fma(p, j, rows, z, b, a, w, st, y)
            }
        };
    }
    head_scan_body::<false, false>(p, j, rows, z, b, a, w, st, y)
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
            st: HeadState<'_>,
            y: &mut [f32],
        ) {
            head_scan_body::<$fma, $avx512>(p, j, rows, z, b, a, w, st, y)
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
    /// On the first token, the records of the last verify to fold into the state (whole
    /// [`Pending`] records, oldest first; none if empty): the first read of each row of the
    /// state folds them in and writes the row back, the arithmetic of [`settle`], so the
    /// state is read from memory and written once, not once by the fold and again by the
    /// sweep.
    fold: &'a [f32],
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

/// Where one token's sweep of a column block reads the block and writes it: each pointer is
/// the block's first column in row 0, and rows lie `*_stride` floats apart (`d` in a head's
/// state, the block's width in a verify's block scratch).
#[derive(Clone, Copy)]
struct Block {
    src: *mut f32,
    src_stride: usize,
    dst: *mut f32,
    dst_stride: usize,
}

/// Columns `c0..c0 + C` of one token's sweep down the `d` rows of `S`, read from `b.src` and
/// written to `b.dst`: `δ = β(v − decay·S_oldᵀk)`, `S[i] = decay·S[i] + k[i]·δ`,
/// `o = Σ_i S[i]·q[i]`, `kv_next = Σ_i S[i]·k_next[i]`. Each row's block is loaded into
/// registers, updated and stored whole, so in place and out of place compile alike. `dl`,
/// unless null, gets the block's δ (a verify row's record, see [`Pending`]).
///
/// With records to fold (`tok.fold`, first tokens only), the summing pass that forms
/// `S_oldᵀk` folds them into each row of `b.src` first and writes the row back there.
///
/// # Safety
/// `b.src` and `b.dst` each hold `d` rows of `C` values at their strides and are the same
/// block or disjoint; `dl` is null or holds `d` values.
#[inline(always)]
#[allow(clippy::too_many_arguments)]
unsafe fn sweep<const FMA: bool, const C: usize>(
    b: Block,
    dl_out: *mut f32,
    d: usize,
    c0: usize,
    tok: &Token<'_>,
    o: &mut [f32],
    kv_next: &mut [f32],
) {
    let Block {
        src,
        src_stride,
        dst,
        dst_stride,
    } = b;
    let load = |i: usize| std::ptr::read_unaligned(src.add(i * src_stride).cast::<[f32; C]>());
    // The first column block of a call's first token is the first read of the state's rows
    // (the later tokens find the block in L1): ask for whole rows a few ahead, so the column
    // blocks after it find them in cache.
    let ahead = |i: usize| {
        if c0 == 0 && i + ROWS_AHEAD < d {
            prefetch_row::<false>(src.add((i + ROWS_AHEAD) * src_stride), d);
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
                let mut row = load(i);
                if !tok.fold.is_empty() {
                    fold_row::<FMA>(&mut row, tok.fold, i, c0, d);
                    std::ptr::write_unaligned(src.add(i * src_stride).cast::<[f32; C]>(), row);
                }
                let ki = tok.k[i];
                for c in 0..C {
                    acc[c] = madd::<FMA>(row[c], ki, acc[c]);
                }
            }
            acc
        }
    };
    let dl: [f32; C] = std::array::from_fn(|c| tok.beta * (tok.v[c0 + c] - tok.decay * kv[c]));
    if !dl_out.is_null() {
        std::ptr::write_unaligned(dl_out.add(c0).cast::<[f32; C]>(), dl);
    }
    let mut oa = [0f32; C];
    let mut kn = [0f32; C];
    for i in 0..d {
        next(i);
        let (ki, qi, kni) = (tok.k[i], tok.q[i], tok.k_next[i]);
        let mut row = load(i);
        for c in 0..C {
            row[c] = madd::<FMA>(ki, dl[c], row[c] * tok.decay);
            oa[c] = madd::<FMA>(row[c], qi, oa[c]);
            kn[c] = madd::<FMA>(row[c], kni, kn[c]);
        }
        std::ptr::write_unaligned(dst.add(i * dst_stride).cast::<[f32; C]>(), row);
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
/// As `sweep`, and the CPU has AVX-512 F.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
#[inline]
#[allow(clippy::too_many_arguments)]
unsafe fn sweep32_avx512(
    b: Block,
    dl_out: *mut f32,
    d: usize,
    c0: usize,
    tok: &Token<'_>,
    o: &mut [f32],
    kv_next: &mut [f32],
) {
    use std::arch::x86_64::*;
    let (s, ss, t, ts) = (b.src, b.src_stride, b.dst, b.dst_stride);
    let mut kv = [_mm512_setzero_ps(); 2];
    match tok.kv {
        Some(k) => {
            let k = k[c0..c0 + 32].as_ptr();
            kv = [_mm512_loadu_ps(k), _mm512_loadu_ps(k.add(16))];
        }
        None => {
            for i in 0..d {
                if c0 == 0 && i + ROWS_AHEAD < d {
                    prefetch_row::<false>(s.add((i + ROWS_AHEAD) * ss), d);
                }
                let r = s.add(i * ss);
                let mut row = [_mm512_loadu_ps(r), _mm512_loadu_ps(r.add(16))];
                if !tok.fold.is_empty() {
                    for rc in tok.fold.chunks_exact(Pending::record(d)) {
                        let (decay, ki) = (_mm512_set1_ps(rc[0]), _mm512_set1_ps(rc[1 + i]));
                        let dl = rc[1 + d + c0..][..32].as_ptr();
                        for (h, x) in row.iter_mut().enumerate() {
                            let dl = _mm512_loadu_ps(dl.add(16 * h));
                            *x = _mm512_fmadd_ps(ki, dl, _mm512_mul_ps(*x, decay));
                        }
                    }
                    _mm512_storeu_ps(r, row[0]);
                    _mm512_storeu_ps(r.add(16), row[1]);
                }
                let ki = _mm512_set1_ps(tok.k[i]);
                kv[0] = _mm512_fmadd_ps(row[0], ki, kv[0]);
                kv[1] = _mm512_fmadd_ps(row[1], ki, kv[1]);
            }
        }
    }
    let (beta, decay) = (_mm512_set1_ps(tok.beta), _mm512_set1_ps(tok.decay));
    let v = tok.v[c0..c0 + 32].as_ptr();
    let mut dl = [_mm512_setzero_ps(); 2];
    for h in 0..2 {
        let kd = _mm512_mul_ps(decay, kv[h]);
        dl[h] = _mm512_mul_ps(beta, _mm512_sub_ps(_mm512_loadu_ps(v.add(16 * h)), kd));
        if !dl_out.is_null() {
            _mm512_storeu_ps(dl_out.add(c0 + 16 * h), dl[h]);
        }
    }
    let mut oa = [_mm512_setzero_ps(); 2];
    let mut kn = [_mm512_setzero_ps(); 2];
    for i in 0..d {
        if let Some(n) = tok.next_head {
            prefetch_row::<true>(n.wrapping_add((c0 / 32 * d + i) * 32), 32);
        }
        let (ki, qi, kni) = (
            _mm512_set1_ps(tok.k[i]),
            _mm512_set1_ps(tok.q[i]),
            _mm512_set1_ps(tok.k_next[i]),
        );
        for h in 0..2 {
            let row = _mm512_loadu_ps(s.add(i * ss + 16 * h));
            let row = _mm512_fmadd_ps(ki, dl[h], _mm512_mul_ps(row, decay));
            oa[h] = _mm512_fmadd_ps(row, qi, oa[h]);
            kn[h] = _mm512_fmadd_ps(row, kni, kn[h]);
            _mm512_storeu_ps(t.add(i * ts + 16 * h), row);
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
///
/// Every quantity of a sweep but the norm is a column's own (column j' of S, of δ, o and the
/// next kv), so the sweeps run a column block at a time through all the tokens: the block
/// (128 rows of 32 floats, 16 KiB) stays in L1 from the first token to the last, and the head's
/// state crosses L2 once a call instead of once a token. The arithmetic of each column is the
/// same, in the same order, so the bits are those of one token at a time. With a verify's
/// scratch of one block and its fold in the first sweep (`Token::fold`), a depth-2 draft
/// round's GDN cores on bench-0.8b PQ2_0 (`xtask bench --engine --phases`, Zen 4, 2 threads,
/// the builds alternated four times) went from 3.08-3.32 to 2.24-2.44 ms, where a plain
/// step's take 1.2-1.5 ms.
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
    st: HeadState<'_>,
    y: &mut [f32],
) {
    let (cd, d) = (p.conv_dim(), p.d);
    let n_tok = y.len() / d;
    let u = rows.u;
    let kh = j % p.n_k; // tiled V order
    let q_at = |t: usize| &u[t * cd + kh * d..][..d];
    let k_at = |t: usize| &u[t * cd + (p.n_k + kh) * d..][..d];
    let v_at = |t: usize| &u[t * cd + (2 * p.n_k + j) * d..][..d];
    let HeadState {
        live,
        fold,
        scratch,
        rec,
    } = st;
    let rl = Pending::record(d);
    assert!(
        live.len() == d * d
            && scratch.as_ref().is_none_or(|s| {
                (s.len() == d * d || s.len() == d * COLS) && rec.len() >= (rows.t0 + n_tok) * rl
            }),
        "a head's state is d x d, with a scratch and a record per row out of place"
    );
    // Out of place, a scratch of d x d carries the rows' state from one chunk to the next; a
    // block scratch (d x COLS, when the rows are one chunk) holds one column block's state
    // from the first row to the last, in L1.
    let block_scratch = scratch.as_ref().is_some_and(|s| s.len() < d * d);
    let scratch: Option<*mut f32> = scratch.map(|s| s.as_mut_ptr().cast::<f32>());
    // The next head's live state, which the last token's sweeps bring into L2.
    let next_head = live.as_ptr().wrapping_add(d * d);
    // Each token's β and decay; out of place, its record's decay and k (δ comes from the
    // sweeps).
    let gates: Vec<(f32, f32)> = (0..n_tok)
        .map(|t| {
            let row = rows.base + rows.t0 + t;
            let beta = sigmoid(b.row(row)[j]);
            let decay = (w.ssm_a[j] * softplus(a.row(row)[j] + w.dt_bias[j])).exp();
            (beta, decay)
        })
        .collect();
    if scratch.is_some() {
        for (t, &(_, decay)) in gates.iter().enumerate() {
            let r = &mut rec[(rows.t0 + t) * rl..(rows.t0 + t + 1) * rl];
            r[0] = decay;
            r[1..1 + d].copy_from_slice(k_at(t));
        }
    }
    let rec = rec.as_mut_ptr();
    // kvs[t] = S_oldᵀk of token t, written by token t - 1's sweeps (the first token's is
    // summed in its own).
    let mut kvs = vec![0f32; (n_tok + 1) * d];
    // Column blocks of COLS, so that δ, o and the next kv of a block stay in registers while
    // the sweep runs down the rows; then the leftover columns one at a time.
    let full = d / COLS * COLS;
    let blocks = (0..full)
        .step_by(COLS)
        .map(|c0| (c0, COLS))
        .chain((full..d).map(|c0| (c0, 1)));
    for (c0, width) in blocks {
        for t in 0..n_tok {
            let at = rows.t0 + t;
            let (done, next) = kvs.split_at_mut((t + 1) * d);
            let (beta, decay) = gates[t];
            let tok = Token {
                beta,
                decay,
                q: q_at(t),
                k: k_at(t),
                v: v_at(t),
                k_next: k_at((t + 1).min(n_tok - 1)),
                kv: (t > 0).then_some(&done[t * d..]),
                fold: if t == 0 { fold } else { &[] },
                next_head: (t + 1 == n_tok).then_some(next_head),
            };
            let o = &mut y[t * d..(t + 1) * d];
            // In place on the live state; out of place the sequence's first row reads the
            // live state and every row writes the scratch, which the next row reads, and
            // leaves δ in its record.
            let live_block = (live.as_mut_ptr().wrapping_add(c0), d);
            let (dst, src, dl) = match scratch {
                None => (live_block, live_block, std::ptr::null_mut()),
                Some(scratch) => {
                    let dst = match block_scratch {
                        true => (scratch, width),
                        false => (scratch.wrapping_add(c0), d),
                    };
                    let src = match at {
                        0 => live_block,
                        _ => dst,
                    };
                    (dst, src, rec.wrapping_add(at * rl + 1 + d))
                }
            };
            let b = Block {
                src: src.0,
                src_stride: src.1,
                dst: dst.0,
                dst_stride: dst.1,
            };
            let kv_next = &mut next[..d];
            // SAFETY: the live state and a d x d scratch hold d rows of d values (checked
            // above), a block scratch d rows of COLS: d rows of the block's width at its
            // stride either way. The live state and the scratch are disjoint, and the scratch's
            // block is written whole (every row of the block's columns) by the block's first
            // row before a later row reads it. dl is null or a record's d values of δ (rec
            // holds rows.t0 + n_tok records, checked above).
            unsafe {
                #[cfg(target_arch = "x86_64")]
                if AVX512 && width == COLS {
                    // AVX512 is set only by `head_scan_avx512`, after the feature check.
                    const { assert!(COLS == 32) };
                    sweep32_avx512(b, dl, d, c0, &tok, o, kv_next);
                    continue;
                }
                match width {
                    COLS => sweep::<FMA, COLS>(b, dl, d, c0, &tok, o, kv_next),
                    _ => sweep::<FMA, 1>(b, dl, d, c0, &tok, o, kv_next),
                }
            }
        }
    }
    // Gated RMSNorm over the head, per token.
    for (t, o) in y.chunks_exact_mut(d).enumerate() {
        let row = rows.base + rows.t0 + t;
        let sc = rms_scale(o, p.eps);
        let zj = &z.row(row)[j * d..(j + 1) * d];
        for ((ov, &g), &zv) in o.iter_mut().zip(w.norm).zip(zj) {
            *ov = *ov * sc * g * silu(zv);
        }
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
    /// `S_oldᵀk` summed in the sweep (with or without records to fold into the source, which
    /// out of place then holds the folded state) or given.
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
        // Two records to fold (decay, k, δ each), for the first token's sweeps.
        let recs: Vec<f32> = [0.9f32, 0.8]
            .iter()
            .enumerate()
            .flat_map(|(r, &decay)| {
                std::iter::once(decay)
                    .chain(v(8 + r, d))
                    .chain(v(10 + r, d))
            })
            .collect();
        let cases = [(false, false), (true, false), (false, true)];
        for (given_kv, folds) in cases {
            for in_place in [false, true] {
                let tok = Token {
                    decay: 0.93,
                    beta: 0.61,
                    q: &q,
                    k: &k,
                    v: &vv,
                    k_next: &kn,
                    kv: given_kv.then_some(&kv0[..]),
                    fold: if folds { &recs } else { &[] },
                    next_head: Some(next.as_ptr()),
                };
                let run = |wide: bool| {
                    let mut src = state.clone();
                    let mut dst = vec![0f32; d * d];
                    let (mut o, mut kvn) = (vec![0f32; d], vec![0f32; d]);
                    let mut dl = vec![0f32; d];
                    let sp = src.as_mut_ptr();
                    let dp = if in_place { sp } else { dst.as_mut_ptr() };
                    let dlp = dl.as_mut_ptr();
                    for c0 in (0..d).step_by(32) {
                        let b = Block {
                            src: sp.wrapping_add(c0),
                            src_stride: d,
                            dst: dp.wrapping_add(c0),
                            dst_stride: d,
                        };
                        // SAFETY: both buffers hold d * d values, dl d; AVX-512 F checked above.
                        unsafe {
                            if wide {
                                sweep32_avx512(b, dlp, d, c0, &tok, &mut o, &mut kvn);
                            } else {
                                sweep::<true, 32>(b, dlp, d, c0, &tok, &mut o, &mut kvn);
                            }
                        }
                    }
                    let bits = |x: &[f32]| x.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
                    // Out of place, the source holds the folded state.
                    (bits(&src), bits(&dst), bits(&o), bits(&kvn), bits(&dl))
                };
                let (wide, fma) = (run(true), run(false));
                assert!(
                    wide == fma,
                    "kv given {given_kv}, folding {folds}, in place {in_place}"
                );
                if folds && !in_place {
                    assert!(
                        wide.0 != state.iter().map(|v| v.to_bits()).collect::<Vec<_>>(),
                        "the fold writes the source"
                    );
                }
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
        /// `n` rows of heads `d` wide: 32 is one column block of the sweep, 40 one and 8
        /// columns swept one at a time.
        fn new(n: usize, seed: usize, d: usize) -> Self {
            let p = GdnParams {
                n_k: 2,
                n_v: 4,
                d,
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
        for d in [32, 40] {
            mixed_batch_case(d);
        }
    }

    fn mixed_batch_case(d: usize) {
        let rows = [1, 5, 1, 1];
        let n: usize = rows.iter().sum();
        let c = Small::new(n, 11, d);
        let (p, w) = (&c.p, c.weights());
        let (mixed, z, b, a) = (&c.mixed, &c.z, &c.b, &c.a);
        let fresh = |seed: usize| Recurrent {
            conv: tensor(1, p.conv_state_len(), 20 + seed).data,
            ssm: tensor(1, p.ssm_state_len(), 30 + seed).data.into(),
            pending: Pending::default(),
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
                    gdn_batch(p, &m, &zz, &bb, &aa, &w, &mut seqs).data
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
            let y = gdn_batch(p, &m, &zz, &bb, &aa, &w, &mut seqs).data;
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
                assert_eq!(
                    st[i].settled_ssm(),
                    alone_st[i].settled_ssm(),
                    "sequence {i}'s ssm state"
                );
                assert_eq!(st[i].conv, alone_st[i].conv, "sequence {i}'s conv state");
                at += rows[i];
            }
            assert_eq!(cell[0].conv, alone_cell[0].conv);
        }
    }

    /// A snapshot batch (a verify batch's rows, out of place) leaves the live state as it was
    /// with the rows pending, and restoring cell t gives the bits that feeding rows 0..=t one
    /// at a time leaves, for the state, the conv state and the next row's output; with
    /// nothing restored, the next call folds in every row. Longer than a chunk, so a chunk's
    /// first row reads the scratch copy the chunk before left; from a state that itself has
    /// pending rows, so the batch folds those in first.
    ///
    /// Also a batch of 9 rows (one chunk, so its scratch holds one column block) with heads
    /// wider than a block, and the long batch with those heads.
    #[test]
    fn snapshot_rows_restore_to_the_state_after_each_row() {
        for (n, d) in [(CHUNK + 3, 32), (9, 40), (9, 64), (CHUNK + 3, 40)] {
            snapshot_case(n, d);
        }
    }

    fn snapshot_case(n: usize, d: usize) {
        let c = Small::new(n + 3, 5, d);
        let (p, w) = (&c.p, c.weights());
        let row = |t: &Tensor, i: usize| Tensor {
            data: t.row(i).to_vec(),
            rows: 1,
            cols: t.cols,
        };
        let rows = |t: &Tensor, i: usize, m: usize| Tensor {
            data: t.data[i * t.cols..(i + m) * t.cols].to_vec(),
            rows: m,
            cols: t.cols,
        };
        let feed = |st: &mut Recurrent, i: usize| {
            let (m, zz, bb, aa) = (row(&c.mixed, i), row(&c.z, i), row(&c.b, i), row(&c.a, i));
            gdn(p, &m, &zz, &bb, &aa, &w, st).data
        };
        let snapshot = |st: &mut Recurrent, cells: &mut [Recurrent], i: usize, m: usize| {
            let g = |t: &Tensor| rows(t, i, m);
            let (mm, zz, bb, aa) = (g(&c.mixed), g(&c.z), g(&c.b), g(&c.a));
            let mut seqs = [Seq {
                rows: m,
                state: st,
                cells: Some(cells),
            }];
            gdn_batch(p, &mm, &zz, &bb, &aa, &w, &mut seqs).data
        };
        let fresh = || Recurrent {
            conv: tensor(1, p.conv_state_len(), 40).data,
            ssm: tensor(1, p.ssm_state_len(), 41).data.into(),
            pending: Pending::default(),
        };
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        let cells = |k: usize| (0..k).map(|_| fresh()).collect::<Vec<_>>();
        // Rows 0 and 1 by a verify of two rows, all kept, then rows 2.. of n.
        let mut live = fresh();
        let mut first = cells(1);
        let mut y = snapshot(&mut live, &mut first, 0, 2);
        let before = live.ssm.to_vec();
        let mut cs = cells(n - 1);
        y.extend(snapshot(&mut live, &mut cs, 2, n));
        assert!(
            live.ssm[..] != before[..],
            "the second batch folds in the first's rows"
        );
        // Consecutive verify batches take turns with two record buffers; a plain step keeps
        // the one it folded in for the next verify.
        {
            let mut s = fresh();
            let mut ptrs = Vec::new();
            for i in 0..4 {
                if i == 3 {
                    drop(feed(&mut s, 9));
                    assert!(s.pending.data.is_empty() && s.pending.spare.as_ptr() == ptrs[2]);
                }
                drop(snapshot(&mut s, &mut cells(2), 3 * i, 3));
                ptrs.push(s.pending.data.as_ptr());
            }
            assert!(
                ptrs[0] == ptrs[2] && ptrs[0] != ptrs[1] && ptrs[3] == ptrs[2],
                "record buffers {ptrs:?}"
            );
            assert!(
                s.clone().pending.spare.is_empty(),
                "a copy leaves the spare"
            );
        }
        // The same rows one at a time.
        let mut st = fresh();
        let mut y1 = Vec::new();
        let mut after = Vec::new();
        for i in 0..n + 2 {
            y1.extend(feed(&mut st, i));
            if i >= 2 {
                after.push((st.ssm.to_vec(), st.conv.clone()));
            }
        }
        assert!(bits(&y) == bits(&y1), "outputs");
        assert!(
            bits(&live.settled_ssm()) == bits(&after[n - 1].0),
            "live state"
        );
        assert_eq!(live.conv, after[n - 1].1);
        for (t, cell) in cs.iter_mut().enumerate() {
            // A cell marks rows to keep and folds in nothing itself.
            assert!(cell.settled_ssm() == cell.ssm.to_vec(), "cell {t} alone");
            let mut r = live.clone();
            r.restore(cell);
            assert!(bits(&r.settled_ssm()) == bits(&after[t].0), "cell {t}");
            assert_eq!(r.conv, after[t].1, "cell {t}'s conv");
            // The next row from the restored state, against feeding row by row.
            let mut s1 = fresh();
            (0..t + 3).for_each(|i| drop(feed(&mut s1, i)));
            let want = feed(&mut s1, t + 3);
            assert!(
                bits(&feed(&mut r, t + 3)) == bits(&want),
                "row after cell {t}"
            );
            assert!(
                bits(&r.ssm) == bits(&s1.ssm),
                "state after cell {t} and a row"
            );
        }
    }

    /// A batch longer than a chunk gives the outputs and state of feeding it token by token.
    #[test]
    fn batch_across_chunks_matches_token_by_token() {
        for d in [32, 40] {
            batch_across_chunks_case(d);
        }
    }

    fn batch_across_chunks_case(d: usize) {
        let n = 2 * CHUNK + 37;
        let c = Small::new(n, 1, d);
        let (p, w) = (&c.p, c.weights());
        let (mixed, z, b, a) = (&c.mixed, &c.z, &c.b, &c.a);
        let fresh = || Recurrent {
            conv: vec![0.1; p.conv_state_len()],
            ssm: vec![0.01; p.ssm_state_len()].into(),
            pending: Pending::default(),
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
