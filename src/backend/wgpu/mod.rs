//! The portable GPU backend: WGSL shaders (`shaders/*.wgsl`, one op each) through wgpu, on
//! Vulkan, Metal, DX12, or Mesa's lavapipe on a CPU-only machine.
//!
//! The op logic is `backend::gpu`'s, shared with the CUDA backend; this module is the device
//! under it: adapter and limits, the shader preprocessor, pipelines and bind groups, the
//! command encoder. Every op runs on the device; nothing falls back to the CPU. Weights are
//! uploaded once in their stored dtype (the kernels decode them) and split by rows when larger
//! than the adapter's storage binding limit.

pub mod device;
pub mod shaders;

use super::gpu::{AllocRule, GpuBackend};
use super::BackendError;
pub use device::Gpu;

/// The wgpu backend: the GPU op layer on a wgpu device.
pub type WgpuBackend = GpuBackend<Gpu>;

impl GpuBackend<Gpu> {
    /// Opens the first adapter (honouring `WGPU_BACKEND` / `WGPU_ADAPTER_NAME`), or says why
    /// there is none.
    pub fn new() -> Result<WgpuBackend, BackendError> {
        Ok(GpuBackend::on(Gpu::new()?))
    }
}

/// wgpu's allocation rule for a device whose storage bindings hold `binding_limit` bytes
/// (buffers padded to whole words, weights split at the limit): what the planner prices.
pub fn alloc_rule(binding_limit: u64) -> AllocRule {
    AllocRule {
        binding_limit,
        pad_to_word: true,
    }
}
