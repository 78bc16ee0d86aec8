//! The GPU backends' host side, written once. Every op's logic (which kernel for which
//! dtype, the work split of attention and the recurrence, the Hadamard fold, the cache
//! layout, the weight split at the binding limit) lives in this module over a small
//! [`Device`] trait: allocate, upload, copy, read back, launch a kernel by its typed key.
//! `backend::wgpu` (WGSL through wgpu) and `backend::cuda` (CUDA C++ through NVRTC and the
//! driver API) implement only that trait; their kernels are ports of one another with the
//! same arguments, the same workgroup sizes and the same constants ([`kernels`]).
//!
//! The contract every kernel keeps, so that one launch serves both devices: its buffers come
//! first, in order (WGSL `@binding(1..)`, CUDA's pointer parameters), then its scalars, in
//! order (the WGSL uniform `Params` at `@binding(0)`, CUDA's value parameters). A 1-D grid
//! ([`Grid::Linear`]) may be folded into two dimensions by the device (wgpu's 65,535 limit);
//! the kernels recover the index as `wid.x + wid.y * nwg.x`.

pub mod attention;
pub mod basic;
pub mod gdn;
pub mod kernels;
pub mod matmul;
pub mod plan;
pub mod vision;

use std::collections::HashMap;
use std::sync::{Arc, Mutex, OnceLock};

use super::{
    AttnParams, Backend, BackendError, GdnParams, GdnWeights, KvTypes, WeightBytes, WeightSource,
};
use crate::quant::hadamard::{GdnPermutation, HadamardConfig};
use crate::tensor::GgmlType;
pub use attention::Kv;
pub use gdn::{GdnForm, Recurrent};
pub use kernels::Kernel;

/// The work of one launch: `Linear(n)` workgroups (the device may fold them into two
/// dimensions, or several logical groups into one block), or an explicit grid whose
/// dimensions the kernel reads as they are.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Grid {
    Linear(usize),
    Dims([u32; 3]),
}

/// A scalar kernel argument. On wgpu it is a word of the uniform block (an f32 by its bits);
/// on CUDA a 32-bit value parameter.
#[derive(Copy, Clone, Debug, PartialEq)]
pub enum Scalar {
    U(u32),
    F(f32),
}

impl Scalar {
    pub fn bits(self) -> u32 {
        match self {
            Scalar::U(u) => u,
            Scalar::F(f) => f.to_bits(),
        }
    }
}

/// `n` as a kernel's u32 argument; the kernels index with u32, so a larger value is a shape
/// they cannot run.
pub fn u32_of(n: usize, what: &str) -> u32 {
    u32::try_from(n).unwrap_or_else(|_| panic!("{what} {n} does not fit the kernels' u32 indices"))
}

/// A buffer argument: `len` bytes of `mem` from `offset`.
pub struct View<'a, M> {
    pub mem: &'a M,
    pub offset: u64,
    pub len: u64,
}

impl<M> Clone for View<'_, M> {
    fn clone(&self) -> Self {
        *self
    }
}
impl<M> Copy for View<'_, M> {}

/// The limits and features a device reports that shape the host's choices.
#[derive(Clone, Debug)]
pub struct Caps {
    /// Largest buffer one kernel argument may bind; weights above it are split by rows.
    pub max_binding: u64,
    /// Workgroup (shared) memory per workgroup.
    pub shared_bytes: u32,
    /// Native f16 loads (`Kernel::MatmulVecF16`).
    pub native_f16: bool,
}

/// How a device sizes an allocation of `n` bytes, so the planner prices exactly what
/// `upload` allocates without a device at hand.
#[derive(Copy, Clone, Debug)]
pub struct AllocRule {
    pub binding_limit: u64,
    /// wgpu pads buffers to whole words; CUDA allocates the size asked for.
    pub pad_to_word: bool,
}

/// The CUDA backend's rule: one exact allocation (at least 4 bytes) per weight. Here rather
/// than in the feature-gated backend so that `tern fit --backend cuda` prices it in any build.
pub fn cuda_alloc_rule() -> AllocRule {
    AllocRule {
        binding_limit: u64::MAX,
        pad_to_word: false,
    }
}

impl AllocRule {
    pub fn size(&self, n: u64) -> u64 {
        if self.pad_to_word {
            n.div_ceil(4).max(1) * 4
        } else {
            n.max(4)
        }
    }
}

/// What a GPU backend needs from its device. Ops never wait: launches, copies and uploads
/// are queued in order, and only `read` waits for the queue.
pub trait Device: Send + Sync + Sized + 'static {
    /// A device allocation.
    type Mem: Send + Sync;
    /// The backend's name ("wgpu", "cuda").
    const NAME: &'static str;

    fn caps(&self) -> &Caps;
    fn alloc_rule(&self) -> AllocRule;
    /// One line for start-up logs.
    fn describe(&self) -> String;

    /// A new allocation of `bytes` (contents undefined), or the device's refusal.
    fn alloc(&self, bytes: u64) -> Result<Self::Mem, BackendError>;
    /// A new allocation holding `data` (weights, sign tables): what `upload` keeps.
    fn upload_new(&self, data: &[u8]) -> Result<Self::Mem, BackendError>;
    /// Writes `data` into `dst` in queue order: after every launch queued before it.
    fn write(&self, dst: &Self::Mem, data: &[u8]);
    /// Zeroes `dst` in queue order.
    fn zero(&self, dst: &Self::Mem);
    /// Bytes `mem` holds.
    fn size(&self, mem: &Self::Mem) -> u64;
    fn copy(&self, src: &Self::Mem, src_off: u64, dst: &Self::Mem, dst_off: u64, bytes: u64);
    /// `bytes` of `src` from `offset`, once the queued work is done.
    fn read(&self, src: &Self::Mem, offset: u64, bytes: u64) -> Vec<u8>;
    /// Queues one launch of `kernel` with its buffers and then its scalars.
    fn launch(&self, kernel: Kernel, grid: Grid, bufs: &[View<'_, Self::Mem>], scalars: &[Scalar]);
    /// Called when long-lived buffers are replaced (a cache regrown), so that the device
    /// drops anything it keeps that refers to the old ones (cached bind groups).
    fn forget_bindings(&self) {}
}

/// The free buffers of a device, by size, and what they add up to.
struct Pool<M> {
    free: HashMap<u64, Vec<M>>,
    allocated: u64,
}

/// A buffer on loan from the pool; it goes back when dropped. Dropping one that a queued
/// launch still reads is fine: whoever takes it next writes it from a later launch in the
/// same queue.
pub struct PBuf<D: Device> {
    mem: Option<D::Mem>,
    pub size: u64,
    pool: Arc<Mutex<Pool<D::Mem>>>,
}

impl<D: Device> PBuf<D> {
    pub fn mem(&self) -> &D::Mem {
        self.mem.as_ref().expect("live buffer")
    }
    pub fn view(&self) -> View<'_, D::Mem> {
        View {
            mem: self.mem(),
            offset: 0,
            len: self.size,
        }
    }
}

impl<D: Device> Drop for PBuf<D> {
    fn drop(&mut self) {
        if let Some(m) = self.mem.take() {
            if let Ok(mut p) = self.pool.lock() {
                p.free.entry(self.size).or_default().push(m);
            }
        }
    }
}

/// A row-major `[rows, cols]` f32 activation in a pooled buffer.
pub struct Tensor<D: Device> {
    pub buf: PBuf<D>,
    pub rows: usize,
    pub cols: usize,
}

impl<D: Device> Tensor<D> {
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The tensor's elements as a kernel argument (at least one word, as WGSL wants).
    pub fn view(&self) -> View<'_, D::Mem> {
        View {
            mem: self.buf.mem(),
            offset: 0,
            len: (self.len() as u64 * 4).max(4),
        }
    }
}

/// Rows `[row0, row0 + n_rows)` of a weight, in an allocation of their own.
pub struct WeightPart<M> {
    pub mem: M,
    pub row0: usize,
    pub n_rows: usize,
}

/// The input transform of a Hadamard-folded weight, on the device.
pub struct GpuFold<M> {
    pub hadamard: Arc<HadamardConfig>,
    /// ±1 per input column; `None` in `identity` sign mode.
    pub signs: Option<M>,
    pub perm: Option<GdnPermutation>,
}

impl<M> GpuFold<M> {
    /// Whether two folds transform an input the same way (so one transform serves both).
    pub fn same_as(&self, other: &GpuFold<M>) -> bool {
        Arc::ptr_eq(&self.hadamard, &other.hadamard) && self.perm == other.perm
    }
}

pub struct Weight<D: Device> {
    pub name: String,
    pub ty: GgmlType,
    pub ne0: usize,
    pub rows: usize,
    pub row_bytes: usize,
    /// The stored bytes, split by rows to fit the device's binding limit.
    pub parts: Vec<WeightPart<D::Mem>>,
    /// Small 1-D weights (norms, biases, conv taps) decoded once to f32.
    pub dense: Option<D::Mem>,
    /// Forward rule on the input of a folded matmul.
    pub fold: Option<GpuFold<D::Mem>>,
    /// Inverse rule after a row lookup in an inverse-folded embedding.
    pub inverse: Option<GpuFold<D::Mem>>,
}

impl<D: Device> Weight<D> {
    pub fn dense(&self) -> &D::Mem {
        self.dense
            .as_ref()
            .unwrap_or_else(|| panic!("{}: dense view of a matrix weight", self.name))
    }
    /// The decoded values of a small weight as a kernel argument.
    pub fn dense_view(&self) -> View<'_, D::Mem> {
        View {
            mem: self.dense(),
            offset: 0,
            len: (self.ne0 * self.rows * 4).max(4) as u64,
        }
    }
}

/// A GPU backend: the op logic of this module on device `D`.
pub struct GpuBackend<D: Device> {
    pub dev: Arc<D>,
    pool: Arc<Mutex<Pool<D::Mem>>>,
    /// ggml's GELU table as f32 (256 KiB from the pool), uploaded at the first `gelu`.
    gelu_table: OnceLock<PBuf<D>>,
}

impl<D: Device> GpuBackend<D> {
    pub fn on(dev: D) -> GpuBackend<D> {
        GpuBackend {
            dev: Arc::new(dev),
            pool: Arc::new(Mutex::new(Pool {
                free: HashMap::new(),
                allocated: 0,
            })),
            gelu_table: OnceLock::new(),
        }
    }

    /// `backend::gelu_f16_table` as f32 values on the device, uploaded once.
    pub(crate) fn gelu_table(&self) -> &PBuf<D> {
        self.gelu_table.get_or_init(|| {
            let t: Vec<f32> = super::gelu_f16_table()
                .iter()
                .map(|&h| half::f16::from_bits(h).to_f32())
                .collect();
            self.upload_pooled(bytemuck::cast_slice(&t))
        })
    }

    /// A pooled buffer of at least `bytes` (rounded up to a power of two, at least 256).
    pub fn alloc(&self, bytes: usize) -> PBuf<D> {
        let size = (bytes as u64).max(256).next_power_of_two();
        let hit = self
            .pool
            .lock()
            .unwrap()
            .free
            .get_mut(&size)
            .and_then(Vec::pop);
        let mem = match hit {
            Some(m) => m,
            None => {
                let m = self
                    .dev
                    .alloc(size)
                    .unwrap_or_else(|e| panic!("{}: activation buffer: {e}", D::NAME));
                self.pool.lock().unwrap().allocated += size;
                m
            }
        };
        PBuf {
            mem: Some(mem),
            size,
            pool: self.pool.clone(),
        }
    }

    /// A pooled buffer holding `data`, written in queue order.
    pub fn upload_pooled(&self, data: &[u8]) -> PBuf<D> {
        let b = self.alloc(data.len());
        self.dev.write(b.mem(), data);
        b
    }

    pub fn new_tensor(&self, rows: usize, cols: usize) -> Tensor<D> {
        Tensor {
            buf: self.alloc(rows * cols * 4),
            rows,
            cols,
        }
    }

    /// Bytes held by the pool (in use or free): the boot ledger's compute line.
    pub fn pooled_bytes(&self) -> u64 {
        self.pool.lock().unwrap().allocated
    }

    /// The u32 words of `bytes` read back from `mem`.
    pub(crate) fn read_words(&self, mem: &D::Mem, bytes: usize) -> Vec<u32> {
        self.dev
            .read(mem, 0, bytes as u64)
            .chunks_exact(4)
            .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn fold_on_device(
        &self,
        h: &Arc<HadamardConfig>,
        width: usize,
        perm: Option<GdnPermutation>,
    ) -> Result<GpuFold<D::Mem>, BackendError> {
        let signs = match h.signs(width) {
            Some(s) => Some(self.dev.upload_new(bytemuck::cast_slice(s))?),
            None => None,
        };
        Ok(GpuFold {
            hadamard: h.clone(),
            signs,
            perm,
        })
    }
}

/// Rows per allocation of a weight split to fit a binding of `limit` bytes.
fn rows_per_part(row_bytes: usize, limit: u64) -> usize {
    (limit.min(usize::MAX as u64) as usize / row_bytes.max(1)).max(1)
}

/// What `upload` allocates for `w` on a device with allocation rule `rule`: the stored rows
/// (one allocation per part), or the f32 copy of a small weight, plus a sign vector per
/// Hadamard rule it carries. The planner prices weights with this.
pub fn planned_weight_bytes(w: &WeightSource, rule: AllocRule) -> WeightBytes {
    let (ne0, rows) = w.shape2();
    let row_bytes = w.info.row_bytes() as usize;
    let mut owned = if w.decode_once() {
        rule.size((ne0 as u64).saturating_mul(rows as u64).saturating_mul(4))
    } else {
        let per_part = rows_per_part(row_bytes, rule.binding_limit);
        let (full, rest) = (rows / per_part, rows % per_part);
        let part = |n: usize| rule.size((n as u64).saturating_mul(row_bytes as u64));
        (full as u64)
            .saturating_mul(part(per_part))
            .saturating_add(if rest > 0 { part(rest) } else { 0 })
    };
    for n in w.sign_vectors() {
        owned = owned.saturating_add(rule.size(n as u64 * 4));
    }
    WeightBytes {
        tensor: w.info.name.clone(),
        mapped: 0,
        owned,
        shared: 0,
    }
}

impl<D: Device> GpuBackend<D> {
    /// `upload` with the rows split into parts of at most `rows_per_part` (the last may be
    /// shorter). `upload` uses the device's binding limit; tests force small parts to check
    /// the per-part dispatch without a weight of that size.
    pub fn upload_split(
        &self,
        w: &WeightSource,
        rows_per_part: Option<usize>,
    ) -> Result<Weight<D>, BackendError> {
        let ty = w.info.ty;
        // The kernels decode every type tern computes with.
        if !ty.can_compute() {
            return Err(BackendError::UnsupportedType {
                name: w.info.name.clone(),
                ty,
                backend: D::NAME,
            });
        }
        let (ne0, rows) = w.shape2();
        let row_bytes = w.info.row_bytes() as usize;
        let bytes = w.bytes();
        let mut out = Weight {
            name: w.info.name.clone(),
            ty,
            ne0,
            rows,
            row_bytes,
            parts: Vec::new(),
            dense: None,
            fold: None,
            inverse: None,
        };
        if w.decode_once() {
            if rows_per_part.is_some() {
                return Err(BackendError::BadWeight {
                    name: out.name,
                    what: "a dense weight has no row parts".into(),
                });
            }
            let f = w.decoded()?;
            out.dense = Some(self.dev.upload_new(bytemuck::cast_slice(&f))?);
        } else {
            let per_part = rows_per_part
                .unwrap_or_else(|| self::rows_per_part(row_bytes, self.dev.caps().max_binding))
                .max(1);
            let mut row0 = 0;
            while row0 < rows {
                let n = per_part.min(rows - row0);
                let mem = self
                    .dev
                    .upload_new(&bytes[row0 * row_bytes..(row0 + n) * row_bytes])?;
                out.parts.push(WeightPart {
                    mem,
                    row0,
                    n_rows: n,
                });
                row0 += n;
            }
        }
        if let Some(f) = &w.fold {
            out.fold = Some(self.fold_on_device(&f.hadamard, ne0, f.perm)?);
        }
        if let Some(h) = &w.inverse {
            out.inverse = Some(self.fold_on_device(h, ne0, None)?);
        }
        Ok(out)
    }
}

impl<D: Device> Backend for GpuBackend<D> {
    type T = Tensor<D>;
    type W = Weight<D>;
    type Kv = Kv<D>;
    type Rs = Recurrent<D>;

    fn name(&self) -> &'static str {
        D::NAME
    }

    fn upload(&self, w: &WeightSource) -> Result<Weight<D>, BackendError> {
        self.upload_split(w, None)
    }

    fn weight_bytes(&self, w: &Weight<D>) -> WeightBytes {
        let dev = &self.dev;
        let signs = |f: &Option<GpuFold<D::Mem>>| {
            f.as_ref()
                .and_then(|f| f.signs.as_ref())
                .map_or(0, |m| dev.size(m))
        };
        WeightBytes {
            tensor: w.name.clone(),
            mapped: 0,
            owned: w.parts.iter().map(|p| dev.size(&p.mem)).sum::<u64>()
                + w.dense.as_ref().map_or(0, |m| dev.size(m))
                + signs(&w.fold)
                + signs(&w.inverse),
            shared: 0,
        }
    }

    fn compute_bytes(&self) -> Option<u64> {
        Some(self.pooled_bytes())
    }

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Tensor<D> {
        assert_eq!(data.len(), rows * cols);
        Tensor {
            buf: self.upload_pooled(bytemuck::cast_slice(data)),
            rows,
            cols,
        }
    }

    fn to_host(&self, t: &Tensor<D>) -> Vec<f32> {
        self.dev
            .read(t.buf.mem(), 0, t.len() as u64 * 4)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    }

    fn rows(&self, t: &Tensor<D>, start: usize, n: usize) -> Tensor<D> {
        basic::gather_rows(self, t, &[(start, n)])
    }

    fn gather_rows(&self, t: &Tensor<D>, runs: &[(usize, usize)]) -> Tensor<D> {
        basic::gather_rows(self, t, runs)
    }

    fn concat_cols(&self, a: &Tensor<D>, b: &Tensor<D>) -> Tensor<D> {
        basic::concat_cols(self, a, b)
    }

    fn concat_rows(&self, parts: &[&Tensor<D>]) -> Tensor<D> {
        basic::concat_rows(self, parts)
    }

    fn embed(&self, table: &Weight<D>, ids: &[u32]) -> Tensor<D> {
        matmul::embed(self, table, ids)
    }

    fn rms_norm(&self, x: &Tensor<D>, w: &Weight<D>, eps: f32) -> Tensor<D> {
        basic::rms_norm(self, x, w, eps)
    }

    fn matmul(&self, w: &Weight<D>, x: &Tensor<D>) -> Tensor<D> {
        matmul::matmul(self, w, x)
    }

    fn matmul_many(&self, ws: &[&Weight<D>], x: &Tensor<D>) -> Vec<Tensor<D>> {
        matmul::matmul_many(self, ws, x)
    }

    fn add_assign(&self, x: &mut Tensor<D>, y: &Tensor<D>) {
        basic::add_assign(self, x, y)
    }

    fn add_scaled_rows(&self, y: &mut Tensor<D>, x: &Tensor<D>, scales: &[f32]) {
        basic::add_scaled_rows(self, y, x, scales)
    }

    fn swiglu(&self, gate: &Tensor<D>, up: &Tensor<D>) -> Tensor<D> {
        basic::swiglu(self, gate, up)
    }

    fn new_kv(&self, p: &AttnParams, types: KvTypes) -> Result<Kv<D>, BackendError> {
        attention::new_kv(self, p, types)
    }

    fn kv_len(&self, kv: &Kv<D>) -> usize {
        kv.len
    }

    fn kv_bytes(&self, kv: &Kv<D>) -> u64 {
        self.dev.size(&kv.k.mem) + self.dev.size(&kv.v.mem)
    }

    fn kv_reserve(&self, kv: &mut Kv<D>, positions: usize) -> Result<(), BackendError> {
        attention::reserve_exact(self, kv, positions)
    }

    fn kv_truncate(&self, kv: &mut Kv<D>, len: usize) {
        kv.len = kv.len.min(len);
    }

    fn kv_copy(&self, from: &Kv<D>, to: &mut Kv<D>) {
        attention::kv_copy(self, from, to)
    }

    fn attention(
        &self,
        p: &AttnParams,
        qg: &Tensor<D>,
        k: &Tensor<D>,
        v: &Tensor<D>,
        q_norm: &Weight<D>,
        k_norm: &Weight<D>,
        kv: &mut Kv<D>,
        pos0: usize,
        rope: &[f32],
    ) -> Tensor<D> {
        attention::attention(self, p, qg, k, v, q_norm, k_norm, kv, pos0, rope)
    }

    fn new_recurrent(&self, p: &GdnParams) -> Recurrent<D> {
        gdn::new_recurrent(self, p)
    }

    fn recurrent_copy(&self, from: &Recurrent<D>, to: &mut Recurrent<D>) {
        gdn::recurrent_copy(self, from, to)
    }

    fn recurrent_bytes(&self, rs: &Recurrent<D>) -> u64 {
        self.dev.size(&rs.conv) + self.dev.size(&rs.ssm)
    }

    fn gdn(
        &self,
        p: &GdnParams,
        mixed: &Tensor<D>,
        z: &Tensor<D>,
        b: &Tensor<D>,
        a: &Tensor<D>,
        w: &GdnWeights<'_, Weight<D>>,
        state: &mut Recurrent<D>,
    ) -> Tensor<D> {
        gdn::gdn_with(self, p, mixed, z, b, a, w, state, GdnForm::Auto)
    }

    fn argmax_rows(&self, x: &Tensor<D>) -> Vec<u32> {
        attention::argmax_rows(self, x)
    }

    fn layer_norm(&self, x: &Tensor<D>, w: &Weight<D>, b: &Weight<D>, eps: f32) -> Tensor<D> {
        vision::layer_norm(self, x, w, b, eps)
    }

    fn add_bias(&self, x: &mut Tensor<D>, b: &Weight<D>) {
        vision::add_bias(self, x, b)
    }

    fn gelu(&self, x: &Tensor<D>) -> Tensor<D> {
        vision::gelu(self, x)
    }

    fn reshape(&self, t: Tensor<D>, rows: usize, cols: usize) -> Tensor<D> {
        assert_eq!(
            rows * cols,
            t.len(),
            "reshape of [{}, {}] to [{rows}, {cols}]",
            t.rows,
            t.cols
        );
        Tensor {
            buf: t.buf,
            rows,
            cols,
        }
    }

    fn vision_attention(
        &self,
        qkv: &Tensor<D>,
        n_head: usize,
        head_dim: usize,
        rope: &[f32],
    ) -> Tensor<D> {
        vision::vision_attention(self, qkv, n_head, head_dim, rope)
    }
}
