//! Choosing a backend by name, shared by the CLI and the server.

use super::cpu::CpuBackend;
use super::wgpu::WgpuBackend;
use super::BackendError;

/// The backend a command runs on.
pub enum Picked {
    Cpu(CpuBackend),
    Wgpu(WgpuBackend),
}

impl Picked {
    pub fn name(&self) -> &'static str {
        match self {
            Picked::Cpu(_) => "cpu",
            Picked::Wgpu(_) => "wgpu",
        }
    }
}

/// `cpu`, `wgpu`, `cuda` or `auto`. `auto` takes wgpu when a hardware adapter exists and says
/// why it fell back to the CPU otherwise; an explicit backend that cannot start is an error
/// naming the reason.
pub fn pick(name: &str) -> Result<Picked, BackendError> {
    match name {
        "cpu" => Ok(Picked::Cpu(CpuBackend::new())),
        "wgpu" => {
            let be = WgpuBackend::new()?;
            eprintln!("{}", be.gpu.describe());
            Ok(Picked::Wgpu(be))
        }
        "cuda" => Err(BackendError::Unavailable(
            "cuda".into(),
            "not in this build (the CUDA backend has not landed yet)".into(),
        )),
        "auto" => match WgpuBackend::new() {
            // A software rasterizer (lavapipe, WARP) is slower than the CPU backend.
            Ok(be) if be.gpu.info.device_type == wgpu::DeviceType::Cpu => {
                eprintln!(
                    "backend: cpu (auto: the only wgpu adapter, {:?}, is a software renderer; --backend wgpu forces it)",
                    be.gpu.info.name
                );
                Ok(Picked::Cpu(CpuBackend::new()))
            }
            Ok(be) => {
                eprintln!("backend: wgpu (auto); {}", be.gpu.describe());
                Ok(Picked::Wgpu(be))
            }
            Err(e) => {
                eprintln!("backend: cpu (auto: {e})");
                Ok(Picked::Cpu(CpuBackend::new()))
            }
        },
        other => Err(BackendError::Unavailable(
            other.into(),
            "unknown backend (expected cpu, wgpu, cuda or auto)".into(),
        )),
    }
}
