//! The access log: one line per request once its response is done (a stream when its last
//! event is sent, or when the client leaves), with the method, path, status, latency, the
//! prompt and generated tokens and the slot when it ran on one, and the client's address.
//!
//! The polling routes llama-server keeps out of its request log (/health, /models, /props,
//! /metrics) are logged at debug, the rest at info.

use std::net::SocketAddr;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::task::{Context, Poll};
use std::time::Instant;

use axum::body::{Body, Bytes, HttpBody};
use axum::extract::{ConnectInfo, Request};
use axum::http::{Method, StatusCode};
use axum::middleware::Next;
use axum::response::Response;

/// What a handler learns about its request, for the access line.
#[derive(Clone, Debug, Default)]
pub struct Access(Arc<Mutex<Info>>);

#[derive(Clone, Debug, Default)]
struct Info {
    slot: Option<usize>,
    prompt_tokens: Option<usize>,
    cached_tokens: Option<usize>,
    generated_tokens: Option<usize>,
}

impl Access {
    fn with(&self, f: impl FnOnce(&mut Info)) {
        let mut g = self.0.lock().unwrap_or_else(|p| p.into_inner());
        f(&mut g);
    }

    pub fn slot(&self, slot: usize) {
        self.with(|i| i.slot = Some(slot));
    }

    pub fn tokens(&self, prompt: usize, cached: usize, generated: usize) {
        self.with(|i| {
            i.prompt_tokens = Some(prompt);
            i.cached_tokens = Some(cached);
            i.generated_tokens = Some(generated);
        });
    }

    fn info(&self) -> Info {
        self.0.lock().unwrap_or_else(|p| p.into_inner()).clone()
    }
}

fn quiet(path: &str) -> bool {
    matches!(
        path,
        "/health" | "/v1/health" | "/models" | "/v1/models" | "/props" | "/metrics"
    )
}

/// Emits the line when dropped: with the response body, so a stream is logged when it ends.
struct Line {
    t0: Instant,
    method: Method,
    path: String,
    status: StatusCode,
    remote: Option<SocketAddr>,
    access: Access,
}

impl Drop for Line {
    fn drop(&mut self) {
        let i = self.access.info();
        let latency_ms = (self.t0.elapsed().as_secs_f64() * 1e4).round() / 10.0;
        let status = self.status.as_u16();
        let method = self.method.as_str();
        let path = self.path.as_str();
        let remote = self
            .remote
            .map(|a| a.to_string())
            .unwrap_or_else(|| "-".into());
        macro_rules! line {
            ($lvl:ident) => {
                match (i.prompt_tokens, i.generated_tokens) {
                    (Some(prompt), Some(generated)) => tracing::$lvl!(
                        target: "tern::access",
                        method,
                        path,
                        status,
                        latency_ms,
                        prompt_tokens = prompt,
                        cached_tokens = i.cached_tokens.unwrap_or(0),
                        generated_tokens = generated,
                        slot = i.slot.map(|s| s as i64).unwrap_or(-1),
                        remote = remote.as_str(),
                        "request"
                    ),
                    _ => tracing::$lvl!(
                        target: "tern::access",
                        method,
                        path,
                        status,
                        latency_ms,
                        remote = remote.as_str(),
                        "request"
                    ),
                }
            };
        }
        if quiet(path) {
            line!(debug);
        } else {
            line!(info);
        }
    }
}

/// The response body, carrying the line until it is dropped.
struct Logged {
    inner: Body,
    _line: Line,
}

impl HttpBody for Logged {
    type Data = Bytes;
    type Error = axum::Error;

    fn poll_frame(
        mut self: Pin<&mut Self>,
        cx: &mut Context<'_>,
    ) -> Poll<Option<Result<http_body::Frame<Bytes>, axum::Error>>> {
        Pin::new(&mut self.inner).poll_frame(cx)
    }

    fn is_end_stream(&self) -> bool {
        self.inner.is_end_stream()
    }

    fn size_hint(&self) -> http_body::SizeHint {
        self.inner.size_hint()
    }
}

/// The middleware: hands the request an [`Access`] and logs once the response is done.
pub async fn log(mut req: Request, next: Next) -> Response {
    let t0 = Instant::now();
    let method = req.method().clone();
    let path = req.uri().path().to_string();
    let remote = req
        .extensions()
        .get::<ConnectInfo<SocketAddr>>()
        .map(|c| c.0);
    let access = Access::default();
    req.extensions_mut().insert(access.clone());
    let resp = next.run(req).await;
    let line = Line {
        t0,
        method,
        path,
        status: resp.status(),
        remote,
        access,
    };
    resp.map(|inner| Body::new(Logged { inner, _line: line }))
}
