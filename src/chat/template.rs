//! Chat templates: the model's Jinja template (`tokenizer.chat_template`, or
//! `--chat-template-file`) rendered with minijinja set up as Hugging Face's transformers sets up
//! jinja2 (trim_blocks, lstrip_blocks, Python string methods, `raise_exception`, a `tojson`
//! that writes what Python's `json.dumps` writes), so that the prompt is byte-identical to the
//! one the model was trained on.

use std::fmt;

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde_json::Value as Json;

/// A template that failed: at load (a syntax error) or while rendering (the template raised,
/// or the input does not fit it). Both name the cause; neither is a server fault.
#[derive(Debug, Clone, PartialEq)]
pub enum TemplateError {
    /// The template does not parse.
    Syntax(String),
    /// `raise_exception(msg)` in the template, or an error it hit rendering these inputs.
    Render(String),
}

impl fmt::Display for TemplateError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            TemplateError::Syntax(m) => write!(f, "chat template does not parse: {m}"),
            TemplateError::Render(m) => write!(f, "chat template error: {m}"),
        }
    }
}

impl std::error::Error for TemplateError {}

/// What a template is rendered with.
#[derive(Debug, Clone, Default)]
pub struct TemplateInputs {
    /// OpenAI-shaped messages (role, content as a string or parts, tool_calls, ...).
    pub messages: Json,
    /// OpenAI-shaped tools (`[{"type":"function","function":{...}}]`), absent when none.
    pub tools: Option<Json>,
    pub add_generation_prompt: bool,
    /// Extra variables: `enable_thinking`, `reasoning_effort`, `preserve_thinking` and any other
    /// `chat_template_kwargs` (later keys win).
    pub kwargs: serde_json::Map<String, Json>,
    pub bos_token: String,
    pub eos_token: String,
}

pub struct ChatTemplate {
    env: Environment<'static>,
    source: String,
}

impl fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("ChatTemplate")
            .field("chars", &self.source.len())
            .finish()
    }
}

const NAME: &str = "chat";

impl ChatTemplate {
    /// Compiles `source`; a syntax error is reported here, at boot, not at the first request.
    pub fn new(source: &str) -> Result<ChatTemplate, TemplateError> {
        let mut env = Environment::new();
        // transformers: trim_blocks and lstrip_blocks on, the trailing newline dropped.
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .keep_trailing_newline(false)
            .build()
            .map_err(|e| TemplateError::Syntax(e.to_string()))?;
        env.set_syntax(syntax);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_filter("tojson", tojson);
        env.add_filter("string", py_string);
        env.add_template_owned(NAME, source.to_string())
            .map_err(|e| TemplateError::Syntax(describe(&e)))?;
        Ok(ChatTemplate {
            env,
            source: source.to_string(),
        })
    }

    /// The template text as given.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// Whether the template reads a variable (a cheap textual check, used to say when a request
    /// field has no effect).
    pub fn mentions(&self, name: &str) -> bool {
        self.source.contains(name)
    }

    pub fn render(&self, inputs: &TemplateInputs) -> Result<String, TemplateError> {
        let tmpl = self
            .env
            .get_template(NAME)
            .map_err(|e| TemplateError::Render(describe(&e)))?;
        let mut ctx = serde_json::Map::new();
        ctx.insert("messages".into(), inputs.messages.clone());
        if let Some(t) = &inputs.tools {
            ctx.insert("tools".into(), t.clone());
        }
        ctx.insert(
            "add_generation_prompt".into(),
            Json::Bool(inputs.add_generation_prompt),
        );
        ctx.insert("bos_token".into(), Json::String(inputs.bos_token.clone()));
        ctx.insert("eos_token".into(), Json::String(inputs.eos_token.clone()));
        for (k, v) in &inputs.kwargs {
            ctx.insert(k.clone(), v.clone());
        }
        let ctx = Value::from(minijinja::value::Serde(Json::Object(ctx)));
        tmpl.render(ctx)
            .map_err(|e| TemplateError::Render(describe(&e)))
    }
}

/// An error's own message (for `raise_exception`, exactly the template's text).
fn describe(e: &Error) -> String {
    match (e.kind(), e.detail()) {
        (ErrorKind::InvalidOperation, Some(d)) => d.to_string(),
        _ => {
            let mut s = e.to_string();
            let mut src = std::error::Error::source(e);
            while let Some(inner) = src {
                s.push_str(": ");
                s.push_str(&inner.to_string());
                src = inner.source();
            }
            s
        }
    }
}

fn raise_exception(msg: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, msg))
}

/// Python's `str()` for the values a template prints: `True`/`False`/`None` as Python spells
/// them, everything else as minijinja does.
fn py_string(v: &Value) -> Value {
    if v.is_none() {
        return Value::from("None");
    }
    if let Some(b) = bool_of(v) {
        return Value::from(if b { "True" } else { "False" });
    }
    if v.is_undefined() {
        return Value::from("");
    }
    if let Some(s) = v.as_str() {
        return Value::from(s);
    }
    Value::from(v.to_string())
}

fn bool_of(v: &Value) -> Option<bool> {
    (v.kind() == minijinja::value::ValueKind::Bool).then(|| v.is_true())
}

/// transformers' `tojson`: `json.dumps(x, ensure_ascii=False, indent=indent)`, i.e. `", "` and
/// `": "` separators (or newlines and `indent` spaces), non-ASCII kept, nothing HTML-escaped.
fn tojson(v: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let indent = match indent {
        Some(i) => Some(i),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    // `ensure_ascii`, `sort_keys` and `separators` are accepted; only their defaults are honoured.
    for k in ["ensure_ascii", "sort_keys", "separators"] {
        let _: Option<Value> = kwargs.get(k)?;
    }
    kwargs.assert_all_used()?;
    let json: Json = serde_json::to_value(v).map_err(|e| {
        Error::new(ErrorKind::InvalidOperation, "cannot serialize to JSON").with_source(e)
    })?;
    let indent = match indent {
        None => None,
        Some(i) if i.is_none() => None,
        Some(i) => Some(usize::try_from(i)?),
    };
    Ok(Value::from_safe_string(python_json(&json, indent)))
}

/// `json.dumps(value, ensure_ascii=False, indent=indent)` as CPython writes it.
pub fn python_json(value: &Json, indent: Option<usize>) -> String {
    let mut out = String::new();
    write_py(&mut out, value, indent, 0);
    out
}

fn write_py(out: &mut String, v: &Json, indent: Option<usize>, depth: usize) {
    let newline = |out: &mut String, depth: usize| {
        if let Some(n) = indent {
            out.push('\n');
            out.extend(std::iter::repeat_n(' ', n * depth));
        }
    };
    let item_sep = if indent.is_some() { "," } else { ", " };
    match v {
        Json::Null => out.push_str("null"),
        Json::Bool(b) => out.push_str(if *b { "true" } else { "false" }),
        Json::Number(n) => out.push_str(&py_number(n)),
        Json::String(s) => write_py_str(out, s),
        Json::Array(a) => {
            if a.is_empty() {
                out.push_str("[]");
                return;
            }
            out.push('[');
            for (i, x) in a.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_py(out, x, indent, depth + 1);
            }
            newline(out, depth);
            out.push(']');
        }
        Json::Object(m) => {
            if m.is_empty() {
                out.push_str("{}");
                return;
            }
            out.push('{');
            for (i, (k, x)) in m.iter().enumerate() {
                if i > 0 {
                    out.push_str(item_sep);
                }
                newline(out, depth + 1);
                write_py_str(out, k);
                out.push_str(": ");
                write_py(out, x, indent, depth + 1);
            }
            newline(out, depth);
            out.push('}');
        }
    }
}

/// Python's float repr for the common cases (`1.0`, `0.5`, `1e-05`); integers as they are.
fn py_number(n: &serde_json::Number) -> String {
    if n.is_i64() || n.is_u64() {
        return n.to_string();
    }
    let f = n.as_f64().unwrap_or(0.0);
    if !f.is_finite() {
        return if f.is_nan() {
            "NaN".into()
        } else if f > 0.0 {
            "Infinity".into()
        } else {
            "-Infinity".into()
        };
    }
    if f == f.trunc() && f.abs() < 1e16 {
        return format!("{f:.1}");
    }
    let a = f.abs();
    if (1e-4..1e16).contains(&a) {
        return format!("{f}");
    }
    // Exponent form as Python writes it: 1e-05, 1.5e+20.
    let s = format!("{f:e}");
    match s.split_once('e') {
        Some((m, e)) => {
            let (sign, digits) = match e.strip_prefix('-') {
                Some(d) => ('-', d),
                None => ('+', e),
            };
            format!("{m}e{sign}{digits:0>2}")
        }
        None => s,
    }
}

fn write_py_str(out: &mut String, s: &str) {
    out.push('"');
    for c in s.chars() {
        match c {
            '"' => out.push_str("\\\""),
            '\\' => out.push_str("\\\\"),
            '\n' => out.push_str("\\n"),
            '\r' => out.push_str("\\r"),
            '\t' => out.push_str("\\t"),
            '\u{08}' => out.push_str("\\b"),
            '\u{0c}' => out.push_str("\\f"),
            c if (c as u32) < 0x20 => out.push_str(&format!("\\u{:04x}", c as u32)),
            c => out.push(c),
        }
    }
    out.push('"');
}

/// The reasoning levels the Qwen3.5 (Ternary-Bonsai-2) templates accept; they raise on any
/// other value.
pub const ACCEPTED_EFFORTS: [&str; 3] = ["xhigh", "medium", "low"];

/// Maps a requested `reasoning_effort` to the nearest accepted level. Returns the level and,
/// when it differs from the request, a note saying so (for the log). `none` is not mapped: the
/// caller turns it into `enable_thinking = false`.
pub fn map_reasoning_effort(requested: &str) -> (String, Option<String>) {
    let r = requested.trim().to_ascii_lowercase();
    if ACCEPTED_EFFORTS.contains(&r.as_str()) {
        return (r, None);
    }
    // OpenAI's ladder, low to high; ties go up (a client that asked for more thinking).
    let ladder = ["none", "minimal", "low", "medium", "high", "xhigh", "max"];
    let mapped = match ladder.iter().position(|l| *l == r) {
        Some(at) => ACCEPTED_EFFORTS
            .iter()
            .min_by_key(|a| {
                let p = ladder.iter().position(|l| l == *a).unwrap_or(0);
                // Distance, then prefer the higher level on a tie.
                ((p as i64 - at as i64).unsigned_abs() * 2, usize::MAX - p)
            })
            .copied()
            .unwrap_or("medium"),
        None => "medium",
    };
    (
        mapped.to_string(),
        Some(format!(
            "reasoning_effort {requested:?} is not one of {} that the template accepts; using {mapped:?}",
            ACCEPTED_EFFORTS.join("|")
        )),
    )
}
