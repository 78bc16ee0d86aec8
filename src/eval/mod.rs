//! Quality measurement: `tern perplexity` (llama-perplexity's method and figure) and `tern kld`
//! (the distance of a candidate model or backend from a reference, the quantization gate of the
//! seeds), on any backend.
//!
//! - [`score`]: the chunked evaluation loop shared by both (chunks of `n_ctx` tokens, each from
//!   a fresh state, the second half scored, several chunks per batch).
//! - [`stats`]: per-position log-softmax, KL and Δp, and llama-perplexity's estimators.
//! - [`base`]: the versioned base file of `tern kld --save-base`.
//! - [`cli`]: the two subcommands.

pub mod base;
pub mod cli;
pub mod score;
pub mod stats;

use std::path::PathBuf;

use crate::backend::BackendError;
use crate::model::ModelError;
use crate::tokenizer::TokenizerError;

#[derive(Debug, thiserror::Error)]
pub enum EvalError {
    #[error(transparent)]
    Model(#[from] ModelError),
    #[error(transparent)]
    Backend(#[from] BackendError),
    #[error(transparent)]
    Tokenizer(#[from] TokenizerError),
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("{path}: {why}")]
    BaseFile { path: PathBuf, why: String },
    #[error(
        "the text tokenizes to {tokens} tokens; at least {need} are needed for a context of {n_ctx} (two chunks)"
    )]
    TooShort {
        tokens: usize,
        need: usize,
        n_ctx: usize,
    },
    #[error("{0}")]
    Settings(String),
    #[error("{0}")]
    Mismatch(String),
}
