//! Errors in OpenAI's shape: `{"error":{"code","message","type"}}`, with llama-server's types
//! (`invalid_request_error` 400, `authentication_error` 401, `not_found_error` 404,
//! `exceed_context_size_error` 400 with `n_prompt_tokens` and `n_ctx`, `unavailable_error` 503,
//! `not_supported_error` 501, `server_error` 500).

use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};

use crate::runtime::engine::EngineError;

#[derive(Clone, Debug, PartialEq)]
pub struct ApiError {
    pub status: StatusCode,
    pub kind: &'static str,
    pub message: String,
    /// Extra fields inside `error` (n_prompt_tokens, n_ctx).
    pub extra: Vec<(&'static str, Value)>,
    /// Seconds for a `Retry-After` header (a 503 the client may retry).
    pub retry_after: Option<u64>,
}

impl ApiError {
    pub fn new(status: StatusCode, kind: &'static str, message: impl Into<String>) -> ApiError {
        ApiError {
            status,
            kind,
            message: message.into(),
            extra: Vec::new(),
            retry_after: None,
        }
    }

    pub fn retry_after(mut self, secs: u64) -> ApiError {
        self.retry_after = Some(secs);
        self
    }

    pub fn bad_request(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::BAD_REQUEST, "invalid_request_error", message)
    }

    pub fn unauthorized() -> ApiError {
        ApiError::new(
            StatusCode::UNAUTHORIZED,
            "authentication_error",
            "Invalid API Key",
        )
    }

    pub fn not_found(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_FOUND, "not_found_error", message)
    }

    pub fn not_supported(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::NOT_IMPLEMENTED, "not_supported_error", message)
    }

    pub fn unavailable(message: impl Into<String>) -> ApiError {
        ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "unavailable_error",
            message,
        )
    }

    pub fn server(message: impl Into<String>) -> ApiError {
        ApiError::new(StatusCode::INTERNAL_SERVER_ERROR, "server_error", message)
    }

    /// A prompt longer than the slot window (llama-server's 400 that names both numbers).
    pub fn exceed_context(n_prompt: usize, n_ctx: usize) -> ApiError {
        let mut e = ApiError::new(
            StatusCode::BAD_REQUEST,
            "exceed_context_size_error",
            format!(
                "the request exceeds the available context size: the prompt has {n_prompt} tokens and the slot window n_ctx is {n_ctx}; shorten the prompt or start the server with a larger --ctx-size per slot"
            ),
        );
        e.extra = vec![
            ("n_prompt_tokens", json!(n_prompt)),
            ("n_ctx", json!(n_ctx)),
        ];
        e
    }

    /// The `error` object itself.
    pub fn body(&self) -> Value {
        let mut e = json!({
            "code": self.status.as_u16(),
            "message": self.message,
            "type": self.kind,
        });
        if let Some(m) = e.as_object_mut() {
            for (k, v) in &self.extra {
                m.insert((*k).to_string(), v.clone());
            }
        }
        e
    }

    pub fn to_json(&self) -> Value {
        json!({ "error": self.body() })
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, axum::Json(self.to_json())).into_response();
        if let Some(s) = self.retry_after {
            r.headers_mut()
                .insert(axum::http::header::RETRY_AFTER, s.into());
        }
        r
    }
}

impl From<EngineError> for ApiError {
    fn from(e: EngineError) -> ApiError {
        match e {
            EngineError::PromptTooLong {
                n_prompt,
                n_ctx_slot,
            } => ApiError::exceed_context(n_prompt, n_ctx_slot),
            EngineError::EmptyPrompt => ApiError::bad_request("the prompt is empty"),
            EngineError::Sampling(m) => {
                ApiError::bad_request(format!("bad sampling parameters: {m}"))
            }
            EngineError::Stopped => ApiError::unavailable("the server is shutting down"),
            e @ EngineError::TooManyChoices { .. } => ApiError::bad_request(e.to_string()),
            e @ (EngineError::Config(_)
            | EngineError::Grammar(_)
            | EngineError::UnevenPool { .. }
            | EngineError::WindowTooLong { .. }
            | EngineError::Model(_)) => ApiError::server(e.to_string()),
        }
    }
}
