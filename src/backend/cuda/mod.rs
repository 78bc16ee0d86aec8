//! The CUDA backend (`--features cuda`): the kernels in `cuda/*.cu`, one op each, ported from
//! the verified WGSL in `shaders/` with the same algorithms, arguments and constants, compiled
//! with NVRTC at first use and launched through the driver API (cudarc, loaded at run time: a
//! build with this feature still starts on a machine without CUDA, and says why the backend is
//! unavailable).
//!
//! The op logic is `backend::gpu`'s, shared with wgpu; this module is the device under it. As
//! on wgpu, every op runs on the device and nothing falls back to the CPU. Weights are uploaded
//! once in their stored dtype, each in one allocation; activations come from the shared buffer
//! pool; one stream orders all work, so a decode step is a queue of launches and the host waits
//! only to read back what it asked for (the sampled ids, or logits).

pub mod device;
pub mod emu;
pub mod kernels;
pub mod nvrtc_lib;

use super::gpu::GpuBackend;
use super::BackendError;
pub use device::{Arg, DBuf, Device};

/// The CUDA backend: the GPU op layer on a CUDA device (or its CPU emulator).
pub type CudaBackend = GpuBackend<Device>;

impl GpuBackend<Device> {
    /// Opens the first CUDA device (`CUDA_VISIBLE_DEVICES` chooses which one that is), or says
    /// why there is none: no driver library, no device, no NVRTC. Never panics.
    pub fn new() -> Result<CudaBackend, BackendError> {
        Ok(GpuBackend::on(Device::new(0)?))
    }

    /// The backend on the CPU emulator of a device (`emu.rs`): the same host code and kernels,
    /// for checking them where there is no GPU. Slow; tests only.
    pub fn emulated() -> Result<CudaBackend, BackendError> {
        Ok(GpuBackend::on(Device::emulated()?))
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
