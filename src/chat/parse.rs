//! The model's output split into what an OpenAI client reads: `reasoning_content` (the text
//! between `<think>` and `</think>`, with `--reasoning-format deepseek`), `content`, and
//! `tool_calls` parsed from Qwen3.5's XML-style blocks:
//!
//! ```text
//! <tool_call>
//! <function=NAME>
//! <parameter=ARG>
//! VALUE
//! </parameter>
//! </function>
//! </tool_call>
//! ```
//!
//! [`ChatParser`] is a streaming state machine: text goes in as the engine produces it and
//! [`Delta`]s come out as soon as they are certain (a tail that may still become a tag is held
//! back). The non-streaming path feeds the whole text through the same machine, so a stream's
//! deltas always add up to the non-streamed message. A block that does not parse (no
//! `<function=…>`, stray text between parameters, the generation ending inside it) comes back
//! as content, never as an error.

use std::collections::HashMap;

use serde_json::Value as Json;

pub const THINK_OPEN: &str = "<think>";
pub const THINK_CLOSE: &str = "</think>";
pub const TOOL_OPEN: &str = "<tool_call>";
pub const TOOL_CLOSE: &str = "</tool_call>";

/// How a parameter's value is typed, from the tool's JSON schema.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ParamKind {
    /// The schema allows only strings: the value is kept verbatim.
    StringOnly,
    /// Anything else (or no schema): a value that parses as JSON keeps its type, else it is a
    /// string.
    Json,
}

/// The declared tools, for typing parameter values.
#[derive(Clone, Debug, Default)]
pub struct ToolSpecs {
    /// tool name -> parameter name -> kind.
    params: HashMap<String, HashMap<String, ParamKind>>,
}

impl ToolSpecs {
    /// From OpenAI-shaped `tools` (`[{"type":"function","function":{"name","parameters"}}]`).
    /// Entries that are not shaped so are skipped (their calls still parse, untyped).
    pub fn from_openai(tools: &Json) -> ToolSpecs {
        let mut params = HashMap::new();
        for t in tools.as_array().into_iter().flatten() {
            let f = t.get("function").unwrap_or(t);
            let Some(name) = f.get("name").and_then(Json::as_str) else {
                continue;
            };
            let mut kinds = HashMap::new();
            if let Some(props) = f
                .get("parameters")
                .and_then(|p| p.get("properties"))
                .and_then(Json::as_object)
            {
                for (pname, schema) in props {
                    kinds.insert(pname.clone(), kind_of(schema));
                }
            }
            params.insert(name.to_string(), kinds);
        }
        ToolSpecs { params }
    }

    fn kind(&self, tool: &str, param: &str) -> ParamKind {
        self.params
            .get(tool)
            .and_then(|p| p.get(param))
            .copied()
            .unwrap_or(ParamKind::Json)
    }
}

fn kind_of(schema: &Json) -> ParamKind {
    match schema.get("type") {
        Some(Json::String(t)) if t == "string" => ParamKind::StringOnly,
        Some(Json::Array(ts)) if !ts.is_empty() && ts.iter().all(|t| t == "string") => {
            ParamKind::StringOnly
        }
        _ => ParamKind::Json,
    }
}

#[derive(Clone, Debug, Default)]
pub struct ParserConfig {
    /// Split `<think>…</think>` into reasoning (`--reasoning-format deepseek`).
    pub reasoning: bool,
    /// The prompt ends inside an open `<think>` (the Qwen3.5 generation prompt), so the output
    /// starts as reasoning.
    pub starts_in_reasoning: bool,
    /// Parse `<tool_call>` blocks (the request has tools and tool_choice is not "none").
    pub tools: Option<ToolSpecs>,
}

impl ParserConfig {
    /// Whether the rendered prompt leaves a `<think>` open.
    pub fn prompt_opens_thinking(prompt: &str) -> bool {
        prompt.trim_end().ends_with(THINK_OPEN)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ToolCall {
    /// Position in the message's `tool_calls`.
    pub index: usize,
    pub id: String,
    pub name: String,
    /// A JSON object, serialized.
    pub arguments: String,
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Delta {
    Reasoning(String),
    Content(String),
    ToolCall(ToolCall),
}

/// The whole message, as the deltas add up.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct ParsedMessage {
    pub content: String,
    pub reasoning: String,
    pub tool_calls: Vec<ToolCall>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Mode {
    /// Undecided: the output may open with `<think>`.
    Start,
    Reasoning {
        skip_ws: bool,
    },
    Content {
        skip_ws: bool,
    },
    /// Inside `<tool_call>…`, waiting for `</tool_call>`.
    Tool,
    /// After a tool call: whitespace is dropped, another block may follow.
    AfterTool,
}

pub struct ChatParser {
    cfg: ParserConfig,
    mode: Mode,
    buf: String,
    msg: ParsedMessage,
    ids: Box<dyn FnMut(usize) -> String + Send>,
}

impl ChatParser {
    /// Tool call ids are random (`call_…`).
    pub fn new(cfg: ParserConfig) -> ChatParser {
        ChatParser::with_ids(cfg, |_| format!("call_{}", crate::chat::random_id(24)))
    }

    /// Tool call ids from `ids(index)` (deterministic tests).
    pub fn with_ids(
        cfg: ParserConfig,
        ids: impl FnMut(usize) -> String + Send + 'static,
    ) -> ChatParser {
        let mode = if !cfg.reasoning {
            Mode::Content { skip_ws: false }
        } else if cfg.starts_in_reasoning {
            Mode::Reasoning { skip_ws: true }
        } else {
            Mode::Start
        };
        ChatParser {
            cfg,
            mode,
            buf: String::new(),
            msg: ParsedMessage::default(),
            ids: Box::new(ids),
        }
    }

    /// Feeds generated text; returns the deltas that are now certain.
    pub fn push(&mut self, text: &str) -> Vec<Delta> {
        self.buf.push_str(text);
        let mut out = Vec::new();
        while self.step(false, &mut out) {}
        out
    }

    /// The generation ended: releases everything held back.
    pub fn finish(&mut self) -> Vec<Delta> {
        let mut out = Vec::new();
        while self.step(true, &mut out) {}
        out
    }

    /// The message so far (complete after [`ChatParser::finish`]).
    pub fn message(&self) -> &ParsedMessage {
        &self.msg
    }

    /// Whether the output is still inside the reasoning block.
    pub fn in_reasoning(&self) -> bool {
        matches!(self.mode, Mode::Reasoning { .. })
    }

    /// Parses a whole text at once.
    pub fn parse_all(cfg: ParserConfig, text: &str) -> ParsedMessage {
        let mut p = ChatParser::new(cfg);
        p.push(text);
        p.finish();
        p.msg
    }

    fn emit(&mut self, d: Delta, out: &mut Vec<Delta>) {
        match &d {
            Delta::Reasoning(s) if s.is_empty() => return,
            Delta::Content(s) if s.is_empty() => return,
            Delta::Reasoning(s) => self.msg.reasoning.push_str(s),
            Delta::Content(s) => self.msg.content.push_str(s),
            Delta::ToolCall(c) => self.msg.tool_calls.push(c.clone()),
        }
        out.push(d);
    }

    fn tools_on(&self) -> bool {
        self.cfg.tools.is_some()
    }

    /// One transition; false when nothing more can happen until more text (or the end).
    fn step(&mut self, fin: bool, out: &mut Vec<Delta>) -> bool {
        match self.mode {
            Mode::Start => {
                let t = self.buf.trim_start();
                if let Some(rest) = t.strip_prefix(THINK_OPEN) {
                    self.buf = rest.to_string();
                    self.mode = Mode::Reasoning { skip_ws: true };
                    true
                } else if !fin && THINK_OPEN.starts_with(t) {
                    false
                } else {
                    self.mode = Mode::Content { skip_ws: false };
                    true
                }
            }
            Mode::Reasoning { skip_ws } => {
                if skip_ws {
                    let n = self.buf.len() - self.buf.trim_start().len();
                    self.buf.drain(..n);
                    if self.buf.is_empty() {
                        return false;
                    }
                    self.mode = Mode::Reasoning { skip_ws: false };
                }
                let close = self.buf.find(THINK_CLOSE);
                let tool = self.buf.find(TOOL_OPEN);
                match (close, tool) {
                    (Some(c), t) if t.is_none_or(|t| c < t) => {
                        let r = self.buf[..c].trim_end().to_string();
                        self.buf.drain(..c + THINK_CLOSE.len());
                        self.emit(Delta::Reasoning(r), out);
                        self.mode = Mode::Content { skip_ws: true };
                        true
                    }
                    (_, Some(t)) => {
                        let r = self.buf[..t].trim_end().to_string();
                        self.buf.drain(..t);
                        self.emit(Delta::Reasoning(r), out);
                        self.mode = Mode::Content { skip_ws: false };
                        true
                    }
                    _ => {
                        let safe = if fin {
                            self.buf.trim_end().len()
                        } else {
                            safe_len(&self.buf, &[THINK_CLOSE, TOOL_OPEN])
                        };
                        let r: String = self.buf[..safe].to_string();
                        self.buf.drain(..safe);
                        if fin {
                            self.buf.clear();
                        }
                        self.emit(Delta::Reasoning(r), out);
                        false
                    }
                }
            }
            Mode::Content { skip_ws } => {
                if skip_ws {
                    let n = self.buf.len() - self.buf.trim_start().len();
                    self.buf.drain(..n);
                    if self.buf.is_empty() && !fin {
                        return false;
                    }
                    self.mode = Mode::Content { skip_ws: false };
                }
                if !self.tools_on() {
                    let c = std::mem::take(&mut self.buf);
                    self.emit(Delta::Content(c), out);
                    return false;
                }
                if let Some(t) = self.buf.find(TOOL_OPEN) {
                    let c = self.buf[..t].trim_end().to_string();
                    self.buf.drain(..t);
                    self.emit(Delta::Content(c), out);
                    self.mode = Mode::Tool;
                    return true;
                }
                let safe = if fin {
                    self.buf.len()
                } else {
                    safe_len(&self.buf, &[TOOL_OPEN])
                };
                let c: String = self.buf[..safe].to_string();
                self.buf.drain(..safe);
                self.emit(Delta::Content(c), out);
                false
            }
            Mode::Tool => {
                if let Some(end) = self.buf.find(TOOL_CLOSE) {
                    let block: String = self.buf[..end + TOOL_CLOSE.len()].to_string();
                    self.buf.drain(..end + TOOL_CLOSE.len());
                    let specs = self.cfg.tools.clone().unwrap_or_default();
                    match parse_tool_block(&block, &specs) {
                        Some((name, arguments)) => {
                            let index = self.msg.tool_calls.len();
                            let id = (self.ids)(index);
                            self.emit(
                                Delta::ToolCall(ToolCall {
                                    index,
                                    id,
                                    name,
                                    arguments,
                                }),
                                out,
                            );
                            self.mode = Mode::AfterTool;
                        }
                        None => {
                            self.emit(Delta::Content(block), out);
                            self.mode = Mode::Content { skip_ws: false };
                        }
                    }
                    true
                } else if fin {
                    // The generation ended inside the block: it is text, not a call.
                    let c = std::mem::take(&mut self.buf);
                    self.emit(Delta::Content(c), out);
                    false
                } else {
                    false
                }
            }
            Mode::AfterTool => {
                let n = self.buf.len() - self.buf.trim_start().len();
                self.buf.drain(..n);
                if self.buf.starts_with(TOOL_OPEN) {
                    self.mode = Mode::Tool;
                    true
                } else if self.buf.is_empty() || (!fin && TOOL_OPEN.starts_with(&*self.buf)) {
                    false
                } else {
                    self.mode = Mode::Content { skip_ws: false };
                    true
                }
            }
        }
    }
}

/// How much of `buf` can be released now: everything but trailing whitespace and a tail that
/// could still grow into one of `tags`.
fn safe_len(buf: &str, tags: &[&str]) -> usize {
    let mut safe = buf.len();
    for tag in tags {
        for k in (1..tag.len()).rev() {
            if buf.len() >= k && buf.is_char_boundary(buf.len() - k) && buf.ends_with(&tag[..k]) {
                safe = safe.min(buf.len() - k);
                break;
            }
        }
    }
    buf[..safe].trim_end().len()
}

/// Parses one `<tool_call>…</tool_call>` block into (name, arguments as a JSON object string).
/// None when it is not shaped as Qwen3.5 writes it.
pub fn parse_tool_block(block: &str, specs: &ToolSpecs) -> Option<(String, String)> {
    let inner = block
        .trim()
        .strip_prefix(TOOL_OPEN)?
        .strip_suffix(TOOL_CLOSE)?
        .trim();
    let rest = inner.strip_prefix("<function=")?;
    let gt = rest.find('>')?;
    let name = rest[..gt].trim();
    if name.is_empty() || name.contains(['\n', '<']) {
        return None;
    }
    let body = rest[gt + 1..].trim_end().strip_suffix("</function>")?;
    let mut args = serde_json::Map::new();
    let mut s = body;
    loop {
        s = s.trim_start();
        if s.is_empty() {
            break;
        }
        let r = s.strip_prefix("<parameter=")?;
        let gt = r.find('>')?;
        let pname = r[..gt].trim();
        if pname.is_empty() || pname.contains(['\n', '<']) {
            return None;
        }
        let r = &r[gt + 1..];
        let end = r.find("</parameter>")?;
        let raw = &r[..end];
        let raw = raw.strip_prefix('\n').unwrap_or(raw);
        let raw = raw.strip_suffix('\n').unwrap_or(raw);
        let value = match specs.kind(name, pname) {
            ParamKind::StringOnly => Json::String(raw.to_string()),
            ParamKind::Json => serde_json::from_str::<Json>(raw.trim())
                .unwrap_or_else(|_| Json::String(raw.to_string())),
        };
        args.insert(pname.to_string(), value);
        s = &r[end + "</parameter>".len()..];
    }
    Some((name.to_string(), Json::Object(args).to_string()))
}
