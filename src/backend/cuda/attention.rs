//! Gated attention over the KV cache, argmax and top-k (the port of `wgpu/attention.rs`).
//!
//! One `attention` call enqueues four kinds of launch:
//! 1. `attn_prep`: per (token, head), q/k RMSNorm times their weights and partial NEOX RoPE
//!    (IMROPE sectors, the (sin, cos) table from `backend::rope_table`); q to a scratch
//!    `[rows, n_head*hd]`, k to a scratch `[rows, width]`.
//! 2. `kv_store` (twice): the k scratch and the raw v rows into the cache at `pos0..`, in the
//!    cache dtype, as ggml blocks.
//! 3. `attn_split`: per (tile of R query vectors sharing a kv head, kv head, chunk of
//!    positions), online softmax over the chunk with K/V dequantized in the kernel, each cache
//!    element read once for the R queries; writes (max, sum, o) partials per query and chunk.
//! 4. `attn_combine`: per (row, query head), merges the chunks and applies the sigmoid gate.
//!
//! Chunking splits long caches across blocks in decode (split-K), and collapses to one chunk
//! when a prefill batch already gives enough blocks.
//!
//! The cache buffers are allocated at their exact size outside the activation pool (they live as
//! long as the sequence) and grow by doubling, copying the rows they hold.

use super::basic::{new_tensor, run, u32_of};
use super::device::{blocks, Arg};
use super::kernels::{cache_code, ModuleKey};
use super::{CudaBackend, DBuf, Tensor, Weight};
use crate::backend::{AttnParams, BackendError, KvTypes};
use crate::tensor::GgmlType;

pub use crate::backend::gpu_plan::TOPK_MAX;
use crate::backend::gpu_plan::{
    check_attention, check_kv, kv_row_words as row_words, plan_chunks, INITIAL_CAPACITY, MAX_Q,
    MAX_R, TILE, TOPK_SEGMENT,
};

/// K or V of one layer's cache: rows of `width` elements as ggml rows of `ty`, each padded to
/// `row_words` u32 words.
pub struct KvBuf {
    pub buf: DBuf,
    pub ty: GgmlType,
    pub row_words: usize,
}

/// One layer's attention cache on the device. Positions `>= len` are stale (truncated) and are
/// overwritten by the next append.
pub struct Kv {
    pub len: usize,
    /// Positions the buffers hold.
    pub capacity: usize,
    pub width: usize,
    pub k: KvBuf,
    pub v: KvBuf,
}

pub fn new_kv(be: &CudaBackend, p: &AttnParams, types: KvTypes) -> Result<Kv, BackendError> {
    let width = check_kv(p, types)?;
    let (kw, vw) = (row_words(types.k, width), row_words(types.v, width));
    let capacity = INITIAL_CAPACITY;
    Ok(Kv {
        len: 0,
        capacity,
        width,
        k: KvBuf {
            buf: be.dev.try_alloc_exact(capacity * kw * 4)?,
            ty: types.k,
            row_words: kw,
        },
        v: KvBuf {
            buf: be.dev.try_alloc_exact(capacity * vw * 4)?,
            ty: types.v,
            row_words: vw,
        },
    })
}

/// Sets the buffers to hold exactly `positions` positions (a slot's window, at boot), keeping
/// the rows held (a cache already holding more is left alone); `Err` when the device cannot
/// hold them.
pub fn reserve_exact(be: &CudaBackend, kv: &mut Kv, positions: usize) -> Result<(), BackendError> {
    // Exactly the window, even below the initial capacity: the boot ledger counts these bytes.
    if positions == kv.capacity || positions < kv.len {
        return Ok(());
    }
    let too_big = |which: &str| BackendError::BadWeight {
        name: format!("{which} cache"),
        what: format!("{positions} positions do not fit in memory"),
    };
    let kb = positions
        .checked_mul(kv.k.row_words * 4)
        .ok_or_else(|| too_big("K"))?;
    let vb = positions
        .checked_mul(kv.v.row_words * 4)
        .ok_or_else(|| too_big("V"))?;
    let k = be.dev.try_alloc_exact(kb)?;
    let v = be.dev.try_alloc_exact(vb)?;
    regrow(be, kv, positions, k, v);
    Ok(())
}

/// Moves the cache into the new buffers `k` and `v` of `capacity` positions, copying the rows
/// held.
fn regrow(be: &CudaBackend, kv: &mut Kv, capacity: usize, k: DBuf, v: DBuf) {
    for (c, buf) in [(&mut kv.k, k), (&mut kv.v, v)] {
        be.dev
            .copy(c.buf.ptr(), buf.ptr(), kv.len * c.row_words * 4);
        c.buf = buf;
    }
    kv.capacity = capacity;
}

/// Grows the buffers to hold `needed` positions (doubling), keeping the first `len` rows.
fn reserve(be: &CudaBackend, kv: &mut Kv, needed: usize) {
    if needed <= kv.capacity {
        return;
    }
    let capacity = needed.max(kv.capacity * 2);
    let k = be.dev.alloc_exact(capacity * kv.k.row_words * 4);
    let v = be.dev.alloc_exact(capacity * kv.v.row_words * 4);
    regrow(be, kv, capacity, k, v);
}

/// Writes `src` (`[rows, width]` f32) into cache rows `row0..` in the cache's dtype.
fn store(be: &CudaBackend, c: &KvBuf, src: &Tensor, row0: usize) {
    let width = src.cols;
    let units = match c.ty {
        GgmlType::F32 => width,
        GgmlType::F16 | GgmlType::BF16 => width.div_ceil(2),
        _ => (width / 32).div_ceil(2),
    };
    let entry = match c.ty {
        GgmlType::F32 => "kv_store_f32",
        GgmlType::F16 => "kv_store_f16",
        GgmlType::BF16 => "kv_store_bf16",
        GgmlType::Q8_0 => "kv_store_q8_0",
        GgmlType::Q4_0 => "kv_store_q4_0",
        _ => unreachable!("KvTypes::check admits only cache dtypes"),
    };
    let f = be.dev.function(&ModuleKey::plain("kv_store"), entry);
    be.dev.launch(
        &f,
        (blocks(src.rows * units, 64), 1, 1),
        64,
        &[
            Arg::P(src.ptr()),
            Arg::P(c.buf.ptr()),
            Arg::U(u32_of(src.rows, "rows")),
            Arg::U(u32_of(width, "width")),
            Arg::U(u32_of(c.row_words, "row words")),
            Arg::U(u32_of(row0, "cache row")),
            Arg::U(u32_of(units, "units")),
        ],
    );
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    be: &CudaBackend,
    p: &AttnParams,
    qg: &Tensor,
    k: &Tensor,
    v: &Tensor,
    q_norm: &Weight,
    k_norm: &Weight,
    kv: &mut Kv,
    pos0: usize,
) -> Tensor {
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
    let out = new_tensor(be, rows, p.n_head * hd);
    if rows == 0 {
        return out;
    }
    reserve(be, kv, pos0 + rows);
    let dev = &be.dev;

    // 1. q/k norm and RoPE.
    let q = new_tensor(be, rows, p.n_head * hd);
    let kr = new_tensor(be, rows, width);
    let table = crate::backend::rope_table(pos0, rows, p.n_rot, p.rope_base, p.rope_sections);
    let rope = dev.upload(bytemuck::cast_slice(&table));
    run(
        be,
        "attn_prep",
        (u32_of(rows * (p.n_head + p.n_head_kv), "block count"), 1, 1),
        64,
        &[
            Arg::P(qg.ptr()),
            Arg::P(k.ptr()),
            Arg::P(q_norm.dense()),
            Arg::P(k_norm.dense()),
            Arg::P(q.ptr()),
            Arg::P(kr.ptr()),
            Arg::P(rope.ptr()),
            Arg::U(rows as u32),
            Arg::U(p.n_head as u32),
            Arg::U(p.n_head_kv as u32),
            Arg::U(hd as u32),
            Arg::U(p.n_rot as u32),
            Arg::F(p.eps),
        ],
    );

    // 2. Append to the cache.
    store(be, &kv.k, &kr, pos0);
    store(be, &kv.v, v, pos0);
    kv.len = pos0 + rows;

    // 3. Partials per (query tile, kv head, chunk of positions). A tile is R query vectors of
    // one kv head: its group's heads, token-major.
    let n_ctx = pos0 + rows;
    let group = p.n_head / p.n_head_kv;
    let n_q = rows * group;
    let r = n_q.next_power_of_two().min(MAX_R).min(MAX_Q / hd);
    let n_tiles = n_q.div_ceil(r);
    let (n_chunks, chunk_len) = plan_chunks(n_tiles * p.n_head_kv, n_ctx);
    let n_blocks = n_tiles * p.n_head_kv * n_chunks;
    let part = dev.alloc(rows * p.n_head * n_chunks * (hd + 2) * 4);
    let (kc, vc) = (cache_code(kv.k.ty), cache_code(kv.v.ty));
    let entry = match r {
        1 => "attn_split_r1",
        2 => "attn_split_r2",
        4 => "attn_split_r4",
        _ => "attn_split_r8",
    };
    let f = dev.function(
        &ModuleKey::with("attn_split", &[("K_TYPE", kc), ("V_TYPE", vc)]),
        entry,
    );
    dev.launch(
        &f,
        (u32_of(n_blocks, "block count"), 1, 1),
        TILE as u32,
        &[
            Arg::P(q.ptr()),
            Arg::P(kv.k.buf.ptr()),
            Arg::P(kv.v.buf.ptr()),
            Arg::P(part.ptr()),
            Arg::U(rows as u32),
            Arg::U(p.n_head as u32),
            Arg::U(hd as u32),
            Arg::U(group as u32),
            Arg::U(u32_of(pos0, "position")),
            Arg::U(n_chunks as u32),
            Arg::U(u32_of(chunk_len, "chunk length")),
            Arg::U(kv.k.row_words as u32),
            Arg::U(kv.v.row_words as u32),
            Arg::F(p.scale),
            Arg::U(n_tiles as u32),
        ],
    );

    // 4. Merge and gate.
    run(
        be,
        "attn_combine",
        (u32_of(rows * p.n_head, "block count"), 1, 1),
        64,
        &[
            Arg::P(part.ptr()),
            Arg::P(qg.ptr()),
            Arg::P(out.ptr()),
            Arg::U(rows as u32),
            Arg::U(p.n_head as u32),
            Arg::U(hd as u32),
            Arg::U(n_chunks as u32),
        ],
    );
    out
}

fn words(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Per-row argmax on the device (ties to the lowest index); only the ids come back.
pub fn argmax_rows(be: &CudaBackend, x: &Tensor) -> Vec<u32> {
    if x.rows == 0 {
        return Vec::new();
    }
    assert!(x.cols > 0, "argmax of empty rows");
    let ids = be.dev.alloc(x.rows * 4);
    run(
        be,
        "argmax",
        (u32_of(x.rows, "rows"), 1, 1),
        256,
        &[
            Arg::P(x.ptr()),
            Arg::P(ids.ptr()),
            Arg::U(x.rows as u32),
            Arg::U(u32_of(x.cols, "cols")),
        ],
    );
    words(&be.dev.read(ids.ptr(), x.rows * 4))
}

/// The `k` largest entries of every row, sorted descending (equal values: lower index first),
/// as `rows * k` ids and values. `1 <= k <= min(64, cols)`.
pub fn topk_rows(be: &CudaBackend, x: &Tensor, k: usize) -> (Vec<u32>, Vec<f32>) {
    assert!(
        (1..=TOPK_MAX.min(x.cols)).contains(&k),
        "topk: k = {k} outside 1..={}",
        TOPK_MAX.min(x.cols)
    );
    if x.rows == 0 {
        return (Vec::new(), Vec::new());
    }
    let dev = &be.dev;
    let rows = x.rows;
    let mut cur: Option<(super::PBuf, super::PBuf)> = None;
    let mut n = x.cols;
    loop {
        let g = if n <= TOPK_SEGMENT {
            1
        } else {
            n.div_ceil(TOPK_SEGMENT)
        };
        let ov = dev.alloc(rows * g * k * 4);
        let oi = dev.alloc(rows * g * k * 4);
        let (xv, xi, has_ids) = match &cur {
            None => (x.ptr(), 0, 0),
            Some((v, i)) => (v.ptr(), i.ptr(), 1),
        };
        run(
            be,
            "topk",
            (blocks(rows * g, 64), 1, 1),
            64,
            &[
                Arg::P(xv),
                Arg::P(xi),
                Arg::P(ov.ptr()),
                Arg::P(oi.ptr()),
                Arg::U(rows as u32),
                Arg::U(u32_of(n, "items")),
                Arg::U(g as u32),
                Arg::U(k as u32),
                Arg::U(has_ids),
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
    let ids = words(&dev.read(oi.ptr(), bytes));
    let vals = words(&dev.read(ov.ptr(), bytes))
        .into_iter()
        .map(f32::from_bits)
        .collect();
    (ids, vals)
}

/// The first `kv.len` rows of K and of V as stored, in ggml's row layout (the word padding of
/// each row dropped): for inspection and tests.
pub fn read_cache(be: &CudaBackend, kv: &Kv) -> (Vec<u8>, Vec<u8>) {
    let read = |c: &KvBuf| {
        let row_bytes = c.ty.row_bytes(kv.width as u64).expect("whole blocks") as usize;
        let b = be.dev.read(c.buf.ptr(), kv.len * c.row_words * 4);
        let mut out = Vec::with_capacity(kv.len * row_bytes);
        for r in 0..kv.len {
            out.extend_from_slice(&b[r * c.row_words * 4..][..row_bytes]);
        }
        out
    };
    (read(&kv.k), read(&kv.v))
}
