//! The generation machinery shared by the chat and completion endpoints ([`super::chat`],
//! [`super::completion`]).
//!
//! Each request is submitted to the engine and its blocking event channel is bridged into
//! tokio by a blocking task ([`bridge`]) that also keeps `/slots` current and cancels the
//! request (freeing its slot) as soon as the client is gone: a streamed response whose body is
//! dropped, or a handler future that is dropped, closes the channel the bridge writes to.

use std::convert::Infallible;
use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::{Body, Bytes};
use axum::http::header;
use axum::response::Response;
use serde_json::{json, Value};
use tokio::sync::mpsc;
use tokio_stream::wrappers::ReceiverStream;

use super::error::ApiError;
use super::request::{field, opt_str, type_name, GenParams, Obj};
use super::state::AppState;
use crate::runtime::constraint::{Constraint, GrammarSpec, Grammars};
use crate::runtime::engine::{Engine, EngineError, Event, Finish, FinishReason, Request};
use crate::runtime::sampler::TokenProbs;
// ---------------------------------------------------------------------------------------------
// Engine bridge
// ---------------------------------------------------------------------------------------------

/// A submitted request that has a slot.
pub struct Submission {
    pub rx: mpsc::UnboundedReceiver<Event>,
    pub slot: usize,
    pub cached: usize,
    pub t0: Instant,
    /// The request's access-log record.
    pub access: super::Access,
}

/// The engine, or 503 while it loads.
pub fn engine(state: &AppState) -> Result<Arc<Engine>, ApiError> {
    state
        .ready()
        .cloned()
        .ok_or_else(|| ApiError::unavailable("Loading model"))
}

/// The checks the engine would make, made here so that they are 400s before any stream starts.
pub fn check_prompt(state: &AppState, ids: &[u32]) -> Result<(), ApiError> {
    if ids.is_empty() {
        return Err(ApiError::bad_request("the prompt is empty"));
    }
    let n_ctx = state.cfg.n_ctx_slot;
    if ids.len() >= n_ctx {
        return Err(ApiError::exceed_context(ids.len(), n_ctx));
    }
    let n_vocab = state.cfg.meta.n_vocab;
    let image_row = crate::runtime::engine::IMAGE_ROW;
    if let Some((i, t)) = ids
        .iter()
        .enumerate()
        .find(|(_, &t)| t != image_row && t as usize >= n_vocab)
    {
        return Err(ApiError::bad_request(format!(
            "prompt token {i} = {t} is outside the vocabulary (n_vocab {n_vocab})"
        )));
    }
    Ok(())
}

/// Submits `req` and waits until it has a slot (a request beyond the free slots waits here,
/// counted in requests_deferred). An engine refusal is the matching HTTP error.
pub async fn submit(
    state: &Arc<AppState>,
    req: Request,
    params: Value,
    access: super::Access,
) -> Result<Submission, ApiError> {
    if state.drain.is_on() {
        return Err(state.drain.refusal());
    }
    let engine = engine(state)?;
    let t0 = Instant::now();
    let max_tokens = Some(req.max_tokens);
    let n_prompt = req.prompt.len();
    let handle = engine.submit(req);
    drop(engine);
    let (tx, mut rx) = mpsc::unbounded_channel();
    let st = state.clone();
    let task_id = state.new_task_id();
    tokio::task::spawn_blocking(move || {
        bridge(&st, handle, tx, task_id, n_prompt, max_tokens, params)
    });
    // A request still waiting for a slot when the drain begins is refused at once (dropping
    // `rx` makes the bridge cancel it in the engine's queue).
    let first = tokio::select! {
        biased;
        ev = rx.recv() => ev,
        _ = state.drain.begun() => return Err(state.drain.refusal()),
    };
    match first {
        Some(Event::Started {
            slot,
            cached_tokens,
            ..
        }) => {
            access.slot(slot);
            Ok(Submission {
                rx,
                slot,
                cached: cached_tokens,
                t0,
                access,
            })
        }
        Some(Event::Error(e)) => Err(e.into()),
        Some(_) => Err(ApiError::server(
            "the engine answered before assigning a slot",
        )),
        None => Err(ApiError::unavailable("the engine stopped")),
    }
}

/// Forwards one request's events to tokio, keeps its slot's `/slots` view, and cancels it when
/// the receiving side is gone or shutdown gives up waiting.
fn bridge(
    state: &AppState,
    handle: crate::runtime::engine::RequestHandle,
    tx: mpsc::UnboundedSender<Event>,
    task_id: u64,
    n_prompt: usize,
    max_tokens: Option<usize>,
    params: Value,
) {
    let mut slot: Option<usize> = None;
    let mut cancelled = false;
    // A request with n choices ends at its n-th Done.
    let (mut choices, mut done) = (1, 0);
    loop {
        if !cancelled && state.cancel_all.load(Ordering::Relaxed) {
            handle.cancel();
            cancelled = true;
        }
        match handle.events.recv_timeout(Duration::from_millis(50)) {
            Ok(ev) => {
                match &ev {
                    Event::Started {
                        slot: s,
                        cached_tokens,
                        choices: c,
                    } => {
                        slot = Some(*s);
                        choices = *c;
                        let params = params.clone();
                        state.with_slot(*s, |v| {
                            v.id_task = Some(task_id);
                            v.processing = true;
                            v.n_prompt_tokens = n_prompt;
                            v.n_cached = *cached_tokens;
                            v.n_decoded = 0;
                            v.max_tokens = max_tokens;
                            v.params = params;
                        });
                    }
                    Event::Token { .. } => {
                        if let Some(s) = slot {
                            state.with_slot(s, |v| v.n_decoded += 1);
                        }
                    }
                    _ => {}
                }
                if matches!(ev, Event::Done(_)) {
                    done += 1;
                }
                let last = done >= choices || matches!(ev, Event::Error(_));
                if tx.send(ev).is_err() {
                    // The client is gone: free the slot now.
                    handle.cancel();
                    break;
                }
                if last {
                    break;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {
                if tx.is_closed() {
                    handle.cancel();
                    break;
                }
            }
            Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                let _ = tx.send(Event::Error(EngineError::Stopped));
                break;
            }
        }
    }
    if let Some(s) = slot {
        state.with_slot(s, |v| {
            if v.id_task == Some(task_id) {
                v.processing = false;
            }
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Shared response pieces
// ---------------------------------------------------------------------------------------------

pub fn unix_now() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

pub(super) fn per(n: usize, ms: f64) -> (f64, f64) {
    if n == 0 || ms <= 0.0 {
        (0.0, 0.0)
    } else {
        (ms / n as f64, n as f64 * 1e3 / ms)
    }
}

/// llama-server's `timings` object.
pub fn timings_json(f: &Finish) -> Value {
    let t = &f.timings;
    let (ppt, pps) = per(t.prompt_n, t.prompt_ms);
    let (gpt, gps) = per(t.predicted_n, t.predicted_ms);
    json!({
        "cache_n": f.cached_tokens,
        "prompt_n": t.prompt_n,
        "prompt_ms": t.prompt_ms,
        "prompt_per_token_ms": ppt,
        "prompt_per_second": pps,
        "predicted_n": t.predicted_n,
        "predicted_ms": t.predicted_ms,
        "predicted_per_token_ms": gpt,
        "predicted_per_second": gps,
        "draft_n": t.draft_n,
        "draft_n_accepted": t.draft_n_accepted,
    })
}

pub fn usage_json(f: &Finish) -> Value {
    json!({
        "completion_tokens": f.completion_tokens,
        "prompt_tokens": f.prompt_tokens,
        "total_tokens": f.prompt_tokens + f.completion_tokens,
        "prompt_tokens_details": { "cached_tokens": f.cached_tokens },
    })
}

pub(super) fn cancelled_error() -> ApiError {
    ApiError::unavailable("the request was cancelled: the server is shutting down")
}

pub(super) fn sse_bytes(v: &Value) -> Bytes {
    Bytes::from(format!("data: {v}\n\n"))
}

/// An SSE stream that sends llama-server's `:` comment after `every` of silence, so that
/// clients with an idle timeout keep the connection through a long prefill.
struct KeepAlive {
    rx: ReceiverStream<Bytes>,
    every: Option<Duration>,
    sleep: Option<Pin<Box<tokio::time::Sleep>>>,
}

impl tokio_stream::Stream for KeepAlive {
    type Item = Result<Bytes, Infallible>;

    fn poll_next(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<Option<Self::Item>> {
        if let Poll::Ready(item) = Pin::new(&mut self.rx).poll_next(cx) {
            if let (Some(d), Some(sl)) = (self.every, self.sleep.as_mut()) {
                sl.as_mut().reset(tokio::time::Instant::now() + d);
            }
            return Poll::Ready(item.map(Ok));
        }
        let every = self.every;
        match (every, self.sleep.as_mut()) {
            (Some(d), Some(sl)) => {
                if sl.as_mut().poll(cx).is_ready() {
                    sl.as_mut().reset(tokio::time::Instant::now() + d);
                    // Registers the new deadline's waker.
                    let _ = sl.as_mut().poll(cx);
                    return Poll::Ready(Some(Ok(Bytes::from_static(b":\n\n"))));
                }
                Poll::Pending
            }
            _ => Poll::Pending,
        }
    }
}

/// An SSE response fed by `rx`, with `:` pings after `ping` of silence.
pub(super) fn sse_response(rx: mpsc::Receiver<Bytes>, ping: Option<Duration>) -> Response {
    let stream = KeepAlive {
        rx: ReceiverStream::new(rx),
        every: ping,
        sleep: ping.map(|d| Box::pin(tokio::time::sleep(d))),
    };
    let mut r = Response::new(Body::from_stream(stream));
    let h = r.headers_mut();
    h.insert(
        header::CONTENT_TYPE,
        header::HeaderValue::from_static("text/event-stream"),
    );
    h.insert(
        header::CACHE_CONTROL,
        header::HeaderValue::from_static("no-cache"),
    );
    r
}

pub(super) fn log_done(state: &AppState, route: &str, f: &Finish, sub: &Submission) {
    let t0 = sub.t0;
    sub.access
        .tokens(f.prompt_tokens, f.cached_tokens, f.completion_tokens);
    state.log(
        4,
        format!(
            "{route}: prompt {} tokens ({} cached), generated {} in {:.0} ms, finish {:?}",
            f.prompt_tokens,
            f.cached_tokens,
            f.completion_tokens,
            t0.elapsed().as_secs_f64() * 1e3,
            f.reason
        ),
    );
}

pub(super) fn request_of(
    state: &AppState,
    ids: Vec<u32>,
    gen: &GenParams,
    constraint: Option<Constraint>,
) -> Request {
    Request {
        prompt: ids,
        images: Vec::new(),
        max_tokens: gen
            .max_tokens
            .or(state.cfg.n_predict)
            .unwrap_or(state.cfg.n_ctx_slot),
        sampler: gen.sampler.clone(),
        stop: gen.stop.clone(),
        ignore_eos: gen.ignore_eos,
        constraint,
        probs: gen.probs,
        n: gen.n,
        embed: None,
        reasoning_budget: None,
        cache_prompt: gen.cache_prompt,
        special: state.cfg.special,
        lora: gen.lora.clone(),
    }
}

/// The SSE ping interval of a request (`sse_ping_interval`, else `--sse-ping-interval`).
pub(super) fn ping_of(state: &AppState, gen: &GenParams) -> Option<Duration> {
    match gen.sse_ping_interval {
        Some(n) if n > 0 => Some(Duration::from_secs(n as u64)),
        Some(_) => None,
        None => state.cfg.sse_ping,
    }
}

/// Compiles a request's grammar, a 400 naming what the grammar library rejected.
pub(super) fn compile_grammar(
    state: &AppState,
    spec: &GrammarSpec,
    after_think: bool,
) -> Result<Constraint, ApiError> {
    let g = Grammars::shared(&state.tok).map_err(|e| ApiError::server(e.to_string()))?;
    g.compile(spec, after_think)
        .map_err(|e| ApiError::bad_request(e.to_string()))
}

/// llama-server's `json_schema` and `grammar` fields (either, not both).
pub(super) fn grammar_fields(body: &Obj) -> Result<Option<GrammarSpec>, ApiError> {
    let schema = field(body, "json_schema");
    let grammar = opt_str(body, "grammar")?.filter(|g| !g.trim().is_empty());
    match (schema, grammar) {
        (Some(_), Some(_)) => Err(ApiError::bad_request(
            "'json_schema' and 'grammar' cannot both be given",
        )),
        (Some(s), None) => {
            if !s.is_object() && !s.is_boolean() {
                return Err(ApiError::bad_request(format!(
                    "'json_schema' must be an object, not {}",
                    type_name(s)
                )));
            }
            Ok(Some(GrammarSpec::JsonSchema(s.clone())))
        }
        (None, Some(g)) => Ok(Some(match g.trim_start().strip_prefix("%llguidance") {
            Some(rest) => {
                // `%llguidance {}` then the Lark grammar, as llama.cpp takes it.
                let rest = rest.trim_start();
                let rest = rest.strip_prefix("{}").unwrap_or(rest);
                GrammarSpec::Lark(rest.to_string())
            }
            None => GrammarSpec::Gbnf(g.to_string()),
        })),
        (None, None) => Ok(None),
    }
}

/// One token's probabilities in llama-server's shape (`logprob` / `top_logprobs`, or `prob` /
/// `top_probs` with `post_sampling_probs`).
pub fn token_probs_json(state: &AppState, id: u32, text: &str, p: &TokenProbs) -> Value {
    let post = p.post_sampling;
    let val = |x: f32| -> Value {
        if post {
            json!(x)
        } else if x <= 0.0 {
            // JSON has no -inf: llama-server sends the lowest float.
            json!(f32::MIN)
        } else {
            json!(x.ln())
        }
    };
    let top: Vec<Value> = p
        .top
        .iter()
        .map(|t| {
            let b = state.tok.decode_bytes(&[t.id], true).unwrap_or_default();
            json!({
                "id": t.id,
                "token": String::from_utf8_lossy(&b),
                "bytes": b,
                (if post { "prob" } else { "logprob" }): val(t.p),
            })
        })
        .collect();
    json!({
        "id": id,
        "token": text,
        "bytes": text.as_bytes(),
        (if post { "prob" } else { "logprob" }): val(p.p),
        (if post { "top_probs" } else { "top_logprobs" }): top,
    })
}

/// The text of a token as its probabilities report it (specials shown as llama-server's
/// `common_token_to_piece` with `special` off: not at all).
pub fn token_text(state: &AppState, id: u32) -> String {
    String::from_utf8_lossy(&state.tok.decode_bytes(&[id], true).unwrap_or_default()).into_owned()
}

pub(super) fn params_of(state: &AppState, gen: &GenParams) -> Value {
    let mut v = state.params_json(
        &gen.sampler,
        gen.max_tokens,
        &gen.stop,
        gen.stream,
        gen.ignore_eos,
    );
    if let Value::Object(m) = &mut v {
        m.insert("lora".into(), super::lora::LoraState::to_json(&gen.lora));
    }
    v
}

pub(super) fn finish_reason(f: &Finish, has_tool_calls: bool) -> &'static str {
    match f.reason {
        FinishReason::Stop if has_tool_calls => "tool_calls",
        FinishReason::Stop | FinishReason::Cancelled => "stop",
        FinishReason::Length => "length",
    }
}

/// A prompt's ids; a text too long for the slot window whatever its tokens is refused
/// without tokenizing it.
pub(super) fn tokenize(state: &AppState, text: &str) -> Result<Vec<u32>, ApiError> {
    super::limits::refuse_by_length(state, text)?;
    state
        .tok
        .encode(text, true, true)
        .map_err(|e| ApiError::server(format!("tokenizer: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio_stream::StreamExt;

    #[tokio::test]
    async fn silence_gets_a_ping_and_data_resets_it() {
        let every = Duration::from_millis(200);
        let (tx, rx) = mpsc::channel::<Bytes>(4);
        let mut s = KeepAlive {
            rx: ReceiverStream::new(rx),
            every: Some(every),
            sleep: Some(Box::pin(tokio::time::sleep(every))),
        };
        // Silence: llama-server's `:` comment, no sooner than the interval.
        let t0 = Instant::now();
        assert_eq!(
            s.next().await.unwrap().unwrap(),
            Bytes::from_static(b":\n\n")
        );
        assert!(t0.elapsed() >= every);
        tx.send(Bytes::from_static(b"data: 1\n\n")).await.unwrap();
        assert_eq!(
            s.next().await.unwrap().unwrap(),
            Bytes::from_static(b"data: 1\n\n")
        );
        let t1 = Instant::now();
        assert_eq!(
            s.next().await.unwrap().unwrap(),
            Bytes::from_static(b":\n\n")
        );
        assert!(
            t1.elapsed() >= every - Duration::from_millis(5),
            "data reset the timer"
        );
        drop(tx);
        assert!(s.next().await.is_none(), "the stream ends with its sender");
        // Without an interval, no pings.
        let (tx, rx) = mpsc::channel::<Bytes>(1);
        let mut s = KeepAlive {
            rx: ReceiverStream::new(rx),
            every: None,
            sleep: None,
        };
        let quiet = tokio::time::timeout(every * 2, s.next()).await;
        assert!(quiet.is_err(), "no ping when disabled");
        drop(tx);
    }
}
