//! Request bodies read field by field from JSON, so that every wrong type, range or shape is a
//! 400 that names the field (never a panic, never a 500).

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::runtime::sampler::SamplerConfig;

pub type Obj = Map<String, Value>;

/// The largest `max_tokens` accepted (llama.cpp's n_predict is an int32).
pub const MAX_TOKENS_LIMIT: u64 = i32::MAX as u64;

/// Parses a body as a JSON object.
pub fn parse_object(body: &[u8]) -> Result<Obj, ApiError> {
    if body.iter().all(u8::is_ascii_whitespace) {
        return Err(ApiError::bad_request(
            "the request body is empty; expected a JSON object",
        ));
    }
    let v: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the request body is not valid JSON: {e}")))?;
    match v {
        Value::Object(m) => Ok(m),
        other => Err(ApiError::bad_request(format!(
            "the request body must be a JSON object, not {}",
            type_name(&other)
        ))),
    }
}

pub fn type_name(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

fn wrong(key: &str, want: &str, got: &Value) -> ApiError {
    ApiError::bad_request(format!("'{key}' must be {want}, not {}", type_name(got)))
}

/// A present, non-null field.
pub fn field<'a>(m: &'a Obj, key: &str) -> Option<&'a Value> {
    m.get(key).filter(|v| !v.is_null())
}

pub fn opt_bool(m: &Obj, key: &str) -> Result<Option<bool>, ApiError> {
    match field(m, key) {
        None => Ok(None),
        Some(Value::Bool(b)) => Ok(Some(*b)),
        Some(v) => Err(wrong(key, "a boolean", v)),
    }
}

pub fn opt_str<'a>(m: &'a Obj, key: &str) -> Result<Option<&'a str>, ApiError> {
    match field(m, key) {
        None => Ok(None),
        Some(Value::String(s)) => Ok(Some(s)),
        Some(v) => Err(wrong(key, "a string", v)),
    }
}

/// A finite number that fits an f32.
pub fn opt_f32(m: &Obj, key: &str) -> Result<Option<f32>, ApiError> {
    match field(m, key) {
        None => Ok(None),
        Some(Value::Number(n)) => {
            let x = n.as_f64().unwrap_or(f64::NAN);
            if !x.is_finite() || x.abs() > f32::MAX as f64 {
                return Err(ApiError::bad_request(format!(
                    "'{key}' = {n} is out of range"
                )));
            }
            Ok(Some(x as f32))
        }
        Some(v) => Err(wrong(key, "a number", v)),
    }
}

/// An integer (a float with no fractional part is accepted, as JSON clients often send 10.0).
pub fn opt_i64(m: &Obj, key: &str) -> Result<Option<i64>, ApiError> {
    match field(m, key) {
        None => Ok(None),
        Some(Value::Number(n)) => {
            if let Some(i) = n.as_i64() {
                return Ok(Some(i));
            }
            if n.as_u64().is_some() {
                return Err(ApiError::bad_request(format!("'{key}' = {n} is too large")));
            }
            match n.as_f64() {
                Some(f) if f.fract() == 0.0 && f.abs() < 9.0e15 => Ok(Some(f as i64)),
                Some(f) if f.fract() == 0.0 => {
                    Err(ApiError::bad_request(format!("'{key}' = {n} is too large")))
                }
                _ => Err(ApiError::bad_request(format!(
                    "'{key}' must be an integer, not {n}"
                ))),
            }
        }
        Some(v) => Err(wrong(key, "an integer", v)),
    }
}

/// `max_tokens`-like fields: the first of `keys` that is present, with llama-server's range
/// for all of them (-1 = no limit of its own, 0 = evaluate the prompt only). None when none is
/// given, or -1.
pub fn max_tokens(m: &Obj, keys: &[&str]) -> Result<Option<usize>, ApiError> {
    for key in keys {
        let Some(n) = opt_i64(m, key)? else {
            continue;
        };
        if n == -1 {
            return Ok(None);
        }
        if n < 0 {
            return Err(ApiError::bad_request(format!(
                "'{key}' = {n} must be -1 (no limit), 0 (evaluate the prompt only) or positive"
            )));
        }
        if n as u64 > MAX_TOKENS_LIMIT {
            return Err(ApiError::bad_request(format!(
                "'{key}' = {n} is too large (at most {MAX_TOKENS_LIMIT})"
            )));
        }
        return Ok(Some(n as usize));
    }
    Ok(None)
}

/// `stop`: a string or an array of strings.
pub fn stop_strings(m: &Obj) -> Result<Vec<String>, ApiError> {
    match field(m, "stop") {
        None => Ok(Vec::new()),
        Some(Value::String(s)) => Ok(vec![s.clone()]),
        Some(Value::Array(a)) => {
            if a.len() > 64 {
                return Err(ApiError::bad_request("'stop' has more than 64 strings"));
            }
            a.iter()
                .enumerate()
                .map(|(i, v)| match v {
                    Value::String(s) => Ok(s.clone()),
                    v => Err(wrong(&format!("stop[{i}]"), "a string", v)),
                })
                .collect()
        }
        Some(v) => Err(wrong("stop", "a string or an array of strings", v)),
    }
}

/// What every generation endpoint reads besides its prompt.
#[derive(Clone, Debug)]
pub struct GenParams {
    /// None: the server's `--n-predict`, else until the slot window.
    pub max_tokens: Option<usize>,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub stream: bool,
    /// `stream_options.include_usage`.
    pub include_usage: bool,
    /// `cache_prompt`: reuse the slot's cached prefix.
    pub cache_prompt: bool,
    /// `sse_ping_interval` (-1 or 0: no pings).
    pub sse_ping_interval: Option<i64>,
    /// Each LoRA adapter's scale (`lora`, else the global scales; server/lora.rs).
    pub lora: Vec<f32>,
}

/// The server's defaults a request starts from: the model file's sampling and then the flags
/// (`--seed`, `--reverse-prompt`, `--ignore-eos`, `--cache-prompt`).
#[derive(Clone, Debug)]
pub struct GenDefaults<'a> {
    pub sampler: &'a SamplerConfig,
    pub fixed_seed: Option<u64>,
    pub stop: &'a [String],
    pub ignore_eos: bool,
    pub cache_prompt: bool,
}

/// Sampling: the server's defaults (model file, then flags), overridden by the request.
/// `random_seed` is used when neither the flags nor the request fix one.
pub fn gen_params(m: &Obj, d: &GenDefaults, max_keys: &[&str]) -> Result<GenParams, ApiError> {
    let fixed_seed = d.fixed_seed;
    let mut s = d.sampler.clone();
    if let Some(t) = opt_f32(m, "temperature")?.or(opt_f32(m, "temp")?) {
        s.temperature = t;
    }
    if let Some(k) = opt_i64(m, "top_k")? {
        s.top_k = if k <= 0 {
            0
        } else {
            k.min(i32::MAX as i64) as usize
        };
    }
    if let Some(p) = opt_f32(m, "top_p")? {
        s.top_p = p;
    }
    if let Some(p) = opt_f32(m, "min_p")? {
        s.min_p = p;
    }
    if let Some(p) = opt_f32(m, "presence_penalty")? {
        s.presence_penalty = p;
    }
    if let Some(p) = opt_f32(m, "frequency_penalty")? {
        s.frequency_penalty = p;
    }
    if let Some(p) = opt_f32(m, "repeat_penalty")? {
        s.repeat_penalty = p;
    }
    if let Some(n) = opt_i64(m, "repeat_last_n")? {
        if n < -1 {
            return Err(ApiError::bad_request(format!(
                "'repeat_last_n' = {n} must be -1 (the whole context), 0 (off) or positive"
            )));
        }
        s.penalty_last_n = if n == -1 { usize::MAX } else { n as usize };
    }
    s.seed = match opt_i64(m, "seed")? {
        Some(-1) | None => fixed_seed.unwrap_or_else(random_seed),
        Some(x) if x < 0 => {
            return Err(ApiError::bad_request(format!(
                "'seed' = {x} must be -1 (random) or non-negative"
            )))
        }
        Some(x) => x as u64,
    };
    s.validate()
        .map_err(|e| ApiError::bad_request(format!("bad sampling parameters: {e}")))?;
    if let Some(n) = opt_i64(m, "n")? {
        if n != 1 {
            return Err(ApiError::bad_request(format!(
                "'n' = {n}: only n = 1 is supported"
            )));
        }
    }
    if opt_bool(m, "logprobs")? == Some(true) {
        return Err(ApiError::bad_request(
            "'logprobs' is not supported by this server",
        ));
    }
    let include_usage = match field(m, "stream_options") {
        None => false,
        Some(Value::Object(o)) => opt_bool(o, "include_usage")?.unwrap_or(false),
        Some(v) => return Err(wrong("stream_options", "an object", v)),
    };
    let sse_ping_interval = opt_i64(m, "sse_ping_interval")?;
    if let Some(n) = sse_ping_interval {
        if !(-1..=i32::MAX as i64).contains(&n) {
            return Err(ApiError::bad_request(format!(
                "'sse_ping_interval' = {n} must be -1 (no pings) or in 0..={}",
                i32::MAX
            )));
        }
    }
    let stop = stop_strings(m)?;
    Ok(GenParams {
        max_tokens: max_tokens(m, max_keys)?,
        sampler: s,
        stop: if stop.is_empty() {
            d.stop.to_vec()
        } else {
            stop
        },
        ignore_eos: opt_bool(m, "ignore_eos")?.unwrap_or(d.ignore_eos),
        stream: opt_bool(m, "stream")?.unwrap_or(false),
        lora: Vec::new(),
        include_usage,
        cache_prompt: opt_bool(m, "cache_prompt")?.unwrap_or(d.cache_prompt),
        sse_ping_interval,
    })
}

/// A seed for a request that did not fix one.
pub fn random_seed() -> u64 {
    use std::hash::{BuildHasher, Hasher};
    let mut h = std::collections::hash_map::RandomState::new().build_hasher();
    h.write_u128(
        std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0),
    );
    h.finish() & 0xFFFF_FFFF
}

/// A prompt given as text or as token ids (llama-server's `prompt`).
#[derive(Clone, Debug, PartialEq)]
pub enum Prompt {
    Text(String),
    Tokens(Vec<u32>),
}

pub fn prompt_field(m: &Obj, key: &str) -> Result<Prompt, ApiError> {
    let Some(v) = field(m, key) else {
        return Err(ApiError::bad_request(format!("'{key}' is required")));
    };
    prompt_value(v, key)
}

fn prompt_value(v: &Value, key: &str) -> Result<Prompt, ApiError> {
    match v {
        Value::String(s) => Ok(Prompt::Text(s.clone())),
        Value::Array(a) if a.iter().all(Value::is_number) => a
            .iter()
            .enumerate()
            .map(|(i, t)| {
                t.as_u64()
                    .filter(|&x| x <= u32::MAX as u64)
                    .map(|x| x as u32)
                    .ok_or_else(|| {
                        ApiError::bad_request(format!("'{key}[{i}]' = {t} is not a token id"))
                    })
            })
            .collect::<Result<Vec<u32>, _>>()
            .map(Prompt::Tokens),
        // One prompt in a list (OpenAI's `prompt: ["..."]`).
        Value::Array(a) if a.len() == 1 => prompt_value(&a[0], key),
        Value::Array(a) if a.is_empty() => Err(ApiError::bad_request(format!("'{key}' is empty"))),
        Value::Array(_) => Err(ApiError::bad_request(format!(
            "'{key}' has several prompts; this server takes one prompt per request"
        ))),
        v => Err(wrong(key, "a string or an array of token ids", v)),
    }
}
