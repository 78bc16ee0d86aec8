//! A prompt with images laid out for the engine as mtmd lays it out: each marker becomes
//! `<|vision_start|>`, one [`IMAGE_ROW`] per image token, `<|vision_end|>`; each image decoded
//! and brought to the projector's grid (CPU work, done by the caller's thread: the engine's
//! thread only encodes and runs it), and hashed for prefix reuse.

use std::sync::Arc;

use sha2::{Digest, Sha256};

use super::engine::{PromptImage, IMAGE_ROW};
use crate::model::vision::{tokenize_with_marker, MediaError, Piece, VisionConfig, VisionError};
use crate::tokenizer::Tokenizer;

#[derive(Debug, thiserror::Error)]
pub enum LayoutError {
    #[error(transparent)]
    Media(#[from] MediaError),
    #[error("image {index}: {source}")]
    Image { index: usize, source: VisionError },
}

/// The prompt's entries and its images; `prompt` holds `marker` once per image, in order.
pub fn prompt_with_images(
    tok: &Tokenizer,
    cfg: &VisionConfig,
    prompt: &str,
    marker: &str,
    images: &[&[u8]],
) -> Result<(Vec<u32>, Vec<PromptImage>), LayoutError> {
    let mut ids = Vec::new();
    let mut out = Vec::with_capacity(images.len());
    for piece in tokenize_with_marker(tok, prompt, marker, images.len())? {
        match piece {
            Piece::Text(t) => ids.extend(t),
            Piece::Image(index) => {
                let bytes = images[index];
                let pixels = cfg
                    .prepare(bytes)
                    .map_err(|source| LayoutError::Image { index, source })?;
                let (rows, cols) = pixels.grid(cfg);
                out.push(PromptImage {
                    at: ids.len(),
                    rows,
                    cols,
                    hash: Sha256::digest(bytes).into(),
                    pixels: Arc::new(pixels),
                });
                ids.extend(std::iter::repeat_n(IMAGE_ROW, rows * cols));
            }
        }
    }
    Ok((ids, out))
}
