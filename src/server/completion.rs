//! `POST /v1/completions` (OpenAI) and `POST /completion` (llama-server's native shape): a raw
//! prompt (text or token ids), answered whole or streamed.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Value};
use tokio::sync::mpsc;

use super::chat::{chat_grammar, merged_finish};
use super::error::ApiError;
use super::generate::{
    cancelled_error, check_prompt, compile_grammar, finish_reason, log_done, params_of, request_of,
    sse_bytes, sse_response, submit, timings_json, token_probs_json, token_text, tokenize,
    unix_now, usage_json, Submission,
};
use super::request::{gen_params, opt_bool, parse_object, prompt_field, Endpoint, Prompt};
use super::state::AppState;
use super::Body as RawBody;
use crate::chat::ParserConfig;
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

/// A completion request parsed and tokenized, ready for the engine.
struct PreparedCompletion {
    req: crate::runtime::engine::Request,
    params: Value,
    prompt_text: String,
    return_tokens: bool,
    include_usage: bool,
    n_prompt: usize,
    n: usize,
    stream: bool,
    ping: Option<std::time::Duration>,
}

/// The CPU work of a completion request (off the async runtime).
fn prepare_completion(
    state: &AppState,
    bytes: &[u8],
    flavor: Flavor,
) -> Result<PreparedCompletion, ApiError> {
    let body = parse_object(bytes)?;
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
        &state.tok,
        match flavor {
            Flavor::OpenAi => Endpoint::OpenAiCompletion,
            Flavor::Llama => Endpoint::Completion,
        },
    )?;
    gen.lora = state.lora.for_request(&body)?;
    let return_tokens = opt_bool(&body, "return_tokens")?.unwrap_or(false);
    let (ids, prompt_text) = match prompt {
        Prompt::Text(t) => (tokenize(state, &t)?, t),
        Prompt::Tokens(ids) => {
            let text = state.tok.decode(&ids, false).unwrap_or_default();
            (ids, text)
        }
    };
    check_prompt(state, &ids)?;
    let constraint = chat_grammar(&body, None, "auto", None)?
        .map(|g| compile_grammar(state, &g, ParserConfig::prompt_opens_thinking(&prompt_text)))
        .transpose()?;
    Ok(PreparedCompletion {
        n_prompt: ids.len(),
        params: params_of(state, &gen),
        n: gen.n,
        stream: gen.stream,
        include_usage: gen.include_usage,
        ping: super::generate::ping_of(state, &gen),
        req: request_of(state, ids, &gen, constraint),
        prompt_text,
        return_tokens,
    })
}

async fn completion_impl(
    state: Arc<AppState>,
    bytes: Bytes,
    access: super::Access,
    flavor: Flavor,
) -> Result<Response, ApiError> {
    let p = super::limits::off_runtime(&state, move |st| prepare_completion(st, &bytes, flavor))
        .await?;
    let sub = submit(&state, p.req, p.params.clone(), access).await?;
    let id = format!("cmpl-{}", crate::chat::random_id(32));
    let created = unix_now();
    let ctx = CompletionCtx {
        state,
        id,
        created,
        flavor,
        params: p.params,
        prompt_text: p.prompt_text,
        return_tokens: p.return_tokens,
        include_usage: p.include_usage,
        n_prompt: p.n_prompt,
        n: p.n,
    };
    if p.stream {
        Ok(stream_completion(ctx, sub, p.ping))
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
    n: usize,
}

fn stop_type(f: &Finish) -> &'static str {
    match (f.reason, &f.stop_word) {
        (FinishReason::Stop, Some(_)) => "word",
        (FinishReason::Stop, None) => "eos",
        (FinishReason::Length, _) => "limit",
        (FinishReason::Cancelled, _) => "none",
    }
}

/// One choice's output so far.
#[derive(Default)]
struct ChoiceOut {
    text: String,
    tokens: Vec<u32>,
    /// llama-server's per-token entries.
    probs: Vec<Value>,
    /// Where each token with probabilities starts in `text` (OpenAI's `text_offset`).
    offsets: Vec<usize>,
    done: Option<Finish>,
}

/// `/v1/completions`' `logprobs`: OpenAI's legacy arrays, plus llama-server's `content` entries.
fn openai_logprobs(probs: &[Value], offsets: &[usize], base: usize) -> Value {
    let key = |p: &Value| {
        if p.get("logprob").is_some() {
            "logprob"
        } else {
            "prob"
        }
    };
    let tokens: Vec<Value> = probs.iter().map(|p| p["token"].clone()).collect();
    let lps: Vec<Value> = probs.iter().map(|p| p[key(p)].clone()).collect();
    let tops: Vec<Value> = probs
        .iter()
        .map(|p| {
            let list = p
                .get("top_logprobs")
                .or(p.get("top_probs"))
                .and_then(Value::as_array);
            let mut m = serde_json::Map::new();
            for t in list.into_iter().flatten() {
                let tok = t["token"].as_str().unwrap_or_default().to_string();
                m.entry(tok).or_insert(t[key(t)].clone());
            }
            Value::Object(m)
        })
        .collect();
    let offs: Vec<usize> = offsets.iter().map(|o| base + o).collect();
    json!({
        "tokens": tokens,
        "token_logprobs": lps,
        "top_logprobs": tops,
        "text_offset": offs,
        "content": probs,
    })
}

impl CompletionCtx {
    /// The final object (whole text when not streamed; empty content when it was).
    fn final_json(&self, slot: usize, outs: &[ChoiceOut], f: &Finish, streamed: bool) -> Value {
        match self.flavor {
            Flavor::OpenAi => {
                let choices: Vec<Value> = outs
                    .iter()
                    .enumerate()
                    .map(|(c, o)| {
                        let fin = o.done.as_ref().unwrap_or(f);
                        json!({
                            "text": if streamed { "" } else { o.text.as_str() },
                            "index": c,
                            "logprobs": if o.probs.is_empty() || streamed {
                                Value::Null
                            } else {
                                openai_logprobs(&o.probs, &o.offsets, 0)
                            },
                            "finish_reason": finish_reason(fin, false),
                        })
                    })
                    .collect();
                json!({
                    "choices": choices,
                    "created": self.created,
                    "model": self.state.cfg.alias,
                    "system_fingerprint": self.state.cfg.build_info,
                    "object": "text_completion",
                    "usage": usage_json(f),
                    "id": self.id,
                    "timings": timings_json(f),
                })
            }
            Flavor::Llama => {
                let o = &outs[0];
                let content = if streamed { "" } else { o.text.as_str() };
                let mut v = json!({
                    "index": 0,
                    "content": content,
                    "tokens": if streamed { &[][..] } else { &o.tokens[..] },
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
                });
                if !streamed && !o.probs.is_empty() {
                    v["completion_probabilities"] = Value::Array(o.probs.clone());
                }
                v
            }
        }
    }
}

async fn collect_completion(ctx: CompletionCtx, mut sub: Submission) -> Result<Response, ApiError> {
    let mut outs: Vec<ChoiceOut> = (0..ctx.n).map(|_| ChoiceOut::default()).collect();
    while outs.iter().any(|o| o.done.is_none()) {
        match sub.rx.recv().await {
            Some(Event::Token {
                choice,
                id,
                text: t,
                probs,
            }) => {
                let o = &mut outs[choice];
                if ctx.return_tokens {
                    o.tokens.push(id);
                }
                if let Some(p) = probs {
                    o.offsets.push(o.text.len());
                    let tt = token_text(&ctx.state, id);
                    o.probs.push(token_probs_json(&ctx.state, id, &tt, &p));
                }
                o.text.push_str(&t);
            }
            Some(Event::Text { choice, text }) => outs[choice].text.push_str(&text),
            Some(Event::Started { .. }) | Some(Event::Embedding(_)) => {}
            Some(Event::Done(f)) => {
                if f.reason == FinishReason::Cancelled {
                    return Err(cancelled_error());
                }
                let c = f.choice;
                outs[c].done = Some(f);
            }
            Some(Event::Error(e)) => return Err(e.into()),
            None => return Err(ApiError::unavailable("the engine stopped")),
        }
    }
    let fins: Vec<Finish> = outs.iter().filter_map(|o| o.done.clone()).collect();
    let fin = merged_finish(&fins);
    log_done(&ctx.state, "completion", &fin, &sub);
    let body = ctx.final_json(sub.slot, &outs, &fin, false);
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
        let mut outs: Vec<ChoiceOut> = (0..ctx.n).map(|_| ChoiceOut::default()).collect();
        let mut n_decoded = 0usize;
        loop {
            let ev = sub.rx.recv().await;
            if tx.is_closed() {
                return;
            }
            let (choice, text, id, probs) = match ev {
                Some(Event::Token {
                    choice,
                    id,
                    text,
                    probs,
                }) => {
                    n_decoded += 1;
                    (choice, text, Some(id), probs)
                }
                Some(Event::Text { choice, text }) => (choice, text, None, None),
                Some(Event::Started { .. }) | Some(Event::Embedding(_)) => continue,
                Some(Event::Done(fin)) => {
                    if fin.reason == FinishReason::Cancelled {
                        let _ = send(cancelled_error().to_json()).await;
                        return;
                    }
                    let c = fin.choice;
                    outs[c].done = Some(fin);
                    if outs.iter().any(|o| o.done.is_none()) {
                        continue;
                    }
                    let fins: Vec<Finish> = outs.iter().filter_map(|o| o.done.clone()).collect();
                    let fin = merged_finish(&fins);
                    log_done(&ctx.state, "completion (stream)", &fin, &sub);
                    let mut last = ctx.final_json(sub.slot, &outs, &fin, true);
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
            let entry = match (id, probs) {
                (Some(id), Some(p)) => {
                    let tt = token_text(&ctx.state, id);
                    Some(token_probs_json(&ctx.state, id, &tt, &p))
                }
                _ => None,
            };
            if text.is_empty() && entry.is_none() && ctx.flavor == Flavor::OpenAi {
                continue;
            }
            let offset = outs[choice].text.len();
            outs[choice].text.push_str(&text);
            let v = match ctx.flavor {
                Flavor::OpenAi => json!({
                    "choices": [{
                        "text": text,
                        "index": choice,
                        "logprobs": match &entry {
                            Some(e) => openai_logprobs(std::slice::from_ref(e), &[0], offset),
                            None => Value::Null,
                        },
                        "finish_reason": null,
                    }],
                    "created": ctx.created,
                    "model": ctx.state.cfg.alias,
                    "system_fingerprint": ctx.state.cfg.build_info,
                    "object": "text_completion",
                    "id": ctx.id,
                }),
                Flavor::Llama => {
                    let mut v = json!({
                        "index": 0,
                        "content": text,
                        "tokens": id.map(|i| vec![i]).unwrap_or_default(),
                        "stop": false,
                        "id_slot": sub.slot,
                        "tokens_predicted": n_decoded,
                        "tokens_evaluated": ctx.n_prompt,
                    });
                    if let Some(e) = entry {
                        v["completion_probabilities"] = json!([e]);
                    }
                    v
                }
            };
            if !send(v).await {
                return;
            }
        }
    });
    sse_response(rx, ping)
}
