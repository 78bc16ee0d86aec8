//! Gated attention over the KV cache, argmax and top-k.
//!
//! One `attention` call records four kinds of dispatch:
//! 1. `attn_prep`: per (token, head), q/k RMSNorm times their weights and partial NEOX RoPE
//!    (IMROPE sectors); q to a scratch `[rows, n_head*hd]`, k to a scratch `[rows, width]`.
//! 2. `kv_store` (twice): the k scratch and the raw v rows into the cache at `pos0..`, in the
//!    cache dtype, as ggml blocks.
//! 3. `attn_split`: per (tile of R query vectors sharing a kv head, kv head, chunk of
//!    positions), online softmax over the chunk with K/V dequantized in the kernel, each cache
//!    element read once for the R queries (the GQA group in decode, several tokens in prefill);
//!    writes (max, sum, o) partials per query and chunk.
//! 4. `attn_combine`: per (row, query head), merges the chunks and applies the sigmoid gate.
//!
//! Chunking splits long caches across workgroups in decode (split-K), and collapses to one
//! chunk when a prefill batch already gives enough workgroups.
//!
//! The cache buffers are allocated at their exact size outside the activation pool (they live
//! as long as the sequence) and grow by doubling, copying the rows they hold.

use super::basic::{new_tensor, params};
use super::gpu::groups_2d;
use super::{Bind, PBuf, Tensor, Weight, WgpuBackend};
use crate::backend::{AttnParams, BackendError, KvTypes};
use crate::tensor::GgmlType;

const ATTN_PREP: &str = include_str!("../../../shaders/attn_prep.wgsl");
const KV_STORE: &str = include_str!("../../../shaders/kv_store.wgsl");
const ATTN_SPLIT: &str = include_str!("../../../shaders/attn_split.wgsl");
const ATTN_COMBINE: &str = include_str!("../../../shaders/attn_combine.wgsl");
const ARGMAX: &str = include_str!("../../../shaders/argmax.wgsl");
const TOPK: &str = include_str!("../../../shaders/topk.wgsl");

pub use crate::backend::gpu_plan::TOPK_MAX;
use crate::backend::gpu_plan::{
    check_attention, check_kv, kv_row_words as row_words, plan_chunks, INITIAL_CAPACITY, MAX_Q,
    MAX_R, TOPK_SEGMENT,
};

/// The shaders' dtype codes.
fn type_code(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::BF16 => 2,
        GgmlType::Q8_0 => 3,
        GgmlType::Q4_0 => 4,
        _ => unreachable!("KvTypes::check admits only cache dtypes"),
    }
}

/// Sets the value of `const NAME: u32 = ...;` in a shader.
fn specialize(src: &str, consts: &[(&str, u32)]) -> String {
    let mut s = src.to_string();
    for (name, v) in consts {
        let from = format!("const {name}: u32 = ");
        let at = s
            .find(&from)
            .unwrap_or_else(|| panic!("shader has no `{from}`"))
            + from.len();
        let end = at + s[at..].find(';').expect("const ends with ;");
        s.replace_range(at..end, &format!("{v}u"));
    }
    s
}

/// K or V of one layer's cache: rows of `width` elements as ggml rows of `ty`, each padded to
/// `row_words` u32 words.
pub struct KvBuf {
    pub buf: wgpu::Buffer,
    pub ty: GgmlType,
    pub row_words: usize,
}

impl KvBuf {
    fn bind(&self, capacity: usize) -> Bind<'_> {
        Bind {
            buf: &self.buf,
            offset: 0,
            size: Some((capacity * self.row_words * 4) as u64),
        }
    }
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

impl Kv {
    /// Bytes of one stored row of K and of V.
    pub fn row_bytes(&self) -> (usize, usize) {
        (self.k.row_words * 4, self.v.row_words * 4)
    }
}

/// Most positions a cache can hold: one binding of K or V must fit the adapter's limit.
fn max_capacity(be: &WgpuBackend, kv: &Kv) -> usize {
    let l = &be.gpu.limits;
    let limit = l.max_storage_buffer_binding_size.min(l.max_buffer_size) as usize;
    limit / (kv.k.row_words.max(kv.v.row_words) * 4)
}

fn alloc_rows(be: &WgpuBackend, row_words: usize, capacity: usize) -> wgpu::Buffer {
    be.gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("kv cache"),
        size: (capacity * row_words * 4) as u64,
        usage: wgpu::BufferUsages::STORAGE
            | wgpu::BufferUsages::COPY_SRC
            | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    })
}

pub fn new_kv(be: &WgpuBackend, p: &AttnParams, types: KvTypes) -> Result<Kv, BackendError> {
    let width = check_kv(p, types)?;
    let (kw, vw) = (row_words(types.k, width), row_words(types.v, width));
    let capacity = INITIAL_CAPACITY;
    Ok(Kv {
        len: 0,
        capacity,
        width,
        k: KvBuf {
            buf: alloc_rows(be, kw, capacity),
            ty: types.k,
            row_words: kw,
        },
        v: KvBuf {
            buf: alloc_rows(be, vw, capacity),
            ty: types.v,
            row_words: vw,
        },
    })
}

/// Sets the buffers to hold exactly `positions` positions (a slot's window, at boot), keeping
/// the rows held (a cache already holding more is left alone); refuses a window past the
/// adapter's binding limit.
pub fn reserve_exact(be: &WgpuBackend, kv: &mut Kv, positions: usize) -> Result<(), BackendError> {
    // Exactly the window, even below the initial capacity: the boot ledger counts these bytes.
    if positions == kv.capacity || positions < kv.len {
        return Ok(());
    }
    let max = max_capacity(be, kv);
    if positions > max {
        return Err(BackendError::BadWeight {
            name: "KV cache".into(),
            what: format!(
                "{positions} positions exceed the adapter's storage binding limit ({max} positions of this layer's K/V rows)"
            ),
        });
    }
    regrow(be, kv, positions);
    Ok(())
}

fn regrow(be: &WgpuBackend, kv: &mut Kv, capacity: usize) {
    for c in [&mut kv.k, &mut kv.v] {
        let buf = alloc_rows(be, c.row_words, capacity);
        be.gpu
            .copy(&c.buf, 0, &buf, 0, (kv.len * c.row_words * 4) as u64);
        c.buf = buf;
    }
    kv.capacity = capacity;
}

/// Grows the buffers to hold `needed` positions, keeping the first `len` rows.
fn reserve(be: &WgpuBackend, kv: &mut Kv, needed: usize) {
    if needed <= kv.capacity {
        return;
    }
    let max = max_capacity(be, kv);
    assert!(
        needed <= max,
        "KV cache of {needed} positions exceeds the adapter's storage binding limit ({max} positions)"
    );
    let capacity = needed.max(kv.capacity * 2).min(max);
    regrow(be, kv, capacity);
}

/// Writes `src` (`[rows, width]` f32) into cache rows `row0..` in the cache's dtype.
fn store(be: &WgpuBackend, c: &KvBuf, capacity: usize, src: &Tensor, row0: usize) {
    let width = src.cols;
    let units = match c.ty {
        GgmlType::F32 => width,
        GgmlType::F16 | GgmlType::BF16 => width.div_ceil(2),
        _ => (width / 32).div_ceil(2),
    };
    let code = type_code(c.ty);
    let pipe = be.gpu.pipeline(
        &format!("kv_store_{code}"),
        &specialize(KV_STORE, &[("KIND", code)]),
    );
    let n = src.rows * units;
    be.gpu.dispatch(
        &pipe,
        &params(&[
            src.rows as u32,
            width as u32,
            c.row_words as u32,
            row0 as u32,
            units as u32,
        ]),
        &[src.bind(), c.bind(capacity)],
        groups_2d(n.div_ceil(64) as u32),
    );
}

#[allow(clippy::too_many_arguments)]
pub fn attention(
    be: &WgpuBackend,
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
    let gpu = &be.gpu;

    // 1. q/k norm and RoPE.
    let q = new_tensor(be, rows, p.n_head * hd);
    let kr = new_tensor(be, rows, width);
    let table = crate::backend::rope_table(pos0, rows, p.n_rot, p.rope_base, p.rope_sections);
    let rope = gpu.upload_pooled(bytemuck::cast_slice(&table));
    let pipe = gpu.pipeline("attn_prep", ATTN_PREP);
    gpu.dispatch(
        &pipe,
        &params(&[
            rows as u32,
            p.n_head as u32,
            p.n_head_kv as u32,
            hd as u32,
            p.n_rot as u32,
            pos0 as u32,
            p.eps.to_bits(),
        ]),
        &[
            qg.bind(),
            k.bind(),
            dense(q_norm),
            dense(k_norm),
            q.bind(),
            kr.bind(),
            (&rope).into(),
        ],
        groups_2d((rows * (p.n_head + p.n_head_kv)) as u32),
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
    let r = n_q.next_power_of_two().min(MAX_R).min(MAX_Q / hd);
    let n_tiles = n_q.div_ceil(r);
    let (n_chunks, chunk_len) = plan_chunks(n_tiles * p.n_head_kv, n_ctx);
    let groups = n_tiles * p.n_head_kv * n_chunks;
    let part_bytes = rows * p.n_head * n_chunks * (hd + 2) * 4;
    assert!(
        part_bytes as u64 <= gpu.limits.max_storage_buffer_binding_size,
        "attention: a batch of {rows} rows needs {part_bytes} bytes of partials, over the binding limit"
    );
    let part = gpu.alloc(part_bytes as u64);
    let (kc, vc) = (type_code(kv.k.ty), type_code(kv.v.ty));
    let pipe = gpu.pipeline(
        &format!("attn_split_{kc}_{vc}_{r}"),
        &specialize(
            ATTN_SPLIT,
            &[("K_TYPE", kc), ("V_TYPE", vc), ("R", r as u32)],
        ),
    );
    gpu.dispatch(
        &pipe,
        &params(&[
            rows as u32,
            p.n_head as u32,
            hd as u32,
            (p.n_head / p.n_head_kv) as u32,
            pos0 as u32,
            n_chunks as u32,
            chunk_len as u32,
            kv.k.row_words as u32,
            kv.v.row_words as u32,
            p.scale.to_bits(),
            n_tiles as u32,
        ]),
        &[
            q.bind(),
            kv.k.bind(kv.capacity),
            kv.v.bind(kv.capacity),
            (&part).into(),
        ],
        groups_2d(groups as u32),
    );

    // 4. Merge and gate.
    let pipe = gpu.pipeline("attn_combine", ATTN_COMBINE);
    gpu.dispatch(
        &pipe,
        &params(&[rows as u32, p.n_head as u32, hd as u32, n_chunks as u32]),
        &[(&part).into(), qg.bind(), out.bind()],
        groups_2d((rows * p.n_head) as u32),
    );
    out
}

fn dense(w: &Weight) -> Bind<'_> {
    w.dense().into()
}

fn words(b: &[u8]) -> Vec<u32> {
    b.chunks_exact(4)
        .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
        .collect()
}

/// Per-row argmax on the device (ties to the lowest index); only the ids come back.
pub fn argmax_rows(be: &WgpuBackend, x: &Tensor) -> Vec<u32> {
    if x.rows == 0 {
        return Vec::new();
    }
    assert!(x.cols > 0, "argmax of empty rows");
    let ids = be.gpu.alloc((x.rows * 4) as u64);
    let pipe = be.gpu.pipeline("argmax", ARGMAX);
    be.gpu.dispatch(
        &pipe,
        &params(&[x.rows as u32, x.cols as u32]),
        &[x.bind(), (&ids).into()],
        groups_2d(x.rows as u32),
    );
    words(&be.gpu.read(ids.buffer(), 0, (x.rows * 4) as u64))
}

/// The `k` largest entries of every row, sorted descending (equal values: lower index first),
/// as `rows * k` ids and values. `1 <= k <= min(64, cols)`.
pub fn topk_rows(be: &WgpuBackend, x: &Tensor, k: usize) -> (Vec<u32>, Vec<f32>) {
    assert!(
        (1..=TOPK_MAX.min(x.cols)).contains(&k),
        "topk: k = {k} outside 1..={}",
        TOPK_MAX.min(x.cols)
    );
    if x.rows == 0 {
        return (Vec::new(), Vec::new());
    }
    let gpu = &be.gpu;
    let pipe = gpu.pipeline("topk", TOPK);
    let rows = x.rows;
    // Stands in for the ids of the first pass, which are the columns.
    let no_ids = gpu.alloc(4);
    let mut cur: Option<(PBuf, PBuf)> = None;
    let mut n = x.cols;
    loop {
        let g = if n <= TOPK_SEGMENT {
            1
        } else {
            n.div_ceil(TOPK_SEGMENT)
        };
        let ov = gpu.alloc((rows * g * k * 4) as u64);
        let oi = gpu.alloc((rows * g * k * 4) as u64);
        let (xv, xi, has_ids) = match &cur {
            None => (x.bind(), Bind::from(&no_ids), 0),
            Some((v, i)) => (Bind::from(v), Bind::from(i), 1),
        };
        gpu.dispatch(
            &pipe,
            &params(&[rows as u32, n as u32, g as u32, k as u32, has_ids]),
            &[xv, xi, (&ov).into(), (&oi).into()],
            groups_2d((rows * g).div_ceil(64) as u32),
        );
        cur = Some((ov, oi));
        n = g * k;
        if g == 1 {
            break;
        }
    }
    let (ov, oi) = cur.expect("at least one pass");
    let bytes = (rows * k * 4) as u64;
    let ids = words(&gpu.read(oi.buffer(), 0, bytes));
    let vals = words(&gpu.read(ov.buffer(), 0, bytes))
        .into_iter()
        .map(f32::from_bits)
        .collect();
    (ids, vals)
}

/// The first `kv.len` rows of K and of V as stored, in ggml's row layout (the word padding of
/// each row dropped): for inspection and tests.
pub fn read_cache(be: &WgpuBackend, kv: &Kv) -> (Vec<u8>, Vec<u8>) {
    let read = |c: &KvBuf| {
        let row_bytes = c.ty.row_bytes(kv.width as u64).expect("whole blocks") as usize;
        let b = be
            .gpu
            .read(&c.buf, 0, (kv.len * c.row_words * 4).max(4) as u64);
        let mut out = Vec::with_capacity(kv.len * row_bytes);
        for r in 0..kv.len {
            out.extend_from_slice(&b[r * c.row_words * 4..][..row_bytes]);
        }
        out
    };
    (read(&kv.k), read(&kv.v))
}
