//! What one request may cost: the body size (`--max-body-mb`, a 413), the CPU work before the
//! engine (JSON parsing, template rendering, tokenization) on a small pool of low-priority
//! threads so that `/health`, `/metrics` and `/slots` never wait behind it, and a prompt refused
//! by its length in bytes, before it is rendered or tokenized, when it cannot fit the slot
//! window.

use std::sync::Arc;

use super::error::ApiError;
use super::state::AppState;
use crate::tokenizer::Tokenizer;

/// The descriptors kept free beside the connections (the model file, logs, the engine's).
const FD_RESERVE: u64 = 64;

/// Raises the soft descriptor limit to the hard one (as Go's runtime and nginx's
/// `worker_rlimit_nofile` do) and returns how many connections it then allows, so that the
/// cap is reached before `accept` fails with EMFILE.
pub fn connection_ceiling() -> u64 {
    // SAFETY: getrlimit/setrlimit write and read one plain struct we own.
    unsafe {
        let mut r = libc::rlimit {
            rlim_cur: 0,
            rlim_max: 0,
        };
        if libc::getrlimit(libc::RLIMIT_NOFILE, &mut r) != 0 {
            return 1024 - FD_RESERVE;
        }
        if r.rlim_cur < r.rlim_max {
            let raised = libc::rlimit {
                rlim_cur: r.rlim_max,
                rlim_max: r.rlim_max,
            };
            if libc::setrlimit(libc::RLIMIT_NOFILE, &raised) == 0 {
                r.rlim_cur = r.rlim_max;
            }
        }
        r.rlim_cur.saturating_sub(FD_RESERVE).max(1)
    }
}

/// The longest token's text in bytes: a text of `n` bytes has at least `n / longest` tokens.
pub fn longest_token(tok: &Tokenizer) -> usize {
    (0..tok.n_vocab() as u32)
        .filter_map(|id| tok.decode_bytes(&[id], false).ok())
        .map(|b| b.len())
        .max()
        .unwrap_or(1)
        .max(1)
}

/// The request CPU work that runs before the engine: parsing, rendering, tokenizing.
pub struct Work {
    /// Half the cores (at least one), at a lower scheduling priority than the engine and the
    /// async workers: a flood of large bodies delays other bodies, not `/health` or decoding.
    pool: Option<rayon::ThreadPool>,
    /// See [`longest_token`].
    pub longest_token: usize,
}

impl Work {
    pub fn new(longest_token: usize) -> Work {
        let cores = std::thread::available_parallelism().map_or(2, |n| n.get());
        let pool = rayon::ThreadPoolBuilder::new()
            .num_threads((cores / 2).max(1))
            .thread_name(|i| format!("tern-prep-{i}"))
            .start_handler(|_| {
                // SAFETY: setpriority on the calling thread (who = 0 is this thread on Linux).
                unsafe {
                    libc::setpriority(libc::PRIO_PROCESS, 0, 10);
                }
            })
            .build()
            .map_err(|e| tracing::warn!(target: "tern::server", "no request pool ({e}); preparing on the blocking pool"))
            .ok();
        Work {
            pool,
            longest_token: longest_token.max(1),
        }
    }
}

/// Runs `f` on the request pool, so that the async workers stay free for the cheap routes.
pub async fn off_runtime<T, F>(state: &Arc<AppState>, f: F) -> Result<T, ApiError>
where
    T: Send + 'static,
    F: FnOnce(&AppState) -> Result<T, ApiError> + Send + 'static,
{
    let st = state.clone();
    let run = move || {
        std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&st))).unwrap_or_else(|_| {
            Err(ApiError::server(
                "internal error while preparing the request",
            ))
        })
    };
    match &state.work.pool {
        Some(pool) => {
            let (tx, rx) = tokio::sync::oneshot::channel();
            pool.spawn(move || {
                let _ = tx.send(run());
            });
            rx.await
                .unwrap_or_else(|_| Err(ApiError::unavailable("the server is shutting down")))
        }
        None => tokio::task::spawn_blocking(run)
            .await
            .unwrap_or_else(|_| Err(ApiError::unavailable("the server is shutting down"))),
    }
}

/// A prompt text that cannot fit the slot window whatever its tokens: refused with its lower
/// bound on the token count, before any tokenizing.
pub fn refuse_by_length(state: &AppState, text: &str) -> Result<(), ApiError> {
    refuse_by_bytes(state, text.len())
}

/// [`refuse_by_length`] for a text of `bytes` bytes.
pub fn refuse_by_bytes(state: &AppState, bytes: usize) -> Result<(), ApiError> {
    let at_least = bytes.div_ceil(state.work.longest_token);
    let n_ctx = state.cfg.n_ctx_slot;
    if at_least >= n_ctx {
        let mut e = ApiError::exceed_context(at_least, n_ctx);
        e.message = format!(
            "the request exceeds the available context size: the prompt has at least {at_least} tokens ({} bytes, no token longer than {} bytes) and the slot window n_ctx is {n_ctx}; shorten the prompt or start the server with a larger --ctx-size per slot",
            bytes,
            state.work.longest_token
        );
        return Err(e);
    }
    Ok(())
}

/// The body limit in bytes, as a request extension (the router sets it) for the 413's message.
#[derive(Clone, Copy, Debug)]
pub struct BodyLimit(pub usize);

/// The bytes of the last message's text (a string, or its text parts): the template renders
/// it whole, so the prompt is at least this long.
pub fn last_message_bytes(body: &serde_json::Map<String, serde_json::Value>) -> usize {
    use serde_json::Value;
    let Some(Value::Array(msgs)) = body.get("messages") else {
        return 0;
    };
    match msgs.last().and_then(|m| m.get("content")) {
        Some(Value::String(s)) => s.len(),
        Some(Value::Array(parts)) => parts
            .iter()
            .filter_map(|p| p.get("text").and_then(Value::as_str))
            .map(str::len)
            .sum(),
        _ => 0,
    }
}

/// The 413 of a body over `--max-body-mb`, in OpenAI's error shape.
pub fn too_large(limit: usize) -> ApiError {
    ApiError::new(
        axum::http::StatusCode::PAYLOAD_TOO_LARGE,
        "invalid_request_error",
        format!("the request body is larger than this server accepts: more than {limit} bytes (--max-body-mb)"),
    )
}
