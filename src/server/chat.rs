//! `POST /v1/chat/completions` and `POST /apply-template`: messages checked and normalized,
//! the chat template rendered (reasoning, effort, tools), the output split into reasoning,
//! content and tool calls, answered whole or streamed as SSE chunks.

use std::sync::Arc;

use axum::body::Bytes;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use serde_json::{json, Map, Value};
use tokio::sync::mpsc;

use super::error::ApiError;
use super::generate::{
    cancelled_error, check_prompt, compile_grammar, finish_reason, grammar_fields, log_done,
    params_of, request_of, sse_bytes, sse_response, submit, timings_json, token_probs_json,
    tokenize, unix_now, usage_json, Submission,
};
use super::request::{
    field, gen_params, opt_bool, opt_i64, opt_str, parse_object, type_name, Endpoint, Obj,
};
use super::state::AppState;
use super::Body as RawBody;
use crate::chat::{
    map_reasoning_effort, ChatParser, Delta, ParserConfig, TemplateInputs, ToolSpecs,
};
use crate::config::{Reasoning, ReasoningFormat};
use crate::runtime::budget::BudgetConfig;
use crate::runtime::constraint::{tool_call_lark, GrammarSpec};
use crate::runtime::engine::{Event, Finish, FinishReason};

/// A chat request rendered to its prompt.
pub struct RenderedChat {
    /// The prompt, with `marker` where each of `images` goes.
    pub prompt: String,
    pub images: Vec<ImagePart>,
    pub marker: String,
    pub parser: ParserConfig,
    /// What the output is constrained to (response_format, json_schema, grammar, a forced
    /// tool call).
    pub grammar: Option<GrammarSpec>,
}

const ROLES: &str = "system, user, assistant, tool";

/// An image part of a message: where it was (for errors) and its file's bytes.
pub struct ImagePart {
    pub at: String,
    pub bytes: Vec<u8>,
}

fn vision_refusal(i: usize, kind: &str) -> ApiError {
    ApiError::bad_request(format!(
        "messages[{i}] has an {kind} part: image input is not supported: this server was started without a multimodal projector (--mmproj)"
    ))
}

/// The bytes of an `image_url` part's URL: a `data:image/...;base64,` URL or bare base64, as
/// llama-server reads them. A remote URL is refused: the server never fetches anything (no
/// request can make it reach another host), nor reads local files.
fn image_bytes(at: &str, part: &Value) -> Result<Vec<u8>, ApiError> {
    use base64::Engine as _;
    let url = match part.get("image_url") {
        Some(Value::String(u)) => u.as_str(),
        Some(Value::Object(o)) => match o.get("url") {
            Some(Value::String(u)) => u.as_str(),
            _ => {
                return Err(ApiError::bad_request(format!(
                    "{at}.image_url has no string 'url'"
                )))
            }
        },
        _ => {
            return Err(ApiError::bad_request(format!(
                "{at} is an image_url part without 'image_url' (an object with 'url', or the URL)"
            )))
        }
    };
    let lower = url.get(..8).unwrap_or(url).to_ascii_lowercase();
    if lower.starts_with("http://") || lower.starts_with("https:/") {
        return Err(ApiError::bad_request(format!(
            "{at}: remote image URLs are not fetched (this server never downloads anything); send the image inline as a data:image/...;base64 URL"
        )));
    }
    if lower.starts_with("file:") {
        return Err(ApiError::bad_request(format!(
            "{at}: file:// URLs are not read; send the image inline as a data:image/...;base64 URL"
        )));
    }
    let data = match url.strip_prefix("data:") {
        Some(rest) => {
            let Some((head, data)) = rest.split_once(',') else {
                return Err(ApiError::bad_request(format!(
                    "{at}: the data URL has no ',' before its data"
                )));
            };
            if !head.starts_with("image/") {
                return Err(ApiError::bad_request(format!(
                    "{at}: the data URL's type is {head:?}; only images (data:image/...) are read"
                )));
            }
            if !head.ends_with(";base64") {
                return Err(ApiError::bad_request(format!(
                    "{at}: the data URL must be base64-encoded (data:image/...;base64,...)"
                )));
            }
            data
        }
        None => url,
    };
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| ApiError::bad_request(format!("{at}: the image is not valid base64: {e}")))?;
    if bytes.is_empty() {
        return Err(ApiError::bad_request(format!("{at}: the image is empty")));
    }
    Ok(bytes)
}

/// A message's parts as one string, as llama-server gives the template a message with media:
/// the parts joined by newlines, none before or after an image's marker.
fn join_parts(parts: &[Value], marker: &str) -> String {
    let mut text = String::new();
    let mut after_marker = false;
    for p in parts {
        let t = p["text"].as_str().unwrap_or_default();
        let is_marker = p["type"] == "media_marker";
        if !is_marker && !after_marker && !text.is_empty() {
            text.push('\n');
        }
        text.push_str(if is_marker { marker } else { t });
        after_marker = is_marker;
    }
    text
}

/// Checks the messages and puts them in the shape the template reads: `developer` becomes
/// `system`, tool-call arguments given as JSON text become objects (the Qwen3.5 template
/// iterates them). Each image part is taken out, and its message's content becomes one string
/// with `marker` in its place (llama-server's media marker); without a projector an image part
/// is refused.
pub fn normalize_messages(
    state: &AppState,
    v: Option<&Value>,
    marker: &str,
) -> Result<(Value, Vec<ImagePart>), ApiError> {
    let arr = match v {
        None => return Err(ApiError::bad_request("'messages' is required")),
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "'messages' must be an array, not {}",
                type_name(other)
            )))
        }
    };
    if arr.is_empty() {
        return Err(ApiError::bad_request("'messages' must not be empty"));
    }
    let mut out = Vec::with_capacity(arr.len());
    let mut images = Vec::new();
    for (i, m) in arr.iter().enumerate() {
        let Value::Object(obj) = m else {
            return Err(ApiError::bad_request(format!(
                "messages[{i}] must be an object, not {}",
                type_name(m)
            )));
        };
        let mut msg = obj.clone();
        let role = match obj.get("role") {
            Some(Value::String(r)) => r.as_str(),
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].role must be a string, not {}",
                    type_name(other)
                )))
            }
            None => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}] has no 'role'"
                )))
            }
        };
        let role = match role {
            "system" | "user" | "assistant" | "tool" => role,
            "developer" => "system",
            r => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].role {r:?} is not one of {ROLES}"
                )))
            }
        };
        msg.insert("role".into(), Value::String(role.into()));
        let has_calls = obj.get("tool_calls").is_some_and(|t| !t.is_null());
        match obj.get("content") {
            None if role == "assistant" && has_calls => {}
            None => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}] ({role}) has no 'content'"
                )))
            }
            Some(Value::Null) | Some(Value::String(_)) => {}
            Some(Value::Array(parts)) => {
                let mut norm = Vec::with_capacity(parts.len());
                for (j, p) in parts.iter().enumerate() {
                    let ty = p.get("type").and_then(Value::as_str).unwrap_or("");
                    match ty {
                        "text" | "input_text" => match p.get("text") {
                            Some(Value::String(t)) => {
                                norm.push(json!({"type": "text", "text": t}));
                            }
                            _ => {
                                return Err(ApiError::bad_request(format!(
                                "messages[{i}].content[{j}] is a text part without a string 'text'"
                            )))
                            }
                        },
                        "image_url" | "input_image" | "image" if state.cfg.vision.is_none() => {
                            return Err(vision_refusal(i, ty))
                        }
                        "image_url" => {
                            let at = format!("messages[{i}].content[{j}]");
                            images.push(ImagePart {
                                bytes: image_bytes(&at, p)?,
                                at,
                            });
                            norm.push(json!({"type": "media_marker"}));
                        }
                        "input_image" | "image" => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}].content[{j}]: {ty} parts are not read; send an image as {{\"type\": \"image_url\", \"image_url\": {{\"url\": \"data:image/png;base64,...\"}}}}"
                            )))
                        }
                        "input_audio" | "audio" | "video" | "video_url" | "file" => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}].content[{j}]: {ty} parts are not supported"
                            )))
                        }
                        "" => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}].content[{j}] has no 'type'"
                            )))
                        }
                        t => {
                            return Err(ApiError::bad_request(format!(
                                "messages[{i}].content[{j}]: unknown part type {t:?}"
                            )))
                        }
                    }
                }
                let content = if norm.iter().any(|p| p["type"] == "media_marker") {
                    Value::String(join_parts(&norm, marker))
                } else {
                    Value::Array(norm)
                };
                msg.insert("content".into(), content);
            }
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].content must be a string or an array of parts, not {}",
                    type_name(other)
                )))
            }
        }
        match obj.get("reasoning_content") {
            None | Some(Value::Null) | Some(Value::String(_)) => {}
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].reasoning_content must be a string, not {}",
                    type_name(other)
                )))
            }
        }
        if has_calls {
            let calls = normalize_tool_calls(i, obj.get("tool_calls"))?;
            msg.insert("tool_calls".into(), calls);
        }
        out.push(Value::Object(msg));
    }
    Ok((Value::Array(out), images))
}

fn normalize_tool_calls(i: usize, v: Option<&Value>) -> Result<Value, ApiError> {
    let Some(Value::Array(calls)) = v else {
        return Err(ApiError::bad_request(format!(
            "messages[{i}].tool_calls must be an array"
        )));
    };
    let mut out = Vec::with_capacity(calls.len());
    for (j, c) in calls.iter().enumerate() {
        let Value::Object(call) = c else {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].tool_calls[{j}] must be an object"
            )));
        };
        let mut call = call.clone();
        let Some(Value::Object(f)) = call.get("function") else {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].tool_calls[{j}] has no 'function' object"
            )));
        };
        let mut f = f.clone();
        if !matches!(f.get("name"), Some(Value::String(_))) {
            return Err(ApiError::bad_request(format!(
                "messages[{i}].tool_calls[{j}].function has no string 'name'"
            )));
        }
        match f.get("arguments") {
            None | Some(Value::Null) => {
                f.insert("arguments".into(), json!({}));
            }
            Some(Value::Object(_)) => {}
            Some(Value::String(s)) => {
                let parsed: Value = if s.trim().is_empty() {
                    json!({})
                } else {
                    serde_json::from_str(s).map_err(|e| {
                        ApiError::bad_request(format!(
                            "messages[{i}].tool_calls[{j}].function.arguments is not valid JSON: {e}"
                        ))
                    })?
                };
                if !parsed.is_object() {
                    return Err(ApiError::bad_request(format!(
                        "messages[{i}].tool_calls[{j}].function.arguments must be a JSON object"
                    )));
                }
                f.insert("arguments".into(), parsed);
            }
            Some(other) => {
                return Err(ApiError::bad_request(format!(
                    "messages[{i}].tool_calls[{j}].function.arguments must be a JSON object or its text, not {}",
                    type_name(other)
                )))
            }
        }
        call.insert("function".into(), Value::Object(f));
        out.push(Value::Object(call));
    }
    Ok(Value::Array(out))
}

/// `tools`: None when absent or empty.
fn parse_tools(body: &Obj) -> Result<Option<Value>, ApiError> {
    let tools = match field(body, "tools") {
        None => return Ok(None),
        Some(Value::Array(a)) if a.is_empty() => return Ok(None),
        Some(Value::Array(a)) => a,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "'tools' must be an array, not {}",
                type_name(other)
            )))
        }
    };
    for (i, t) in tools.iter().enumerate() {
        let ty = t.get("type").and_then(Value::as_str);
        if ty != Some("function") {
            return Err(ApiError::bad_request(format!(
                "tools[{i}].type must be \"function\""
            )));
        }
        let name = t
            .get("function")
            .and_then(|f| f.get("name"))
            .and_then(Value::as_str);
        if name.is_none_or(str::is_empty) {
            return Err(ApiError::bad_request(format!(
                "tools[{i}].function.name must be a non-empty string"
            )));
        }
    }
    Ok(Some(Value::Array(tools.clone())))
}

/// `tool_choice`: "auto" (default), "none", "required", or a named function (then
/// "required" and its name).
fn parse_tool_choice(body: &Obj) -> Result<(String, Option<String>), ApiError> {
    match field(body, "tool_choice") {
        None => Ok(("auto".into(), None)),
        Some(Value::String(s)) if matches!(s.as_str(), "auto" | "none" | "required") => {
            Ok((s.clone(), None))
        }
        Some(Value::String(s)) => Err(ApiError::bad_request(format!(
            "'tool_choice' {s:?} is not one of auto, none, required"
        ))),
        Some(Value::Object(o))
            if o.get("function")
                .and_then(|f| f.get("name"))
                .is_some_and(Value::is_string) =>
        {
            let name = o["function"]["name"].as_str().unwrap_or_default().to_string();
            Ok(("required".into(), Some(name)))
        }
        Some(other) => Err(ApiError::bad_request(format!(
            "'tool_choice' must be a string or {{\"type\":\"function\",\"function\":{{\"name\":…}}}}, not {}",
            type_name(other)
        ))),
    }
}

/// Renders a chat request's prompt (`/v1/chat/completions`, `/apply-template`).
pub fn render_chat(state: &AppState, body: &Obj) -> Result<RenderedChat, ApiError> {
    // Drawn per request, so that no text a client writes can pass for an image.
    let marker = format!("<__media_{}__>", crate::chat::random_id(16));
    let (messages, images) = normalize_messages(state, body.get("messages"), &marker)?;
    let tools = parse_tools(body)?;
    let (tool_choice, tool_name) = parse_tool_choice(body)?;
    let grammar = chat_grammar(body, tools.as_ref(), &tool_choice, tool_name.as_deref())?;
    // The server's own variables (--chat-template-kwargs, --reasoning-effort), then
    // --reasoning, then the request's.
    let mut kwargs = state.cfg.template_kwargs.clone();
    match state.cfg.reasoning {
        Reasoning::On => {
            kwargs.insert("enable_thinking".into(), Value::Bool(true));
        }
        Reasoning::Off => {
            kwargs.insert("enable_thinking".into(), Value::Bool(false));
        }
        Reasoning::Auto => {}
    }
    match field(body, "chat_template_kwargs") {
        None => {}
        Some(Value::Object(o)) => {
            for (k, v) in o {
                kwargs.insert(k.clone(), v.clone());
            }
        }
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "'chat_template_kwargs' must be an object, not {}",
                type_name(other)
            )))
        }
    }
    match kwargs.get("enable_thinking") {
        None | Some(Value::Bool(_)) => {}
        Some(Value::Null) => {
            kwargs.remove("enable_thinking");
        }
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "chat_template_kwargs.enable_thinking must be a boolean, not {}",
                type_name(other)
            )))
        }
    }
    if let Some(e) = opt_str(body, "reasoning_effort")? {
        kwargs.insert("reasoning_effort".into(), Value::String(e.to_string()));
    }
    match kwargs.get("reasoning_effort").cloned() {
        None | Some(Value::Null) => {
            kwargs.remove("reasoning_effort");
        }
        Some(Value::String(e)) if e.trim().eq_ignore_ascii_case("none") => {
            kwargs.remove("reasoning_effort");
            kwargs.insert("enable_thinking".into(), Value::Bool(false));
        }
        Some(Value::String(e)) => {
            let (level, note) = map_reasoning_effort(&e);
            if let Some(n) = note {
                state.log(2, n);
            }
            kwargs.insert("reasoning_effort".into(), Value::String(level));
        }
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "'reasoning_effort' must be a string, not {}",
                type_name(&other)
            )))
        }
    }
    for k in ["preserve_thinking", "add_vision_id"] {
        if let Some(v) = kwargs.get(k) {
            if !v.is_boolean() && !v.is_null() {
                return Err(ApiError::bad_request(format!(
                    "chat_template_kwargs.{k} must be a boolean, not {}",
                    type_name(v)
                )));
            }
        }
    }
    let add_generation_prompt = opt_bool(body, "add_generation_prompt")?.unwrap_or(true);
    let inputs = TemplateInputs {
        messages,
        tools: tools.clone(),
        add_generation_prompt,
        kwargs,
        bos_token: state.cfg.meta.bos_token.clone(),
        eos_token: state.cfg.meta.eos_token.clone(),
    };
    let prompt = state
        .template
        .render(&inputs)
        .map_err(|e| ApiError::bad_request(e.to_string()))?;
    let format = match opt_str(body, "reasoning_format")? {
        None => state.cfg.reasoning_format,
        Some("none") => ReasoningFormat::None,
        Some("deepseek" | "deepseek-legacy" | "auto") => ReasoningFormat::Deepseek,
        Some(other) => {
            return Err(ApiError::bad_request(format!(
                "'reasoning_format' {other:?} is not one of deepseek, none"
            )))
        }
    };
    // --skip-chat-parsing: everything the model says is content.
    let parse = !state.cfg.skip_chat_parsing;
    let parser = ParserConfig {
        reasoning: parse && format.extracts(),
        starts_in_reasoning: parse && ParserConfig::prompt_opens_thinking(&prompt),
        tools: match (&tools, tool_choice.as_str()) {
            (Some(t), c) if parse && c != "none" => Some(ToolSpecs::from_openai(t)),
            _ => None,
        },
    };
    Ok(RenderedChat {
        prompt,
        images,
        marker,
        parser,
        grammar,
    })
}

/// The grammar of a chat request: `response_format` (json_object, json_schema), llama-server's
/// `json_schema` / `grammar`, or a forced tool call (`tool_choice` "required" or named). At
/// most one of them.
pub(super) fn chat_grammar(
    body: &Obj,
    tools: Option<&Value>,
    tool_choice: &str,
    tool_name: Option<&str>,
) -> Result<Option<GrammarSpec>, ApiError> {
    let mut found: Vec<(&str, GrammarSpec)> = Vec::new();
    if let Some(rf) = field(body, "response_format") {
        let ty = rf.get("type").and_then(Value::as_str).unwrap_or("");
        if !rf.is_object() || !matches!(ty, "text" | "json_object" | "json_schema") {
            return Err(ApiError::bad_request(
                "'response_format' must be {\"type\": \"text\" | \"json_object\" | \"json_schema\"}",
            ));
        }
        // llama-server also takes a schema beside json_object.
        let loose = rf.get("schema").filter(|s| !s.is_null());
        match ty {
            "json_object" => found.push((
                "response_format",
                loose
                    .map(|s| GrammarSpec::JsonSchema(s.clone()))
                    .unwrap_or(GrammarSpec::JsonObject),
            )),
            "json_schema" => {
                let js = rf.get("json_schema");
                let schema = js
                    .and_then(|j| j.get("schema"))
                    .or(loose)
                    .filter(|s| !s.is_null());
                if let Some(strict) = js.and_then(|j| j.get("strict")) {
                    if !strict.is_boolean() && !strict.is_null() {
                        return Err(ApiError::bad_request(
                            "'response_format.json_schema.strict' must be a boolean",
                        ));
                    }
                }
                let Some(schema) = schema else {
                    return Err(ApiError::bad_request(
                        "'response_format' of type json_schema needs 'json_schema.schema'",
                    ));
                };
                found.push(("response_format", GrammarSpec::JsonSchema(schema.clone())));
            }
            _ => {}
        }
    }
    if let Some(g) = grammar_fields(body)? {
        found.push(("json_schema/grammar", g));
    }
    if tool_choice == "required" {
        let Some(Value::Array(all)) = tools else {
            return Err(ApiError::bad_request(
                "'tool_choice' requires a call but the request has no 'tools'",
            ));
        };
        let chosen: Vec<&Value> = all
            .iter()
            .filter(|t| {
                tool_name.is_none_or(|n| {
                    t.get("function")
                        .and_then(|f| f.get("name"))
                        .and_then(Value::as_str)
                        == Some(n)
                })
            })
            .collect();
        if chosen.is_empty() {
            return Err(ApiError::bad_request(format!(
                "'tool_choice' names the function {:?}, which is not in 'tools'",
                tool_name.unwrap_or_default()
            )));
        }
        let lark = tool_call_lark(&chosen).map_err(|e| ApiError::bad_request(e.to_string()))?;
        found.push(("tool_choice", GrammarSpec::Lark(lark)));
    }
    if found.len() > 1 {
        return Err(ApiError::bad_request(format!(
            "'{}' and '{}' each constrain the output; give one",
            found[0].0, found[1].0
        )));
    }
    Ok(found.pop().map(|(_, g)| g))
}

fn delta_json(d: &Delta) -> Value {
    match d {
        Delta::Reasoning(s) => json!({ "reasoning_content": s }),
        Delta::Content(s) => json!({ "content": s }),
        Delta::ToolCall(c) => json!({
            "tool_calls": [{
                "index": c.index,
                "id": c.id,
                "type": "function",
                "function": { "name": c.name, "arguments": c.arguments },
            }]
        }),
    }
}

/// `POST /v1/chat/completions`.
pub async fn chat_completions(State(state): State<Arc<AppState>>, body: RawBody) -> Response {
    match chat_impl(state, body.0, body.1).await {
        Ok(r) => r,
        Err(e) => e.into_response(),
    }
}

/// The reasoning budget of a chat request: `reasoning_budget_tokens` (or
/// `thinking_budget_tokens`) and `reasoning_budget_message`, else `--reasoning-budget` and
/// `--reasoning-budget-message`. llama-server feeds the generation prompt (the text after the
/// last `<|im_start|>`) through the budget first, so a prompt that opens thinking starts the
/// count.
fn reasoning_budget(
    state: &AppState,
    body: &Obj,
    prompt: &str,
) -> Result<Option<BudgetConfig>, ApiError> {
    let b = &state.cfg.budget;
    let asked = match opt_i64(body, "reasoning_budget_tokens")? {
        Some(n) => Some(n),
        None => opt_i64(body, "thinking_budget_tokens")?,
    };
    let tokens = match asked {
        Some(n) if n < -1 || n > i32::MAX as i64 => {
            return Err(ApiError::bad_request(format!(
                "'reasoning_budget_tokens' = {n} must be -1 (unrestricted) or in 0..={}",
                i32::MAX
            )))
        }
        Some(-1) | None => b.tokens,
        Some(n) => n,
    };
    if tokens < 0 || b.start.is_empty() || b.end.is_empty() {
        return Ok(None);
    }
    let message = opt_str(body, "reasoning_budget_message")?
        .map(str::to_string)
        .unwrap_or_else(|| b.message.clone());
    let encode = |t: &str| {
        state
            .tok
            .encode(t, false, true)
            .map_err(|e| ApiError::server(format!("tokenizer: {e}")))
    };
    let mut forced = encode(&message)?;
    forced.extend_from_slice(&b.end);
    let generation_prompt = prompt.rfind("<|im_start|>").map_or("", |i| &prompt[i..]);
    Ok(Some(BudgetConfig {
        budget: tokens as usize,
        start: b.start.clone(),
        end: vec![b.end.clone()],
        forced,
        prefill: encode(generation_prompt)?,
        incomplete: state.incomplete_tokens(),
    }))
}

/// A chat request parsed, rendered and tokenized, ready for the engine.
struct PreparedChat {
    req: crate::runtime::engine::Request,
    params: Value,
    parser: ParserConfig,
    n: usize,
    stream: bool,
    include_usage: bool,
    ping: Option<std::time::Duration>,
}

/// The CPU work of a chat request (off the async runtime: [`super::limits::off_runtime`]).
fn prepare_chat(state: &AppState, bytes: &[u8]) -> Result<PreparedChat, ApiError> {
    let body = parse_object(bytes)?;
    if let Some(m) = field(&body, "model") {
        if !m.is_string() {
            return Err(ApiError::bad_request("'model' must be a string"));
        }
    }
    // A last message too long for the window is refused before the template copies it.
    super::limits::refuse_by_bytes(state, super::limits::last_message_bytes(&body))?;
    let rendered = render_chat(state, &body)?;
    let mut gen = gen_params(
        &body,
        &state.gen_defaults(),
        &["n_predict", "max_completion_tokens", "max_tokens"],
        &state.tok,
        Endpoint::Chat,
    )?;
    gen.lora = state.lora.for_request(&body)?;
    let (ids, images) = if rendered.images.is_empty() {
        (tokenize(state, &rendered.prompt)?, Vec::new())
    } else {
        super::vision::prompt_with_images(
            state,
            &rendered.prompt,
            &rendered.marker,
            &rendered.images,
        )?
    };
    check_prompt(state, &ids)?;
    let constraint = rendered
        .grammar
        .as_ref()
        .map(|g| compile_grammar(state, g, rendered.parser.starts_in_reasoning))
        .transpose()?;
    state.log(
        4,
        format!("chat prompt ({} tokens):\n{}", ids.len(), rendered.prompt),
    );
    let budget = reasoning_budget(state, &body, &rendered.prompt)?;
    let mut req = request_of(state, ids, &gen, constraint);
    req.images = images;
    req.reasoning_budget = budget;
    Ok(PreparedChat {
        req,
        params: params_of(state, &gen),
        parser: rendered.parser,
        n: gen.n,
        stream: gen.stream,
        include_usage: gen.include_usage,
        ping: super::generate::ping_of(state, &gen),
    })
}

async fn chat_impl(
    state: Arc<AppState>,
    bytes: Bytes,
    access: super::Access,
) -> Result<Response, ApiError> {
    let p = super::limits::off_runtime(&state, move |st| prepare_chat(st, &bytes)).await?;
    let sub = submit(&state, p.req, p.params, access).await?;
    let id = format!("chatcmpl-{}", crate::chat::random_id(32));
    let created = unix_now();
    let parsers = (0..p.n)
        .map(|_| ChatParser::new(p.parser.clone()))
        .collect();
    if p.stream {
        Ok(stream_chat(
            state,
            sub,
            parsers,
            id,
            created,
            p.include_usage,
            p.ping,
        ))
    } else {
        collect_chat(&state, sub, parsers, id, created).await
    }
}

fn chunk(state: &AppState, id: &str, created: u64, choices: Value) -> Value {
    json!({
        "choices": choices,
        "created": created,
        "id": id,
        "model": state.cfg.alias,
        "system_fingerprint": state.cfg.build_info,
        "object": "chat.completion.chunk",
    })
}

/// The usage of a request's choices: the prompt once, the completions added up.
pub(super) fn merged_finish(done: &[Finish]) -> Finish {
    let mut f = done[0].clone();
    f.completion_tokens = done.iter().map(|d| d.completion_tokens).sum();
    f.timings.predicted_n = f.completion_tokens;
    f.timings.predicted_ms = done
        .iter()
        .map(|d| d.timings.predicted_ms)
        .fold(0.0, f64::max);
    f.timings.draft_n = done.iter().map(|d| d.timings.draft_n).sum();
    f.timings.draft_n_accepted = done.iter().map(|d| d.timings.draft_n_accepted).sum();
    f
}

async fn collect_chat(
    state: &AppState,
    mut sub: Submission,
    mut parsers: Vec<ChatParser>,
    id: String,
    created: u64,
) -> Result<Response, ApiError> {
    let n = parsers.len();
    let mut done: Vec<Option<Finish>> = vec![None; n];
    let mut probs: Vec<Vec<Value>> = vec![Vec::new(); n];
    while done.iter().any(Option::is_none) {
        match sub.rx.recv().await {
            Some(Event::Token {
                choice,
                text,
                probs: p,
                id: tid,
            }) => {
                parsers[choice].push(&text);
                if let Some(p) = p {
                    let t = super::generate::token_text(state, tid);
                    probs[choice].push(token_probs_json(state, tid, &t, &p));
                }
            }
            Some(Event::Text { choice, text }) => {
                parsers[choice].push(&text);
            }
            Some(Event::Started { .. }) | Some(Event::Embedding(_)) => {}
            Some(Event::Done(f)) => {
                if f.reason == FinishReason::Cancelled {
                    return Err(cancelled_error());
                }
                let c = f.choice;
                done[c] = Some(f);
            }
            Some(Event::Error(e)) => return Err(e.into()),
            None => return Err(ApiError::unavailable("the engine stopped")),
        }
    }
    let done: Vec<Finish> = done.into_iter().map(|f| f.expect("all done")).collect();
    let mut choices = Vec::with_capacity(n);
    for (c, parser) in parsers.iter_mut().enumerate() {
        parser.finish();
        let msg = parser.message();
        let mut m = Map::new();
        m.insert("role".into(), json!("assistant"));
        m.insert(
            "content".into(),
            if msg.content.is_empty() && !msg.tool_calls.is_empty() {
                Value::Null
            } else {
                Value::String(msg.content.clone())
            },
        );
        if !msg.reasoning.is_empty() {
            m.insert("reasoning_content".into(), json!(msg.reasoning));
        }
        if !msg.tool_calls.is_empty() {
            let calls: Vec<Value> = msg
                .tool_calls
                .iter()
                .map(|c| {
                    json!({
                        "type": "function",
                        "function": { "name": c.name, "arguments": c.arguments },
                        "id": c.id,
                    })
                })
                .collect();
            m.insert("tool_calls".into(), Value::Array(calls));
        }
        let mut choice = json!({
            "finish_reason": finish_reason(&done[c], !msg.tool_calls.is_empty()),
            "index": c,
            "message": Value::Object(m),
        });
        if !probs[c].is_empty() {
            choice["logprobs"] = json!({ "content": std::mem::take(&mut probs[c]) });
        }
        choices.push(choice);
    }
    let fin = merged_finish(&done);
    log_done(state, "chat", &fin, &sub);
    let body = json!({
        "choices": choices,
        "created": created,
        "model": state.cfg.alias,
        "system_fingerprint": state.cfg.build_info,
        "object": "chat.completion",
        "usage": usage_json(&fin),
        "id": id,
        "timings": timings_json(&fin),
    });
    Ok((StatusCode::OK, axum::Json(body)).into_response())
}

fn stream_chat(
    state: Arc<AppState>,
    mut sub: Submission,
    mut parsers: Vec<ChatParser>,
    id: String,
    created: u64,
    include_usage: bool,
    ping: Option<std::time::Duration>,
) -> Response {
    let (tx, rx) = mpsc::channel::<Bytes>(64);
    tokio::spawn(async move {
        let n = parsers.len();
        let send = |v: Value| {
            let tx = tx.clone();
            async move { tx.send(sse_bytes(&v)).await.is_ok() }
        };
        for c in 0..n {
            let first = chunk(
                &state,
                &id,
                created,
                json!([{ "finish_reason": null, "index": c, "delta": { "role": "assistant", "content": null } }]),
            );
            if !send(first).await {
                return;
            }
        }
        let delta_chunk = |c: usize, d: Option<&Delta>, lp: Vec<Value>| {
            let mut choice = json!({
                "finish_reason": null,
                "index": c,
                "delta": d.map(delta_json).unwrap_or_else(|| json!({})),
            });
            if !lp.is_empty() {
                choice["logprobs"] = json!({ "content": lp });
            }
            chunk(&state, &id, created, json!([choice]))
        };
        // Probabilities of tokens whose text the parser still holds back ride on the next
        // chunk of their choice.
        let mut pending: Vec<Vec<Value>> = vec![Vec::new(); n];
        let mut done: Vec<Option<Finish>> = vec![None; n];
        loop {
            let ev = sub.rx.recv().await;
            if tx.is_closed() {
                // The client is gone (even while the parser holds text back): dropping the
                // receiver cancels the request.
                return;
            }
            match ev {
                Some(Event::Token {
                    choice,
                    text,
                    probs,
                    id: tid,
                }) => {
                    if let Some(p) = probs {
                        let t = super::generate::token_text(&state, tid);
                        pending[choice].push(token_probs_json(&state, tid, &t, &p));
                    }
                    for d in parsers[choice].push(&text) {
                        let lp = std::mem::take(&mut pending[choice]);
                        if !send(delta_chunk(choice, Some(&d), lp)).await {
                            return;
                        }
                    }
                }
                Some(Event::Text { choice, text }) => {
                    for d in parsers[choice].push(&text) {
                        let lp = std::mem::take(&mut pending[choice]);
                        if !send(delta_chunk(choice, Some(&d), lp)).await {
                            return;
                        }
                    }
                }
                Some(Event::Started { .. }) | Some(Event::Embedding(_)) => {}
                Some(Event::Done(fin)) => {
                    if fin.reason == FinishReason::Cancelled {
                        let _ = send(cancelled_error().to_json()).await;
                        return;
                    }
                    let c = fin.choice;
                    for d in parsers[c].finish() {
                        let lp = std::mem::take(&mut pending[c]);
                        if !send(delta_chunk(c, Some(&d), lp)).await {
                            return;
                        }
                    }
                    if !pending[c].is_empty() {
                        let lp = std::mem::take(&mut pending[c]);
                        if !send(delta_chunk(c, None, lp)).await {
                            return;
                        }
                    }
                    let fr = finish_reason(&fin, !parsers[c].message().tool_calls.is_empty());
                    done[c] = Some(fin);
                    let all = done.iter().all(Option::is_some);
                    let mut last = chunk(
                        &state,
                        &id,
                        created,
                        json!([{ "finish_reason": fr, "index": c, "delta": {} }]),
                    );
                    if !all {
                        if !send(last).await {
                            return;
                        }
                        continue;
                    }
                    let fins: Vec<Finish> = done.iter().flatten().cloned().collect();
                    let fin = merged_finish(&fins);
                    if include_usage {
                        if !send(last).await {
                            return;
                        }
                        last = chunk(&state, &id, created, json!([]));
                    }
                    if let Some(o) = last.as_object_mut() {
                        o.insert("usage".into(), usage_json(&fin));
                        o.insert("timings".into(), timings_json(&fin));
                    }
                    log_done(&state, "chat (stream)", &fin, &sub);
                    if send(last).await {
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
            }
        }
    });
    sse_response(rx, ping)
}
