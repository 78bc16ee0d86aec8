//! The boot ledger: what the engine allocates at boot must be what the planner projected. The
//! weights, caches, recurrent states and prompt checkpoints to the byte; compute (measured over
//! the warm-up step: the heap's peak on the cpu, the buffer pool on wgpu) within its
//! projection. Fixture models × shapes (slots, K/V dtypes, drafting, ubatch) × backends.

mod common;

use std::path::Path;
use std::sync::Arc;

use tern::backend::cpu::CpuBackend;
use tern::backend::{Backend, KvTypes};
use tern::gguf::Gguf;
use tern::model::Model;
use tern::plan::{self, BackendKind, Ledger};
use tern::runtime::engine::{Engine, EngineConfig};
use tern::runtime::speculative::SpecConfig;
use tern::tensor::GgmlType;
use tern::tokenizer::Tokenizer;

#[global_allocator]
static HEAP: tern::alloc::Counting = tern::alloc::Counting;

struct Case {
    parallel: usize,
    ctx_per_slot: usize,
    ubatch: usize,
    kv: KvTypes,
    depth: Option<usize>,
}

fn cases(has_mtp: bool) -> Vec<Case> {
    use GgmlType::*;
    let mut v = vec![
        Case {
            parallel: 1,
            ctx_per_slot: 256,
            ubatch: 64,
            kv: KvTypes { k: F16, v: F16 },
            depth: None,
        },
        Case {
            parallel: 3,
            ctx_per_slot: 160,
            ubatch: 33,
            kv: KvTypes { k: F16, v: Q8_0 },
            depth: None,
        },
        Case {
            parallel: 2,
            ctx_per_slot: 128,
            ubatch: 128,
            kv: KvTypes { k: Q4_0, v: BF16 },
            depth: None,
        },
    ];
    if has_mtp {
        v.push(Case {
            parallel: 2,
            ctx_per_slot: 192,
            ubatch: 65,
            kv: KvTypes { k: F16, v: Q8_0 },
            depth: Some(2),
        });
    }
    v
}

/// The heap counter is process-wide: one measurement at a time.
static ONE: std::sync::Mutex<()> = std::sync::Mutex::new(());

/// `mk` makes a fresh backend per case, so a pool measures that case alone.
fn check<B: Backend + 'static>(
    mk: impl Fn() -> B,
    (kind, cpu_exact): (BackendKind, bool),
    (fixture, adapters): (&str, &[&str]),
) where
    B::W: 'static,
{
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    HEAP.mark_installed();
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(fixture);
    let g = Arc::new(Gguf::open(&path).unwrap());
    let tok = Arc::new(Tokenizer::from_gguf(&g).unwrap());
    let has_mtp = tern::model::Config::from_gguf(&g).unwrap().has_mtp();
    for c in cases(has_mtp) {
        let cfg = EngineConfig {
            ctx_size: c.ctx_per_slot * c.parallel,
            parallel: c.parallel,
            ubatch: c.ubatch,
            kv_types: c.kv,
            spec: c.depth.map(|n_max| SpecConfig {
                n_max,
                n_min: 0,
                p_min: 0.0,
                adaptive: true,
            }),
            draft_kv_types: KvTypes {
                k: GgmlType::F16,
                v: GgmlType::F16,
            },
        };
        let mut shape = tern::plan::boot::shape_of(&cfg, kind, c.ubatch as u64).unwrap();
        shape.cpu_exact = cpu_exact;
        let lora: Vec<_> = adapters
            .iter()
            .map(|a| path.parent().unwrap().join("lora").join(a))
            .collect();
        shape.lora = lora.clone();
        let ledger = Ledger::price(&g, &shape).unwrap();
        let be = mk();
        let mut m = Model::load(&be, g.clone()).unwrap();
        for a in &lora {
            m.add_adapter(&be, a).unwrap();
        }
        let engine = Engine::start(m, be, tok.clone(), cfg).unwrap();
        let a = &engine.allocated;
        let table = plan::boot::table(&ledger, a);
        eprintln!("{fixture} on {kind:?}, {}:\n{table}", shape.summary());
        assert!(a.compute.is_some(), "compute not measured:\n{table}");
        assert!(a.kv > 0 && a.weights > 0, "nothing allocated:\n{table}");
        assert_eq!(a.draft_kv > 0, c.depth.is_some(), "{table}");
        assert_eq!(a.lora > 0, !adapters.is_empty(), "{table}");
        assert!(
            plan::boot::agrees(&ledger, a),
            "{fixture}: the boot ledger disagrees with the projection:\n{table}"
        );
    }
}

/// The projector's lines: its weights as uploaded to the byte, and one encode of the largest
/// image `--image-max-tokens` allows within the vision compute projected for it. Each fixture
/// projector (F32, F16, Q8_0) at two limits (64 and 150 tokens: 256 and 600 patches, an
/// 8 x 8 and a 10 x 15 token grid).
fn check_projector<B: Backend>(mk: impl Fn() -> B, (kind, cpu_exact): (BackendKind, bool)) {
    use tern::model::vision::Projector;
    let _one = ONE.lock().unwrap_or_else(|e| e.into_inner());
    HEAP.mark_installed();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/vision");
    let g = Arc::new(Gguf::open(dir.join("tiny-vl-f32.gguf")).unwrap());
    let n_embd = tern::model::Config::from_gguf(&g).unwrap().n_embd;
    for file in ["mmproj-f32.gguf", "mmproj-f16.gguf", "mmproj-q8_0.gguf"] {
        for max_tokens in [64u64, 150] {
            let shape = tern::plan::Shape {
                ctx_size: 256,
                mmproj: Some(dir.join(file)),
                image_max_tokens: Some(max_tokens),
                backend: kind,
                cpu_exact,
                ..Default::default()
            };
            let ledger = Ledger::price(&g, &shape).unwrap();
            let be = mk();
            let mut p = Projector::open(&be, dir.join(file), n_embd).unwrap();
            p.set_token_limits(None, Some(max_tokens as usize)).unwrap();
            let (projector, vision_compute, vision_how) = plan::boot::projector_allocated(&be, &p);
            let a = plan::Allocated {
                projector,
                vision_compute,
                vision_how,
                ..Default::default()
            };
            let rows = plan::boot::rows(&ledger, &a);
            let mine: Vec<_> = rows
                .iter()
                .filter(|r| r.term == "projector" || r.term == "vision compute")
                .collect();
            let table: String = mine
                .iter()
                .map(|r| {
                    format!(
                        "  {:<16} projected {:>10} B, allocated {:>10} B ({}, {})\n",
                        r.term,
                        r.projected,
                        r.allocated.unwrap_or(0),
                        r.rule,
                        if r.ok { "ok" } else { "DISAGREES" }
                    )
                })
                .collect();
            eprintln!(
                "{file} on {kind:?}, image-max-tokens {max_tokens} ({}):\n{table}",
                a.vision_how
            );
            assert_eq!(mine.len(), 2, "{table}");
            assert!(
                a.vision_compute.is_some_and(|c| c > 0),
                "not measured:\n{table}"
            );
            assert!(
                mine.iter().all(|r| r.ok),
                "{file}: the projector's lines disagree with the projection:\n{table}"
            );
        }
    }
}

#[test]
fn cpu_projector_allocates_what_was_projected() {
    check_projector(common::cpu, (BackendKind::Cpu, true));
    // The serving path, which packs the Q8_0 projector's matrices.
    check_projector(CpuBackend::int8, (BackendKind::Cpu, false));
}

#[test]
fn wgpu_projector_allocates_what_was_projected() {
    if common::wgpu().is_none() {
        eprintln!("skipped: no wgpu adapter");
        return;
    }
    check_projector(
        || tern::backend::wgpu::WgpuBackend::new().unwrap(),
        (BackendKind::Wgpu, false),
    );
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_projector_allocates_what_was_projected() {
    let Some(be) = common::cuda() else {
        return;
    };
    let emulated = be.dev.is_emulated();
    check_projector(
        || {
            if emulated {
                tern::backend::cuda::CudaBackend::emulated().unwrap()
            } else {
                tern::backend::cuda::CudaBackend::new().unwrap()
            }
        },
        (BackendKind::Cuda, false),
    );
}

/// Each fixture with the LoRA adapters loaded on it (their pairs priced like weights, their
/// terms in the warm-up's compute).
const FIXTURES: [(&str, &[&str]); 5] = [
    ("tiny-q8_0.gguf", &[]),
    ("tiny-pq2_0.gguf", &[]),
    ("tiny-tied-q8_0.gguf", &[]),
    ("tiny-f16.gguf", &[]),
    (
        "tiny-pq2_0.gguf",
        &["tiny-lora-r4-f32.gguf", "tiny-lora-r8-q8_0.gguf"],
    ),
];

#[test]
fn cpu_allocates_what_was_projected() {
    for f in FIXTURES {
        check(common::cpu, (BackendKind::Cpu, true), f);
        // The serving path: Q8_0 matrices packed once per tensor (the tied fixture's head
        // shares the embedding table's copy); PQ2_0 packs whole 512-column groups, which the
        // tiny fixtures do not have (bench-0.8b PQ2_0 agreed at 284.64 MiB when tried).
        check(CpuBackend::int8, (BackendKind::Cpu, false), f);
    }
}

#[test]
fn wgpu_allocates_what_was_projected() {
    if common::wgpu().is_none() {
        eprintln!("skipped: no wgpu adapter");
        return;
    }
    for f in FIXTURES {
        check(
            || tern::backend::wgpu::WgpuBackend::new().unwrap(),
            (BackendKind::Wgpu, false),
            f,
        );
    }
}

#[cfg(feature = "cuda")]
#[test]
fn cuda_allocates_what_was_projected() {
    let Some(be) = common::cuda() else {
        return;
    };
    // A fresh backend of the same kind (device or emulator) per case.
    let emulated = be.dev.is_emulated();
    for f in FIXTURES {
        check(
            || {
                if emulated {
                    tern::backend::cuda::CudaBackend::emulated().unwrap()
                } else {
                    tern::backend::cuda::CudaBackend::new().unwrap()
                }
            },
            (BackendKind::Cuda, false),
            f,
        );
    }
}
