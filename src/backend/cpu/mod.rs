//! The CPU backend: plain loops, rayon across output rows, tokens and heads.
//!
//! Weights stay in the mmap in their stored dtype, except that the serving path repacks Q8_0,
//! PQ2_0 and PTQ1_0 (as PQ2_0) matrices once at load for its VNNI kernels (`quant::packed`).
//! On the f32 reference path (`CpuBackend::new`)
//! one token's matvec streams each row through `quant::dot_row`, so a 2.7 GB quantized file
//! decodes without an f32 copy of itself; several tokens go through `gemm`, which dequantizes a
//! tile of rows at a time into per-thread scratch and multiplies it with every token row.
//! Activations stay f32 throughout: those fast paths change the order of f32 sums, never the
//! precision. The serving path (`CpuBackend::int8`) quantizes a matmul's activations to int8
//! once and runs `quant::int8`'s integer kernels on quantized weights, every token row of the
//! batch against each weight row while it is in cache (`product_int8`).
//!
//! `gemm` holds the register-blocked products (the many-token matmul and attention's two
//! products), `attention` and `gdn` the two mixer cores, `math` the vectorized exp and the
//! activations built on it.

use std::collections::HashMap;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, Weak};

use rayon::prelude::*;

use super::{
    AttnParams, AttnSeq, Backend, BackendError, Fold, GdnParams, GdnWeights, KvTypes, WeightSource,
};
use crate::alloc::Lines;
use crate::quant::{self, hadamard::HadamardConfig, packed::Layout};
use crate::tensor::GgmlType;
use math::{sigmoid, silu};

mod attention;
mod gdn;
mod gemm;
mod math;
mod step;

/// The CPU backend. `new` is the f32 reference (`tern logits`, the golden tests,
/// `--cpu-exact`); `int8` quantizes each matmul's activations to int8 and runs the integer
/// kernels of `quant::int8` for the quantized weight types, as llama.cpp does (`generate`,
/// `serve`).
pub struct CpuBackend {
    int8: bool,
    /// Whether `upload` copies the matrices `quant::packed::layout` takes (the serving path).
    pack: bool,
    /// Whether `upload` lays the copies out as on an x86 CPU without the packed kernels:
    /// nothing packed, PTQ1_0 transcoded (tests and benches of that path on any CPU).
    as_without_packed: bool,
    /// The copies made so far, by the address of the stored rows: a tensor used twice
    /// (the tied output head, the draft head's first rows of it) shares one copy.
    packed: Mutex<HashMap<usize, Weak<Lines<u8>>>>,
}

impl Default for CpuBackend {
    fn default() -> Self {
        CpuBackend::new()
    }
}

impl CpuBackend {
    fn with(int8: bool, pack: bool) -> Self {
        CpuBackend {
            int8,
            pack,
            as_without_packed: false,
            packed: Mutex::new(HashMap::new()),
        }
    }

    pub fn new() -> Self {
        CpuBackend::with(false, false)
    }

    /// The serving path: int8 activations against Q8_0, Q4_0, PQ2_0 and PTQ1_0 weights, Q8_0,
    /// PQ2_0 and PTQ1_0 matrices packed at upload where the CPU has the packed kernels, and on
    /// x86 the PTQ1_0 matrices they do not take transcoded to PQ2_0 blocks
    /// (`quant::packed::layout`).
    pub fn int8() -> Self {
        CpuBackend::with(true, true)
    }

    /// `int8` with every weight read in place from the mapping, as stored: the same results
    /// bit for bit (the tests and benches compare the two).
    pub fn int8_unpacked() -> Self {
        CpuBackend::with(true, false)
    }

    /// `int8` with the copies an x86 CPU without the packed kernels (no AVX-512 VNNI) makes:
    /// PTQ1_0 matrices transcoded to PQ2_0 blocks (`quant::packed::Layout::Transcoded`), the
    /// others read in place. For the tests and benches of that path on any CPU.
    pub fn int8_transcoded() -> Self {
        CpuBackend {
            as_without_packed: true,
            ..CpuBackend::with(true, true)
        }
    }

    /// How `upload` copies `w`, if at all: as the serving path does on this CPU
    /// (`serving_layout`, which the planner prices), or as `int8_transcoded` asks.
    fn layout(&self, w: &WeightSource) -> Option<Layout> {
        match (self.pack, self.as_without_packed) {
            (false, _) => None,
            (true, false) => serving_layout(w),
            (true, true) => (!w.decode_once()
                && quant::packed::transcodes(w.info.ty, w.shape2().0))
            .then_some(Layout::Transcoded),
        }
    }

    /// `int8` unless `exact`; `int8_unpacked` unless `repack`.
    pub fn serving(exact: bool, repack: bool) -> Self {
        CpuBackend::with(!exact, !exact && repack)
    }

    /// The copy of `w`'s rows in `layout`, made on its first use. A use that asks for fewer
    /// rows of the same stored bytes (the draft head) reads the first rows of the longer copy;
    /// the model loader takes the whole table first.
    fn packed_rows(&self, w: &WeightSource, layout: Layout) -> Arc<Lines<u8>> {
        let (ne0, _) = w.shape2();
        let bytes = w.bytes();
        let key = bytes.as_ptr() as usize;
        let mut map = self.packed.lock().unwrap_or_else(|e| e.into_inner());
        let want = quant::packed::packed_len(w.info.ty, ne0, bytes.len());
        if let Some(p) = map.get(&key).and_then(Weak::upgrade) {
            if p.len() >= want {
                return p;
            }
        }
        let rb = w.info.row_bytes() as usize;
        let pb = quant::packed::packed_row_bytes(w.info.ty, ne0);
        let mut p = Lines::<u8>::zeroed(want);
        let rows_per_task = (INT8_TASK_BYTES / rb).max(1);
        p.par_chunks_mut(rows_per_task * pb)
            .zip(bytes.par_chunks(rows_per_task * rb))
            .for_each(|(d, s)| quant::packed::copy_rows(layout, w.info.ty, s, ne0, d));
        w.file.release(&w.info);
        let p = Arc::new(p);
        map.insert(key, Arc::downgrade(&p));
        p
    }
}

/// `x` with `fold`'s forward rule applied to every row.
fn folded_input(fold: &Fold, x: &Tensor) -> Vec<f32> {
    let mut t = x.data.clone();
    t.par_chunks_mut(x.cols)
        .with_min_len(rows_per_task(x.cols))
        .for_each_init(Vec::new, |scratch, row| fold.apply(row, scratch));
    t
}

/// Whether two folds transform an input the same way.
fn same_fold(a: &Fold, b: &Fold) -> bool {
    Arc::ptr_eq(&a.hadamard, &b.hadamard) && a.perm == b.perm
}

/// `y[r] = W · x[r]` for every row of `x` (already in the weight's folded basis); `int8`
/// takes the integer kernels where the weight type has them.
fn product(w: &Weight, x: &[f32], int8: bool) -> Tensor {
    let (k, n_out) = (w.ne0, w.rows);
    let n_tok = x.len() / k;
    let mut out = Tensor::zeros(n_tok, n_out);
    if int8 && w.dense.is_none() && quant::int8::supported(w.ty) && n_tok > 0 {
        product_int8(w, x, &mut out);
    } else if let Some(d) = &w.dense {
        for (xt, ot) in x.chunks_exact(k).zip(out.data.chunks_exact_mut(n_out)) {
            for (o, dr) in ot.iter_mut().zip(d.chunks_exact(k)) {
                *o = dot(dr, xt);
            }
        }
    } else if n_tok == 1 {
        // One token: stream each stored row through its dot kernel.
        out.data
            .par_chunks_mut(ROW_CHUNK)
            .enumerate()
            .for_each(|(c, chunk)| {
                for (i, o) in chunk.iter_mut().enumerate() {
                    *o = quant::dot_row(w.ty, w.row_data(c * ROW_CHUNK + i), x);
                }
            });
    } else if n_tok <= SMALL_BATCH {
        // A few tokens (a batch of decoding sequences, drafts to verify): stream each stored
        // row once through the multi-token kernel, each token's sum exactly `dot_row`'s.
        let xs: Vec<&[f32]> = x.chunks_exact(k).collect();
        let mut out_t = vec![0f32; n_out * n_tok];
        out_t
            .par_chunks_mut(ROW_CHUNK * n_tok)
            .enumerate()
            .for_each(|(c, chunk)| {
                for (i, o) in chunk.chunks_exact_mut(n_tok).enumerate() {
                    let row = w.row_data(c * ROW_CHUNK + i);
                    match *xs.as_slice() {
                        [a, b] => o.copy_from_slice(&quant::dot_rows(w.ty, row, [a, b])),
                        [a, b, c] => o.copy_from_slice(&quant::dot_rows(w.ty, row, [a, b, c])),
                        [a, b, c, d] => {
                            o.copy_from_slice(&quant::dot_rows(w.ty, row, [a, b, c, d]))
                        }
                        _ => unreachable!("2 to SMALL_BATCH tokens"),
                    }
                }
            });
        for (r, o) in out_t.chunks_exact(n_tok).enumerate() {
            for (t, &v) in o.iter().enumerate() {
                out.data[t * n_out + r] = v;
            }
        }
    } else {
        // Many tokens: dequantized weight tiles times every token row.
        gemm::matmul(w.ty, w.src.bytes(), w.row_bytes, n_out, x, k, &mut out.data);
    }
    out
}

/// `product` on the serving path: the activations quantized once, then a few token rows (a
/// decode step, a batch of streams, a verify batch) go through the row kernels in groups of
/// `MAX_ROWS`, each weight row read from memory once for a group; many (prefill) through the
/// tiled kernel where the CPU has it.
fn product_int8(w: &Weight, x: &[f32], out: &mut Tensor) {
    use quant::int8::{self, QActs};
    let k = w.ne0;
    let n_tok = x.len() / k;
    if n_tok >= int8::tiled_min_rows(w.ty) && int8::gemm_vectorized() {
        return product_int8_tiled(w, x, out);
    }
    let acts = QActs::quantize(w.ty, x, k);
    products_int8_rows(&mut [(w, &acts, out)]);
}

/// Whether `product` of `n_tok` rows by `w` takes the row kernels of `product_int8`.
fn takes_row_kernels(w: &Weight, n_tok: usize, int8: bool) -> bool {
    use quant::int8;
    int8 && w.dense.is_none()
        && int8::supported(w.ty)
        && n_tok > 0
        && !(n_tok >= int8::tiled_min_rows(w.ty) && int8::gemm_vectorized())
}

/// The row kernels of `product_int8` for several matrices at once (q/k/v, the GDN projections,
/// ffn gate and up: one input, several weights), all their row tasks in one parallel region:
/// a decode step forks and joins once per such group instead of once per matrix, and a small
/// matrix (GDN's beta and alpha) shares the region with a large one instead of waking the
/// threads for a few microseconds of work.
fn products_int8_rows(jobs: &mut [(&Weight, &quant::int8::QActs, &mut Tensor)]) {
    use quant::int8::{self, MAX_ROWS};
    let tasks: Vec<(usize, usize, usize)> = jobs
        .iter()
        .enumerate()
        .flat_map(|(j, (w, _, _))| {
            let (n, chunk) = (w.rows, int8_row_chunk(w.row_bytes, w.rows));
            (0..n.div_ceil(chunk)).map(move |c| (j, c * chunk, ((c + 1) * chunk).min(n)))
        })
        .collect();
    let jobs: Vec<(&Weight, &int8::QActs, gemm::OutPtr)> = jobs
        .iter_mut()
        .map(|(w, a, out)| {
            assert_eq!(
                (out.rows, out.cols),
                (a.rows(), w.rows),
                "product of {}: output shape",
                w.src.name()
            );
            (*w, *a, gemm::OutPtr(out.data.as_mut_ptr()))
        })
        .collect();
    // One job per thread, each taking the next task in order until none is left, instead of
    // rayon splitting the list into halves and quarters: a worker that wakes late into a small
    // region (tens of µs from the engine thread on this VM, as long as a GDN out product) or is
    // preempted by a neighbour holds up one task, not a quarter of the matrix; a job no worker
    // has taken when the others run out is popped back by its owner and ends at once.
    let next = AtomicUsize::new(0);
    let threads = rayon::current_num_threads().min(tasks.len());
    (0..threads).into_par_iter().for_each(|_| {
        let mut o: Vec<f32> = Vec::new();
        while let Some(&(j, r0, r1)) = tasks.get(next.fetch_add(1, Ordering::Relaxed)) {
            let (w, acts, dst) = (jobs[j].0, jobs[j].1, &jobs[j].2);
            let (n_tok, n_out) = (acts.rows(), w.rows);
            let rows = &w.rows_bytes()[r0 * w.row_bytes..r1 * w.row_bytes];
            if n_tok == 1 {
                // A decode step: the task's rows in one span kernel call, straight into `out`.
                // SAFETY: job j's output holds one row of `n_out` (checked above); this task
                // alone writes its columns r0..r1.
                let o = unsafe { std::slice::from_raw_parts_mut(dst.at(r0), r1 - r0) };
                if w.layout == Some(Layout::Packed) {
                    quant::packed::dot_span(rows, acts, 0, 1, o);
                } else {
                    int8::dot_span(rows, acts, 0, o);
                }
                continue;
            }
            // A few streams' step or a verify batch: each weight row read once for up to
            // MAX_ROWS token rows, by one span kernel call per group, then the results laid out
            // token row by token row. The calls take OUT_ROWS weight rows at a time, so each
            // one's results are laid out while they sit in L1, and the stores into the output
            // rows (cold: the head's are 1 MB apart) drain behind the next call's arithmetic.
            // Laid out after the whole task instead, they stalled the thread on the stores:
            // 0.9 ms of a three-stream PQ2_0 step on bench-0.8b (perf, Zen 4).
            for t0 in (0..n_tok).step_by(MAX_ROWS) {
                let n = MAX_ROWS.min(n_tok - t0);
                for s0 in (r0..r1).step_by(OUT_ROWS) {
                    let s1 = (s0 + OUT_ROWS).min(r1);
                    let part = &rows[(s0 - r0) * w.row_bytes..(s1 - r0) * w.row_bytes];
                    o.resize((s1 - s0) * n, 0.0);
                    if w.layout == Some(Layout::Packed) {
                        quant::packed::dot_span(part, acts, t0, n, &mut o);
                    } else {
                        int8::dot_span_rows(part, acts, t0, n, &mut o);
                    }
                    for i in 0..n {
                        // SAFETY: job j's output holds `n_tok` rows of `n_out` (checked above);
                        // this task alone writes its columns r0..r1, so s0..s1 of each row.
                        let d = unsafe {
                            std::slice::from_raw_parts_mut(dst.at((t0 + i) * n_out + s0), s1 - s0)
                        };
                        for (d, &v) in d.iter_mut().zip(o[i..].iter().step_by(n)) {
                            *d = v;
                        }
                    }
                }
            }
        }
    });
}

/// Weight rows per span kernel call when a task serves several token rows (see
/// `products_int8_rows`): a multiple of the kernels' pairs of rows, and few enough that a
/// call's results (4 token rows at most) fit in L1 beside its activations.
const OUT_ROWS: usize = 64;

/// Weight rows per rayon task of the row kernels: about `INT8_TASK_BYTES` of weights, so a
/// task outweighs its scheduling (a ternary row of 1,024 is 272 bytes: 32 rows were ~1 µs of
/// work), but at least `ROW_CHUNK` rows and few enough that every thread gets several tasks.
fn int8_row_chunk(row_bytes: usize, n_out: usize) -> usize {
    let by_bytes = (INT8_TASK_BYTES / row_bytes.max(1)).max(ROW_CHUNK);
    let balanced = n_out.div_ceil(4 * rayon::current_num_threads()).max(1);
    by_bytes.min(balanced)
}

/// Weight bytes per task of the row kernels (see `int8_row_chunk`). Decode streams the weights
/// from memory, and a task's stream starts cold: on the Xeon bench machine (2 threads), 64 KiB
/// tasks streamed 1 GiB of Q8_0 rows of 1,024 at 20.8 / 21.2 GB/s for one token row and
/// 20.1 / 19.6 for three, 256 KiB tasks at 23.3 / 22.6 and 23.1 / 21.5, 512 KiB and 1 MiB no
/// more (medians of 11-15 passes, the sizes alternated). In the engine, steps alternating
/// between 64 and 256 KiB within one run (`bench --engine --phases`, bench-0.8b Q8_0, 200
/// steps, two runs with the order swapped) took the matmuls from 43.3 / 50.0 to 40.2 / 47.4 ms
/// at one stream and 49.4 / 56.9 to 46.3 / 52.0 ms at three; PQ2_0's from 24.5 to 23.3 and
/// 26.5 to 26.1; PTQ1_0's, bound by arithmetic, did not move. Every thread still gets at
/// least four tasks a matrix (`int8_row_chunk`).
pub const INT8_TASK_BYTES: usize = 256 << 10;

/// Weight rows per task of the tiled int8 product, decoded once into the task's panel and
/// then dotted with every token row.
const TILED_ROWS: usize = 64;
/// Token rows per call of the tiled kernel: their levels (at most this many times `k` bytes)
/// stay in L2 while the kernel runs down the panel.
const TILED_TOKENS: usize = 64;

/// `product_int8` for many token rows (prefill, `int8::tiled_min_rows`): each task
/// decodes `TILED_ROWS` weight rows into a panel of codes and runs the tiled kernel over
/// panels of `TILED_TOKENS` token rows, writing its columns of `out`.
fn product_int8_tiled(w: &Weight, x: &[f32], out: &mut Tensor) {
    use quant::int8::{self, Isa, Panel, TiledActs};
    let (k, n_out) = (w.ne0, w.rows);
    let acts = TiledActs::quantize(w.ty, x, k);
    let n_tok = acts.rows();
    let dst = gemm::OutPtr(out.data.as_mut_ptr());
    (0..n_out.div_ceil(TILED_ROWS))
        .into_par_iter()
        .for_each_init(
            || (Panel::default(), Vec::new()),
            |(panel, buf), c| {
                let (r0, r1) = (c * TILED_ROWS, ((c + 1) * TILED_ROWS).min(n_out));
                let rows = &w.rows_bytes()[r0 * w.row_bytes..r1 * w.row_bytes];
                if w.layout == Some(Layout::Packed) {
                    panel.decode_packed(w.ty, rows, r1 - r0, k);
                } else {
                    panel.decode(w.ty, rows, r1 - r0, k);
                }
                for t0 in (0..n_tok).step_by(TILED_TOKENS) {
                    let n = TILED_TOKENS.min(n_tok - t0);
                    buf.resize(n * (r1 - r0), 0.0);
                    int8::gemm_isa(panel, &acts, t0, n, buf, Isa::Avx512Vnni);
                    for (i, row) in buf.chunks_exact(r1 - r0).enumerate() {
                        // SAFETY: `out` holds `n_tok` rows of `n_out`; this task alone writes
                        // columns r0..r1, so concurrent tasks never write the same elements.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                row.as_ptr(),
                                dst.at((t0 + i) * n_out + r0),
                                r1 - r0,
                            )
                        };
                    }
                }
            },
        );
}

/// A row-major `[rows, cols]` activation.
#[derive(Clone, Debug)]
pub struct Tensor {
    pub data: Vec<f32>,
    pub rows: usize,
    pub cols: usize,
}

impl Tensor {
    fn zeros(rows: usize, cols: usize) -> Tensor {
        Tensor {
            data: vec![0.0; rows * cols],
            rows,
            cols,
        }
    }
    fn row(&self, r: usize) -> &[f32] {
        &self.data[r * self.cols..(r + 1) * self.cols]
    }
}

pub struct Weight {
    src: WeightSource,
    /// The rows copied for the serving path's kernels (`quant::packed`), shared by every use
    /// of the tensor; `rows * row_bytes` of it are this weight's.
    packed: Option<Arc<Lines<u8>>>,
    /// How `packed` lays them out.
    layout: Option<Layout>,
    /// The type and row length of the rows the kernels read: the stored ones, or the copied
    /// ones (`quant::packed::packed_type`: a copied PTQ1_0 matrix holds PQ2_0 blocks).
    ty: GgmlType,
    ne0: usize,
    rows: usize,
    row_bytes: usize,
    /// Small 1-D weights (norms, biases, conv taps) decoded once; matrices stay in the mmap.
    dense: Option<Vec<f32>>,
    /// A small 2-D weight transposed, `[ne0][rows]` (the GDN conv taps, read one tap across
    /// every channel).
    dense_t: Option<Vec<f32>>,
    fold: Option<Fold>,
    inverse: Option<Arc<HadamardConfig>>,
}

impl Weight {
    /// A stored row, read from the mapping (the f32 paths; a packed weight is only read by the
    /// int8 paths, through `rows_bytes`).
    fn row_data(&self, r: usize) -> &[u8] {
        debug_assert!(
            self.packed.is_none(),
            "stored row of packed {}",
            self.src.name()
        );
        &self.src.bytes()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }
    /// The rows the int8 kernels read: packed where `upload` packed them, else the mapping's.
    fn rows_bytes(&self) -> &[u8] {
        match &self.packed {
            Some(p) => &p[..self.rows * self.row_bytes],
            None => self.src.bytes(),
        }
    }
    /// The decoded values of a small weight.
    pub fn dense(&self) -> &[f32] {
        self.dense
            .as_deref()
            .expect("dense view of a matrix weight")
    }
    /// The decoded values of a small 2-D weight, transposed to `[ne0][rows]`.
    pub fn dense_t(&self) -> &[f32] {
        self.dense_t
            .as_deref()
            .expect("transposed view of a small 2-D weight")
    }
}

/// The attention cache of one layer, held in its dtypes: f32 rows as floats, f16/bf16/q8_0/
/// q4_0 rows as ggml's bytes. Attention dequantizes a tile of one head at a time, so a
/// quantized cache never exists as f32 (the planner prices it at its stored size).
pub struct Kv {
    k: KvStore,
    v: KvStore,
    width: usize,
    len: usize,
}

/// One cache (K or V) of `width`-wide rows.
enum KvStore {
    F32(Vec<f32>),
    Blocks {
        ty: GgmlType,
        data: Vec<u8>,
        row_bytes: usize,
    },
}

impl KvStore {
    fn new(ty: GgmlType, width: usize) -> KvStore {
        match ty {
            GgmlType::F32 => KvStore::F32(Vec::new()),
            _ => KvStore::Blocks {
                ty,
                data: Vec::new(),
                row_bytes: ty.row_bytes(width as u64).expect("checked by new_kv") as usize,
            },
        }
    }

    fn row_size(&self, width: usize) -> usize {
        match self {
            KvStore::F32(_) => width * 4,
            KvStore::Blocks { row_bytes, .. } => *row_bytes,
        }
    }

    fn bytes(&self) -> u64 {
        match self {
            KvStore::F32(d) => (d.capacity() * 4) as u64,
            KvStore::Blocks { data, .. } => data.capacity() as u64,
        }
    }

    /// Room for `rows` rows in all, allocated once (the slot's window at boot).
    fn reserve(&mut self, width: usize, rows: usize) {
        match self {
            KvStore::F32(d) => d.reserve_exact((rows * width).saturating_sub(d.len())),
            KvStore::Blocks {
                data, row_bytes, ..
            } => data.reserve_exact((rows * *row_bytes).saturating_sub(data.len())),
        }
    }

    fn truncate(&mut self, width: usize, rows: usize) {
        match self {
            KvStore::F32(d) => d.truncate(rows * width),
            KvStore::Blocks {
                data, row_bytes, ..
            } => data.truncate(rows * *row_bytes),
        }
    }

    /// Appends `src` (`[n][width]` f32), converted to the store's dtype.
    fn append(&mut self, src: &[f32], width: usize) {
        match self {
            KvStore::F32(d) => d.extend_from_slice(src),
            KvStore::Blocks {
                ty,
                data,
                row_bytes,
            } => {
                let rows: Vec<Vec<u8>> = src
                    .par_chunks(width)
                    .map(|r| quant::quantize_row(*ty, r).expect("cache row is whole blocks"))
                    .collect();
                for r in rows {
                    debug_assert_eq!(r.len(), *row_bytes);
                    data.extend_from_slice(&r);
                }
            }
        }
    }

    fn view(&self) -> attention::Rows<'_> {
        match self {
            KvStore::F32(d) => attention::Rows::F32(d),
            KvStore::Blocks {
                ty,
                data,
                row_bytes,
            } => attention::Rows::Blocks {
                ty: *ty,
                data,
                row_bytes: *row_bytes,
            },
        }
    }
}

#[derive(Clone)]
pub struct Recurrent {
    /// The last `d_conv - 1` raw conv inputs, oldest first, `[d_conv-1][conv_dim]`.
    pub conv: Vec<f32>,
    /// Per V head `S[i=k][j=v]`, v fastest.
    /// On cache lines: see [`Lines`].
    /// Without the rows of a verify batch still pending ([`Recurrent::settled_ssm`]).
    pub ssm: Lines<f32>,
    /// Rows of the last verify batch not folded into `ssm` yet (see [`gdn::Pending`]).
    pending: gdn::Pending,
}

/// Elements per rayon task in elementwise ops: below this a split costs more than it saves.
const ELEM_CHUNK: usize = 1 << 14;

/// Rows of `cols` per rayon task of a row-wise op, so that a task holds about `ELEM_CHUNK`
/// elements: a decode step of a few streams runs its norms, embeddings and folds inline (as
/// one stream's single row always did) instead of waking the pool for microseconds of work,
/// which from the engine thread costs tens of microseconds per region, several times a layer.
fn rows_per_task(cols: usize) -> usize {
    (ELEM_CHUNK / cols.max(1)).max(1)
}

/// A value and its index in a row.
type Found = (usize, f32);

/// `row`'s argmax (the first index of the largest value; NaN never wins) and its first
/// non-finite value, per chunk in parallel and then across the chunks in order (the CPU's
/// `argmax_rows` and `argmax_checked`).
fn scan_row(row: &[f32]) -> (u32, Option<Found>) {
    if row.is_empty() {
        return (0, None);
    }
    let first_max = |best: Found, (i, v): Found| if v > best.1 { (i, v) } else { best };
    let parts: Vec<(Found, Option<Found>)> = row
        .par_chunks(ELEM_CHUNK)
        .enumerate()
        .map(|(c, ch)| scan_chunk(ch, c * ELEM_CHUNK))
        .collect();
    let best = parts.iter().map(|p| p.0).fold((0, row[0]), first_max);
    (best.0 as u32, parts.iter().find_map(|p| p.1))
}

/// One chunk of `scan_row`, its first value at index `i0`. A finite chunk takes its largest
/// value lane-wise, then the first index holding it (the branchy first-max loop ran at about a
/// value a nanosecond, a third of a millisecond per logits row); a chunk with a non-finite
/// value takes that loop, where NaN never wins. Where the CPU has AVX-512 or AVX2 both passes
/// run in its registers (`x86_scan`): compiled for the baseline, the lane-wise pass ran at 8
/// GB/s from L2, 120-130 us for a 248,320-entry row, and a 3-stream decode step scans three.
fn scan_chunk(ch: &[f32], i0: usize) -> (Found, Option<Found>) {
    #[cfg(target_arch = "x86_64")]
    if let Some(r) = x86_scan::finite_max_at(ch) {
        return match r {
            Some((at, max)) => ((i0 + at, max), None),
            None => first_max_and_bad(ch, i0),
        };
    }
    const L: usize = 16;
    let (mut m, mut finite) = ([f32::NEG_INFINITY; L], [true; L]);
    let blocks = ch.chunks_exact(L);
    let tail = blocks.remainder();
    for b in blocks {
        for l in 0..L {
            m[l] = if b[l] > m[l] { b[l] } else { m[l] };
            finite[l] &= b[l].is_finite();
        }
    }
    let mut max = m.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
    let mut all_finite = finite.iter().all(|&f| f);
    for &v in tail {
        max = max.max(v);
        all_finite &= v.is_finite();
    }
    if !all_finite {
        return first_max_and_bad(ch, i0);
    }
    let at = ch
        .iter()
        .position(|&v| v == max)
        .expect("the max is in the chunk");
    ((i0 + at, ch[at]), None)
}

/// The first largest value of `ch` (NaN never wins) and its first non-finite value, one value
/// at a time: a chunk that holds a non-finite value.
fn first_max_and_bad(ch: &[f32], i0: usize) -> (Found, Option<Found>) {
    let mut best = (i0, ch[0]);
    let mut bad = None;
    for (i, &v) in (i0..).zip(ch) {
        if v > best.1 {
            best = (i, v);
        }
        if bad.is_none() && !v.is_finite() {
            bad = Some((i, v));
        }
    }
    (best, bad)
}

/// `scan_chunk`'s passes in AVX-512 or AVX2 registers.
#[cfg(target_arch = "x86_64")]
mod x86_scan {
    use std::arch::x86_64::*;

    /// `None` on a CPU without AVX2; else `Some(None)` when `ch` (not empty) holds a
    /// non-finite value, or `Some(Some((i, ch[i])))`: the first index holding its largest
    /// value (-0 and +0 compare equal, as in `scan_chunk`'s scalar pass).
    pub(super) fn finite_max_at(ch: &[f32]) -> Option<Option<(usize, f32)>> {
        if is_x86_feature_detected!("avx512f") {
            // SAFETY: the feature is present.
            return Some(unsafe { avx512(ch) });
        }
        if is_x86_feature_detected!("avx2") {
            // SAFETY: the feature is present.
            return Some(unsafe { avx2(ch) });
        }
        None
    }

    /// The largest of `max` and the tail's values, and whether the tail is finite too.
    fn tail_max(tail: &[f32], max: f32, finite: bool) -> (f32, bool) {
        tail.iter()
            .fold((max, finite), |(m, f), &v| (m.max(v), f && v.is_finite()))
    }

    /// The first index of `ch` holding `max`, and its value: `hit(i)` masks the lanes of the
    /// `lanes` values from `i` that equal `max`, then the tail one value at a time.
    #[inline(always)]
    fn first_at(
        ch: &[f32],
        lanes: usize,
        max: f32,
        hit: impl Fn(usize) -> u32,
    ) -> Option<(usize, f32)> {
        let full = ch.len() / lanes * lanes;
        let at = (0..full)
            .step_by(lanes)
            .find_map(|i| match hit(i) {
                0 => None,
                m => Some(i + m.trailing_zeros() as usize),
            })
            .or_else(|| Some(full + ch[full..].iter().position(|&v| v == max)?))?;
        Some((at, ch[at]))
    }

    /// # Safety
    /// AVX-512 F.
    #[target_feature(enable = "avx512f")]
    pub(super) unsafe fn avx512(ch: &[f32]) -> Option<(usize, f32)> {
        const L: usize = 16;
        let n = ch.len() / (4 * L) * (4 * L);
        let p = ch.as_ptr();
        let mut m = [_mm512_set1_ps(f32::NEG_INFINITY); 4];
        let mut ok: __mmask16 = 0xffff;
        for i in (0..n).step_by(4 * L) {
            for (k, mk) in m.iter_mut().enumerate() {
                let v = _mm512_loadu_ps(p.add(i + k * L));
                *mk = _mm512_max_ps(*mk, v);
                // v - v is 0 for a finite value, NaN for an infinity or NaN.
                let d = _mm512_sub_ps(v, v);
                ok &= _mm512_cmp_ps_mask::<_CMP_ORD_Q>(d, d);
            }
        }
        let m = _mm512_max_ps(_mm512_max_ps(m[0], m[1]), _mm512_max_ps(m[2], m[3]));
        let (max, finite) = tail_max(&ch[n..], _mm512_reduce_max_ps(m), ok == 0xffff);
        if !finite {
            return None;
        }
        let target = _mm512_set1_ps(max);
        first_at(ch, L, max, |i| {
            _mm512_cmp_ps_mask::<_CMP_EQ_OQ>(_mm512_loadu_ps(p.add(i)), target) as u32
        })
    }

    /// # Safety
    /// AVX2.
    #[target_feature(enable = "avx2")]
    pub(super) unsafe fn avx2(ch: &[f32]) -> Option<(usize, f32)> {
        const L: usize = 8;
        let n = ch.len() / (4 * L) * (4 * L);
        let p = ch.as_ptr();
        let mut m = [_mm256_set1_ps(f32::NEG_INFINITY); 4];
        let mut bad = _mm256_setzero_ps();
        for i in (0..n).step_by(4 * L) {
            for (k, mk) in m.iter_mut().enumerate() {
                let v = _mm256_loadu_ps(p.add(i + k * L));
                *mk = _mm256_max_ps(*mk, v);
                let d = _mm256_sub_ps(v, v);
                bad = _mm256_or_ps(bad, _mm256_cmp_ps::<_CMP_UNORD_Q>(d, d));
            }
        }
        let m = _mm256_max_ps(_mm256_max_ps(m[0], m[1]), _mm256_max_ps(m[2], m[3]));
        let mut lanes = [0f32; L];
        _mm256_storeu_ps(lanes.as_mut_ptr(), m);
        let head = lanes.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
        let (max, finite) = tail_max(&ch[n..], head, _mm256_movemask_ps(bad) == 0);
        if !finite {
            return None;
        }
        let target = _mm256_set1_ps(max);
        first_at(ch, L, max, |i| {
            let eq = _mm256_cmp_ps::<_CMP_EQ_OQ>(_mm256_loadu_ps(p.add(i)), target);
            _mm256_movemask_ps(eq) as u32
        })
    }
}

/// Token counts up to this go through the multi-token row kernels rather than `gemm`: below it,
/// dequantizing a tile costs more than decoding the blocks in registers once per token set.
const SMALL_BATCH: usize = 4;

/// Rows per rayon task in matvec: enough work per task to amortise the scheduling.
const ROW_CHUNK: usize = 32;

pub fn dot(a: &[f32], b: &[f32]) -> f32 {
    debug_assert_eq!(a.len(), b.len());
    let mut acc = [0f32; 8];
    let ca = a.chunks_exact(8);
    let cb = b.chunks_exact(8);
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    let mut s: f32 = acc.iter().sum();
    for (x, y) in ra.iter().zip(rb) {
        s += x * y;
    }
    s
}

fn rms_scale(x: &[f32], eps: f32) -> f32 {
    let mean = (math::sum_sq(x) / x.len() as f64) as f32;
    1.0 / (mean + eps).sqrt()
}

fn softplus(x: f32) -> f32 {
    if x > 20.0 {
        x
    } else {
        x.exp().ln_1p()
    }
}

/// Rotates the first `table.len()` dims of one head (`table` is one row of
/// `backend::rope_table`: `(sin, cos)` per pair, interleaved).
fn rope_apply(x: &mut [f32], table: &[f32]) {
    let half = table.len() / 2;
    for (i, sc) in table.chunks_exact(2).enumerate() {
        let (sin, cos) = (sc[0], sc[1]);
        let a = x[i];
        let b = x[i + half];
        x[i] = a * cos - b * sin;
        x[i + half] = a * sin + b * cos;
    }
}

/// What the f32 reference path's `upload` (`CpuBackend::new`) holds for `w`: the stored rows
/// read in place from the mapping, plus the f32 copies of a small weight (and its transpose
/// when it has several rows).
pub fn planned_weight_bytes(w: &WeightSource) -> super::WeightBytes {
    planned(w, false)
}

/// What the serving path's `upload` (`CpuBackend::int8`) holds for `w`: as
/// `planned_weight_bytes`, except a matrix `quant::packed` takes, held as its packed copy
/// (shared by the tensor's uses) instead of the mapping's bytes.
pub fn planned_weight_bytes_serving(w: &WeightSource) -> super::WeightBytes {
    planned(w, true)
}

fn planned(w: &WeightSource, pack: bool) -> super::WeightBytes {
    let (ne0, rows) = w.shape2();
    let f32s = (ne0 as u64).saturating_mul(rows as u64).saturating_mul(4);
    let owned = match (w.decode_once(), rows > 1) {
        (false, _) => 0,
        (true, false) => f32s,
        (true, true) => f32s.saturating_mul(2),
    };
    let packed = (pack && serving_layout(w).is_some())
        .then(|| quant::packed::packed_len(w.info.ty, ne0, w.info.nbytes as usize) as u64);
    super::WeightBytes {
        tensor: w.info.name.clone(),
        mapped: if packed.is_some() { 0 } else { w.info.nbytes },
        owned,
        shared: packed.unwrap_or(0),
    }
}

/// How the serving path copies `w` on this CPU, if at all: a matrix (not decoded to f32) as
/// `quant::packed::layout` takes it. `upload` and the planner both ask here.
fn serving_layout(w: &WeightSource) -> Option<Layout> {
    if w.decode_once() {
        None
    } else {
        quant::packed::layout(w.info.ty, w.shape2().0)
    }
}

impl Backend for CpuBackend {
    type T = Tensor;
    type W = Weight;
    type Kv = Kv;
    type Rs = Recurrent;

    fn name(&self) -> &'static str {
        "cpu"
    }

    fn run_step<R: Send>(f: impl FnOnce() -> R + Send) -> R {
        step::run(f)
    }

    fn upload(&self, w: &WeightSource) -> Result<Weight, BackendError> {
        let ty = w.info.ty;
        if !ty.can_compute() {
            return Err(BackendError::UnsupportedType {
                name: w.info.name.clone(),
                ty,
                backend: "cpu",
            });
        }
        let (ne0, rows) = w.shape2();
        let row_bytes = w.info.row_bytes() as usize;
        let dense = if w.decode_once() {
            Some(w.decoded()?)
        } else {
            None
        };
        let dense_t = dense.as_ref().filter(|_| rows > 1).map(|d| {
            (0..ne0)
                .flat_map(|i| (0..rows).map(move |r| d[r * ne0 + i]))
                .collect()
        });
        let layout = self.layout(w);
        let packed = layout.map(|l| self.packed_rows(w, l));
        // A copied matrix is read as its copy's type (PTQ1_0 as PQ2_0) by every int8 path.
        let (ty, row_bytes) = match packed {
            Some(_) => (
                quant::packed::packed_type(ty),
                quant::packed::packed_row_bytes(ty, ne0),
            ),
            None => (ty, row_bytes),
        };
        Ok(Weight {
            src: w.clone(),
            packed,
            layout,
            dense_t,
            ty,
            ne0,
            rows,
            row_bytes,
            dense,
            fold: w.fold.clone(),
            inverse: w.inverse.clone(),
        })
    }

    fn compute_bytes(&self) -> Option<u64> {
        None
    }

    fn weight_bytes(&self, w: &Weight) -> super::WeightBytes {
        let f32s = |v: &Option<Vec<f32>>| v.as_ref().map_or(0, |d| d.len() as u64 * 4);
        let packed = w.packed.as_ref().map_or(0, |p| p.len() as u64);
        super::WeightBytes {
            tensor: w.src.info.name.clone(),
            mapped: if packed > 0 {
                0
            } else {
                w.src.bytes().len() as u64
            },
            owned: f32s(&w.dense) + f32s(&w.dense_t),
            shared: packed,
        }
    }

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Tensor {
        assert_eq!(data.len(), rows * cols);
        Tensor {
            data: data.to_vec(),
            rows,
            cols,
        }
    }

    fn to_host(&self, t: &Tensor) -> Vec<f32> {
        t.data.clone()
    }

    fn rows(&self, t: &Tensor, start: usize, n: usize) -> Tensor {
        Tensor {
            data: t.data[start * t.cols..(start + n) * t.cols].to_vec(),
            rows: n,
            cols: t.cols,
        }
    }

    fn concat_cols(&self, a: &Tensor, b: &Tensor) -> Tensor {
        assert_eq!(a.rows, b.rows);
        let mut out = Tensor::zeros(a.rows, a.cols + b.cols);
        for r in 0..a.rows {
            let o = &mut out.data[r * (a.cols + b.cols)..(r + 1) * (a.cols + b.cols)];
            o[..a.cols].copy_from_slice(a.row(r));
            o[a.cols..].copy_from_slice(b.row(r));
        }
        out
    }

    fn concat_rows(&self, parts: &[&Tensor]) -> Tensor {
        let cols = parts[0].cols;
        let mut data = Vec::with_capacity(parts.iter().map(|p| p.data.len()).sum());
        for p in parts {
            assert_eq!(p.cols, cols, "concat_rows: column counts differ");
            data.extend_from_slice(&p.data);
        }
        let rows = data.len() / cols.max(1);
        Tensor { data, rows, cols }
    }

    fn embed(&self, table: &Weight, ids: &[u32]) -> Tensor {
        let mut out = Tensor::zeros(ids.len(), table.ne0);
        out.data
            .par_chunks_mut(table.ne0)
            .zip(ids.par_iter())
            .with_min_len(rows_per_task(table.ne0))
            .for_each_init(Vec::new, |stored, (row, &id)| {
                assert!(
                    (id as usize) < table.rows,
                    "token id {id} outside the {} rows",
                    table.rows
                );
                let r = id as usize;
                let bytes = match table.layout {
                    Some(Layout::Transcoded) => {
                        &table.rows_bytes()[r * table.row_bytes..][..table.row_bytes]
                    }
                    Some(Layout::Packed) => {
                        stored.resize(table.row_bytes, 0);
                        let p = &table.rows_bytes()[r * table.row_bytes..][..table.row_bytes];
                        quant::packed::unpack_row(table.ty, p, table.ne0, stored);
                        &stored[..]
                    }
                    None => table.row_data(r),
                };
                quant::dequantize_row(table.ty, bytes, row).expect("row length validated at load");
                if let Some(h) = &table.inverse {
                    h.inverse_in_place(row);
                }
            });
        out
    }

    fn rms_norm(&self, x: &Tensor, w: &Weight, eps: f32) -> Tensor {
        let w = w.dense();
        assert_eq!(w.len(), x.cols);
        let mut out = x.clone();
        let per_task = rows_per_task(x.cols);
        out.data
            .par_chunks_mut(x.cols)
            .with_min_len(per_task)
            .for_each(|row| {
                let s = rms_scale(row, eps);
                row.iter_mut().zip(w).for_each(|(v, &g)| *v = *v * s * g);
            });
        out
    }

    fn matmul(&self, w: &Weight, x: &Tensor) -> Tensor {
        assert_eq!(x.cols, w.ne0, "matmul {}: input width", w.src.name());
        match &w.fold {
            None => product(w, &x.data, self.int8),
            Some(fold) => product(w, &folded_input(fold, x), self.int8),
        }
    }

    fn matmul_many(&self, ws: &[&Weight], x: &Tensor) -> Vec<Tensor> {
        // Each weight's input: `x`, or `x` through its fold (computed once per distinct fold).
        let mut folded: Vec<(&Fold, Vec<f32>)> = Vec::new();
        let input: Vec<Option<usize>> = ws
            .iter()
            .map(|w| {
                assert_eq!(x.cols, w.ne0, "matmul {}: input width", w.src.name());
                let f = w.fold.as_ref()?;
                Some(match folded.iter().position(|(g, _)| same_fold(g, f)) {
                    Some(i) => i,
                    None => {
                        folded.push((f, folded_input(f, x)));
                        folded.len() - 1
                    }
                })
            })
            .collect();
        let data = |i: Option<usize>| i.map_or(&x.data[..], |i| &folded[i].1[..]);
        if !ws.iter().all(|w| takes_row_kernels(w, x.rows, self.int8)) {
            return ws
                .iter()
                .zip(&input)
                .map(|(w, &i)| product(w, data(i), self.int8))
                .collect();
        }
        // The activations quantized once per input and weight type, then one parallel region.
        let mut acts: Vec<(Option<usize>, GgmlType, quant::int8::QActs)> = Vec::new();
        let which: Vec<usize> = ws
            .iter()
            .zip(&input)
            .map(|(w, &i)| {
                acts.iter()
                    .position(|a| a.0 == i && a.1 == w.ty)
                    .unwrap_or_else(|| {
                        let a = quant::int8::QActs::quantize(w.ty, data(i), x.cols);
                        acts.push((i, w.ty, a));
                        acts.len() - 1
                    })
            })
            .collect();
        let mut outs: Vec<Tensor> = ws.iter().map(|w| Tensor::zeros(x.rows, w.rows)).collect();
        let mut jobs: Vec<_> = ws
            .iter()
            .zip(&which)
            .zip(outs.iter_mut())
            .map(|((w, &a), out)| (*w, &acts[a].2, out))
            .collect();
        products_int8_rows(&mut jobs);
        outs
    }

    fn gather_rows(&self, t: &Tensor, runs: &[(usize, usize)]) -> Tensor {
        let rows: usize = runs.iter().map(|r| r.1).sum();
        let mut data = Vec::with_capacity(rows * t.cols);
        for &(start, n) in runs {
            assert!(
                start + n <= t.rows,
                "rows {start}..{} of {}",
                start + n,
                t.rows
            );
            data.extend_from_slice(&t.data[start * t.cols..(start + n) * t.cols]);
        }
        Tensor {
            data,
            rows,
            cols: t.cols,
        }
    }

    fn add_assign(&self, x: &mut Tensor, y: &Tensor) {
        assert_eq!(x.data.len(), y.data.len());
        x.data
            .par_chunks_mut(ELEM_CHUNK)
            .zip(y.data.par_chunks(ELEM_CHUNK))
            .for_each(|(x, y)| x.iter_mut().zip(y).for_each(|(a, &b)| *a += b));
    }

    fn add_scaled_rows(&self, y: &mut Tensor, x: &Tensor, scales: &[f32]) {
        assert_eq!(
            (y.rows, y.cols),
            (x.rows, x.cols),
            "add_scaled_rows: shapes"
        );
        assert_eq!(scales.len(), y.rows, "add_scaled_rows: one scale per row");
        let cols = y.cols.max(1);
        y.data
            .par_chunks_mut(cols)
            .zip(x.data.par_chunks(cols))
            .zip(scales.par_iter())
            .for_each(|((y, x), &s)| y.iter_mut().zip(x).for_each(|(a, &b)| *a += s * b));
    }

    fn swiglu(&self, gate: &Tensor, up: &Tensor) -> Tensor {
        assert_eq!(gate.data.len(), up.data.len());
        let mut out = Tensor::zeros(gate.rows, gate.cols);
        out.data
            .par_chunks_mut(ELEM_CHUNK)
            .zip(gate.data.par_chunks(ELEM_CHUNK))
            .zip(up.data.par_chunks(ELEM_CHUNK))
            .for_each(|((o, g), u)| math::swiglu(o, g, u));
        out
    }

    fn new_kv(&self, p: &AttnParams, types: KvTypes) -> Result<Kv, BackendError> {
        types.check()?;
        let width = p.n_head_kv * p.head_dim;
        for t in [types.k, types.v] {
            if !width.is_multiple_of(t.block_size()) {
                return Err(BackendError::BadWeight {
                    name: "KV cache".into(),
                    what: format!("row width {width} is not a multiple of the {t} block size"),
                });
            }
        }
        Ok(Kv {
            k: KvStore::new(types.k, width),
            v: KvStore::new(types.v, width),
            width,
            len: 0,
        })
    }

    fn kv_len(&self, kv: &Kv) -> usize {
        kv.len
    }

    fn kv_bytes(&self, kv: &Kv) -> u64 {
        kv.k.bytes() + kv.v.bytes()
    }

    fn kv_reserve(&self, kv: &mut Kv, positions: usize) -> Result<(), BackendError> {
        for (which, c) in [("K", &mut kv.k), ("V", &mut kv.v)] {
            let bytes = positions.checked_mul(c.row_size(kv.width));
            if bytes.is_none_or(|b| b > isize::MAX as usize) {
                return Err(BackendError::BadWeight {
                    name: format!("{which} cache"),
                    what: format!("{positions} positions do not fit in memory"),
                });
            }
            c.reserve(kv.width, positions);
        }
        Ok(())
    }

    fn recurrent_bytes(&self, rs: &Recurrent) -> u64 {
        ((rs.conv.len() + rs.ssm.len()) * 4) as u64
    }

    fn kv_copy(&self, from: &Kv, to: &mut Kv) {
        assert_eq!(from.width, to.width, "kv_copy: geometry");
        for (a, b) in [(&from.k, &mut to.k), (&from.v, &mut to.v)] {
            match (a, b) {
                (KvStore::F32(x), KvStore::F32(y)) => {
                    y.clear();
                    y.extend_from_slice(x);
                }
                (KvStore::Blocks { data: x, .. }, KvStore::Blocks { data: y, .. }) => {
                    y.clear();
                    y.extend_from_slice(x);
                }
                _ => panic!("kv_copy: the caches have different dtypes"),
            }
        }
        to.len = from.len;
    }

    fn kv_truncate(&self, kv: &mut Kv, len: usize) {
        if len < kv.len {
            kv.k.truncate(kv.width, len);
            kv.v.truncate(kv.width, len);
            kv.len = len;
        }
    }

    fn attention(
        &self,
        p: &AttnParams,
        qg: &Tensor,
        k: &Tensor,
        v: &Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        kv: &mut Kv,
        pos0: usize,
        rope_all: &[f32],
    ) -> Tensor {
        let mut seq = [AttnSeq {
            rows: qg.rows,
            kv,
            pos0,
            rope: rope_all,
        }];
        self.attention_batch(p, qg, k, v, q_norm, k_norm, &mut seq)
    }

    /// Each sequence's queries, gates and keys prepared and its rows appended to its cache, then
    /// one [`attention::attend_many`] over all of them.
    fn attention_batch(
        &self,
        p: &AttnParams,
        qg: &Tensor,
        k: &Tensor,
        v: &Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        seqs: &mut [AttnSeq<'_, Kv>],
    ) -> Tensor {
        let hd = p.head_dim;
        assert_eq!(qg.cols, 2 * p.n_head * hd);
        assert_eq!(k.cols, p.n_head_kv * hd);
        assert_eq!(
            seqs.iter().map(|s| s.rows).sum::<usize>(),
            qg.rows,
            "attention: rows of the sequences"
        );
        let (qn, kn) = (q_norm.dense(), k_norm.dense());
        let nh = p.n_head;
        let mut prepared = Vec::with_capacity(seqs.len());
        let mut at = 0;
        for s in seqs.iter_mut() {
            let (kv, n_tok, pos0) = (&mut *s.kv, s.rows, s.pos0);
            assert_eq!(
                self.kv_len(kv),
                pos0,
                "attention: cache holds {} positions, batch starts at {pos0}",
                self.kv_len(kv)
            );
            let width = kv.width;
            // Per token: queries and gates split, q and k normed and rotated.
            let mut q = vec![0f32; n_tok * nh * hd];
            let mut gate = vec![0f32; n_tok * nh * hd];
            let mut k_new = vec![0f32; n_tok * width];
            assert_eq!(s.rope.len(), n_tok * p.n_rot, "attention: rope table size");
            let rope_all = s.rope;
            q.par_chunks_mut(nh * hd)
                .zip(gate.par_chunks_mut(nh * hd))
                .zip(k_new.par_chunks_mut(width))
                .enumerate()
                .for_each(|(t, ((qt, gt), kt))| {
                    let rope = &rope_all[t * p.n_rot..(t + 1) * p.n_rot];
                    for h in 0..nh {
                        let src = &qg.row(at + t)[h * 2 * hd..(h + 1) * 2 * hd];
                        let dq = &mut qt[h * hd..(h + 1) * hd];
                        let s = rms_scale(&src[..hd], p.eps);
                        for i in 0..hd {
                            dq[i] = src[i] * s * qn[i];
                        }
                        rope_apply(dq, rope);
                        gt[h * hd..(h + 1) * hd].copy_from_slice(&src[hd..]);
                    }
                    for (src, dk) in k.row(at + t).chunks_exact(hd).zip(kt.chunks_exact_mut(hd)) {
                        let s = rms_scale(src, p.eps);
                        for i in 0..hd {
                            dk[i] = src[i] * s * kn[i];
                        }
                        rope_apply(dk, rope);
                    }
                });
            kv.k.append(&k_new, width);
            kv.v.append(&v.data[at * width..(at + n_tok) * width], width);
            kv.len += n_tok;
            at += n_tok;
            prepared.push((q, gate));
        }
        let items: Vec<attention::Seq<'_>> = seqs
            .iter()
            .zip(&prepared)
            .map(|(s, (q, gate))| attention::Seq {
                q,
                gate,
                kc: s.kv.k.view(),
                vc: s.kv.v.view(),
                pos0: s.pos0,
                n_tok: s.rows,
            })
            .collect();
        attention::attend_many(p, k.cols, &items)
    }

    fn new_recurrent(&self, p: &GdnParams) -> Recurrent {
        Recurrent {
            conv: vec![0.0; p.conv_state_len()],
            ssm: Lines::zeroed(p.ssm_state_len()),
            pending: gdn::Pending::default(),
        }
    }

    fn recurrent_copy(&self, from: &Recurrent, to: &mut Recurrent) {
        to.conv.copy_from_slice(&from.conv);
        to.ssm.copy_from_slice(&from.ssm);
        to.pending.clone_from(&from.pending);
    }

    fn recurrent_restore(&self, live: &mut Recurrent, cell: &mut Recurrent) {
        live.restore(cell)
    }

    fn gdn(
        &self,
        p: &GdnParams,
        mixed: &Tensor,
        z: &Tensor,
        b: &Tensor,
        a: &Tensor,
        w: &GdnWeights<'_, Weight>,
        st: &mut Recurrent,
    ) -> Tensor {
        gdn::gdn(p, mixed, z, b, a, &gdn_weights(w), st)
    }

    fn gdn_batch(
        &self,
        p: &GdnParams,
        mixed: &Tensor,
        z: &Tensor,
        b: &Tensor,
        a: &Tensor,
        w: &GdnWeights<'_, Weight>,
        seqs: &mut [super::GdnSeq<'_, Recurrent>],
    ) -> Tensor {
        gdn::gdn_batch(p, mixed, z, b, a, &gdn_weights(w), seqs)
    }

    fn argmax_rows(&self, x: &Tensor) -> Vec<u32> {
        (0..x.rows).map(|r| scan_row(x.row(r)).0).collect()
    }

    fn argmax_checked(&self, x: &Tensor, row: usize) -> Option<(u32, Option<(usize, f32)>)> {
        Some(scan_row(x.row(row)))
    }

    fn split_rows(&self, mut t: Tensor, counts: &[usize]) -> Vec<Tensor> {
        assert_eq!(
            counts.iter().sum::<usize>(),
            t.rows,
            "split_rows: row counts"
        );
        // From the last run back, so the first keeps the buffer without a copy.
        let mut parts = Vec::with_capacity(counts.len());
        for &n in counts.iter().skip(1).rev() {
            let data = t.data.split_off((t.rows - n) * t.cols);
            t.rows -= n;
            parts.push(Tensor {
                data,
                rows: n,
                cols: t.cols,
            });
        }
        parts.push(t);
        parts.reverse();
        parts
    }

    fn layer_norm(&self, x: &Tensor, w: &Weight, b: &Weight, eps: f32) -> Tensor {
        let (w, b) = (w.dense(), b.dense());
        assert_eq!(w.len(), x.cols, "layer_norm: weight width");
        assert_eq!(b.len(), x.cols, "layer_norm: bias width");
        let mut out = x.clone();
        let n = x.cols as f32;
        out.data.par_chunks_mut(x.cols.max(1)).for_each(|row| {
            // ggml_norm: the sum in f64 rounded to f32, then the mean in f32; the squares of
            // the centred values summed in f64 and divided there.
            let mean = row.iter().map(|&v| v as f64).sum::<f64>() as f32 / n;
            let mut var = 0f64;
            for v in row.iter_mut() {
                *v -= mean;
                var += (*v * *v) as f64;
            }
            let scale = 1.0 / ((var / row.len() as f64) as f32 + eps).sqrt();
            row.iter_mut()
                .zip(w)
                .zip(b)
                .for_each(|((v, &g), &c)| *v = *v * scale * g + c);
        });
        out
    }

    fn add_bias(&self, x: &mut Tensor, b: &Weight) {
        let b = b.dense();
        assert_eq!(b.len(), x.cols, "add_bias: width");
        x.data
            .par_chunks_mut(x.cols.max(1))
            .for_each(|row| row.iter_mut().zip(b).for_each(|(v, &c)| *v += c));
    }

    fn gelu(&self, x: &Tensor) -> Tensor {
        let mut out = x.clone();
        out.data
            .par_chunks_mut(ELEM_CHUNK)
            .for_each(|c| c.iter_mut().for_each(|v| *v = super::gelu_ggml(*v)));
        out
    }

    fn reshape(&self, t: Tensor, rows: usize, cols: usize) -> Tensor {
        assert_eq!(
            rows * cols,
            t.data.len(),
            "reshape of [{}, {}] to [{rows}, {cols}]",
            t.rows,
            t.cols
        );
        Tensor {
            data: t.data,
            rows,
            cols,
        }
    }

    fn vision_attention(&self, qkv: &Tensor, n_head: usize, hd: usize, rope: &[f32]) -> Tensor {
        let (n, width) = (qkv.rows, n_head * hd);
        super::check_vision_attention(qkv.cols, n, n_head, hd, rope.len());
        // q and k rotated, `[n][n_head * hd]` each.
        let mut q = vec![0f32; n * width];
        let mut k = vec![0f32; n * width];
        q.par_chunks_mut(width.max(1))
            .zip(k.par_chunks_mut(width.max(1)))
            .enumerate()
            .for_each(|(t, (qt, kt))| {
                let row = qkv.row(t);
                let table = &rope[t * hd..(t + 1) * hd];
                qt.copy_from_slice(&row[..width]);
                kt.copy_from_slice(&row[width..2 * width]);
                for (qh, kh) in qt.chunks_exact_mut(hd).zip(kt.chunks_exact_mut(hd)) {
                    rope_apply(qh, table);
                    rope_apply(kh, table);
                }
            });
        attention::attend_full(&q, &k, &qkv.data[2 * width..], 3 * width, n, n_head, hd)
    }
}

/// The GDN core's dense views of a layer's small weights.
fn gdn_weights<'a>(w: &'a GdnWeights<'_, Weight>) -> gdn::Weights<'a> {
    gdn::Weights {
        conv_taps: w.conv.dense_t(),
        dt_bias: w.dt_bias.dense(),
        ssm_a: w.ssm_a.dense(),
        norm: w.norm.dense(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Values in [-1, 1) from an xorshift generator: the same sequence for the same seed. The
    /// CPU backend's tests share it (`attention`'s too).
    pub(super) fn uniform(mut seed: u64) -> impl FnMut() -> f32 {
        move || {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed >> 40) as f32 / (1u64 << 23) as f32 - 1.0
        }
    }

    /// `w` (`rows` rows of `k`) quantized to `ty` as the one tensor, `m.weight`, of a GGUF in
    /// memory.
    fn one_matrix(ty: GgmlType, k: usize, rows: usize, w: &[f32]) -> WeightSource {
        use crate::gguf::{Gguf, GgufWriter};
        let mut gw = GgufWriter::new();
        gw.add_tensor(
            "m.weight",
            &[k as u64, rows as u64],
            ty,
            quant::quantize_row(ty, w).unwrap(),
        );
        let g = Arc::new(Gguf::from_bytes("matrix.gguf", gw.to_bytes()).unwrap());
        WeightSource {
            info: g.tensor("m.weight").unwrap().clone(),
            file: g,
            fold: None,
            inverse: None,
        }
    }

    /// Where the CPU has the packed Q8_0 kernel, the serving path packs a matrix once however
    /// many weights use it (the tied head beside the embedding table, the draft head's first
    /// rows), the planner prices that copy once at its largest use, and the f32 reference path
    /// keeps reading the mapping.
    #[test]
    fn serving_path_packs_a_tensor_once_for_all_its_uses() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-q8_0.gguf");
        let g = Arc::new(crate::gguf::Gguf::open(&path).unwrap());
        let info = g.tensor("token_embd.weight").unwrap().clone();
        let src = WeightSource {
            file: g.clone(),
            info: info.clone(),
            fold: None,
            inverse: None,
        };
        let (ne0, rows) = src.shape2();
        if !quant::packed::packs(GgmlType::Q8_0, ne0) {
            eprintln!("this CPU has no packed kernel: nothing is packed");
            return;
        }
        let mut head = src.clone();
        head.info.nbytes = info.nbytes / rows as u64 * 10;
        head.info.dims[1] = 10;
        let be = CpuBackend::int8();
        let (a, b, h) = (
            be.upload(&src).unwrap(),
            be.upload(&src).unwrap(),
            be.upload(&head).unwrap(),
        );
        let (pa, pb, ph) = (
            a.packed.as_ref().unwrap(),
            b.packed.as_ref().unwrap(),
            h.packed.as_ref().unwrap(),
        );
        assert!(Arc::ptr_eq(pa, pb) && Arc::ptr_eq(pa, ph));
        assert_eq!(h.rows_bytes().len(), 10 * h.row_bytes);
        let mut t = crate::backend::WeightTally::default();
        let mut planned = crate::backend::WeightTally::default();
        for (w, s) in [(&a, &src), (&b, &src), (&h, &head)] {
            t.add(be.weight_bytes(w));
            planned.add(planned_weight_bytes_serving(s));
        }
        // The head reports the copy it reads, the whole table's; the planner prices its own
        // rows, and both tallies keep the largest.
        assert_eq!(be.weight_bytes(&a), planned_weight_bytes_serving(&src));
        assert_eq!(be.weight_bytes(&h).shared, info.nbytes);
        assert_eq!(
            (t.mapped, t.shared, t.total()),
            (0, info.nbytes, info.nbytes)
        );
        assert_eq!(planned.total(), t.total());
        // The reference path reads the file in place.
        let exact = CpuBackend::new().upload(&src).unwrap();
        assert!(exact.packed.is_none());
        assert_eq!(planned_weight_bytes(&src).mapped, info.nbytes);
    }

    /// A PTQ1_0 matrix on the serving path is copied as PQ2_0 blocks of the same values:
    /// packed where the CPU has the packed kernels, else transcoded to stored PQ2_0 rows
    /// (`int8_transcoded` lays it out so on any x86 CPU). Its products (one token row, three,
    /// and a prefill through the tiled kernel) agree with the PTQ1_0 kernels on the stored rows
    /// to f32 rounding, since both sum the same integer products of the same activation levels;
    /// its embedding rows are the stored rows' values; and the planner prices the 34-byte
    /// blocks the backend holds in place of the file's 28.
    #[test]
    fn serving_path_copies_ptq1_0_as_pq2_0_blocks() {
        let (k, rows) = (1024usize, 40usize);
        let mut rnd = uniform(0x9e37_79b9);
        let w: Vec<f32> = (0..k * rows).map(|_| rnd()).collect();
        let src = one_matrix(GgmlType::PTQ1_0, k, rows, &w);
        let stored = CpuBackend::int8_unpacked().upload(&src).unwrap();
        assert_eq!(
            (stored.ty, stored.row_bytes, stored.layout),
            (GgmlType::PTQ1_0, k / 128 * 28, None)
        );
        let native = quant::packed::layout(GgmlType::PTQ1_0, k);
        if cfg!(target_arch = "x86_64") {
            assert!(native.is_some(), "x86 copies PTQ1_0 one way or the other");
        }
        let mut backends = vec![(CpuBackend::int8_transcoded(), Some(Layout::Transcoded))];
        if native.is_some() {
            backends.push((CpuBackend::int8(), native));
        }
        let ids: Vec<u32> = (0..rows as u32).rev().collect();
        let want_rows = CpuBackend::int8_unpacked().embed(&stored, &ids);
        for (be, layout) in backends {
            let copied = be.upload(&src).unwrap();
            assert_eq!(
                (copied.ty, copied.row_bytes, copied.layout),
                (GgmlType::PQ2_0, k / 128 * 34, layout)
            );
            for n_tok in [1, 3, 40] {
                let x: Vec<f32> = (0..n_tok * k).map(|_| rnd()).collect();
                let (a, b) = (product(&copied, &x, true), product(&stored, &x, true));
                // Terms of magnitude up to |x| |w| ~ 1 over 1,024 columns: f32 sums of the
                // same integer products in another order differ by a few ulps of the partial
                // sums.
                for (i, (p, q)) in a.data.iter().zip(&b.data).enumerate() {
                    assert!(
                        (p - q).abs() <= 1e-4,
                        "{layout:?}, {n_tok} rows, output {i}: {p} against {q}"
                    );
                }
            }
            assert!(
                be.embed(&copied, &ids).data == want_rows.data,
                "{layout:?}: embedding rows"
            );
            let held = be.weight_bytes(&copied);
            assert_eq!(
                (held.mapped, held.shared),
                (0, (rows * k / 128 * 34) as u64)
            );
            // The planner prices this CPU's own layout, which holds the same bytes.
            assert_eq!(held, planned_weight_bytes_serving(&src));
        }
    }

    /// Several token rows through the row kernels (a three-stream step, a verify batch, past
    /// `MAX_ROWS`) give each row the bits of its own one-row product, packed or stored, in tasks
    /// of more than `OUT_ROWS` weight rows with a tail: the results are laid out `OUT_ROWS` rows
    /// at a time.
    #[test]
    fn row_kernels_lay_out_several_token_rows_as_their_one_row_products() {
        // Two threads, as CI's machine: tasks of about a quarter of a thread's rows.
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads(2)
            .build()
            .unwrap();
        let (k, rows) = (1024usize, 8 * OUT_ROWS + 37);
        let mut rnd = uniform(0x2545_f491);
        let x: Vec<f32> = (0..5 * k).map(|_| rnd()).collect();
        for ty in [GgmlType::Q8_0, GgmlType::PQ2_0] {
            let w: Vec<f32> = (0..k * rows).map(|_| rnd()).collect();
            let src = one_matrix(ty, k, rows, &w);
            for be in [CpuBackend::int8(), CpuBackend::int8_unpacked()] {
                let m = be.upload(&src).unwrap();
                pool.install(|| {
                    assert!(int8_row_chunk(m.row_bytes, rows) > OUT_ROWS);
                    let bits = |v: &[f32]| v.iter().map(|f| f.to_bits()).collect::<Vec<u32>>();
                    let one: Vec<Vec<u32>> = x
                        .chunks_exact(k)
                        .map(|x| bits(&product(&m, x, true).data))
                        .collect();
                    for n_tok in 2..=5 {
                        let p = product(&m, &x[..n_tok * k], true);
                        for (t, got) in p.data.chunks_exact(rows).enumerate() {
                            assert!(
                                bits(got) == one[t],
                                "{ty} {:?}: token row {t} of {n_tok}",
                                m.layout
                            );
                        }
                    }
                });
            }
        }
    }

    /// The AVX-512 and AVX2 scans give the scalar pass's answer: the largest value and the
    /// first index holding it (ties, -0 beside +0, the maximum in a loop's tail), or no answer
    /// when the chunk holds an infinity or a NaN, at any length around the unrolled loops'.
    #[cfg(target_arch = "x86_64")]
    #[test]
    fn x86_scans_match_the_scalar_pass() {
        let scalar = |ch: &[f32]| -> Option<(usize, f32)> {
            if ch.iter().any(|v| !v.is_finite()) {
                return None;
            }
            let m = ch.iter().fold(f32::NEG_INFINITY, |a, &v| a.max(v));
            let at = ch.iter().position(|&v| v == m)?;
            Some((at, ch[at]))
        };
        let mut seed = 7u64;
        let mut next = move || {
            seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            (seed >> 33) as usize
        };
        let mut cases: Vec<Vec<f32>> = Vec::new();
        for n in (1..=70).chain([127, 128, 129, 255, 300, 16_384, 16_385]) {
            // Few levels, so that ties are common.
            let x: Vec<f32> = (0..n).map(|_| (next() % 9) as f32 * 0.5 - 3.0).collect();
            cases.push(x.clone());
            // The maximum only in the tail, after every full block.
            let mut t = x.clone();
            t[n - 1] = 7.0;
            cases.push(t);
            // -0 first, then +0, as the largest.
            let mut z = vec![-1.0f32; n];
            z[n / 3] = -0.0;
            z[n - 1] = 0.0;
            cases.push(z);
            for bad in [f32::NAN, f32::INFINITY, f32::NEG_INFINITY] {
                let mut b = x.clone();
                b[next() % n] = bad;
                cases.push(b);
            }
        }
        for ch in &cases {
            let want = scalar(ch);
            let bits = |r: Option<(usize, f32)>| r.map(|(i, v)| (i, v.to_bits()));
            if is_x86_feature_detected!("avx2") {
                // SAFETY: the feature is present.
                let got = unsafe { x86_scan::avx2(ch) };
                assert_eq!(bits(got), bits(want), "avx2, {} values", ch.len());
            }
            if is_x86_feature_detected!("avx512f") {
                // SAFETY: the feature is present.
                let got = unsafe { x86_scan::avx512(ch) };
                assert_eq!(bits(got), bits(want), "avx512, {} values", ch.len());
            }
        }
    }

    /// The small-batch path's kernels give each token exactly its one-token `dot_row`, so a
    /// sequence decoded in a batch or alone computes the same numbers.
    #[test]
    fn multi_token_rows_match_dot_row_bit_for_bit() {
        use GgmlType::*;
        let k = 512;
        let vals = |n: usize, a: usize| -> Vec<f32> {
            (0..n)
                .map(|i| ((i * a) % 1001) as f32 / 500.0 - 1.0)
                .collect()
        };
        let xs: Vec<Vec<f32>> = (0..4).map(|t| vals(k, 37 + 14 * t)).collect();
        for ty in [F32, F16, BF16, Q8_0, Q4_0, PQ2_0, PTQ1_0] {
            let row = quant::quantize_row(ty, &vals(k, 53)).unwrap();
            let one: Vec<u32> = xs
                .iter()
                .map(|x| quant::dot_row(ty, &row, x).to_bits())
                .collect();
            let (a, b, c, d) = (&xs[0][..], &xs[1][..], &xs[2][..], &xs[3][..]);
            let two = quant::dot_rows(ty, &row, [a, b]).map(f32::to_bits);
            let three = quant::dot_rows(ty, &row, [a, b, c]).map(f32::to_bits);
            let four = quant::dot_rows(ty, &row, [a, b, c, d]).map(f32::to_bits);
            assert_eq!(two[..], one[..2], "{ty}");
            assert_eq!(three[..], one[..3], "{ty}");
            assert_eq!(four[..], one[..], "{ty}");
        }
    }
}
