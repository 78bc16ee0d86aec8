//! Shared helpers for the op-level tests: seeded random data, weights built in memory, the
//! NMSE comparison, and the list of backends present on this machine.
#![allow(dead_code)]

pub mod vision;

use std::sync::{Arc, OnceLock};

use tern::backend::cpu::CpuBackend;
use tern::backend::gpu::Device as _;
use tern::backend::wgpu::WgpuBackend;
use tern::backend::{nmse, Fold, WeightSource};
use tern::gguf::{Gguf, GgufWriter, Value};
use tern::quant::hadamard::HadamardConfig;
use tern::tensor::GgmlType;

/// splitmix64: deterministic test data.
pub struct Rng(pub u64);

impl Rng {
    pub fn next_u64(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }
    /// Uniform in [-1, 1).
    pub fn f32(&mut self) -> f32 {
        (self.next_u64() >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    }
    pub fn vec(&mut self, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| self.f32() * scale).collect()
    }
    pub fn below(&mut self, n: u64) -> u64 {
        self.next_u64() % n
    }
}

/// A weight `{ne0, rows}` of type `ty` quantized from `data`, as the model would hand it to a
/// backend (in an in-memory GGUF), optionally with a fold.
pub fn weight(name: &str, ty: GgmlType, ne0: usize, rows: usize, data: &[f32]) -> WeightSource {
    assert_eq!(data.len(), ne0 * rows);
    let mut bytes = Vec::new();
    for r in 0..rows {
        bytes.extend(tern::quant::quantize_row(ty, &data[r * ne0..(r + 1) * ne0]).unwrap());
    }
    let dims: Vec<u64> = if rows == 1 {
        vec![ne0 as u64]
    } else {
        vec![ne0 as u64, rows as u64]
    };
    let mut w = GgufWriter::new();
    w.add_tensor(name, &dims, ty, bytes);
    let file = Arc::new(Gguf::from_bytes(format!("{name}.gguf"), w.to_bytes()).unwrap());
    let info = file.tensor(name).unwrap().clone();
    WeightSource {
        file,
        info,
        fold: None,
        inverse: None,
    }
}

pub fn with_fold(
    mut w: WeightSource,
    h: &Arc<HadamardConfig>,
    perm: Option<tern::quant::hadamard::GdnPermutation>,
) -> WeightSource {
    w.fold = Some(Fold {
        hadamard: h.clone(),
        perm,
    });
    w
}

/// A valid `prism.hadamard` config with sign vectors (explicit mode) or without (identity) for
/// `widths`; `widths[0]` is also the embedding width.
pub fn hadamard(block: usize, widths: &[usize], explicit: bool, seed: u64) -> Arc<HadamardConfig> {
    let mut rng = Rng(seed);
    let mut g = GgufWriter::new();
    g.set("general.architecture", Value::String("qwen35".into()));
    g.set("prism.hadamard.version", Value::U32(1));
    g.set("prism.hadamard.block_size", Value::U32(block as u32));
    g.set(
        "prism.hadamard.transform",
        Value::String("normalized-sylvester-walsh-hadamard".into()),
    );
    g.set(
        "prism.hadamard.axis",
        Value::String("input-last-dimension".into()),
    );
    if explicit {
        g.set("prism.hadamard.sign_mode", Value::String("explicit".into()));
        let sw: Vec<i32> = widths.iter().map(|&w| w as i32).collect();
        g.set("prism.hadamard.sign_widths", Value::i32_array(&sw));
        let total: usize = widths.iter().sum();
        let sv: Vec<i32> = (0..total)
            .map(|_| if rng.below(2) == 0 { 1 } else { -1 })
            .collect();
        g.set("prism.hadamard.sign_values", Value::i32_array(&sv));
    } else {
        g.set("prism.hadamard.sign_mode", Value::String("identity".into()));
    }
    let names: Vec<String> = (0..widths.len())
        .map(|i| format!("blk.{i}.ffn_down.weight"))
        .collect();
    g.set("prism.hadamard.weight_names", Value::str_array(&names));
    g.set(
        "prism.hadamard.inverse_weight_names",
        Value::str_array(&["token_embd.weight"]),
    );
    for (name, &w) in names.iter().zip(widths) {
        g.add_f32(name, &[w as u64, 2], &vec![0.0; 2 * w]);
    }
    g.add_f32(
        "token_embd.weight",
        &[widths[0] as u64, 2],
        &vec![0.0; 2 * widths[0]],
    );
    let file = Gguf::from_bytes("hadamard.gguf", g.to_bytes()).unwrap();
    Arc::new(HadamardConfig::from_gguf(&file).unwrap().expect("config"))
}

/// Asserts NMSE(ours, reference) <= tol, printing the figure either way.
pub fn assert_close(what: &str, ours: &[f32], reference: &[f32], tol: f64) {
    assert_eq!(ours.len(), reference.len(), "{what}: length");
    assert!(
        ours.iter().all(|v| v.is_finite()),
        "{what}: non-finite output"
    );
    let e = nmse(ours, reference);
    println!("{what}: NMSE {e:.3e} (tolerance {tol:e})");
    assert!(e <= tol, "{what}: NMSE {e:e} > {tol:e}");
}

pub fn cpu() -> CpuBackend {
    CpuBackend::new()
}

/// The wgpu backend when an adapter exists (lavapipe in CI), shared by the tests of one
/// binary; `None` with the reason printed otherwise. With `TERN_REQUIRE_WGPU=1` (CI, and a GPU
/// machine's run) a missing adapter fails instead of skipping, as `TERN_REQUIRE_CUDA` does.
pub fn wgpu() -> Option<&'static WgpuBackend> {
    static BE: OnceLock<Result<WgpuBackend, String>> = OnceLock::new();
    let r = BE.get_or_init(|| {
        WgpuBackend::new()
            .inspect(|b| eprintln!("{}", b.dev.describe()))
            .map_err(|e| e.to_string())
    });
    match r {
        Ok(b) => Some(b),
        Err(why) => {
            assert!(
                std::env::var("TERN_REQUIRE_WGPU").as_deref() != Ok("1"),
                "TERN_REQUIRE_WGPU=1 but {why}"
            );
            eprintln!("wgpu tests skipped: {why}");
            None
        }
    }
}

/// The CUDA backend when a device is present (built with `--features cuda`), shared by the
/// tests of one binary; otherwise the reason, which each skipped test prints. Without a device,
/// `TERN_CUDA_EMULATE=1` runs the backend on its CPU emulator instead (the same host code and
/// kernels; slow). With `TERN_REQUIRE_CUDA=1` (a GPU machine's run) a missing device fails
/// instead of skipping.
#[cfg(feature = "cuda")]
pub fn cuda_or_reason() -> Result<&'static tern::backend::cuda::CudaBackend, &'static str> {
    use tern::backend::cuda::CudaBackend;
    static BE: OnceLock<Result<CudaBackend, String>> = OnceLock::new();
    let r = BE
        .get_or_init(|| {
            let emulate = std::env::var("TERN_CUDA_EMULATE").as_deref() == Ok("1");
            CudaBackend::new()
                .or_else(|e| {
                    if emulate {
                        eprintln!("no cuda device ({e}): running on the emulator");
                        CudaBackend::emulated()
                    } else {
                        Err(e)
                    }
                })
                .inspect(|b| eprintln!("{}", b.dev.describe()))
                .map_err(|e| e.to_string())
        })
        .as_ref()
        .map_err(String::as_str);
    if let Err(why) = r {
        assert!(
            std::env::var("TERN_REQUIRE_CUDA").as_deref() != Ok("1"),
            "TERN_REQUIRE_CUDA=1 but {why}"
        );
    }
    r
}

/// `cuda_or_reason` with the reason printed on a skip.
#[cfg(feature = "cuda")]
pub fn cuda() -> Option<&'static tern::backend::cuda::CudaBackend> {
    match cuda_or_reason() {
        Ok(be) => Some(be),
        Err(why) => {
            eprintln!("skipped on cuda: {why}");
            None
        }
    }
}

/// Instantiates a generic test body `fn(&B)` once per backend: `cpu` always, `wgpu` when an
/// adapter is present, `cuda` (in a build with `--features cuda`) when a device is present;
/// a skipped instance prints why.
#[macro_export]
macro_rules! per_backend {
    ($($name:ident),* $(,)?) => {
        mod cpu_backend {
            $(
                #[test]
                fn $name() {
                    super::$name(&super::common::cpu());
                }
            )*
        }
        mod wgpu_backend {
            $(
                #[test]
                fn $name() {
                    match super::common::wgpu() {
                        Some(be) => super::$name(be),
                        None => eprintln!("skipped: no wgpu adapter"),
                    }
                }
            )*
        }
        #[cfg(feature = "cuda")]
        mod cuda_backend {
            $(
                #[test]
                fn $name() {
                    if let Some(be) = super::common::cuda() {
                        super::$name(be);
                    }
                }
            )*
        }
    };
}

/// Instantiates a generic test body once per GPU backend: `wgpu` when an adapter is present,
/// `cuda` (in a build with `--features cuda`) when a device is present. For op tests whose
/// reference is the CPU backend (the CPU's own op tests, against references written from the
/// math, are tests/ops_cpu.rs).
#[macro_export]
macro_rules! per_gpu_backend {
    ($($name:ident),* $(,)?) => {
        mod wgpu_backend {
            $(
                #[test]
                fn $name() {
                    match super::common::wgpu() {
                        Some(be) => super::$name(be),
                        None => eprintln!("skipped: no wgpu adapter"),
                    }
                }
            )*
        }
        #[cfg(feature = "cuda")]
        mod cuda_backend {
            $(
                #[test]
                fn $name() {
                    if let Some(be) = super::common::cuda() {
                        super::$name(be);
                    }
                }
            )*
        }
    };
}
