//! The portable GPU backend: WGSL shaders (`shaders/*.wgsl`, one op each) through wgpu, on
//! Vulkan, Metal, DX12, or Mesa's lavapipe on a CPU-only machine.
//!
//! Every op runs on the device; nothing falls back to the CPU on the hot path. Weights are
//! uploaded once in their stored dtype (quantized blocks stay quantized; the kernels decode
//! them) and split by rows when larger than the adapter's storage binding limit.

pub mod attention;
pub mod basic;
pub mod gdn;
pub mod gpu;
pub mod matmul;

use std::sync::Arc;

use super::{AttnParams, Backend, BackendError, GdnParams, GdnWeights, KvTypes, WeightSource};
use crate::quant::hadamard::GdnPermutation;
use crate::tensor::GgmlType;
pub use gpu::{Bind, Gpu, PBuf};

pub struct WgpuBackend {
    pub gpu: Arc<Gpu>,
}

impl WgpuBackend {
    pub fn new() -> Result<WgpuBackend, BackendError> {
        Ok(WgpuBackend {
            gpu: Arc::new(Gpu::new()?),
        })
    }
}

/// A row-major `[rows, cols]` f32 activation in a pooled storage buffer.
pub struct Tensor {
    pub buf: PBuf,
    pub rows: usize,
    pub cols: usize,
}

impl Tensor {
    pub fn len(&self) -> usize {
        self.rows * self.cols
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
    pub fn bind(&self) -> Bind<'_> {
        Bind {
            buf: self.buf.buffer(),
            offset: 0,
            size: Some((self.len() as u64 * 4).max(4)),
        }
    }
}

/// Rows `[row0, row0 + n_rows)` of a weight, in a buffer of their own.
pub struct WeightPart {
    pub buf: wgpu::Buffer,
    pub row0: usize,
    pub n_rows: usize,
}

/// The input transform of a Hadamard-folded weight, on the device.
pub struct GpuFold {
    pub block: usize,
    /// ±1 per input column; `None` in `identity` sign mode.
    pub signs: Option<wgpu::Buffer>,
    pub perm: Option<GdnPermutation>,
}

pub struct Weight {
    pub name: String,
    pub ty: GgmlType,
    pub ne0: usize,
    pub rows: usize,
    pub row_bytes: usize,
    /// The stored bytes, split by rows to fit `max_storage_buffer_binding_size`.
    pub parts: Vec<WeightPart>,
    /// Small 1-D weights (norms, biases, conv taps) decoded once to f32.
    pub dense: Option<wgpu::Buffer>,
    /// Forward rule on the input of a folded matmul.
    pub fold: Option<GpuFold>,
    /// Inverse rule after a row lookup in an inverse-folded embedding.
    pub inverse: Option<GpuFold>,
}

impl Weight {
    pub fn dense(&self) -> &wgpu::Buffer {
        self.dense
            .as_ref()
            .unwrap_or_else(|| panic!("{}: dense view of a matrix weight", self.name))
    }
}

impl WgpuBackend {
    fn fold_on_device(
        &self,
        h: &crate::quant::hadamard::HadamardConfig,
        width: usize,
        perm: Option<GdnPermutation>,
    ) -> GpuFold {
        let signs = h
            .signs(width)
            .map(|s| self.gpu.upload("signs", bytemuck::cast_slice(s)));
        GpuFold {
            block: h.block_size,
            signs,
            perm,
        }
    }
}

/// Rows per buffer of a weight split to fit a storage binding of `limit` bytes.
fn rows_per_part(row_bytes: usize, limit: usize) -> usize {
    (limit / row_bytes.max(1)).max(1)
}

/// Bytes of a buffer holding `n` bytes (`GpuContext::upload` pads to 4).
fn padded(n: u64) -> u64 {
    n.div_ceil(4).max(1) * 4
}

/// What `upload` allocates for `w` on a device whose storage bindings hold `binding_limit`
/// bytes: the stored rows (one buffer per part), or the f32 copy of a small weight, plus a
/// sign vector per Hadamard rule it carries.
pub fn planned_weight_bytes(w: &WeightSource, binding_limit: u64) -> crate::backend::WeightBytes {
    let (ne0, rows) = w.shape2();
    let row_bytes = w.info.row_bytes() as usize;
    let mut owned = if w.decode_once() {
        padded((ne0 as u64).saturating_mul(rows as u64).saturating_mul(4))
    } else {
        let per_part = rows_per_part(row_bytes, binding_limit.min(usize::MAX as u64) as usize);
        let (full, rest) = (rows / per_part, rows % per_part);
        let part = |n: usize| padded((n as u64).saturating_mul(row_bytes as u64));
        (full as u64)
            .saturating_mul(part(per_part))
            .saturating_add(if rest > 0 { part(rest) } else { 0 })
    };
    for n in w.sign_vectors() {
        owned = owned.saturating_add(padded(n as u64 * 4));
    }
    crate::backend::WeightBytes {
        tensor: w.info.name.clone(),
        mapped: 0,
        owned,
    }
}

impl Backend for WgpuBackend {
    type T = Tensor;
    type W = Weight;
    type Kv = attention::Kv;
    type Rs = gdn::Recurrent;

    fn name(&self) -> &'static str {
        "wgpu"
    }

    fn upload(&self, w: &WeightSource) -> Result<Weight, BackendError> {
        let ty = w.info.ty;
        // The kernels decode every type tern computes with.
        if !ty.can_compute() {
            return Err(BackendError::UnsupportedType {
                name: w.info.name.clone(),
                ty,
                backend: "wgpu",
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
            let f = w.decoded()?;
            out.dense = Some(self.gpu.upload(&w.info.name, bytemuck::cast_slice(&f)));
        } else {
            let limit = self.gpu.limits.max_storage_buffer_binding_size as usize;
            let per_part = rows_per_part(row_bytes, limit);
            let mut row0 = 0;
            while row0 < rows {
                let n = per_part.min(rows - row0);
                let buf = self.gpu.upload(
                    &w.info.name,
                    &bytes[row0 * row_bytes..(row0 + n) * row_bytes],
                );
                out.parts.push(WeightPart {
                    buf,
                    row0,
                    n_rows: n,
                });
                row0 += n;
            }
        }
        if let Some(f) = &w.fold {
            out.fold = Some(self.fold_on_device(&f.hadamard, ne0, f.perm));
        }
        if let Some(h) = &w.inverse {
            out.inverse = Some(self.fold_on_device(h, ne0, None));
        }
        Ok(out)
    }

    fn compute_bytes(&self) -> Option<u64> {
        Some(self.gpu.pooled_bytes())
    }

    fn weight_bytes(&self, w: &Weight) -> crate::backend::WeightBytes {
        let signs = |f: &Option<GpuFold>| {
            f.as_ref()
                .and_then(|f| f.signs.as_ref())
                .map_or(0, |b| b.size())
        };
        crate::backend::WeightBytes {
            tensor: w.name.clone(),
            mapped: 0,
            owned: w.parts.iter().map(|p| p.buf.size()).sum::<u64>()
                + w.dense.as_ref().map_or(0, |b| b.size())
                + signs(&w.fold)
                + signs(&w.inverse),
        }
    }

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Tensor {
        assert_eq!(data.len(), rows * cols);
        Tensor {
            buf: self.gpu.upload_pooled(bytemuck::cast_slice(data)),
            rows,
            cols,
        }
    }

    fn to_host(&self, t: &Tensor) -> Vec<f32> {
        self.gpu.read_f32(t.buf.buffer(), 0, t.len())
    }

    fn rows(&self, t: &Tensor, start: usize, n: usize) -> Tensor {
        let out = self.gpu.alloc((n * t.cols * 4) as u64);
        self.gpu.copy(
            t.buf.buffer(),
            (start * t.cols * 4) as u64,
            out.buffer(),
            0,
            (n * t.cols * 4) as u64,
        );
        Tensor {
            buf: out,
            rows: n,
            cols: t.cols,
        }
    }

    fn concat_cols(&self, a: &Tensor, b: &Tensor) -> Tensor {
        basic::concat_cols(self, a, b)
    }

    fn concat_rows(&self, parts: &[&Tensor]) -> Tensor {
        let cols = parts[0].cols;
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        let out = self.gpu.alloc((rows * cols * 4) as u64);
        let mut at = 0u64;
        for p in parts {
            assert_eq!(p.cols, cols, "concat_rows: column counts differ");
            let n = (p.len() * 4) as u64;
            self.gpu.copy(p.buf.buffer(), 0, out.buffer(), at, n);
            at += n;
        }
        Tensor {
            buf: out,
            rows,
            cols,
        }
    }

    fn embed(&self, table: &Weight, ids: &[u32]) -> Tensor {
        matmul::embed(self, table, ids)
    }

    fn rms_norm(&self, x: &Tensor, w: &Weight, eps: f32) -> Tensor {
        basic::rms_norm(self, x, w, eps)
    }

    fn matmul(&self, w: &Weight, x: &Tensor) -> Tensor {
        matmul::matmul(self, w, x)
    }

    fn add_assign(&self, x: &mut Tensor, y: &Tensor) {
        basic::add_assign(self, x, y)
    }

    fn swiglu(&self, gate: &Tensor, up: &Tensor) -> Tensor {
        basic::swiglu(self, gate, up)
    }

    fn new_kv(&self, p: &AttnParams, types: KvTypes) -> Result<attention::Kv, BackendError> {
        attention::new_kv(self, p, types)
    }

    fn kv_len(&self, kv: &attention::Kv) -> usize {
        kv.len
    }

    fn kv_bytes(&self, kv: &attention::Kv) -> u64 {
        (kv.k.buf.size() + kv.v.buf.size()) as u64
    }

    fn recurrent_bytes(&self, rs: &gdn::Recurrent) -> u64 {
        rs.conv.size() + rs.ssm.size()
    }

    fn kv_reserve(&self, kv: &mut attention::Kv, positions: usize) -> Result<(), BackendError> {
        attention::reserve_exact(self, kv, positions)
    }

    fn kv_truncate(&self, kv: &mut attention::Kv, len: usize) {
        kv.len = kv.len.min(len);
    }

    fn attention(
        &self,
        p: &AttnParams,
        qg: &Tensor,
        k: &Tensor,
        v: &Tensor,
        q_norm: &Weight,
        k_norm: &Weight,
        kv: &mut attention::Kv,
        pos0: usize,
    ) -> Tensor {
        attention::attention(self, p, qg, k, v, q_norm, k_norm, kv, pos0)
    }

    fn new_recurrent(&self, p: &GdnParams) -> gdn::Recurrent {
        gdn::new_recurrent(self, p)
    }

    fn recurrent_copy(&self, from: &gdn::Recurrent, to: &mut gdn::Recurrent) {
        gdn::recurrent_copy(self, from, to)
    }

    fn gdn(
        &self,
        p: &GdnParams,
        mixed: &Tensor,
        z: &Tensor,
        b: &Tensor,
        a: &Tensor,
        w: &GdnWeights<'_, Weight>,
        state: &mut gdn::Recurrent,
    ) -> Tensor {
        gdn::gdn(self, p, mixed, z, b, a, w, state)
    }

    fn argmax_rows(&self, x: &Tensor) -> Vec<u32> {
        attention::argmax_rows(self, x)
    }
}
