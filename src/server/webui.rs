//! The chat page at `/` (llama-server's web UI): plain HTML, CSS and JS compiled into the
//! binary from `webui/`, so the server needs no files and no network to serve it. Like
//! llama-server, the page itself is open without an API key (it holds no data); every call it
//! makes carries the key the user gives it. `--no-webui` answers 404 here.

use std::sync::Arc;

use axum::extract::{Path, State};
use axum::http::{header, HeaderMap, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};

use super::error::ApiError;
use super::state::AppState;

const INDEX: &str = include_str!("webui/index.html");

/// The assets under `/webui/`, by file name: (bytes, content type).
const ASSETS: &[(&str, &str, &str)] = &[
    (
        "app.js",
        include_str!("webui/app.js"),
        "text/javascript; charset=utf-8",
    ),
    (
        "markdown.js",
        include_str!("webui/markdown.js"),
        "text/javascript; charset=utf-8",
    ),
    (
        "app.css",
        include_str!("webui/app.css"),
        "text/css; charset=utf-8",
    ),
];

/// Where the page loads from; none of these need an API key, and they answer while the model
/// loads (the page shows that it is loading).
pub fn is_ui_path(path: &str) -> bool {
    matches!(path, "/" | "/index.html" | "/sw.js")
        || path
            .strip_prefix("/webui/")
            .is_some_and(|f| ASSETS.iter().any(|(name, ..)| *name == f))
}

/// The page and its assets, in bytes (reported by the tests and the README).
pub fn size_bytes() -> usize {
    INDEX.len() + ASSETS.iter().map(|(_, body, _)| body.len()).sum::<usize>()
}

/// Only this server's own scripts and styles run: no inline script, no CDN, and the only
/// images are the user's own attachments (data URLs).
const CSP: &str = "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data: blob:; connect-src 'self'; base-uri 'self'; form-action 'self'; frame-ancestors 'none'";

/// The ETag of a body: FNV-1a of its bytes (hashing a few tens of kB per load is nothing
/// next to sending them).
fn etag(body: &str) -> HeaderValue {
    let h = body.bytes().fold(0xcbf29ce484222325u64, |h, c| {
        (h ^ c as u64).wrapping_mul(0x100000001b3)
    });
    HeaderValue::from_str(&format!("\"{h:016x}\"")).expect("hex digits are a valid header value")
}

fn not_modified(req: &HeaderMap, tag: &HeaderValue) -> bool {
    req.get(header::IF_NONE_MATCH)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.split(',').any(|t| t.trim() == tag || t.trim() == "*"))
}

fn serve(req: &HeaderMap, body: String, content_type: &'static str) -> Response {
    let tag = etag(&body);
    let headers = [
        (header::CONTENT_TYPE, HeaderValue::from_static(content_type)),
        // Revalidated on each load, so a new binary's page is picked up at once.
        (header::CACHE_CONTROL, HeaderValue::from_static("no-cache")),
        (header::ETAG, tag.clone()),
        (
            header::CONTENT_SECURITY_POLICY,
            HeaderValue::from_static(CSP),
        ),
        (
            header::X_CONTENT_TYPE_OPTIONS,
            HeaderValue::from_static("nosniff"),
        ),
    ];
    if not_modified(req, &tag) {
        return (StatusCode::NOT_MODIFIED, headers).into_response();
    }
    (StatusCode::OK, headers, body).into_response()
}

async fn not_found() -> Response {
    ApiError::not_found("File Not Found").into_response()
}

/// `/` and `/index.html`. The page's URLs are relative to a `<base>` naming `--api-prefix`,
/// so it works under a prefix too.
pub async fn index(State(state): State<Arc<AppState>>, req: HeaderMap) -> Response {
    if !state.cfg.webui {
        return not_found().await;
    }
    let page = INDEX.replace("{{BASE}}", &format!("{}/", state.cfg.api_prefix));
    serve(&req, page, "text/html; charset=utf-8")
}

/// `/webui/{file}`: the page's scripts and styles.
pub async fn asset(
    State(state): State<Arc<AppState>>,
    Path(file): Path<String>,
    req: HeaderMap,
) -> Response {
    if !state.cfg.webui {
        return not_found().await;
    }
    match ASSETS.iter().find(|(name, ..)| *name == file) {
        Some((_, body, ty)) => serve(&req, body.to_string(), ty),
        None => not_found().await,
    }
}

/// With the UI off, a browser's cached UI service worker is told to remove itself, as
/// llama-server does. tern's page registers no worker, so with the UI on there is none.
pub async fn service_worker(State(state): State<Arc<AppState>>) -> Response {
    if state.cfg.webui {
        return not_found().await;
    }
    const REMOVE: &str = "self.addEventListener('install', () => self.skipWaiting());\nself.addEventListener('activate', (e) => e.waitUntil((async () => {\n    await self.registration.unregister();\n    for (const key of await caches.keys()) await caches.delete(key);\n    for (const c of await self.clients.matchAll({ type: 'window' })) c.navigate(c.url);\n})()));\n";
    (
        StatusCode::OK,
        [
            (header::CONTENT_TYPE, "application/javascript"),
            (header::CACHE_CONTROL, "no-cache"),
        ],
        REMOVE,
    )
        .into_response()
}
