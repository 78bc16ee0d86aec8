//! The memory ledger and the fit planner (memory-ledger.md).
//!
//! A [`Shape`] (slots, pool, cache dtypes, drafting, ubatch, projector, adapters) is priced
//! from the GGUF header alone into a [`Ledger`] of named terms; [`fit`] sets the ledger against
//! a [`Budget`] and, when the shape does not fit, re-prices the cheapest single changes that
//! would. Nothing here reads tensor data or allocates device memory.
//!
//! Terms and their formulas:
//! - **weights**: what the chosen backend takes for the tensors the loader uses, walked by the
//!   loader itself: on the CPU the stored bytes read in place from the mapping (once per
//!   tensor) plus f32 copies of small weights; on a GPU the device copies, the f32 copies and
//!   the Hadamard sign vectors.
//! - **kv**: `pool × n_full_layers × row(n_head_kv × head_dim)` per cache, K and V at their own
//!   dtypes (f32 4, f16/bf16 2, q8_0 34/32, q4_0 18/32 bytes per element). Only full-attention
//!   trunk layers have KV.
//! - **draft kv**: the MTP block is one more full-attention layer, priced over the whole pool at
//!   `spec-draft-type-k/-v`.
//! - **recurrent**: per slot per Gated-DeltaNet layer `(d_conv − 1)·conv_dim + d_state²·n_v`
//!   f32, times `1 + draft_n_max` rollback copies when drafting is armed.
//! - **checkpoint**: one more recurrent state per slot, held at the end of the last prompt for
//!   prefix reuse.
//! - **compute / draft compute**: estimated, see [`compute`].
//! - **projector**: the projector's weights as the backend stores them (walked by its own
//!   loader); **vision compute**: the worst-case encode, see [`vision`].
//! - **lora**: the adapters' pairs as the backend stores them.
//!
//! The margin is not a term: a shape fits when `total + margin <= budget`. After boot,
//! [`boot`] sets what the engine allocated beside this projection.

pub mod boot;
mod compute;
mod fit;
mod price;
mod table;
mod vision;

pub use boot::Allocated;
pub use compute::{ATTN_TILE, GDN_CHUNK};
pub use fit::{fit, parse_mem_available, Budget, Fit, Suggestion, Verdict, POOL_GRAIN};
pub use price::{Geometry, Ledger, Line, Term};
pub use table::{count, mib};

use std::path::PathBuf;

use serde::{Deserialize, Serialize};

use crate::backend::KvTypes;
use crate::gguf::GgufError;
use crate::model::ModelError;
use crate::tensor::GgmlType;

/// Bytes in a MiB.
pub const MIB: u64 = 1 << 20;

/// The default safety margin kept free on the device, in MiB.
pub const DEFAULT_MARGIN_MIB: u64 = 1024;

/// A KV cache element type: the five dtypes a cache may hold.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
pub enum KvType {
    #[serde(rename = "f32")]
    #[value(name = "f32")]
    F32,
    #[serde(rename = "f16")]
    #[value(name = "f16")]
    F16,
    #[serde(rename = "bf16")]
    #[value(name = "bf16")]
    BF16,
    #[serde(rename = "q8_0")]
    #[value(name = "q8_0")]
    Q8_0,
    #[serde(rename = "q4_0")]
    #[value(name = "q4_0")]
    Q4_0,
}

impl KvType {
    pub const ALL: [KvType; 5] = [
        KvType::F32,
        KvType::F16,
        KvType::BF16,
        KvType::Q8_0,
        KvType::Q4_0,
    ];

    pub fn ggml(self) -> GgmlType {
        match self {
            KvType::F32 => GgmlType::F32,
            KvType::F16 => GgmlType::F16,
            KvType::BF16 => GgmlType::BF16,
            KvType::Q8_0 => GgmlType::Q8_0,
            KvType::Q4_0 => GgmlType::Q4_0,
        }
    }

    /// The name used by the flags and the YAML config (`q8_0`).
    pub fn name(self) -> &'static str {
        match self {
            KvType::F32 => "f32",
            KvType::F16 => "f16",
            KvType::BF16 => "bf16",
            KvType::Q8_0 => "q8_0",
            KvType::Q4_0 => "q4_0",
        }
    }

    pub fn parse(s: &str) -> Option<KvType> {
        KvType::ALL
            .into_iter()
            .find(|t| t.name().eq_ignore_ascii_case(s))
    }

    /// Block-quantized types exist only on the flash-attention path when used for V.
    pub fn is_quantized(self) -> bool {
        matches!(self, KvType::Q8_0 | KvType::Q4_0)
    }

    /// Bytes per element as a fraction (type_size / block_size).
    pub fn bytes_per_element(self) -> f64 {
        let t = self.ggml();
        t.type_size() as f64 / t.block_size() as f64
    }
}

impl std::fmt::Display for KvType {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// `--flash-attn on|off|auto`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum FlashAttn {
    On,
    Off,
    Auto,
}

impl FlashAttn {
    pub fn name(self) -> &'static str {
        match self {
            FlashAttn::On => "on",
            FlashAttn::Off => "off",
            FlashAttn::Auto => "auto",
        }
    }
}

/// `--spec-type draft-mtp|none`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum SpecType {
    None,
    DraftMtp,
}

impl SpecType {
    pub fn name(self) -> &'static str {
        match self {
            SpecType::None => "none",
            SpecType::DraftMtp => "draft-mtp",
        }
    }
}

/// `--backend cpu|wgpu|cuda|auto`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum BackendKind {
    Auto,
    Cpu,
    Wgpu,
    Cuda,
}

impl BackendKind {
    pub fn name(self) -> &'static str {
        match self {
            BackendKind::Auto => "auto",
            BackendKind::Cpu => "cpu",
            BackendKind::Wgpu => "wgpu",
            BackendKind::Cuda => "cuda",
        }
    }
}

/// What is priced: everything about a deployment that allocates memory.
///
/// The defaults are llama-server's: 4096 tokens, one slot, f16 K and V, flash attention auto,
/// no drafting (a draft depth of 16 when armed), batch 2048 / ubatch 512.
#[derive(Clone, Debug, PartialEq)]
pub struct Shape {
    /// The KV pool: total tokens across all slots (`--ctx-size`).
    pub ctx_size: u64,
    /// Slots (`--parallel`); each gets `ctx_size / parallel` tokens.
    pub parallel: u64,
    pub cache_type_k: KvType,
    pub cache_type_v: KvType,
    pub flash_attn: FlashAttn,
    pub spec: SpecType,
    /// Draft depth (`--spec-draft-n-max`); each slot keeps `1 + draft_n_max` recurrent copies.
    pub draft_n_max: u64,
    pub spec_draft_type_k: KvType,
    pub spec_draft_type_v: KvType,
    pub ubatch_size: u64,
    pub batch_size: u64,
    /// The vision projector file (`--mmproj`).
    pub mmproj: Option<PathBuf>,
    /// `--image-min-tokens` / `--image-max-tokens`; `None` keeps the projector's own. The
    /// encoder is priced for the largest image the maximum allows.
    pub image_min_tokens: Option<u64>,
    pub image_max_tokens: Option<u64>,
    /// LoRA adapter files (the FILE part of `--lora-scaled FILE:SCALE`).
    pub lora: Vec<PathBuf>,
    pub backend: BackendKind,
    /// The CPU's f32 reference path (`--cpu-exact`), which keeps every weight in the mapping;
    /// the serving path packs Q8_0, PQ2_0 and PTQ1_0 matrices (`quant::packed`).
    pub cpu_exact: bool,
    /// Whether the serving path packs its matrices (`--repack`, default true); without it, or
    /// with `cpu_exact`, the CPU reads every weight in place from the mapping.
    pub repack: bool,
    /// MiB kept free on the device beyond the priced total.
    pub margin_mib: u64,
}

impl Default for Shape {
    fn default() -> Self {
        Shape {
            ctx_size: 4096,
            parallel: 1,
            cache_type_k: KvType::F16,
            cache_type_v: KvType::F16,
            flash_attn: FlashAttn::Auto,
            spec: SpecType::None,
            draft_n_max: 3,
            spec_draft_type_k: KvType::F16,
            spec_draft_type_v: KvType::F16,
            ubatch_size: 512,
            batch_size: 2048,
            mmproj: None,
            image_min_tokens: None,
            image_max_tokens: None,
            lora: Vec::new(),
            backend: BackendKind::Auto,
            cpu_exact: false,
            repack: true,
            margin_mib: DEFAULT_MARGIN_MIB,
        }
    }
}

impl Shape {
    /// Whether the CPU holds packed copies of its matrices: the serving path with `repack`.
    pub fn packs_weights(&self) -> bool {
        self.repack && !self.cpu_exact
    }

    /// Tokens per slot. Meaningful once `validate` has passed.
    pub fn n_ctx_slot(&self) -> u64 {
        self.ctx_size.checked_div(self.parallel).unwrap_or(0)
    }

    pub fn drafting(&self) -> bool {
        self.spec == SpecType::DraftMtp
    }

    /// The micro-batch the runtime actually runs (ubatch is clamped to batch, as in llama.cpp).
    pub fn effective_ubatch(&self) -> u64 {
        self.ubatch_size.min(self.batch_size)
    }

    /// Recurrent-state copies per slot: the live state plus one rollback checkpoint per draft
    /// position when drafting is armed.
    pub fn recurrent_copies(&self) -> u64 {
        if self.drafting() {
            self.draft_n_max.saturating_add(1)
        } else {
            1
        }
    }

    pub fn kv_types(&self) -> KvTypes {
        KvTypes {
            k: self.cache_type_k.ggml(),
            v: self.cache_type_v.ggml(),
        }
    }

    pub fn draft_kv_types(&self) -> KvTypes {
        KvTypes {
            k: self.spec_draft_type_k.ggml(),
            v: self.spec_draft_type_v.ggml(),
        }
    }

    /// Checks the rules that need no model: non-zero sizes, the pool dividing evenly across the
    /// slots, and quantized V only on the flash-attention path.
    pub fn validate(&self) -> Result<(), PlanError> {
        for (key, v) in [
            ("ctx-size", self.ctx_size),
            ("parallel", self.parallel),
            ("ubatch-size", self.ubatch_size),
            ("batch-size", self.batch_size),
        ] {
            if v == 0 {
                return Err(PlanError::Zero { key });
            }
        }
        if !self.ctx_size.is_multiple_of(self.parallel) {
            return Err(PlanError::CtxNotDivisible {
                ctx_size: self.ctx_size,
                parallel: self.parallel,
            });
        }
        if self.flash_attn == FlashAttn::Off {
            if self.cache_type_v.is_quantized() {
                return Err(PlanError::QuantizedVNeedsFlashAttn {
                    key: "cache-type-v",
                    ty: self.cache_type_v,
                });
            }
            if self.drafting() && self.spec_draft_type_v.is_quantized() {
                return Err(PlanError::QuantizedVNeedsFlashAttn {
                    key: "spec-draft-type-v",
                    ty: self.spec_draft_type_v,
                });
            }
        }
        if self.drafting() && self.draft_n_max == 0 {
            return Err(PlanError::Zero {
                key: "spec-draft-n-max",
            });
        }
        Ok(())
    }
}

#[derive(Debug, thiserror::Error)]
pub enum PlanError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error("{key} must be at least 1")]
    Zero { key: &'static str },
    #[error(
        "ctx-size {ctx_size} does not divide evenly by parallel {parallel} \
         ({ctx_size} / {parallel} leaves {}); the pool is split evenly across the slots, \
         so use a multiple of {parallel}, e.g. {}",
        ctx_size % parallel,
        ctx_size - ctx_size % parallel
    )]
    CtxNotDivisible { ctx_size: u64, parallel: u64 },
    #[error(
        "n_ctx_slot {n_ctx_slot} (ctx-size {ctx_size} / parallel {parallel}) exceeds the \
         model's trained context_length {context_length} (tern does no context extension); \
         at {parallel} slots the largest pool is {}",
        context_length.saturating_mul(*parallel)
    )]
    SlotTooLong {
        n_ctx_slot: u64,
        ctx_size: u64,
        parallel: u64,
        context_length: u64,
    },
    #[error(
        "{key} {ty} is quantized, and a quantized V cache exists only on the flash-attention \
         path: --flash-attn off refuses it (use --flash-attn on or auto, or an f16 V)"
    )]
    QuantizedVNeedsFlashAttn { key: &'static str, ty: KvType },
    #[error(
        "--spec-type draft-mtp needs an MTP block, and {} has none (nextn_predict_layers = 0): \
         MTP is a property of the file; use an -MTP export or --spec-type none",
        model.display()
    )]
    DraftWithoutMtp { model: PathBuf },
    #[error(
        "{} declares nextn_predict_layers = {n_nextn} but carries no {block}.nextn.* tensors \
         (a ghost drafter): --spec-type draft-mtp is refused",
        model.display()
    )]
    MtpTensorsMissing {
        model: PathBuf,
        n_nextn: usize,
        block: String,
    },
    #[error("the projector (--mmproj) {}: {source}", path.display())]
    Projector {
        path: PathBuf,
        #[source]
        source: Box<crate::model::vision::VisionError>,
    },
    #[error("{what} {}: {source}", path.display())]
    File {
        what: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error(
        "{which} cache: a row of {elems} elements is not a whole number of {ty} blocks \
         (head_dim × n_head_kv must be a multiple of {})",
        ty.ggml().block_size()
    )]
    KvRow {
        which: &'static str,
        ty: KvType,
        elems: u64,
    },
    #[error(
        "backend {backend}: no free-memory figure (wgpu has no portable query; cuda needs a \
         --features cuda build on a machine with a device); pass --device-mib N with the \
         driver's free figure (e.g. nvidia-smi --query-gpu=memory.free), or --backend cpu to \
         use MemAvailable"
    )]
    BudgetUnknown { backend: &'static str },
    #[error(
        "backend cpu: cannot read MemAvailable from /proc/meminfo ({why}); pass --device-mib N"
    )]
    MemInfo { why: String },
}
