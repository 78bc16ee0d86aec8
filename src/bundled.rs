//! The default model, bundled in the binary so that `tern generate` and `tern serve` work on a
//! fresh machine with no download and no path to remember.
//!
//! It is the trained demo model (`fixtures/demo/demo-q8_0.gguf`, made by `cargo xtask
//! train-demo`; see `fixtures/demo/README.md`): a 2.5M-parameter qwen35 with both layer kinds
//! and an MTP head, trained on Shakespeare, so the default run prints text rather than noise.
//! Q8_0 because it is the smallest of its files that stock llama.cpp also loads and matches
//! token for token (2.7 MB in the binary).

use crate::gguf::{Gguf, GgufError};

pub const DEFAULT_MODEL_NAME: &str = "demo-q8_0.gguf";

static DEFAULT_MODEL: &[u8] = include_bytes!("../fixtures/demo/demo-q8_0.gguf");

pub fn default_model() -> Result<Gguf, GgufError> {
    Gguf::from_bytes(
        format!("<bundled {DEFAULT_MODEL_NAME}>"),
        DEFAULT_MODEL.to_vec(),
    )
}
