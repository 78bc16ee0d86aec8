//! The boot ledger: what the engine allocated, beside what the planner projected.
//!
//! Weights, caches, recurrent states and prompt checkpoints are allocated whole at boot, so
//! they must equal their projection to the byte (the planner and the allocator share their
//! rules: `Weights::load` walks the same tensors for both, the caches are reserved for the
//! slot window). Compute is the one term the backend sizes as it runs: it is measured over a
//! warm-up step of the largest shape the scheduler makes (a full ubatch of prompt on one slot,
//! a verify batch on every other) and must stay within its projection.

use std::fmt::Write;

use serde_json::{json, Value};

use super::price::{Ledger, Term};
use super::table::mib;

/// Bytes the engine holds after boot and warm-up, per ledger term.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Allocated {
    pub weights: u64,
    pub kv: u64,
    pub draft_kv: u64,
    pub recurrent: u64,
    pub checkpoint: u64,
    /// LoRA adapters' pairs, as the weights.
    pub lora: u64,
    /// The projector's weights as uploaded (and, on the cpu, its host position grid).
    pub projector: u64,
    /// The peak of one encode of the worst-case image; `None` when no projector is loaded or
    /// nothing could measure it.
    pub vision_compute: Option<u64>,
    /// How `vision_compute` was measured.
    pub vision_how: String,
    /// Activations and scratch at the warm-up's peak; `None` when nothing could measure them
    /// (a CPU run without the counting allocator).
    pub compute: Option<u64>,
    /// How `compute` was measured.
    pub compute_how: String,
}

/// One row of the comparison.
#[derive(Clone, Debug, PartialEq)]
pub struct BootRow {
    pub term: &'static str,
    pub projected: u64,
    pub allocated: Option<u64>,
    /// `exact`: must be equal; `bound`: allocated must not exceed projected.
    pub rule: &'static str,
    pub ok: bool,
}

pub fn rows(ledger: &Ledger, a: &Allocated) -> Vec<BootRow> {
    let exact = |term: Term, got: u64| {
        let projected = ledger.bytes(term);
        BootRow {
            term: term.name(),
            projected,
            allocated: Some(got),
            rule: "exact",
            ok: projected == got,
        }
    };
    let mut out = vec![
        exact(Term::Weights, a.weights),
        exact(Term::Kv, a.kv),
        exact(Term::DraftKv, a.draft_kv),
        exact(Term::Recurrent, a.recurrent),
        exact(Term::Checkpoint, a.checkpoint),
    ];
    if ledger.line(Term::Lora).is_some() || a.lora > 0 {
        out.push(exact(Term::Lora, a.lora));
    }
    let projected = ledger.bytes(Term::Compute) + ledger.bytes(Term::DraftCompute);
    out.push(BootRow {
        term: "compute",
        projected,
        allocated: a.compute,
        rule: "bound",
        ok: a.compute.is_none_or(|c| c <= projected),
    });
    if ledger.line(Term::Projector).is_some() || a.projector > 0 {
        out.push(exact(Term::Projector, a.projector));
        let projected = ledger.bytes(Term::VisionCompute);
        out.push(BootRow {
            term: Term::VisionCompute.name(),
            projected,
            allocated: a.vision_compute,
            rule: "bound",
            ok: a.vision_compute.is_none_or(|c| c <= projected),
        });
    }
    out
}

/// The projector's lines as allocated: its weights as the backend holds them (plus, on the
/// cpu, the host position grid), and the compute of one encode of the worst-case image (the
/// largest `--image-max-tokens` allows: black pixels, the size does the pricing) measured
/// over that encode: the heap's peak growth on the cpu, the buffer pool's growth on a GPU,
/// where the buffers it leaves in the pool are the ones later images draw from.
pub fn projector_allocated<B: crate::backend::Backend>(
    be: &B,
    proj: &crate::model::vision::Projector<B>,
) -> (u64, Option<u64>, String) {
    let mut t = crate::backend::WeightTally::default();
    proj.each_weight(|w| t.add(be.weight_bytes(w)));
    let pooled = be.compute_bytes();
    let host_grid = if pooled.is_none() {
        proj.cfg.pos_grid_bytes()
    } else {
        0
    };
    let weights = t.total().saturating_add(host_grid);
    let (rows, cols) = proj.cfg.worst_case_grid();
    let a = proj.cfg.patch * proj.cfg.merge;
    let heap = crate::alloc::mark();
    let out = {
        let img = crate::model::vision::Prepared {
            width: cols * a,
            height: rows * a,
            pixels: vec![0.0; 3 * rows * cols * a * a],
        };
        let out = proj.encode(be, &img);
        // Reading the rows back finishes the encode on a device.
        be.to_host(&out).len()
    };
    std::hint::black_box(out);
    let measured = match (pooled, be.compute_bytes()) {
        (Some(before), Some(after)) => (
            Some(after.saturating_sub(before)),
            format!(
                "{}'s buffer pool growth over one {rows} x {cols}-token encode",
                be.name()
            ),
        ),
        _ => match crate::alloc::peak_since(heap) {
            Some(p) => (
                Some(p),
                format!("the heap's peak growth over one {rows} x {cols}-token encode"),
            ),
            None => (None, "not measured (no counting allocator)".to_string()),
        },
    };
    (weights, measured.0, measured.1)
}

/// Whether every term agrees with its projection.
pub fn agrees(ledger: &Ledger, a: &Allocated) -> bool {
    rows(ledger, a).iter().all(|r| r.ok)
}

/// The comparison as a table (MiB), for the boot log.
pub fn table(ledger: &Ledger, a: &Allocated) -> String {
    let mut s = String::new();
    let _ = writeln!(
        s,
        "boot ledger (MiB)  {:>14} {:>14}  check",
        "projected", "allocated"
    );
    for r in rows(ledger, a) {
        let got = r.allocated.map_or("not measured".to_string(), mib);
        let verdict = match (r.ok, r.rule) {
            (true, "exact") => "= projected",
            (true, _) => "within projection",
            (false, "exact") => "DIFFERS",
            (false, _) => "OVER projection",
        };
        let _ = writeln!(
            s,
            "  {:<16} {:>14} {:>14}  {verdict}",
            r.term,
            mib(r.projected),
            got
        );
    }
    let _ = writeln!(s, "  compute measured: {}", a.compute_how);
    if !a.vision_how.is_empty() {
        let _ = writeln!(s, "  vision compute measured: {}", a.vision_how);
    }
    s
}

pub fn to_json(ledger: &Ledger, a: &Allocated) -> Value {
    let rows: Vec<Value> = rows(ledger, a)
        .into_iter()
        .map(|r| {
            json!({"term": r.term, "projected": r.projected, "allocated": r.allocated,
                   "rule": r.rule, "ok": r.ok})
        })
        .collect();
    json!({"rows": rows, "agrees": agrees(ledger, a), "compute_how": a.compute_how})
}

// ---------------------------------------------------------------------------------------------
// The boot step shared by `tern serve` and `tern generate` (and any command that loads a model
// for the engine): open the model, price the shape before anything is allocated, refuse one
// that does not fit, and after the engine has booted set what it allocated beside the
// projection. The short summary is logged at info, the full ledger at debug (`-lv 4`, `-v`).
// ---------------------------------------------------------------------------------------------

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::KvTypes;
use crate::gguf::{Gguf, GgufError};
use crate::runtime::engine::EngineConfig;

use super::{BackendKind, Budget, KvType, PlanError, Shape, SpecType};

#[derive(Debug, thiserror::Error)]
pub enum BootError {
    #[error("cannot open the model {}: {source}", path.display())]
    Open {
        path: PathBuf,
        #[source]
        source: GgufError,
    },
    #[error("the model path {} is a directory; give a .gguf file{}", path.display(), hint(found))]
    Directory { path: PathBuf, found: Vec<String> },
    #[error("{what} is a `{arch}` model (general.architecture); tern runs qwen35 models only")]
    NotQwen35 { what: String, arch: String },
    #[error("{what} has no general.architecture: it is not a qwen35 model")]
    NoArchitecture { what: String },
    #[error("the bundled model: {0}")]
    Bundled(#[source] GgufError),
    #[error("cannot price {what}: {source}")]
    Price {
        what: String,
        #[source]
        source: Box<PlanError>,
    },
    #[error("{which}: {ty} is not a cache type the planner prices")]
    CacheType { which: &'static str, ty: String },
    #[error("the shape does not fit: it needs {needed} MiB and the budget is {budget} MiB{}", if suggestions.is_empty() { String::new() } else { format!("; cheapest changes that fit: {}", suggestions.join("; ")) })]
    DoesNotFit {
        needed: String,
        budget: String,
        suggestions: Vec<String>,
    },
    #[error("spec-draft-n-max {n_max}: a slot of {n_ctx_slot} tokens never drafts more than {max} tokens (llama.cpp caps the draft at the slot window)")]
    DraftTooDeep {
        n_max: u64,
        n_ctx_slot: u64,
        max: u64,
    },
}

fn hint(found: &[String]) -> String {
    match found {
        [] => String::new(),
        [one] => format!(" (it holds {one})"),
        many => format!(" (it holds {})", many.join(", ")),
    }
}

/// An opened model: the file, how messages name it, and the name the API serves it under by
/// default.
pub struct OpenedModel {
    pub file: Arc<Gguf>,
    pub path: String,
    pub file_name: String,
}

/// Opens `path` (or the bundled model) and refuses, before anything else is read, a directory
/// (listing the GGUF files in it) and a model of another architecture.
pub fn open_model(path: Option<&Path>) -> Result<OpenedModel, BootError> {
    let (file, shown, name) = match path {
        Some(p) => {
            if p.is_dir() {
                let mut found: Vec<String> = std::fs::read_dir(p)
                    .map(|rd| {
                        rd.filter_map(|e| e.ok())
                            .map(|e| e.file_name().to_string_lossy().into_owned())
                            .filter(|n| n.ends_with(".gguf"))
                            .collect()
                    })
                    .unwrap_or_default();
                found.sort();
                return Err(BootError::Directory {
                    path: p.to_path_buf(),
                    found,
                });
            }
            let g = Gguf::open(p).map_err(|source| BootError::Open {
                path: p.to_path_buf(),
                source,
            })?;
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.display().to_string());
            (g, p.display().to_string(), name)
        }
        None => {
            let g = crate::bundled::default_model().map_err(BootError::Bundled)?;
            let shown = g.path().display().to_string();
            (g, shown, crate::bundled::DEFAULT_MODEL_NAME.to_string())
        }
    };
    match file.architecture() {
        Some("qwen35") => {}
        Some(arch) => {
            return Err(BootError::NotQwen35 {
                what: shown,
                arch: arch.to_string(),
            })
        }
        None => return Err(BootError::NoArchitecture { what: shown }),
    }
    Ok(OpenedModel {
        file: Arc::new(file),
        path: shown,
        file_name: name,
    })
}

/// The pool when the settings leave it to the model: `--ctx-size 0` is the trained context
/// (as llama.cpp), no `--ctx-size` is 4096 tokens per slot at most the trained context.
pub fn settle_pool(ctx_size: Option<u64>, parallel: u64, trained: u64) -> u64 {
    let parallel = parallel.max(1);
    match ctx_size {
        Some(0) => (trained / parallel).max(1) * parallel,
        Some(c) => c,
        None => (Shape::default().ctx_size / parallel).clamp(1, trained.max(1)) * parallel,
    }
}

/// A draft deeper than a slot can ever use is refused before it is allocated: llama.cpp never
/// drafts past `n_ctx_slot - 2` tokens, and tern keeps one recurrent-state copy per position.
pub fn check_draft_depth(shape: &Shape) -> Result<(), BootError> {
    if !shape.drafting() {
        return Ok(());
    }
    let n_ctx_slot = shape.n_ctx_slot();
    let max = n_ctx_slot.saturating_sub(2);
    if shape.draft_n_max > max {
        return Err(BootError::DraftTooDeep {
            n_max: shape.draft_n_max,
            n_ctx_slot,
            max,
        });
    }
    Ok(())
}

/// The shape an engine configuration allocates, for the planner.
pub fn shape_of(
    cfg: &EngineConfig,
    backend: BackendKind,
    ubatch_size: u64,
) -> Result<Shape, BootError> {
    let kv = |which: &'static str, t: KvTypes| -> Result<(KvType, KvType), BootError> {
        let one = |ty: crate::tensor::GgmlType| {
            KvType::parse(ty.name()).ok_or_else(|| BootError::CacheType {
                which,
                ty: ty.to_string(),
            })
        };
        Ok((one(t.k)?, one(t.v)?))
    };
    let (k, v) = kv("cache", cfg.kv_types)?;
    let (dk, dv) = kv("draft cache", cfg.draft_kv_types)?;
    Ok(Shape {
        ctx_size: cfg.ctx_size as u64,
        parallel: cfg.parallel as u64,
        cache_type_k: k,
        cache_type_v: v,
        spec: if cfg.spec.is_some() {
            SpecType::DraftMtp
        } else {
            SpecType::None
        },
        draft_n_max: cfg.spec.as_ref().map_or(0, |s| s.n_max as u64),
        spec_draft_type_k: dk,
        spec_draft_type_v: dv,
        ubatch_size,
        batch_size: ubatch_size,
        backend,
        ..Shape::default()
    })
}

/// Prices `shape` against the device's budget (or `device_mib`) and refuses a shape that does
/// not fit, naming what it needs and the cheapest changes. Logs one summary line at info
/// (model, shape, and the MiB to spare) and the full ledger at debug. Without a known budget
/// the fit is not checked, and a warning says so.
pub fn plan(
    file: &Arc<Gguf>,
    shape: &Shape,
    device_mib: Option<u64>,
    what: &str,
) -> Result<Ledger, BootError> {
    let price_err = |source: PlanError| BootError::Price {
        what: what.to_string(),
        source: Box::new(source),
    };
    match Budget::resolve(shape.backend, device_mib) {
        Ok(budget) => {
            let fit = super::fit(file, shape, &budget).map_err(price_err)?;
            let l = &fit.ledger;
            let v = &fit.verdict;
            tracing::info!(
                target: "tern::boot",
                "model {}; shape {}",
                l.model_summary(),
                l.shape.summary()
            );
            tracing::debug!(target: "tern::boot", "memory ledger:\n{}", fit.table());
            if !v.fits {
                tracing::warn!(target: "tern::boot", "the shape does not fit:\n{}", fit.table().trim_end());
                return Err(BootError::DoesNotFit {
                    needed: mib(v.needed),
                    budget: mib(v.budget),
                    suggestions: fit
                        .suggestions
                        .iter()
                        .filter(|s| s.fits)
                        .take(3)
                        .map(|s| format!("{} ({})", s.flags, s.change))
                        .collect(),
                });
            }
            tracing::info!(
                target: "tern::boot",
                "fits: needs {} MiB of {} MiB ({}), {} MiB to spare",
                mib(v.needed),
                mib(v.budget),
                budget.source,
                mib(v.budget.saturating_sub(v.needed))
            );
            Ok(fit.ledger)
        }
        Err(e @ PlanError::BudgetUnknown { .. }) => {
            let l = super::Ledger::price(file, shape).map_err(price_err)?;
            tracing::info!(
                target: "tern::boot",
                "model {}; shape {}",
                l.model_summary(),
                l.shape.summary()
            );
            tracing::debug!(target: "tern::boot", "memory ledger:\n{}", l.table());
            tracing::warn!(
                target: "tern::boot",
                "needs {} MiB; the fit is not checked: {e}",
                mib(l.total())
            );
            Ok(l)
        }
        Err(e) => Err(price_err(e)),
    }
}

/// Logs the boot ledger (projected beside allocated) at debug; a term that disagrees is a
/// warning that names it (the shape is already running, so refusing now would only lose it).
pub fn report(ledger: &Ledger, allocated: &Allocated) {
    tracing::debug!(target: "tern::boot", "{}", table(ledger, allocated).trim_end());
    for r in rows(ledger, allocated).iter().filter(|r| !r.ok) {
        tracing::warn!(
            target: "tern::boot",
            "boot ledger: {} allocated {} B against a projection of {} B ({})",
            r.term,
            r.allocated.unwrap_or(0),
            r.projected,
            r.rule
        );
    }
}

/// Reads the model's pages once with a progress bar, when stderr is a terminal: the first
/// read from disk is most of a large model's load, and the loader then finds it in the page
/// cache. Elsewhere (logs, pipes, the bundled model) it does nothing.
pub fn read_with_progress(file: &Gguf) {
    use std::io::IsTerminal;
    let bytes = file.bytes();
    if !std::io::stderr().is_terminal() || bytes.len() < (64 << 20) {
        return;
    }
    let pb = indicatif::ProgressBar::with_draw_target(
        Some(bytes.len() as u64),
        indicatif::ProgressDrawTarget::stderr(),
    );
    if let Ok(style) = indicatif::ProgressStyle::with_template(
        "loading {msg} [{bar:32}] {bytes}/{total_bytes} {binary_bytes_per_sec} eta {eta}",
    ) {
        pb.set_style(style.progress_chars("=> "));
    }
    pb.set_message(
        file.path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default(),
    );
    let mut sum = 0u8;
    for chunk in bytes.chunks(8 << 20) {
        for page in chunk.iter().step_by(4096) {
            sum = sum.wrapping_add(*page);
        }
        pb.inc(chunk.len() as u64);
    }
    std::hint::black_box(sum);
    pb.finish_and_clear();
}

/// The model with its LoRA adapters, in id order (the planner has checked each already), and
/// the reduced draft head when `drafting` (priced by the planner alike).
pub fn load_model<B: crate::backend::Backend>(
    be: &B,
    file: Arc<Gguf>,
    adapters: &[PathBuf],
    drafting: bool,
) -> Result<crate::model::Model<B>, crate::model::ModelError> {
    let n_vocab = crate::model::Config::from_gguf(&file)?.n_vocab;
    let draft = crate::model::draft_vocab(n_vocab, drafting);
    let mut m = crate::model::Model::load_with_draft(be, file, draft)?;
    for a in adapters {
        m.add_adapter(be, a)?;
    }
    Ok(m)
}

/// The engine configuration of a settled shape.
pub fn engine_config(shape: &Shape, s: &crate::config::Settings) -> EngineConfig {
    let spec = shape
        .drafting()
        .then(|| crate::runtime::speculative::SpecConfig {
            n_max: shape.draft_n_max as usize,
            n_min: s.spec_draft_n_min.unwrap_or(0) as usize,
            p_min: s.spec_draft_p_min.unwrap_or(0.0),
            adaptive: s.spec_adaptive.unwrap_or(true),
        });
    EngineConfig {
        ctx_size: shape.ctx_size as usize,
        parallel: shape.parallel as usize,
        ubatch: shape.effective_ubatch() as usize,
        kv_types: shape.kv_types(),
        spec,
        draft_kv_types: shape.draft_kv_types(),
    }
}

/// `--threads` / `--threads-batch` as pool sizes (<= 0 is every core, as llama.cpp).
pub fn threads(s: &crate::config::Settings) -> crate::runtime::engine::Threads {
    let cores = || {
        std::thread::available_parallelism()
            .map(|n| n.get())
            .unwrap_or(1)
    };
    let size = |n: i64| if n > 0 { n as usize } else { cores() };
    let decode = s.threads.map(size);
    crate::runtime::engine::Threads {
        decode,
        batch: s.threads_batch.map(size).or(decode),
    }
}

/// The sampling defaults: llama.cpp's, then the model's `general.sampling.*`, then the
/// settings; and the seed the settings fix (`--seed -1` fixes none).
pub fn sampler(
    file: &Gguf,
    s: &crate::config::Settings,
) -> Result<(crate::runtime::sampler::SamplerConfig, Option<u64>), String> {
    let mut c = crate::runtime::sampler::SamplerConfig::from_gguf(file);
    if let Some(t) = s.temp {
        // llama.cpp treats a negative temperature as greedy.
        c.temperature = t.max(0.0);
    }
    if let Some(p) = s.top_p {
        c.top_p = p;
    }
    if let Some(k) = s.top_k {
        c.top_k = k.max(0) as usize;
    }
    if let Some(p) = s.min_p {
        c.min_p = p;
    }
    if let Some(p) = s.presence_penalty {
        c.presence_penalty = p;
    }
    if let Some(p) = s.frequency_penalty {
        c.frequency_penalty = p;
    }
    if let Some(p) = s.repeat_penalty {
        c.repeat_penalty = p;
    }
    if let Some(n) = s.repeat_last_n {
        c.penalty_last_n = n.max(0) as usize;
    }
    c.validate()?;
    let fixed = s.seed.filter(|&x| x >= 0).map(|x| x as u64);
    c.seed = fixed.unwrap_or(u32::MAX as u64);
    Ok((c, fixed))
}
