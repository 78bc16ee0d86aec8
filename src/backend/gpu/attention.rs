//! Gated attention over the KV cache, argmax and top-k.
//!
//! One `attention` call queues four kinds of launch:
//! 1. `attn_prep`: per (token, head), q/k RMSNorm times their weights and partial NEOX RoPE
//!    (IMROPE sectors, the caller's (sin, cos) table from `backend::rope_table_at`); q to a scratch
//!    `[rows, n_head*hd]`, k to a scratch `[rows, width]`.
//! 2. `kv_store` (twice): the k scratch and the raw v rows into the cache at `pos0..`, in the
//!    cache dtype, as ggml blocks.
//! 3. `attn_split`: per (tile of R query vectors sharing a kv head, kv head, chunk of
//!    positions), online softmax over the chunk with K/V dequantized in the kernel, each cache
//!    element read once for the R queries (the GQA group in decode, several tokens in
//!    prefill); writes (max, sum, o) partials per query and chunk.
//! 4. `attn_combine`: per (row, query head), merges the chunks and applies the sigmoid gate.
//!
//! Chunking splits long caches across workgroups in decode (split-K), and collapses to one
//! chunk when a prefill batch already gives enough workgroups.
//!
//! The cache buffers are allocations of their own at their exact size, outside the activation
//! pool (they live as long as the sequence); the engine reserves a slot's window at boot, and
//! a cache used beyond what it holds grows by doubling, copying the rows it holds.

use super::kernels::consts::{INITIAL_CAPACITY, MAX_Q, MAX_R, TOPK_MAX, TOPK_SEGMENT};
use super::kernels::{cache_code, Kernel};
use super::plan::{check_attention, check_kv, kv_row_words, plan_chunks};
use super::{u32_of, Device, GpuBackend, Grid, PBuf, Scalar, Tensor, View, Weight};
use crate::backend::{AttnParams, BackendError, KvTypes};
use crate::tensor::GgmlType;

/// K or V of one layer's cache: rows of `width` elements as ggml rows of `ty`, each padded to
/// `row_words` u32 words.
pub struct KvBuf<M> {
    pub mem: M,
    pub ty: GgmlType,
    pub row_words: usize,
}

impl<M> KvBuf<M> {
    fn view(&self, capacity: usize) -> View<'_, M> {
        View {
            mem: &self.mem,
            offset: 0,
            len: (capacity * self.row_words * 4).max(4) as u64,
        }
    }
}

/// One layer's attention cache on the device. Positions `>= len` are stale (truncated) and are
/// overwritten by the next append.
pub struct Kv<D: Device> {
    pub len: usize,
    /// Positions the buffers hold.
    pub capacity: usize,
    pub width: usize,
    pub k: KvBuf<D::Mem>,
    pub v: KvBuf<D::Mem>,
}

impl<D: Device> Kv<D> {
    /// Bytes of one stored row of K and of V.
    pub fn row_bytes(&self) -> (usize, usize) {
        (self.k.row_words * 4, self.v.row_words * 4)
    }
}

/// Most positions a cache can hold: one binding of K or V must fit the device's limit.
fn max_capacity<D: Device>(be: &GpuBackend<D>, kv: &Kv<D>) -> usize {
    let limit = be.dev.caps().max_binding.min(usize::MAX as u64) as usize;
    limit / (kv.k.row_words.max(kv.v.row_words) * 4)
}

fn alloc_rows<D: Device>(
    be: &GpuBackend<D>,
    which: &str,
    row_words: usize,
    capacity: usize,
) -> Result<D::Mem, BackendError> {
    let bytes = capacity
        .checked_mul(row_words * 4)
        .ok_or_else(|| BackendError::BadWeight {
            name: format!("{which} cache"),
            what: format!("{capacity} positions do not fit in memory"),
        })?;
    be.dev.alloc(bytes.max(4) as u64)
}

pub fn new_kv<D: Device>(
    be: &GpuBackend<D>,
    p: &AttnParams,
    types: KvTypes,
) -> Result<Kv<D>, BackendError> {
    let width = check_kv(p, types)?;
    let (kw, vw) = (kv_row_words(types.k, width), kv_row_words(types.v, width));
    let capacity = INITIAL_CAPACITY;
    Ok(Kv {
        len: 0,
        capacity,
        width,
        k: KvBuf {
            mem: alloc_rows(be, "K", kw, capacity)?,
            ty: types.k,
            row_words: kw,
        },
        v: KvBuf {
            mem: alloc_rows(be, "V", vw, capacity)?,
            ty: types.v,
            row_words: vw,
        },
    })
}

/// Sets the buffers to hold exactly `positions` positions (a slot's window, at boot), keeping
/// the rows held (a cache already holding more is left alone); refuses a window past the
/// device's binding limit or its memory.
pub fn reserve_exact<D: Device>(
    be: &GpuBackend<D>,
    kv: &mut Kv<D>,
    positions: usize,
) -> Result<(), BackendError> {
    // Exactly the window, even below the initial capacity: the boot ledger counts these bytes.
    if positions == kv.capacity || positions < kv.len {
        return Ok(());
    }
    let max = max_capacity(be, kv);
    if positions > max {
        return Err(BackendError::BadWeight {
            name: "KV cache".into(),
            what: format!(
                "{positions} positions exceed the device's binding limit ({max} positions of this layer's K/V rows)"
            ),
        });
    }
    regrow(be, kv, positions)
}

fn regrow<D: Device>(
    be: &GpuBackend<D>,
    kv: &mut Kv<D>,
    capacity: usize,
) -> Result<(), BackendError> {
    let k = alloc_rows(be, "K", kv.k.row_words, capacity)?;
    let v = alloc_rows(be, "V", kv.v.row_words, capacity)?;
    for (c, mem) in [(&mut kv.k, k), (&mut kv.v, v)] {
        be.dev
            .copy(&c.mem, 0, &mem, 0, (kv.len * c.row_words * 4) as u64);
        c.mem = mem;
    }
    kv.capacity = capacity;
    be.dev.forget_bindings();
    Ok(())
}

/// Makes `to` hold `from`'s rows (a fork of one prompt's cache).
pub fn kv_copy<D: Device>(be: &GpuBackend<D>, from: &Kv<D>, to: &mut Kv<D>) {
    assert_eq!(
        (from.k.row_words, from.v.row_words, from.k.ty, from.v.ty),
        (to.k.row_words, to.v.row_words, to.k.ty, to.v.ty),
        "kv_copy: geometry and dtypes"
    );
    reserve(be, to, from.len);
    for (a, b) in [(&from.k, &to.k), (&from.v, &to.v)] {
        be.dev
            .copy(&a.mem, 0, &b.mem, 0, (from.len * a.row_words * 4) as u64);
    }
    to.len = from.len;
}

/// Grows the buffers to hold `needed` positions, keeping the first `len` rows.
fn reserve<D: Device>(be: &GpuBackend<D>, kv: &mut Kv<D>, needed: usize) {
    if needed <= kv.capacity {
        return;
    }
    let max = max_capacity(be, kv);
    assert!(
        needed <= max,
        "KV cache of {needed} positions exceeds the device's binding limit ({max} positions)"
    );
    let capacity = needed.max(kv.capacity * 2).min(max);
    regrow(be, kv, capacity).unwrap_or_else(|e| panic!("{}: {e}", D::NAME));
}

/// Writes `src` (`[rows, width]` f32) into cache rows `row0..` in the cache's dtype.
fn store<D: Device>(
    be: &GpuBackend<D>,
    c: &KvBuf<D::Mem>,
    capacity: usize,
    src: &Tensor<D>,
    row0: usize,
) {
    let width = src.cols;
    let units = match c.ty {
        GgmlType::F32 => width,
        GgmlType::F16 | GgmlType::BF16 => width.div_ceil(2),
        _ => (width / 32).div_ceil(2),
    };
    be.dev.launch(
        Kernel::KvStore {
            kind: cache_code(c.ty),
        },
        Grid::Linear((src.rows * units).div_ceil(64)),
        &[src.view(), c.view(capacity)],
        &[
            Scalar::U(u32_of(src.rows, "rows")),
            Scalar::U(u32_of(width, "width")),
            Scalar::U(u32_of(c.row_words, "row words")),
            Scalar::U(u32_of(row0, "cache row")),
            Scalar::U(u32_of(units, "units")),
        ],
    );
}

#[allow(clippy::too_many_arguments)]
pub fn attention<D: Device>(
    be: &GpuBackend<D>,
    p: &AttnParams,
    qg: &Tensor<D>,
    k: &Tensor<D>,
    v: &Tensor<D>,
    q_norm: &Weight<D>,
    k_norm: &Weight<D>,
    kv: &mut Kv<D>,
    pos0: usize,
    table: &[f32],
) -> Tensor<D> {
    let hd = p.head_dim;
    let rows = qg.rows;
    let width = p.n_head_kv * hd;
    check_attention(
        p,
        (qg.rows, qg.cols),
        (k.rows, k.cols),
        (v.rows, v.cols),
        kv.width,
        kv.len,
        pos0,
        (q_norm.ne0 * q_norm.rows, k_norm.ne0 * k_norm.rows),
    );
    let out = be.new_tensor(rows, p.n_head * hd);
    if rows == 0 {
        return out;
    }
    reserve(be, kv, pos0 + rows);
    let dev = &be.dev;

    // 1. q/k norm and RoPE.
    let q = be.new_tensor(rows, p.n_head * hd);
    let kr = be.new_tensor(rows, width);
    assert_eq!(table.len(), rows * p.n_rot, "attention: rope table size");
    let rope = be.upload_pooled(bytemuck::cast_slice(table));
    dev.launch(
        Kernel::AttnPrep,
        Grid::Linear(rows * (p.n_head + p.n_head_kv)),
        &[
            qg.view(),
            k.view(),
            q_norm.dense_view(),
            k_norm.dense_view(),
            q.view(),
            kr.view(),
            View {
                mem: rope.mem(),
                offset: 0,
                len: (table.len() * 4).max(4) as u64,
            },
        ],
        &[
            Scalar::U(u32_of(rows, "rows")),
            Scalar::U(p.n_head as u32),
            Scalar::U(p.n_head_kv as u32),
            Scalar::U(hd as u32),
            Scalar::U(p.n_rot as u32),
            Scalar::F(p.eps),
        ],
    );

    // 2. Append to the cache.
    store(be, &kv.k, kv.capacity, &kr, pos0);
    store(be, &kv.v, kv.capacity, v, pos0);
    kv.len = pos0 + rows;

    // 3. Partials per (query tile, kv head, chunk of positions). A tile is R query vectors of
    // one kv head: its group's heads, token-major.
    let n_ctx = pos0 + rows;
    let group = p.n_head / p.n_head_kv;
    let n_q = rows * group;
    let r = n_q.next_power_of_two().min(MAX_R).min(MAX_Q as usize / hd);
    let n_tiles = n_q.div_ceil(r);
    let (n_chunks, chunk_len) = plan_chunks(n_tiles * p.n_head_kv, n_ctx);
    let groups = n_tiles * p.n_head_kv * n_chunks;
    let part_bytes = rows * p.n_head * n_chunks * (hd + 2) * 4;
    assert!(
        part_bytes as u64 <= dev.caps().max_binding,
        "attention: a batch of {rows} rows needs {part_bytes} bytes of partials, over the binding limit"
    );
    let part = be.alloc(part_bytes);
    let part_view = View {
        mem: part.mem(),
        offset: 0,
        len: part_bytes as u64,
    };
    dev.launch(
        Kernel::AttnSplit {
            k: cache_code(kv.k.ty),
            v: cache_code(kv.v.ty),
            r: r as u32,
        },
        Grid::Linear(groups),
        &[
            q.view(),
            kv.k.view(kv.capacity),
            kv.v.view(kv.capacity),
            part_view,
        ],
        &[
            Scalar::U(rows as u32),
            Scalar::U(p.n_head as u32),
            Scalar::U(hd as u32),
            Scalar::U(group as u32),
            Scalar::U(u32_of(pos0, "position")),
            Scalar::U(n_chunks as u32),
            Scalar::U(u32_of(chunk_len, "chunk length")),
            Scalar::U(kv.k.row_words as u32),
            Scalar::U(kv.v.row_words as u32),
            Scalar::F(p.scale),
            Scalar::U(n_tiles as u32),
        ],
    );

    // 4. Merge and gate.
    dev.launch(
        Kernel::AttnCombine,
        Grid::Linear(rows * p.n_head),
        &[part_view, qg.view(), out.view()],
        &[
            Scalar::U(rows as u32),
            Scalar::U(p.n_head as u32),
            Scalar::U(hd as u32),
            Scalar::U(n_chunks as u32),
        ],
    );
    out
}

fn words_view<D: Device>(b: &PBuf<D>, n: usize) -> View<'_, D::Mem> {
    View {
        mem: b.mem(),
        offset: 0,
        len: (n * 4).max(4) as u64,
    }
}

/// Per-row argmax on the device (ties to the lowest index); only the ids come back.
pub fn argmax_rows<D: Device>(be: &GpuBackend<D>, x: &Tensor<D>) -> Vec<u32> {
    if x.rows == 0 {
        return Vec::new();
    }
    assert!(x.cols > 0, "argmax of empty rows");
    let ids = be.alloc(x.rows * 4);
    be.dev.launch(
        Kernel::Argmax,
        Grid::Linear(x.rows),
        &[x.view(), words_view(&ids, x.rows)],
        &[Scalar::U(x.rows as u32), Scalar::U(u32_of(x.cols, "cols"))],
    );
    be.read_words(ids.mem(), x.rows * 4)
}

/// The `k` largest entries of every row, sorted descending (equal values: lower index first),
/// as `rows * k` ids and values. `1 <= k <= min(64, cols)`.
pub fn topk_rows<D: Device>(be: &GpuBackend<D>, x: &Tensor<D>, k: usize) -> (Vec<u32>, Vec<f32>) {
    let kmax = TOPK_MAX as usize;
    assert!(
        (1..=kmax.min(x.cols)).contains(&k),
        "topk: k = {k} outside 1..={}",
        kmax.min(x.cols)
    );
    if x.rows == 0 {
        return (Vec::new(), Vec::new());
    }
    let rows = x.rows;
    // Stands in for the ids of the first pass, which are the columns.
    let no_ids = be.alloc(4);
    let mut cur: Option<(PBuf<D>, PBuf<D>)> = None;
    let mut n = x.cols;
    loop {
        let g = if n <= TOPK_SEGMENT {
            1
        } else {
            n.div_ceil(TOPK_SEGMENT)
        };
        let ov = be.alloc(rows * g * k * 4);
        let oi = be.alloc(rows * g * k * 4);
        let (xv, xi, has_ids) = match &cur {
            None => (x.view(), words_view(&no_ids, 1), 0),
            Some((v, i)) => (words_view(v, rows * n), words_view(i, rows * n), 1),
        };
        be.dev.launch(
            Kernel::Topk,
            Grid::Linear((rows * g).div_ceil(64)),
            &[
                xv,
                xi,
                words_view(&ov, rows * g * k),
                words_view(&oi, rows * g * k),
            ],
            &[
                Scalar::U(rows as u32),
                Scalar::U(u32_of(n, "items")),
                Scalar::U(g as u32),
                Scalar::U(k as u32),
                Scalar::U(has_ids),
            ],
        );
        cur = Some((ov, oi));
        n = g * k;
        if g == 1 {
            break;
        }
    }
    let (ov, oi) = cur.expect("at least one pass");
    let bytes = rows * k * 4;
    let ids = be.read_words(oi.mem(), bytes);
    let vals = be
        .read_words(ov.mem(), bytes)
        .into_iter()
        .map(f32::from_bits)
        .collect();
    (ids, vals)
}

/// The first `kv.len` rows of K and of V as stored, in ggml's row layout (the word padding of
/// each row dropped): for inspection and tests.
pub fn read_cache<D: Device>(be: &GpuBackend<D>, kv: &Kv<D>) -> (Vec<u8>, Vec<u8>) {
    let read = |c: &KvBuf<D::Mem>| {
        let row_bytes = c.ty.row_bytes(kv.width as u64).expect("whole blocks") as usize;
        let b = be
            .dev
            .read(&c.mem, 0, (kv.len * c.row_words * 4).max(4) as u64);
        let mut out = Vec::with_capacity(kv.len * row_bytes);
        for r in 0..kv.len {
            out.extend_from_slice(&b[r * c.row_words * 4..][..row_bytes]);
        }
        out
    };
    (read(&kv.k), read(&kv.v))
}
