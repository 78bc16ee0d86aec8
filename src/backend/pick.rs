//! Choosing a backend by name, shared by the CLI and the server.

use super::cpu::CpuBackend;
#[cfg(feature = "cuda")]
use super::cuda::CudaBackend;
use super::gpu::Device as _;
use super::wgpu::WgpuBackend;
use super::BackendError;

/// The backend a command runs on.
pub enum Picked {
    Cpu(CpuBackend),
    Wgpu(WgpuBackend),
    #[cfg(feature = "cuda")]
    Cuda(CudaBackend),
}

impl Picked {
    pub fn name(&self) -> &'static str {
        match self {
            Picked::Cpu(_) => "cpu",
            Picked::Wgpu(_) => "wgpu",
            #[cfg(feature = "cuda")]
            Picked::Cuda(_) => "cuda",
        }
    }
}

/// Whether this build has the CUDA backend (`--features cuda`).
pub const CUDA_BUILT: bool = cfg!(feature = "cuda");

/// Opens the CUDA backend with its description line, or says why it cannot: not built in, no
/// driver, no device, no NVRTC. Never panics.
#[cfg(feature = "cuda")]
fn open_cuda() -> Result<(Picked, String), BackendError> {
    let be = CudaBackend::new()?;
    let line = be.dev.describe();
    Ok((Picked::Cuda(be), line))
}

#[cfg(not(feature = "cuda"))]
fn open_cuda() -> Result<(Picked, String), BackendError> {
    Err(BackendError::Unavailable(
        "cuda".into(),
        "this build has no CUDA backend: rebuild with `cargo build --release --features cuda`"
            .into(),
    ))
}

/// `(free, total)` bytes of the device a backend would run on, where the backend can tell:
/// cuda's cuMemGetInfo (the planner's budget for `--backend cuda`); `None` for the others (wgpu
/// has no such query; the CPU's figure is MemAvailable) and for a build without cuda.
pub fn device_memory(name: &str) -> Option<Result<(u64, u64), BackendError>> {
    match name {
        #[cfg(feature = "cuda")]
        "cuda" => Some(super::cuda::device_memory()),
        _ => None,
    }
}

/// `cpu`, `wgpu`, `cuda` or `auto`. `auto` takes cuda when built in and a device is present,
/// else wgpu when a hardware adapter exists, and says why it passed over each; an explicit
/// backend that cannot start is an error naming the reason. The CPU backend is the f32
/// reference (`tern logits`, perplexity, KLD); the serving commands use [`pick_serving`].
pub fn pick(name: &str) -> Result<Picked, BackendError> {
    pick_with(name, true, false)
}

/// [`pick`] for `generate` and `serve`: the CPU backend runs int8 activations unless
/// `cpu_exact` (`--cpu-exact`), on matrices packed at load when `repack` (`--repack`).
pub fn pick_serving(name: &str, cpu_exact: bool, repack: bool) -> Result<Picked, BackendError> {
    pick_with(name, cpu_exact, repack)
}

fn pick_with(name: &str, cpu_exact: bool, repack: bool) -> Result<Picked, BackendError> {
    let cpu = || {
        let be = CpuBackend::serving(cpu_exact, repack);
        let how = match (cpu_exact, repack) {
            (true, _) => "f32 activations (--cpu-exact)",
            (false, true) => "int8 activations on quantized weights",
            (false, false) => "int8 activations on quantized weights read in place (--no-repack)",
        };
        tracing::debug!(target: "tern::backend", "cpu matmuls: {how}");
        be
    };
    match name {
        "cpu" => Ok(Picked::Cpu(cpu())),
        "wgpu" => {
            let be = WgpuBackend::new()?;
            tracing::info!(target: "tern::backend", "{}", be.dev.describe());
            Ok(Picked::Wgpu(be))
        }
        "cuda" => {
            let (picked, line) = open_cuda()?;
            tracing::info!(target: "tern::backend", "{line}");
            Ok(picked)
        }
        "auto" => {
            match open_cuda() {
                Ok((picked, line)) => {
                    tracing::info!(target: "tern::backend", "backend: cuda (auto); {line}");
                    return Ok(picked);
                }
                // Only a build with the feature has something to say about CUDA.
                Err(e) if CUDA_BUILT => {
                    tracing::info!(target: "tern::backend", "backend: not cuda (auto: {e})")
                }
                Err(_) => {}
            }
            match WgpuBackend::new() {
                // A software rasterizer (lavapipe, WARP) is slower than the CPU backend.
                Ok(be) if be.dev.info.device_type == wgpu::DeviceType::Cpu => {
                    tracing::info!(
                        target: "tern::backend",
                        "backend: cpu (auto: the only wgpu adapter, {:?}, is a software renderer; --backend wgpu forces it)",
                        be.dev.info.name
                    );
                    Ok(Picked::Cpu(cpu()))
                }
                Ok(be) => {
                    tracing::info!(target: "tern::backend", "backend: wgpu (auto); {}", be.dev.describe());
                    Ok(Picked::Wgpu(be))
                }
                Err(e) => {
                    tracing::info!(target: "tern::backend", "backend: cpu (auto: {e})");
                    Ok(Picked::Cpu(cpu()))
                }
            }
        }
        other => Err(BackendError::Unavailable(
            other.into(),
            "unknown backend (expected cpu, wgpu, cuda or auto)".into(),
        )),
    }
}
