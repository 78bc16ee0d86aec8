//! Request mutation: JSON bodies for every POST route (chat, completions, tokenize,
//! detokenize, apply-template) built from valid requests and then mutated as trees (fields
//! retyped, set to boundary numbers, huge or special-token strings, dropped, duplicated, added)
//! or as text (truncated, bytes flipped, deep nesting spliced in, duplicate keys), sent through
//! the server's router in process (no sockets). The server is booted on the bundled model
//! without loading its weights, so a request that passes every check ends in a 503 from the
//! engine gate: the parsing, the chat template, tokenization and the window check all run. Each
//! accepted body also gets its sampling parameters drawn through the sampler. A quarter of the
//! cases are model output for the tool-call parser instead: whole and streamed in random
//! chunks, which must agree, with every call's arguments a JSON object.

use std::sync::Arc;

use axum::body::Body;
use axum::http::{Request, StatusCode};
use serde_json::{json, Map, Value};
use tower::ServiceExt;

use super::{random_text, Outcome, Rng, Verdict};
use crate::backend::cpu::CpuBackend;
use crate::backend::KvTypes;
use crate::chat::{ChatParser, Delta, ParsedMessage, ParserConfig, ToolSpecs};
use crate::config::Settings;
use crate::model::Model;
use crate::plan::BackendKind;
use crate::runtime::engine::{Engine, EngineConfig};
use crate::runtime::sampler::Sampler;
use crate::server::request::{gen_params, Endpoint, GenDefaults};
use crate::server::state::AppState;

/// A booted server without an engine, driven in process.
pub struct Target {
    rt: tokio::runtime::Runtime,
    router: axum::Router,
    state: Arc<AppState>,
}

/// One request case.
pub enum Case {
    Http {
        route: &'static str,
        body: Vec<u8>,
        note: String,
    },
    ToolText {
        cfg: ParserConfig,
        text: String,
        cuts: Vec<usize>,
        note: String,
    },
}

impl Case {
    pub fn note(&self) -> String {
        match self {
            Case::Http { route, body, note } => {
                let head: String = String::from_utf8_lossy(&body[..body.len().min(160)]).into();
                format!("POST {route} ({} bytes) {note}: {head}", body.len())
            }
            Case::ToolText { text, note, .. } => {
                let head: String = text.chars().take(160).collect();
                format!("tool-call text ({} bytes) {note}: {head:?}", text.len())
            }
        }
    }
}

const ROUTES: &[&str] = &[
    "/v1/chat/completions",
    "/chat/completions",
    "/apply-template",
    "/v1/completions",
    "/completions",
    "/completion",
    "/tokenize",
    "/detokenize",
];

/// Keys the routes read; added to bodies with random values.
const KEYS: &[&str] = &[
    "messages",
    "model",
    "prompt",
    "content",
    "tokens",
    "max_tokens",
    "max_completion_tokens",
    "n_predict",
    "temperature",
    "temp",
    "top_k",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repeat_last_n",
    "seed",
    "n",
    "logprobs",
    "stream",
    "stream_options",
    "stop",
    "ignore_eos",
    "tools",
    "tool_choice",
    "response_format",
    "chat_template_kwargs",
    "reasoning_effort",
    "reasoning_format",
    "add_generation_prompt",
    "add_special",
    "parse_special",
    "with_pieces",
    "return_tokens",
    "cache_prompt",
    "id_slot",
];

/// The largest request body the target's router reads; a larger one is refused (413) unread.
const MAX_BODY: usize = 4 << 20;

/// `body` as the JSON object whose sampling fields `check_sampling` draws, or `None` where the
/// server parses no such object: not an object, or over `MAX_BODY`. Parsing an oversize body
/// anyway only cost the harness memory: case 299,129 of the default seed (a 176 MB body of
/// nested arrays, which the router refuses) ran a fuzz worker out of its 4 GiB address space
/// inside `serde_json`, an abort that was the harness's, not the server's.
fn sampled_fields(body: &[u8]) -> Option<Map<String, Value>> {
    if body.len() > MAX_BODY {
        return None;
    }
    match serde_json::from_slice(body) {
        Ok(Value::Object(obj)) => Some(obj),
        _ => None,
    }
}

impl Target {
    /// Boots the server on the bundled model (CPU, one slot of 256 tokens, so that a request
    /// generates at most a window's worth of tokens).
    pub fn new() -> anyhow::Result<Target> {
        let settings = Settings {
            backend: Some(BackendKind::Cpu),
            ctx_size: Some(256),
            parallel: Some(1),
            log_verbosity: Some(0),
            ..Default::default()
        };
        let prepared = crate::server::prepare(settings)?;
        let state = prepared.state().clone();
        let be = CpuBackend::new();
        let model = Model::load(&be, Arc::new(crate::bundled::default_model()?))?;
        let engine = Engine::start(
            model,
            be,
            state.tok.clone(),
            EngineConfig {
                ctx_size: 256,
                parallel: 1,
                ubatch: 64,
                kv_types: KvTypes::default(),
                spec: None,
                draft_kv_types: KvTypes::default(),
            },
        )?;
        if state.engine.set(Arc::new(engine)).is_err() {
            anyhow::bail!("the fuzz server already had an engine");
        }
        let router = crate::server::routes::router(state.clone(), MAX_BODY);
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()?;
        Ok(Target { rt, router, state })
    }

    pub fn n_vocab(&self) -> usize {
        self.state.cfg.meta.n_vocab
    }

    /// Case `index` of a run seeded `seed`.
    pub fn case(&self, seed: u64, index: u64) -> Case {
        let mut rng = Rng::for_case(seed, index);
        if rng.chance(1, 4) {
            return tool_text_case(&mut rng);
        }
        let route = *rng.pick(ROUTES);
        let mut body = base_body(route, &mut rng, self.n_vocab());
        let mut notes = Vec::new();
        let n_mut = rng.below(4);
        for _ in 0..n_mut {
            notes.push(mutate_tree(&mut body, &mut rng));
        }
        let mut bytes = serde_json::to_vec(&body).unwrap_or_default();
        if rng.chance(1, 5) {
            notes.push(mutate_text(&mut bytes, &mut rng));
        }
        Case::Http {
            route,
            body: bytes,
            note: notes.join("; "),
        }
    }

    pub fn run(&self, case: &Case) -> Verdict {
        match case {
            Case::Http { route, body, .. } => self.run_http(route, body),
            Case::ToolText {
                cfg, text, cuts, ..
            } => run_tool_text(cfg, text, cuts),
        }
    }

    fn run_http(&self, route: &str, body: &[u8]) -> Verdict {
        let req = Request::post(route)
            .header("content-type", "application/json")
            .body(Body::from(body.to_vec()))
            .expect("a request with a static route");
        let resp = self
            .rt
            .block_on(async { self.router.clone().oneshot(req).await });
        let resp = match resp {
            Ok(r) => r,
            Err(e) => return Verdict::new(Outcome::Panic, format!("router error {e}")),
        };
        let status = resp.status();
        let sse = resp
            .headers()
            .get("content-type")
            .and_then(|v| v.to_str().ok())
            .is_some_and(|t| t.starts_with("text/event-stream"));
        let bytes = self
            .rt
            .block_on(axum::body::to_bytes(resp.into_body(), 64 << 20))
            .unwrap_or_default();
        let json: Option<Value> = serde_json::from_slice(&bytes).ok();
        let text = || String::from_utf8_lossy(&bytes[..bytes.len().min(200)]).into_owned();
        let err_msg = json
            .as_ref()
            .and_then(|j| j.get("error"))
            .and_then(|e| e.get("message"))
            .and_then(Value::as_str)
            .map(str::to_string);
        // The sampling parameters an accepted body carries, drawn once.
        if let Some(obj) = sampled_fields(body) {
            if let Some(v) = self.check_sampling(route, &obj) {
                return v;
            }
        }
        if status == StatusCode::SERVICE_UNAVAILABLE {
            return match err_msg {
                Some(m) => Verdict::valid(format!("503 {m}")),
                None => Verdict::new(
                    Outcome::Panic,
                    format!("503 without an error body: {}", text()),
                ),
            };
        }
        if status.is_server_error() {
            let p = super::take_panic().unwrap_or_default();
            return Verdict::new(Outcome::Panic, format!("{status} {} {p}", text()));
        }
        if status.is_client_error() {
            return match err_msg {
                Some(m) if !m.is_empty() => Verdict::clean(format!("{} {m}", status.as_u16())),
                _ => Verdict::clean(format!(
                    "{} (not in OpenAI's error shape) {}",
                    status.as_u16(),
                    text()
                )),
            };
        }
        if sse && status.is_success() {
            return sse_verdict(&bytes, route == "/completion");
        }
        match json {
            Some(_) if status.is_success() => Verdict::valid(format!("{status}")),
            _ => Verdict::new(
                Outcome::Panic,
                format!("{status} with a body that is not JSON: {}", text()),
            ),
        }
    }

    /// Draws from the sampler with the request's parameters over rows with extreme but finite
    /// logits: the draw must be a token of the row.
    fn check_sampling(&self, route: &str, obj: &Map<String, Value>) -> Option<Verdict> {
        // A fixed seed where the request gives none, so that a case replays the same draw.
        let d = GenDefaults {
            fixed_seed: Some(7),
            ..self.state.gen_defaults()
        };
        // The fields a body may carry depend on the route that reads it (as the server parses).
        let endpoint = match route {
            "/v1/completions" | "/completions" => Endpoint::OpenAiCompletion,
            "/completion" => Endpoint::Completion,
            _ => Endpoint::Chat,
        };
        let p = gen_params(
            obj,
            &d,
            &["n_predict", "max_tokens"],
            &self.state.tok,
            endpoint,
        )
        .ok()?;
        let rows: [Vec<f32>; 3] = [
            (0..64)
                .map(|i| ((i * 37 % 64) as f32 - 32.0) * 0.37)
                .collect(),
            (0..64)
                .map(|i| if i % 2 == 0 { 3e38 } else { -3e38 })
                .collect(),
            vec![1e-30; 64],
        ];
        let mut s = Sampler::new(p.sampler.clone());
        for r in &rows {
            let id = s.sample(r) as usize;
            if id >= r.len() {
                return Some(Verdict::new(
                    Outcome::SilentNaN,
                    format!(
                        "sampler drew {id} from a row of {} with {:?}",
                        r.len(),
                        p.sampler
                    ),
                ));
            }
            s.accept(id as u32);
        }
        None
    }
}

/// A stream must be `data: <JSON>` events ending in `data: [DONE]` (OpenAI's routes) or in an
/// event with `"stop": true` (llama-server's native `/completion`, which sends no `[DONE]`); an
/// error event is the stream's way to refuse.
fn sse_verdict(bytes: &[u8], native: bool) -> Verdict {
    let text = String::from_utf8_lossy(bytes);
    let mut events = 0;
    let mut done = false;
    for line in text.lines().filter(|l| !l.trim().is_empty()) {
        let Some(data) = line.strip_prefix("data: ") else {
            return Verdict::new(
                Outcome::Panic,
                format!("stream line is not an event: {line:?}"),
            );
        };
        if data == "[DONE]" {
            done = true;
            continue;
        }
        match serde_json::from_str::<Value>(data) {
            Ok(v) if v.get("error").is_some() => {
                return Verdict::clean(format!("stream error event {}", v["error"]))
            }
            Ok(v) => {
                events += 1;
                if native && v.get("stop") == Some(&Value::Bool(true)) {
                    done = true;
                }
            }
            Err(e) => {
                return Verdict::new(
                    Outcome::Panic,
                    format!("stream event is not JSON ({e}): {data:?}"),
                )
            }
        }
    }
    if !done {
        return Verdict::new(
            Outcome::Panic,
            format!("stream of {events} events without its end"),
        );
    }
    Verdict::valid(format!("stream of {events} events"))
}

fn boundary_number(rng: &mut Rng) -> Value {
    match rng.below(14) {
        0 => json!(0),
        1 => json!(-1),
        2 => json!(1),
        3 => json!(i64::MAX),
        4 => json!(i64::MIN),
        5 => json!(u64::MAX),
        6 => json!(1e308),
        7 => json!(-1e308),
        8 => json!(5e-324),
        9 => json!(2147483648u64),
        10 => json!(0.5),
        11 => json!(1e-30),
        12 => json!(rng.below(100_000)),
        _ => json!(-(rng.below(1000) as i64)),
    }
}

fn random_value(rng: &mut Rng, depth: usize) -> Value {
    match rng.below(if depth > 3 { 6 } else { 9 }) {
        0 => Value::Null,
        1 => json!(rng.chance(1, 2)),
        2 | 3 => boundary_number(rng),
        4 => json!(random_text(rng, 64)),
        5 => json!(match rng.below(4) {
            0 => "x".repeat(rng.below(200_000)),
            1 => "<|im_start|>user\n<think></think><tool_call>".repeat(1 + rng.below(50)),
            2 => "{{ raise_exception('x') }}{% for x in messages %}".to_string(),
            _ => String::new(),
        }),
        6 => Value::Array(
            (0..rng.below(6))
                .map(|_| random_value(rng, depth + 1))
                .collect(),
        ),
        7 => {
            let mut m = Map::new();
            for _ in 0..rng.below(5) {
                m.insert(rng.pick(KEYS).to_string(), random_value(rng, depth + 1));
            }
            Value::Object(m)
        }
        _ => Value::Array(
            (0..rng.below(3000))
                .map(|_| json!(rng.below(2000)))
                .collect(),
        ),
    }
}

fn message(rng: &mut Rng) -> Value {
    let role = *rng.pick(&[
        "system",
        "user",
        "assistant",
        "tool",
        "developer",
        "user",
        "user",
    ]);
    let content = match rng.below(6) {
        0 => Value::Null,
        1 => {
            json!([{"type": "text", "text": random_text(rng, 80)}, {"type": "text", "text": "more"}])
        }
        2 => json!([{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]),
        _ => json!(random_text(rng, 120)),
    };
    let mut m = json!({"role": role, "content": content});
    if role == "assistant" && rng.chance(1, 2) {
        m["tool_calls"] = json!([{
            "id": "call_1",
            "type": "function",
            "function": {
                "name": *rng.pick(&["get_weather", "f", "", "a b"]),
                "arguments": match rng.below(4) {
                    0 => json!({"city": "Paris", "n": 3}),
                    1 => json!("{\"city\": \"Paris\"}"),
                    2 => json!("{not json"),
                    _ => json!(random_text(rng, 30)),
                },
            }
        }]);
    }
    if role == "assistant" && rng.chance(1, 3) {
        m["reasoning_content"] = json!(random_text(rng, 40));
    }
    m
}

fn tools(rng: &mut Rng) -> Value {
    let n = rng.below(4);
    Value::Array(
        (0..n)
            .map(|_| {
                json!({
                    "type": "function",
                    "function": {
                        "name": *rng.pick(&["get_weather", "search", "f", "x-y"]),
                        "description": random_text(rng, 30),
                        "parameters": {
                            "type": "object",
                            "properties": {
                                "city": {"type": *rng.pick(&["string", "number", "integer", "object", "array", "boolean"])},
                                "n": {"type": ["string", "null"]},
                            },
                            "required": ["city"],
                        }
                    }
                })
            })
            .collect(),
    )
}

/// A valid request for `route`.
fn base_body(route: &str, rng: &mut Rng, n_vocab: usize) -> Value {
    let mut b = Map::new();
    match route {
        "/tokenize" => {
            b.insert("content".into(), json!(random_text(rng, 200)));
            for k in ["add_special", "parse_special", "with_pieces"] {
                if rng.chance(1, 2) {
                    b.insert(k.into(), json!(rng.chance(1, 2)));
                }
            }
        }
        "/detokenize" => {
            let ids: Vec<usize> = (0..rng.below(40)).map(|_| rng.below(n_vocab + 2)).collect();
            b.insert("tokens".into(), json!(ids));
        }
        "/v1/completions" | "/completions" | "/completion" => {
            let prompt = match rng.below(4) {
                0 => json!((0..1 + rng.below(20))
                    .map(|_| rng.below(n_vocab))
                    .collect::<Vec<_>>()),
                1 => json!([random_text(rng, 60)]),
                _ => json!(random_text(rng, 200)),
            };
            b.insert("prompt".into(), prompt);
            b.insert("max_tokens".into(), json!(1 + rng.below(64)));
        }
        _ => {
            let msgs: Vec<Value> = (0..1 + rng.below(5)).map(|_| message(rng)).collect();
            b.insert("messages".into(), Value::Array(msgs));
            b.insert("model".into(), json!("tern"));
            b.insert("max_tokens".into(), json!(1 + rng.below(64)));
            if rng.chance(1, 2) {
                b.insert("tools".into(), tools(rng));
                b.insert(
                    "tool_choice".into(),
                    json!(*rng.pick(&["auto", "none", "required"])),
                );
            }
            if rng.chance(1, 3) {
                b.insert(
                    "chat_template_kwargs".into(),
                    json!({"enable_thinking": rng.chance(1, 2), "preserve_thinking": true}),
                );
            }
            if rng.chance(1, 4) {
                b.insert(
                    "reasoning_effort".into(),
                    json!(*rng.pick(&["low", "medium", "high", "none", "max", ""])),
                );
            }
        }
    }
    for k in [
        "temperature",
        "top_k",
        "top_p",
        "min_p",
        "seed",
        "stream",
        "stop",
    ] {
        if rng.chance(1, 4) {
            let v = match k {
                "temperature" => json!(rng.below(200) as f64 / 100.0),
                "top_k" => json!(rng.below(100)),
                "top_p" | "min_p" => json!(rng.below(101) as f64 / 100.0),
                "seed" => json!(rng.below(1 << 20)),
                "stream" => json!(rng.chance(1, 2)),
                _ => json!(["\n", "</s>"]),
            };
            b.insert(k.into(), v);
        }
    }
    Value::Object(b)
}

/// Every node of a tree as a JSON pointer.
fn pointers(v: &Value, at: String, out: &mut Vec<String>) {
    out.push(at.clone());
    match v {
        Value::Array(a) => {
            for (i, x) in a.iter().enumerate().take(16) {
                pointers(x, format!("{at}/{i}"), out);
            }
        }
        Value::Object(m) => {
            for (k, x) in m {
                let k = k.replace('~', "~0").replace('/', "~1");
                pointers(x, format!("{at}/{k}"), out);
            }
        }
        _ => {}
    }
}

fn mutate_tree(body: &mut Value, rng: &mut Rng) -> String {
    let mut ptrs = Vec::new();
    pointers(body, String::new(), &mut ptrs);
    let p = ptrs[rng.below(ptrs.len())].clone();
    match rng.below(6) {
        0 | 1 => {
            let v = random_value(rng, 0);
            if let Some(slot) = body.pointer_mut(&p) {
                *slot = v;
            }
            format!("replace {p}")
        }
        2 => {
            // Drop the node from its parent.
            let (parent, last) = p.rsplit_once('/').unwrap_or(("", ""));
            match body.pointer_mut(parent) {
                Some(Value::Object(m)) => {
                    let k = last.replace("~1", "/").replace("~0", "~");
                    m.remove(&k);
                }
                Some(Value::Array(a)) => {
                    if let Ok(i) = last.parse::<usize>() {
                        if i < a.len() {
                            a.remove(i);
                        }
                    }
                }
                _ => {}
            }
            format!("drop {p}")
        }
        3 => {
            let k = rng.pick(KEYS).to_string();
            let v = random_value(rng, 0);
            if let Some(Value::Object(m)) = body.pointer_mut(&p) {
                m.insert(k.clone(), v);
            } else if let Value::Object(m) = body {
                m.insert(k.clone(), v);
            }
            format!("add {k} under {p}")
        }
        4 => {
            // A subtree copied many times (large messages arrays, long tool lists).
            let copy = body.pointer(&p).cloned().unwrap_or(Value::Null);
            let n = 1 + rng.below(300);
            if let Some(Value::Array(a)) = body.pointer_mut(&p) {
                for _ in 0..n {
                    a.push(copy.clone());
                }
            } else if let Some(slot) = body.pointer_mut(&p) {
                *slot = Value::Array(vec![copy; n]);
            }
            format!("repeat {p} x{n}")
        }
        _ => {
            let v = boundary_number(rng);
            if let Some(slot) = body.pointer_mut(&p) {
                *slot = v;
            }
            format!("number at {p}")
        }
    }
}

fn mutate_text(bytes: &mut Vec<u8>, rng: &mut Rng) -> String {
    match rng.below(6) {
        0 => {
            let cut = rng.below(bytes.len() + 1);
            bytes.truncate(cut);
            format!("truncate to {cut}")
        }
        1 => {
            for _ in 0..1 + rng.below(4) {
                if bytes.is_empty() {
                    break;
                }
                let i = rng.below(bytes.len());
                bytes[i] = rng.next_u64() as u8;
            }
            "flip bytes".into()
        }
        2 => {
            let depth = 1 + rng.below(100_000);
            let at = rng.below(bytes.len() + 1);
            let mut nest = "[".repeat(depth).into_bytes();
            nest.extend("]".repeat(depth).into_bytes());
            bytes.splice(at..at, nest);
            format!("nesting {depth} at {at}")
        }
        3 => {
            if bytes.last() == Some(&b'}') {
                bytes.pop();
                let k = rng.pick(KEYS);
                bytes.extend(format!(",\"{k}\":null,\"{k}\":[1e999]}}").into_bytes());
            }
            "duplicate key".into()
        }
        4 => {
            *bytes = match rng.below(6) {
                0 => Vec::new(),
                1 => b"null".to_vec(),
                2 => b"[]".to_vec(),
                3 => b"\"text\"".to_vec(),
                4 => (0..rng.below(4096)).map(|_| rng.next_u64() as u8).collect(),
                _ => vec![b' '; rng.below(100)],
            };
            "replace body".into()
        }
        _ => {
            // Invalid UTF-8 inside a string.
            if let Some(i) = bytes.iter().position(|&b| b == b'"') {
                bytes.splice(i + 1..i + 1, [0xC3, 0x28, 0xFF, 0xED, 0xA0, 0x80]);
            }
            "invalid utf-8".into()
        }
    }
}

fn tool_text_case(rng: &mut Rng) -> Case {
    let tools_v = tools(rng);
    let cfg = ParserConfig {
        reasoning: rng.chance(3, 4),
        starts_in_reasoning: rng.chance(1, 2),
        tools: if rng.chance(4, 5) {
            Some(ToolSpecs::from_openai(&tools_v))
        } else {
            None
        },
    };
    let mut text = String::new();
    for _ in 0..1 + rng.below(6) {
        let piece = match rng.below(9) {
            0 => "<think>".to_string(),
            1 => "</think>".to_string(),
            2 => random_text(rng, 40),
            3 | 4 => {
                let name = *rng.pick(&["get_weather", "search", "f", "", "x y", "<x>"]);
                let mut b = format!("<tool_call>\n<function={name}>\n");
                for _ in 0..rng.below(3) {
                    let p = *rng.pick(&["city", "n", "", "a b"]);
                    let v = match rng.below(6) {
                        0 => "Paris".to_string(),
                        1 => "42".to_string(),
                        2 => "{\"a\": [1, 2]}".to_string(),
                        3 => "1e999".to_string(),
                        4 => "</parameter>".to_string(),
                        _ => random_text(rng, 20),
                    };
                    b.push_str(&format!("<parameter={p}>\n{v}\n</parameter>\n"));
                }
                b.push_str("</function>\n</tool_call>");
                // Broken on purpose sometimes: cut, or a tag dropped.
                if rng.chance(1, 3) {
                    let mut cut = rng.below(b.len() + 1);
                    while !b.is_char_boundary(cut) {
                        cut -= 1;
                    }
                    b.truncate(cut);
                }
                b
            }
            5 => "\n\n".to_string(),
            6 => "<tool_call>".to_string(),
            7 => "</tool_call>".to_string(),
            _ => "Sure, here it is.".to_string(),
        };
        text.push_str(&piece);
    }
    // Stream chunk boundaries (char boundaries: the engine streams whole characters).
    let mut cuts: Vec<usize> = (0..rng.below(12))
        .map(|_| rng.below(text.len() + 1))
        .filter(|&c| text.is_char_boundary(c))
        .collect();
    cuts.sort_unstable();
    cuts.dedup();
    Case::ToolText {
        note: format!(
            "reasoning={} start_in={} tools={}",
            cfg.reasoning,
            cfg.starts_in_reasoning,
            cfg.tools.is_some()
        ),
        cfg,
        text,
        cuts,
    }
}

/// The whole-text parse and a streamed one must agree, their deltas must add up to the
/// message, and every call's arguments must be a JSON object.
fn run_tool_text(cfg: &ParserConfig, text: &str, cuts: &[usize]) -> Verdict {
    let ids = |i: usize| format!("call_{i}");
    let mut whole = ChatParser::with_ids(cfg.clone(), ids);
    let mut d_whole = whole.push(text);
    d_whole.extend(whole.finish());
    let mut stream = ChatParser::with_ids(cfg.clone(), ids);
    let mut d_stream = Vec::new();
    let mut prev = 0;
    for &c in cuts.iter().chain(std::iter::once(&text.len())) {
        d_stream.extend(stream.push(&text[prev..c]));
        prev = c;
    }
    d_stream.extend(stream.finish());
    let sum = |ds: &[Delta]| {
        let mut m = ParsedMessage::default();
        for d in ds {
            match d {
                Delta::Content(s) => m.content.push_str(s),
                Delta::Reasoning(s) => m.reasoning.push_str(s),
                Delta::ToolCall(c) => m.tool_calls.push(c.clone()),
            }
        }
        m
    };
    let (mw, ms) = (whole.message().clone(), stream.message().clone());
    if mw != ms || sum(&d_whole) != mw || sum(&d_stream) != ms {
        return Verdict::new(
            Outcome::Panic,
            format!("stream and whole parses differ: whole {mw:?}, stream {ms:?}"),
        );
    }
    for c in &mw.tool_calls {
        if !matches!(
            serde_json::from_str::<Value>(&c.arguments),
            Ok(Value::Object(_))
        ) {
            return Verdict::new(
                Outcome::Panic,
                format!(
                    "tool call {} arguments are not a JSON object: {}",
                    c.name, c.arguments
                ),
            );
        }
    }
    Verdict::valid(format!(
        "{} content bytes, {} reasoning bytes, {} calls",
        mw.content.len(),
        mw.reasoning.len(),
        mw.tool_calls.len()
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sampling_fields_come_only_from_bodies_the_router_reads() {
        let small = br#"{"temperature":0.5,"n_probs":[0,0]}"#;
        let obj = sampled_fields(small).expect("a small object is read");
        assert_eq!(obj["temperature"], json!(0.5));
        assert!(sampled_fields(b"[1,2]").is_none(), "not an object");
        // The same object padded past the limit: the router refuses it unread, so the sampler
        // never sees its fields.
        let mut big = br#"{"temperature":0.5,"n_probs":["#.to_vec();
        big.extend(b"0,".repeat(MAX_BODY / 2));
        big.extend(br#"0]}"#);
        assert!(serde_json::from_slice::<Value>(&big).is_ok_and(|v| v.is_object()));
        assert!(sampled_fields(&big).is_none(), "{} bytes", big.len());
    }
}
