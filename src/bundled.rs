//! The default model, bundled in the binary so that `tern generate` and `tern serve` work on a
//! fresh machine with no download and no path to remember.

use crate::gguf::{Gguf, GgufError};

pub const DEFAULT_MODEL_NAME: &str = "tiny-q8_0.gguf";

static DEFAULT_MODEL: &[u8] = include_bytes!("../fixtures/tiny-q8_0.gguf");

pub fn default_model() -> Result<Gguf, GgufError> {
    Gguf::from_bytes(
        format!("<bundled {DEFAULT_MODEL_NAME}>"),
        DEFAULT_MODEL.to_vec(),
    )
}
