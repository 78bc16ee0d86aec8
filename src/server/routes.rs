//! The router: llama-server's routes, its middleware (the access log, CORS as `--cors-*` set
//! it, 503 while loading, the API keys on every route but /health and the UI), `--api-prefix`,
//! and OpenAI-shaped errors for unknown routes and methods.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::{DefaultBodyLimit, Request, State};
use axum::http::{header, HeaderMap, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use serde_json::{json, Value};

use super::chat::{self, render_chat};
use super::completion;
use super::embeddings;
use super::error::ApiError;
use super::generate::unix_now;
use super::request::{field, opt_bool, parse_object, type_name};
use super::state::AppState;
use super::webui;
use super::Body as RawBody;

/// The app: every route, with `body_limit` bytes the most a request body may carry.
pub fn router(state: Arc<AppState>, body_limit: usize) -> Router {
    let routes = Router::new()
        .route("/", get(webui::index))
        .route("/index.html", get(webui::index))
        .route("/webui/{file}", get(webui::asset))
        .route("/sw.js", get(webui::service_worker))
        .route("/health", get(health))
        .route("/v1/health", get(health))
        .route("/v1/models", get(models))
        .route("/models", get(models))
        .route("/props", get(props).post(props_change))
        .route("/slots", get(slots))
        .route("/metrics", get(metrics))
        .route("/v1/chat/completions", post(chat::chat_completions))
        .route("/chat/completions", post(chat::chat_completions))
        .route("/v1/completions", post(completion::completions))
        .route("/completions", post(completion::completions))
        .route("/completion", post(completion::completion))
        .route("/tokenize", post(tokenize))
        .route("/detokenize", post(detokenize))
        .route("/apply-template", post(apply_template))
        .route(
            "/lora-adapters",
            get(super::lora::get_adapters).post(super::lora::post_adapters),
        )
        .route("/v1/embeddings", post(embeddings::embeddings_oai))
        .route("/embedding", post(embeddings::embedding_native))
        .route("/embeddings", post(embeddings::embedding_native))
        .method_not_allowed_fallback(method_not_allowed)
        .layer(middleware::from_fn_with_state(state.clone(), gate))
        .layer(DefaultBodyLimit::max(body_limit))
        .layer(axum::Extension(super::limits::BodyLimit(body_limit)));
    let prefix = state.cfg.api_prefix.clone();
    let routes = if prefix.is_empty() {
        routes
    } else {
        // llama-server serves its page at PREFIX/; a nested "/" answers only PREFIX.
        Router::new()
            .nest(&prefix, routes)
            .route(&format!("{prefix}/"), get(webui::index))
    };
    routes
        .fallback(not_found)
        .layer(middleware::from_fn_with_state(state.clone(), cors))
        .layer(tower_http::catch_panic::CatchPanicLayer::custom(on_panic))
        .layer(middleware::from_fn(super::access::log))
        .with_state(state)
}

/// Whether an Origin's host is this machine (llama-server's `--cors-origins localhost`).
fn origin_is_localhost(origin: &str) -> bool {
    let rest = origin.split_once("://").map_or(origin, |(_, r)| r);
    let host = rest.split('/').next().unwrap_or("");
    let host = if let Some(v6) = host.strip_prefix('[') {
        v6.split(']').next().unwrap_or("")
    } else {
        host.rsplit_once(':').map_or(host, |(h, _)| h)
    };
    matches!(host, "localhost" | "127.0.0.1" | "::1")
}

/// CORS as llama-server answers it: `Access-Control-Allow-Origin` on every response (the
/// Origin echoed when credentials are on and origins are `*`, only a localhost Origin for
/// `localhost`, else the configured list), and a preflight OPTIONS answered here.
async fn cors(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let c = &state.cfg.cors;
    let origin = req
        .headers()
        .get(header::ORIGIN)
        .and_then(|v| v.to_str().ok())
        .map(str::to_string);
    let allow = if c.credentials && c.origins == "*" {
        origin.clone()
    } else if c.origins == "localhost" {
        origin.clone().filter(|o| origin_is_localhost(o))
    } else {
        Some(c.origins.clone())
    };
    let preflight = req.method() == axum::http::Method::OPTIONS;
    let mut resp = if preflight {
        let mut r = Response::new(axum::body::Body::empty());
        let h = r.headers_mut();
        let put = |h: &mut HeaderMap, k: header::HeaderName, v: &str| {
            if let Ok(v) = header::HeaderValue::from_str(v) {
                h.insert(k, v);
            }
        };
        put(
            h,
            header::ACCESS_CONTROL_ALLOW_CREDENTIALS,
            if c.credentials { "true" } else { "false" },
        );
        put(h, header::ACCESS_CONTROL_ALLOW_METHODS, &c.methods);
        put(h, header::ACCESS_CONTROL_ALLOW_HEADERS, &c.headers);
        r
    } else {
        next.run(req).await
    };
    if let Some(v) = allow.and_then(|a| header::HeaderValue::from_str(&a).ok()) {
        resp.headers_mut()
            .insert(header::ACCESS_CONTROL_ALLOW_ORIGIN, v);
    }
    resp
}

/// `POST /props` (`--props`): llama-server accepts it and changes nothing yet; 501 without
/// the flag.
async fn props_change(State(state): State<Arc<AppState>>) -> Response {
    if !state.cfg.endpoint_props {
        return ApiError::not_supported(
            "This server does not support changing global properties. Start it with `--props`",
        )
        .into_response();
    }
    Json(json!({ "success": true })).into_response()
}

fn on_panic(_: Box<dyn std::any::Any + Send + 'static>) -> Response {
    ApiError::server("internal error while handling the request").into_response()
}

async fn not_found() -> Response {
    ApiError::not_found("File Not Found").into_response()
}

async fn method_not_allowed() -> Response {
    ApiError::new(
        StatusCode::METHOD_NOT_ALLOWED,
        "invalid_request_error",
        "method not allowed on this route",
    )
    .into_response()
}

/// Routes open without an API key: health, and the UI's own paths.
fn is_public(path: &str) -> bool {
    matches!(path, "/health" | "/v1/health") || webui::is_ui_path(path)
}

/// llama-server's order: not ready → 503 on every route but the UI's; then the API key (not on
/// the public routes). While draining, every route but the monitoring ones is a 503 that may
/// be retried elsewhere (`/health` too, so that a load balancer stops sending work here).
async fn gate(State(state): State<Arc<AppState>>, req: Request, next: Next) -> Response {
    let path = req.uri().path();
    if state.ready().is_none() && !webui::is_ui_path(path) {
        return ApiError::unavailable("Loading model").into_response();
    }
    if state.drain.is_on() && !matches!(path, "/metrics" | "/slots" | "/props") {
        return state.drain.refusal().into_response();
    }
    if !state.cfg.api_keys.is_empty()
        && !is_public(path)
        && !authorized(req.headers(), &state.cfg.api_keys)
    {
        state.log(
            2,
            format!("unauthorized: {} {}: Invalid API Key", req.method(), path),
        );
        return ApiError::unauthorized().into_response();
    }
    next.run(req).await
}

fn authorized(h: &HeaderMap, keys: &[String]) -> bool {
    let given = h
        .get(header::AUTHORIZATION)
        .or_else(|| h.get("x-api-key"))
        .and_then(|v| v.to_str().ok())
        .unwrap_or("");
    let given = given.strip_prefix("Bearer ").unwrap_or(given);
    // Every key is compared, so the time taken says nothing about which one matched.
    keys.iter().fold(false, |ok, k| {
        constant_time_eq(given.as_bytes(), k.as_bytes()) | ok
    })
}

fn constant_time_eq(a: &[u8], b: &[u8]) -> bool {
    if a.len() != b.len() {
        return false;
    }
    a.iter().zip(b).fold(0u8, |acc, (x, y)| acc | (x ^ y)) == 0
}

async fn health() -> Response {
    Json(json!({ "status": "ok" })).into_response()
}

fn model_info(state: &AppState) -> Value {
    let m = &state.cfg.meta;
    json!({
        "id": state.cfg.alias,
        "aliases": state.cfg.aliases,
        "tags": state.cfg.tags,
        "object": "model",
        "created": unix_now(),
        "owned_by": "llamacpp",
        "meta": {
            "vocab_type": 2,
            "n_vocab": m.n_vocab,
            "n_ctx": state.cfg.n_ctx_slot,
            "n_ctx_train": m.n_ctx_train,
            "n_embd": m.n_embd,
            "n_params": m.n_params,
            "size": m.size,
            "ftype": m.ftype,
        },
    })
}

/// `/v1/models` as llama-server answers it: OpenAI's list, and the Ollama-style `models`
/// array beside it.
async fn models(State(state): State<Arc<AppState>>) -> Response {
    let name = &state.cfg.alias;
    Json(json!({
        "models": [{
            "name": name,
            "model": name,
            "modified_at": "",
            "size": "",
            "digest": "",
            "type": "model",
            "description": "",
            "tags": [""],
            "capabilities": ["completion"],
            "parameters": "",
            "details": {
                "parent_model": "",
                "format": "gguf",
                "family": "",
                "families": [""],
                "parameter_size": "",
                "quantization_level": "",
            },
        }],
        "object": "list",
        "data": [model_info(&state)],
    }))
    .into_response()
}

async fn props(State(state): State<Arc<AppState>>) -> Response {
    let c = &state.cfg;
    let params = state.params_json(&c.sampler, None, &[], false, false);
    Json(json!({
        "default_generation_settings": {
            "id": 0,
            "n_ctx": c.n_ctx_slot,
            "speculative": c.spec.is_some(),
            "is_processing": false,
            "params": params,
        },
        "total_slots": c.total_slots,
        "model_alias": c.alias,
        "model_path": c.model_path,
        "modalities": { "vision": c.vision.is_some(), "video": false, "audio": false },
        "endpoint_slots": c.endpoint_slots,
        "endpoint_props": c.endpoint_props,
        "endpoint_metrics": c.metrics,
        "ui": c.webui,
        "ui_settings": c.ui_settings,
        "chat_template": state.template.source(),
        "bos_token": c.meta.bos_token,
        "eos_token": c.meta.eos_token,
        "build_info": c.build_info,
        "is_sleeping": false,
        "backend": c.backend,
    }))
    .into_response()
}

async fn slots(State(state): State<Arc<AppState>>) -> Response {
    if !state.cfg.endpoint_slots {
        return ApiError::not_supported(
            "This server does not support slots endpoint. Start it with `--slots`",
        )
        .into_response();
    }
    let Some(engine) = state.ready() else {
        return ApiError::unavailable("Loading model").into_response();
    };
    let m = engine.metrics();
    let views = state
        .slots
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .clone();
    let out: Vec<Value> = views
        .iter()
        .enumerate()
        .map(|(i, v)| {
            let (busy, n_tokens) = m.slots.get(i).copied().unwrap_or((false, 0));
            let mut o = json!({
                "id": i,
                "n_ctx": state.cfg.n_ctx_slot,
                "speculative": state.cfg.spec.is_some(),
                "is_processing": busy,
                "n_tokens": n_tokens,
            });
            if let (Some(id_task), Some(obj)) = (v.id_task, o.as_object_mut()) {
                let n_remain = v
                    .max_tokens
                    .map(|mx| mx.saturating_sub(v.n_decoded) as i64)
                    .unwrap_or(-1);
                obj.insert("id_task".into(), json!(id_task));
                obj.insert("n_prompt_tokens".into(), json!(v.n_prompt_tokens));
                obj.insert("n_prompt_tokens_cache".into(), json!(v.n_cached));
                obj.insert("params".into(), v.params.clone());
                obj.insert(
                    "next_token".into(),
                    json!([{
                        "has_next_token": busy && v.processing,
                        "has_new_line": false,
                        "n_remain": n_remain,
                        "n_decoded": v.n_decoded,
                    }]),
                );
            }
            o
        })
        .collect();
    Json(Value::Array(out)).into_response()
}

async fn metrics(State(state): State<Arc<AppState>>) -> Response {
    if !state.cfg.metrics {
        return ApiError::not_supported(
            "This server does not support metrics endpoint. Start it with `--metrics`",
        )
        .into_response();
    }
    let Some(engine) = state.ready() else {
        return ApiError::unavailable("Loading model").into_response();
    };
    let text = super::metrics::render(&state, &engine.metrics());
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "text/plain; version=0.0.4")],
        text,
    )
        .into_response()
}

fn body_of(bytes: &Bytes) -> Result<serde_json::Map<String, Value>, ApiError> {
    parse_object(bytes)
}

async fn tokenize(State(state): State<Arc<AppState>>, body: RawBody) -> Response {
    let bytes = body.0;
    let r = super::limits::off_runtime(&state, move |state| -> Result<Value, ApiError> {
        let b = body_of(&bytes)?;
        let content = match field(&b, "content") {
            None => return Ok(json!({ "tokens": [] })),
            Some(Value::String(s)) => s.clone(),
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "'content' must be a string, not {}",
                    type_name(other)
                )))
            }
        };
        let add_special = opt_bool(&b, "add_special")?.unwrap_or(false);
        let parse_special = opt_bool(&b, "parse_special")?.unwrap_or(true);
        let with_pieces = opt_bool(&b, "with_pieces")?.unwrap_or(false);
        let ids = state
            .tok
            .encode(&content, add_special, parse_special)
            .map_err(|e| ApiError::server(format!("tokenizer: {e}")))?;
        if !with_pieces {
            return Ok(json!({ "tokens": ids }));
        }
        let pieces: Vec<Value> = ids
            .iter()
            .map(|&id| {
                let bytes = state.tok.decode_bytes(&[id], false).unwrap_or_default();
                let piece = match String::from_utf8(bytes) {
                    Ok(s) => Value::String(s),
                    Err(e) => json!(e.into_bytes()),
                };
                json!({ "id": id, "piece": piece })
            })
            .collect();
        Ok(json!({ "tokens": pieces }))
    })
    .await;
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn detokenize(State(state): State<Arc<AppState>>, body: RawBody) -> Response {
    let bytes = body.0;
    let r = super::limits::off_runtime(&state, move |state| -> Result<Value, ApiError> {
        let b = body_of(&bytes)?;
        let ids: Vec<u32> = match field(&b, "tokens") {
            None => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .enumerate()
                .map(|(i, t)| {
                    t.as_u64()
                        .filter(|&x| (x as usize) < state.cfg.meta.n_vocab)
                        .map(|x| x as u32)
                        .ok_or_else(|| {
                            ApiError::bad_request(format!(
                                "tokens[{i}] = {t} is not a token id (0..{})",
                                state.cfg.meta.n_vocab
                            ))
                        })
                })
                .collect::<Result<_, _>>()?,
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "'tokens' must be an array of token ids, not {}",
                    type_name(other)
                )))
            }
        };
        let content = state
            .tok
            .decode(&ids, false)
            .map_err(|e| ApiError::bad_request(format!("{e}")))?;
        Ok(json!({ "content": content }))
    })
    .await;
    match r {
        Ok(v) => Json(v).into_response(),
        Err(e) => e.into_response(),
    }
}

async fn apply_template(State(state): State<Arc<AppState>>, body: RawBody) -> Response {
    let bytes = body.0;
    let r = super::limits::off_runtime(&state, move |state| {
        body_of(&bytes).and_then(|b| render_chat(state, &b))
    })
    .await;
    match r {
        // llama.cpp's default marker where each image goes (the request's own is random).
        Ok(c) => Json(
            json!({ "prompt": c.prompt.replace(&c.marker, crate::model::vision::MEDIA_MARKER) }),
        )
        .into_response(),
        Err(e) => e.into_response(),
    }
}
