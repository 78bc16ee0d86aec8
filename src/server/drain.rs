//! The SIGTERM drain (`--drain-timeout`): the listener closes, requests still waiting for a
//! slot and any new request on an open connection get a 503 with `Retry-After` at once (no
//! token of theirs has been produced, so a load balancer may send them elsewhere), `/health`
//! turns 503, and the requests already running keep their slots until they finish or the limit
//! passes. Past it they are cut: a stream ends with an error event, a plain response is a 503.

use std::sync::atomic::{AtomicU64, Ordering};

use tokio::sync::watch;

use super::error::ApiError;

/// What a refused request is told to wait before retrying, in seconds.
pub const RETRY_AFTER_S: u64 = 1;

pub struct Drain {
    on: watch::Sender<bool>,
    /// Requests answered 503 because of the drain (queued, or new on an open connection).
    pub refused: AtomicU64,
}

impl Default for Drain {
    fn default() -> Self {
        Drain {
            on: watch::Sender::new(false),
            refused: AtomicU64::new(0),
        }
    }
}

impl Drain {
    pub fn begin(&self) {
        self.on.send_replace(true);
    }

    pub fn is_on(&self) -> bool {
        *self.on.borrow()
    }

    /// Resolves once the drain has begun.
    pub async fn begun(&self) {
        let mut rx = self.on.subscribe();
        let _ = rx.wait_for(|on| *on).await;
    }

    /// The answer to a request the drain turns away (counted).
    pub fn refusal(&self) -> ApiError {
        self.refused.fetch_add(1, Ordering::Relaxed);
        ApiError::unavailable(
            "the server is shutting down and did not start this request; retry it (on another replica)",
        )
        .retry_after(RETRY_AFTER_S)
    }
}
