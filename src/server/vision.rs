//! Images in chat prompts: laid out by [`crate::runtime::media`] on the request pool (decode and
//! resize are CPU work the engine's thread is spared), each error naming its message part.

use super::chat::ImagePart;
use super::error::ApiError;
use super::state::AppState;
use crate::runtime::engine::PromptImage;
use crate::runtime::media::{prompt_with_images as layout, LayoutError};

/// The prompt's entries and its images. The template must have placed every image's marker
/// once.
pub fn prompt_with_images(
    state: &AppState,
    prompt: &str,
    marker: &str,
    parts: &[ImagePart],
) -> Result<(Vec<u32>, Vec<PromptImage>), ApiError> {
    let Some(cfg) = state.cfg.vision.as_ref() else {
        return Err(ApiError::bad_request(
            "image input is not supported: this server was started without a multimodal projector (--mmproj)",
        ));
    };
    super::limits::refuse_by_length(state, prompt)?;
    let placed = prompt.matches(marker).count();
    if placed != parts.len() {
        return Err(ApiError::bad_request(format!(
            "the chat template placed {placed} of the request's {} images",
            parts.len()
        )));
    }
    let bytes: Vec<&[u8]> = parts.iter().map(|p| p.bytes.as_slice()).collect();
    layout(&state.tok, cfg, prompt, marker, &bytes).map_err(|e| match e {
        LayoutError::Image { index, source } => {
            ApiError::bad_request(format!("{}: {source}", parts[index].at))
        }
        LayoutError::Media(m) => ApiError::bad_request(m.to_string()),
    })
}
