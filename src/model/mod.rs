//! The qwen35 model: validated config, weights with their folds, per-sequence state, and the
//! forward recipe written once against the backend op trait.

mod config;
pub mod image;
pub mod lora;
pub mod phase;
mod qwen35;
pub mod vision;
pub mod weights;

pub use config::Config;
pub use qwen35::{BatchItem, ImageRows, Joined, MtpRows, MtpState, SeqState};

use std::path::Path;
use std::sync::Arc;

use crate::backend::{Backend, BackendError};
use crate::gguf::{Gguf, GgufError};
use crate::quant::hadamard::{HadamardConfig, HadamardError};
pub use weights::Weights;

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
    Gguf(#[from] GgufError),
    #[error("unsupported architecture {0:?} (tern runs qwen35)")]
    UnsupportedArch(String),
    #[error("missing metadata key {0:?}")]
    MissingKey(String),
    #[error("metadata key {key:?}: {why}")]
    BadKey { key: String, why: String },
    #[error("missing tensor {0:?}")]
    MissingTensor(String),
    #[error("tensor {name:?}: shape {found:?}, expected {expected}")]
    BadShape {
        name: String,
        expected: String,
        found: Vec<u64>,
    },
    #[error("tensor {name:?}: {why}")]
    BadTensor { name: String, why: String },
    #[error("prism.hadamard: {0}")]
    Hadamard(#[from] HadamardError),
    #[error("tensor {name:?}: {why}")]
    FoldMisuse { name: String, why: String },
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error("token id {id} is outside the vocabulary of {n_vocab}")]
    BadToken { id: u32, n_vocab: usize },
    #[error("position {pos} exceeds the context of {n_ctx}")]
    ContextFull { pos: usize, n_ctx: usize },
    #[error("the forward pass produced a non-finite logit (row {row}, token {token}: {value}); refusing to sample from it (broken weights or metadata)")]
    NonFiniteLogits {
        row: usize,
        token: usize,
        value: f32,
    },
    #[error("this model has no MTP block (nextn_predict_layers = 0)")]
    NoMtp,
    #[error(transparent)]
    Lora(#[from] lora::LoraError),
}

pub struct Model<B: Backend> {
    pub cfg: Config,
    pub file: Arc<Gguf>,
    pub hadamard: Option<Arc<HadamardConfig>>,
    pub w: Weights<B::W>,
    /// LoRA adapters, in load order (a sequence's `lora` scales are indexed alike).
    pub adapters: Vec<lora::Adapter<B::W>>,
}

/// Token ids an MTP draft step scores (FR-Spec): the full vocabulary below 4 × this.
pub const DRAFT_VOCAB: usize = 32768;

/// The draft vocabulary a model of `n_vocab` tokens loads when `drafting`: the first
/// [`DRAFT_VOCAB`] ids when the vocabulary is at least 4 times larger (Qwen3.5's 248,320:
/// a draft step then reads 13% of the head), else none (the full head). 0 means none.
pub fn draft_vocab(n_vocab: usize, drafting: bool) -> usize {
    if drafting && n_vocab >= 4 * DRAFT_VOCAB {
        DRAFT_VOCAB
    } else {
        0
    }
}

/// What one forward call returns: a logits row and the `h_nextn` row (post-`output_norm`
/// hidden, the MTP head's input) per token asked for.
pub struct Output<T> {
    pub logits: T,
    pub h: T,
}

impl<B: Backend> Model<B> {
    pub fn open(be: &B, path: impl AsRef<Path>) -> Result<Model<B>, ModelError> {
        let file = Arc::new(Gguf::open(path)?);
        Self::load(be, file)
    }

    pub fn load(be: &B, file: Arc<Gguf>) -> Result<Model<B>, ModelError> {
        Self::load_with_draft(be, file, 0)
    }

    /// [`Model::load`], and with `draft_vocab` > 0 the MTP head's first `draft_vocab` rows
    /// for drafting ([`draft_vocab`] is the rule serving uses).
    pub fn load_with_draft(
        be: &B,
        file: Arc<Gguf>,
        draft_vocab: usize,
    ) -> Result<Model<B>, ModelError> {
        let mut cfg = Config::from_gguf(&file)?;
        let hadamard = HadamardConfig::from_gguf(&file)?.map(Arc::new);
        let w = Weights::load(be, &file, &cfg, hadamard.as_ref(), draft_vocab)?;
        if w.mtp.is_none() {
            cfg.n_nextn = 0;
        }
        Ok(Model {
            cfg,
            file,
            hadamard,
            w,
            adapters: Vec::new(),
        })
    }

    /// Loads a LoRA adapter for this model (checked against its tensors, uploaded to `be`);
    /// returns its index, the id sequences' `lora` scales and the server's API use.
    pub fn add_adapter(&mut self, be: &B, path: impl AsRef<Path>) -> Result<usize, ModelError> {
        let a = lora::load(be, path.as_ref(), &self.file, self.cfg.n_layer)?;
        self.adapters.push(a);
        Ok(self.adapters.len() - 1)
    }
}
