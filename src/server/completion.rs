//! `POST /v1/completions` (OpenAI) and `POST /completion` (llama-server's native shape): a raw
//! prompt (text or token ids), answered whole or streamed.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::error::ApiError;
use super::generate::{
    cancelled_error, check_prompt, finish_reason, log_done, params_of, request_of, sse_bytes,
    sse_response, submit, timings_json, tokenize, unix_now, usage_json, Submission,
};
use super::request::{gen_params, opt_bool, parse_object, prompt_field, Prompt};
use super::state::AppState;
use super::Body as RawBody;
use crate::runtime::engine::{Event, Finish, FinishReason};

#[derive(Clone, Copy, PartialEq, Eq)]
enum Flavor {
    OpenAi,
    Llama,
}

/// `POST /v1/completions`.
pub async fn completions(State(state): State<Arc<AppState>>, body: RawBody) -> Response {
    match completion_impl(state, body.0, body.1, Flavor::OpenAi).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// `POST /completion` (llama-server's native shape).
pub async fn completion(State(state): State<Arc<AppState>>, body: RawBody) -> Response {
    match completion_impl(state, body.0, body.1, Flavor::Llama).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

async fn completion_impl(
    state: Arc<AppState>,
    bytes: Bytes,
    access: super::Access,
    flavor: Flavor,
) -> Result<Response, ApiError> {
    let body = parse_object(&bytes)?;
    let key = if flavor == Flavor::Llama
        && body.contains_key("content")
        && !body.contains_key("prompt")
    {
        "content"
    } else {
        "prompt"
    };
    let prompt = prompt_field(&body, key)?;
    let mut gen = gen_params(
        &body,
        &state.gen_defaults(),
        &["n_predict", "max_tokens", "max_completion_tokens"],
    )?;
    gen.lora = state.lora.for_request(&body)?;
    let return_tokens = opt_bool(&body, "return_tokens")?.unwrap_or(false);
    let (ids, prompt_text) = match prompt {
        Prompt::Text(t) => (tokenize(&state, &t)?, t),
        Prompt::Tokens(ids) => {
            let text = state.tok.decode(&ids, false).unwrap_or_default();
            (ids, text)
        }
    };
    check_prompt(&state, &ids)?;
    let n_prompt = ids.len();
    let params = params_of(&state, &gen);
    let req = request_of(&state, ids, &gen);
    let sub = submit(&state, req, params.clone(), access).await?;
    let id = format!("cmpl-{}", crate::chat::random_id(32));
    let created = unix_now();
    let ping = super::generate::ping_of(&state, &gen);
    let ctx = CompletionCtx {
        state,
        id,
        created,
        flavor,
        params,
        prompt_text,
        return_tokens,
        include_usage: gen.include_usage,
        n_prompt,
    };
    if gen.stream {
        Ok(stream_completion(ctx, sub, ping))
    } else {
        collect_completion(ctx, sub).await
    }
}

struct CompletionCtx {
    state: Arc<AppState>,
    id: String,
    created: u64,
    flavor: Flavor,
    params: Value,
    prompt_text: String,
    return_tokens: bool,
    include_usage: bool,
    n_prompt: usize,
}

fn stop_type(f: &Finish) -> &'static str {
    match (f.reason, &f.stop_word) {
        (FinishReason::Stop, Some(_)) => "word",
        (FinishReason::Stop, None) => "eos",
        (FinishReason::Length, _) => "limit",
        (FinishReason::Cancelled, _) => "none",
    }
}

impl CompletionCtx {
    /// The final object (whole text when not streamed; empty content when it was).
    fn final_json(&self, slot: usize, content: &str, tokens: &[u32], f: &Finish) -> Value {
        match self.flavor {
            Flavor::OpenAi => json!({
                "choices": [{
                    "text": content,
                    "index": 0,
                    "logprobs": null,
                    "finish_reason": finish_reason(f, false),
                }],
                "created": self.created,
                "model": self.state.cfg.alias,
                "system_fingerprint": self.state.cfg.build_info,
                "object": "text_completion",
                "usage": usage_json(f),
                "id": self.id,
                "timings": timings_json(f),
            }),
            Flavor::Llama => json!({
                "index": 0,
                "content": content,
                "tokens": tokens,
                "id_slot": slot,
                "stop": true,
                "model": self.state.cfg.alias,
                "tokens_predicted": f.completion_tokens,
                "tokens_evaluated": f.prompt_tokens,
                "generation_settings": self.params,
                "prompt": self.prompt_text,
                "has_new_line": content.contains('\n'),
                "truncated": false,
                "stop_type": stop_type(f),
                "stopping_word": f.stop_word.clone().unwrap_or_default(),
                "tokens_cached": f.prompt_tokens + f.completion_tokens,
                "timings": timings_json(f),
            }),
        }
    }
}

async fn collect_completion(ctx: CompletionCtx, mut sub: Submission) -> Result<Response, ApiError> {
    let mut text = String::new();
    let mut tokens = Vec::new();
    let fin = loop {
        match sub.rx.recv().await {
            Some(Event::Token { id, text: t }) => {
                if ctx.return_tokens {
                    tokens.push(id);
                }
                text.push_str(&t);
            }
            Some(Event::Text(t)) => text.push_str(&t),
            Some(Event::Started { .. }) => {}
            Some(Event::Done(f)) => break f,
            Some(Event::Error(e)) => return Err(e.into()),
            None => return Err(ApiError::unavailable("the engine stopped")),
        }
    };
    if fin.reason == FinishReason::Cancelled {
        return Err(cancelled_error());
    }
    log_done(&ctx.state, "completion", &fin, &sub);
    let body = ctx.final_json(sub.slot, &text, &tokens, &fin);
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

fn stream_completion(
    ctx: CompletionCtx,
    mut sub: Submission,
    ping: Option<std::time::Duration>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let send = |v: Value| {
            let tx = tx.clone();
            async move { tx.send(sse_bytes(&v)).await.is_ok() }
        };
        let mut n_decoded = 0usize;
        loop {
            let ev = sub.rx.recv().await;
            if tx.is_closed() {
                return;
            }
            let (text, id) = match ev {
                Some(Event::Token { id, text }) => {
                    n_decoded += 1;
                    (text, Some(id))
                }
                Some(Event::Text(text)) => (text, None),
                Some(Event::Started { .. }) => continue,
                Some(Event::Done(fin)) => {
                    if fin.reason == FinishReason::Cancelled {
                        let _ = send(cancelled_error().to_json()).await;
                        return;
                    }
                    log_done(&ctx.state, "completion (stream)", &fin, &sub);
                    let mut last = ctx.final_json(sub.slot, "", &[], &fin);
                    if ctx.flavor == Flavor::OpenAi && ctx.include_usage {
                        if let Some(o) = last.as_object_mut() {
                            o.remove("usage");
                            o.remove("timings");
                        }
                        if !send(last).await {
                            return;
                        }
                        last = json!({
                            "choices": [],
                            "created": ctx.created,
                            "model": ctx.state.cfg.alias,
                            "system_fingerprint": ctx.state.cfg.build_info,
                            "object": "text_completion",
                            "id": ctx.id,
                            "usage": usage_json(&fin),
                            "timings": timings_json(&fin),
                        });
                    }
                    if send(last).await && ctx.flavor == Flavor::OpenAi {
                        let _ = tx.send(Bytes::from_static(b"data: [DONE]\n\n")).await;
                    }
                    return;
                }
                Some(Event::Error(e)) => {
                    let _ = send(ApiError::from(e).to_json()).await;
                    return;
                }
                None => {
                    let _ = send(ApiError::unavailable("the engine stopped").to_json()).await;
                    return;
                }
            };
            if text.is_empty() && ctx.flavor == Flavor::OpenAi {
                continue;
            }
            let v = match ctx.flavor {
                Flavor::OpenAi => json!({
                    "choices": [{ "text": text, "index": 0, "logprobs": null, "finish_reason": null }],
                    "created": ctx.created,
                    "model": ctx.state.cfg.alias,
                    "system_fingerprint": ctx.state.cfg.build_info,
                    "object": "text_completion",
                    "id": ctx.id,
                }),
                Flavor::Llama => json!({
                    "index": 0,
                    "content": text,
                    "tokens": id.map(|i| vec![i]).unwrap_or_default(),
                    "stop": false,
                    "id_slot": sub.slot,
                    "tokens_predicted": n_decoded,
                    "tokens_evaluated": ctx.n_prompt,
                }),
            };
            if !send(v).await {
                return;
            }
        }
    });
    sse_response(rx, ping)
}
