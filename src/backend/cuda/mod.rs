//! The CUDA backend (`--features cuda`): the kernels in `cuda/*.cu`, one op each, ported from
//! the verified WGSL in `shaders/` with the same algorithms and numerics, compiled with NVRTC at
//! first use and launched through the driver API (cudarc, loaded at run time: a build with this
//! feature still starts on a machine without CUDA, and says why the backend is unavailable).
//!
//! As on wgpu, every op runs on the device and nothing falls back to the CPU. Weights are
//! uploaded once in their stored dtype (quantized blocks stay quantized; the kernels decode
//! them), each in one allocation; activations come from a buffer pool; one stream orders all
//! work, so a decode step is a queue of launches and the host waits only to read back what it
//! asked for (the sampled ids, or logits).

pub mod attention;
pub mod basic;
pub mod device;
pub mod emu;
pub mod gdn;
pub mod kernels;
pub mod matmul;

use std::sync::Arc;

use super::{
    AttnParams, Backend, BackendError, GdnParams, GdnWeights, KvTypes, WeightBytes, WeightSource,
};
use crate::quant::hadamard::GdnPermutation;
use crate::tensor::GgmlType;
pub use device::{Arg, DBuf, Device, PBuf};

pub struct CudaBackend {
    pub dev: Arc<Device>,
}

impl CudaBackend {
    /// Opens the first CUDA device (`CUDA_VISIBLE_DEVICES` chooses which one that is), or says
    /// why there is none: no driver library, no device, no NVRTC. Never panics.
    pub fn new() -> Result<CudaBackend, BackendError> {
        Ok(CudaBackend {
            dev: Arc::new(Device::new(0)?),
        })
    }

    /// The backend on the CPU emulator of a device (`emu.rs`): the same host code and kernels,
    /// for checking them where there is no GPU. Slow; tests only.
    pub fn emulated() -> Result<CudaBackend, BackendError> {
        Ok(CudaBackend {
            dev: Arc::new(Device::emulated()?),
        })
    }

    /// `(free, total)` device memory in bytes, from cuMemGetInfo: the budget the planner may
    /// use for this device.
    pub fn mem_info(&self) -> Result<(u64, u64), BackendError> {
        self.dev.mem_info()
    }
}

/// `(free, total)` bytes of the first CUDA device without opening a backend, or why there is
/// none (the planner's budget for `--backend cuda`).
pub fn device_memory() -> Result<(u64, u64), BackendError> {
    device::memory(0)
}

/// A row-major `[rows, cols]` f32 activation in a pooled device buffer.
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
    pub fn ptr(&self) -> u64 {
        self.buf.ptr()
    }
}

/// The input transform of a Hadamard-folded weight, on the device.
pub struct CudaFold {
    pub block: usize,
    /// ±1 per input column; `None` in `identity` sign mode.
    pub signs: Option<DBuf>,
    pub perm: Option<GdnPermutation>,
}

pub struct Weight {
    pub name: String,
    pub ty: GgmlType,
    pub ne0: usize,
    pub rows: usize,
    pub row_bytes: usize,
    /// The stored bytes (matrices), in one allocation.
    pub data: Option<DBuf>,
    /// Small 1-D weights (norms, biases, conv taps) decoded once to f32.
    pub dense: Option<DBuf>,
    /// Forward rule on the input of a folded matmul.
    pub fold: Option<CudaFold>,
    /// Inverse rule after a row lookup in an inverse-folded embedding.
    pub inverse: Option<CudaFold>,
}

impl Weight {
    /// The f32 values of a weight decoded at upload.
    pub fn dense(&self) -> u64 {
        self.dense
            .as_ref()
            .unwrap_or_else(|| panic!("{}: dense view of a matrix weight", self.name))
            .ptr()
    }

    /// Bytes this weight holds on the device.
    pub fn device_bytes(&self) -> u64 {
        [&self.data, &self.dense]
            .into_iter()
            .flatten()
            .map(|b| b.size() as u64)
            .sum()
    }
}

impl CudaBackend {
    fn fold_on_device(
        &self,
        h: &crate::quant::hadamard::HadamardConfig,
        width: usize,
        perm: Option<GdnPermutation>,
    ) -> Result<CudaFold, BackendError> {
        let signs = match h.signs(width) {
            Some(s) => Some(self.dev.upload_exact(bytemuck::cast_slice(s))?),
            None => None,
        };
        Ok(CudaFold {
            block: h.block_size,
            signs,
            perm,
        })
    }
}

impl Backend for CudaBackend {
    type T = Tensor;
    type W = Weight;
    type Kv = attention::Kv;
    type Rs = gdn::Recurrent;

    fn name(&self) -> &'static str {
        "cuda"
    }

    fn upload(&self, w: &WeightSource) -> Result<Weight, BackendError> {
        let ty = w.info.ty;
        // The kernels decode every type tern computes with.
        if !ty.can_compute() {
            return Err(BackendError::UnsupportedType {
                name: w.info.name.clone(),
                ty,
                backend: "cuda",
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
            data: None,
            dense: None,
            fold: None,
            inverse: None,
        };
        if w.decode_once() {
            let f = w.decoded()?;
            out.dense = Some(self.dev.upload_exact(bytemuck::cast_slice(&f))?);
        } else {
            out.data = Some(self.dev.upload_exact(bytes)?);
        }
        if let Some(f) = &w.fold {
            out.fold = Some(self.fold_on_device(&f.hadamard, ne0, f.perm)?);
        }
        if let Some(h) = &w.inverse {
            out.inverse = Some(self.fold_on_device(h, ne0, None)?);
        }
        Ok(out)
    }

    fn weight_bytes(&self, w: &Weight) -> WeightBytes {
        let signs = |f: &Option<CudaFold>| {
            f.as_ref()
                .and_then(|f| f.signs.as_ref())
                .map_or(0, |b| b.size() as u64)
        };
        WeightBytes {
            tensor: w.name.clone(),
            mapped: 0,
            owned: w.device_bytes() + signs(&w.fold) + signs(&w.inverse),
        }
    }

    fn compute_bytes(&self) -> Option<u64> {
        Some(self.dev.pooled_bytes())
    }

    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Tensor {
        assert_eq!(data.len(), rows * cols);
        Tensor {
            buf: self.dev.upload(bytemuck::cast_slice(data)),
            rows,
            cols,
        }
    }

    fn to_host(&self, t: &Tensor) -> Vec<f32> {
        self.dev.read_f32(t.ptr(), t.len())
    }

    fn rows(&self, t: &Tensor, start: usize, n: usize) -> Tensor {
        assert!(
            start + n <= t.rows,
            "rows {start}..{} of {}",
            start + n,
            t.rows
        );
        let out = basic::new_tensor(self, n, t.cols);
        self.dev.copy(
            t.ptr() + (start * t.cols * 4) as u64,
            out.ptr(),
            n * t.cols * 4,
        );
        out
    }

    fn concat_cols(&self, a: &Tensor, b: &Tensor) -> Tensor {
        basic::concat_cols(self, a, b)
    }

    fn concat_rows(&self, parts: &[&Tensor]) -> Tensor {
        let cols = parts[0].cols;
        let rows: usize = parts.iter().map(|p| p.rows).sum();
        let out = basic::new_tensor(self, rows, cols);
        let mut at = 0u64;
        for p in parts {
            assert_eq!(p.cols, cols, "concat_rows: column counts differ");
            let n = p.len() * 4;
            self.dev.copy(p.ptr(), out.ptr() + at, n);
            at += n as u64;
        }
        out
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

    fn recurrent_bytes(&self, rs: &gdn::Recurrent) -> u64 {
        (rs.conv.size() + rs.ssm.size()) as u64
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
