//! Request bodies read field by field from JSON, so that every wrong type, range or shape is a
//! 400 that names the field (never a panic, never a 500).

use serde_json::{Map, Value};

use super::error::ApiError;
use crate::runtime::sampler::{ProbsRequest, SamplerConfig};
use crate::tokenizer::Tokenizer;

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
    /// Choices (`n`).
    pub n: usize,
    /// Per-token probabilities (`n_probs`; chat `logprobs`/`top_logprobs`; `/v1/completions`
    /// `logprobs: N`).
    pub probs: Option<ProbsRequest>,
}

/// Which endpoint reads the body: the fields differ (chat's `logprobs` is a boolean,
/// `/v1/completions`' a count; `/completion` has `n_probs`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Endpoint {
    Chat,
    OpenAiCompletion,
    Completion,
}

/// llama-server fields tern does not implement: a request that sets one gets a 400 naming it
/// (with the value that would change nothing accepted).
const NOT_IMPLEMENTED: &[(&str, &str)] = &[
    ("samplers", "a custom sampler order"),
    ("adaptive_target", "the adaptive-p sampler"),
    ("adaptive_decay", "the adaptive-p sampler"),
    ("n_keep", "context shifting"),
    ("n_discard", "context shifting"),
    ("t_max_predict_ms", "a generation time limit"),
    ("t_max_prompt_ms", "a prompt time limit"),
    ("n_indent", "indentation stops"),
    ("grammar_lazy", "lazy grammars"),
    ("grammar_triggers", "lazy grammars"),
    ("preserved_tokens", "lazy grammars"),
    (
        "image_data",
        "image input outside chat messages' image_url parts",
    ),
    (
        "multimodal_data",
        "image input outside chat messages' image_url parts",
    ),
    ("response_fields", "response field selection"),
    ("prediction", "predicted outputs"),
    ("audio", "audio output"),
    ("web_search_options", "web search"),
];

fn check_not_implemented(m: &Obj) -> Result<(), ApiError> {
    for (key, what) in NOT_IMPLEMENTED {
        let Some(v) = field(m, key) else { continue };
        let harmless = match (*key, v) {
            ("n_keep" | "n_discard" | "n_indent" | "t_max_predict_ms" | "t_max_prompt_ms", _) => {
                v.as_i64().is_some_and(|x| x <= 0)
            }
            ("grammar_lazy", Value::Bool(false)) => true,
            (_, Value::Array(a)) => a.is_empty(),
            _ => false,
        };
        if !harmless {
            return Err(ApiError::bad_request(format!(
                "'{key}' is not supported by this server ({what} is not implemented)"
            )));
        }
    }
    // Ollama's top-level image list: the model would never see it (the seeds' deployment
    // counted it in prompt_tokens all the same), so it is refused rather than dropped.
    match field(m, "images") {
        None | Some(Value::Null) => {}
        Some(Value::Array(a)) if a.is_empty() => {}
        Some(_) => {
            return Err(ApiError::bad_request(
                "'images' (a top-level list of images) is not read: send each image as an image_url part of a message's content, {\"type\": \"image_url\", \"image_url\": {\"url\": \"data:image/png;base64,...\"}}",
            ))
        }
    }
    if let Some(id) = opt_i64(m, "id_slot")? {
        if id >= 0 {
            return Err(ApiError::bad_request(format!(
                "'id_slot' = {id}: choosing a slot is not supported (the server picks the slot that reuses the most of the prompt)"
            )));
        }
    }
    Ok(())
}

fn set_f32(m: &Obj, key: &str, dst: &mut f32) -> Result<(), ApiError> {
    if let Some(v) = opt_f32(m, key)? {
        *dst = v;
    }
    Ok(())
}

/// A count where -1 means "the whole context" (llama-server's `*_last_n`).
fn last_n(m: &Obj, key: &str, dst: &mut usize) -> Result<(), ApiError> {
    if let Some(n) = opt_i64(m, key)? {
        if n < -1 {
            return Err(ApiError::bad_request(format!(
                "'{key}' = {n} must be -1 (the whole context), 0 (off) or positive"
            )));
        }
        *dst = if n == -1 { usize::MAX } else { n as usize };
    }
    Ok(())
}

/// `logit_bias`: OpenAI's object of token-id keys, or llama-server's `[[id, bias]]`,
/// `[["text", bias]]` (every token of the text) and `false` (ban).
pub fn logit_bias(m: &Obj, tok: &Tokenizer) -> Result<Vec<(u32, f32)>, ApiError> {
    let n_vocab = tok.n_vocab();
    let bias_of = |key: &str, v: &Value| -> Result<f32, ApiError> {
        match v {
            Value::Bool(false) => Ok(f32::NEG_INFINITY),
            Value::Number(n) => n
                .as_f64()
                .filter(|x| x.is_finite())
                .map(|x| x as f32)
                .ok_or_else(|| ApiError::bad_request(format!("'{key}' = {n} is not a bias"))),
            v => Err(wrong(key, "a number or false", v)),
        }
    };
    let id_of = |key: &str, t: i64| -> Result<u32, ApiError> {
        if t < 0 || t as usize >= n_vocab {
            return Err(ApiError::bad_request(format!(
                "'{key}': token id {t} is outside the vocabulary (n_vocab {n_vocab})"
            )));
        }
        Ok(t as u32)
    };
    let mut out = Vec::new();
    match field(m, "logit_bias") {
        None => {}
        Some(Value::Object(o)) => {
            for (k, v) in o {
                let key = format!("logit_bias.{k}");
                let t: i64 = k.trim().parse().map_err(|_| {
                    ApiError::bad_request(format!("'{key}': the key must be a token id"))
                })?;
                out.push((id_of(&key, t)?, bias_of(&key, v)?));
            }
        }
        Some(Value::Array(a)) => {
            for (i, e) in a.iter().enumerate() {
                let key = format!("logit_bias[{i}]");
                let Some([what, b]) = e.as_array().map(Vec::as_slice) else {
                    return Err(wrong(&key, "a pair [token id or text, bias]", e));
                };
                let bias = bias_of(&key, b)?;
                match what {
                    Value::Number(n) => {
                        let t = n.as_i64().ok_or_else(|| {
                            ApiError::bad_request(format!("'{key}': {n} is not a token id"))
                        })?;
                        out.push((id_of(&key, t)?, bias));
                    }
                    Value::String(text) => {
                        let ids = tok
                            .encode(text, false, false)
                            .map_err(|e| ApiError::bad_request(format!("'{key}': {e}")))?;
                        out.extend(ids.into_iter().map(|t| (t, bias)));
                    }
                    v => return Err(wrong(&key, "a token id or a text", v)),
                }
            }
        }
        Some(v) => return Err(wrong("logit_bias", "an object or an array of pairs", v)),
    }
    Ok(out)
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
pub fn gen_params(
    m: &Obj,
    d: &GenDefaults,
    max_keys: &[&str],
    tok: &Tokenizer,
    endpoint: Endpoint,
) -> Result<GenParams, ApiError> {
    check_not_implemented(m)?;
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
    set_f32(m, "top_p", &mut s.top_p)?;
    set_f32(m, "min_p", &mut s.min_p)?;
    if let Some(v) = opt_f32(m, "typical_p")?.or(opt_f32(m, "typ_p")?) {
        s.typical_p = v;
    }
    set_f32(m, "top_n_sigma", &mut s.top_n_sigma)?;
    set_f32(m, "xtc_probability", &mut s.xtc_probability)?;
    set_f32(m, "xtc_threshold", &mut s.xtc_threshold)?;
    set_f32(m, "dynatemp_range", &mut s.dynatemp_range)?;
    set_f32(m, "dynatemp_exponent", &mut s.dynatemp_exponent)?;
    set_f32(m, "repeat_penalty", &mut s.repeat_penalty)?;
    set_f32(m, "presence_penalty", &mut s.presence_penalty)?;
    set_f32(m, "frequency_penalty", &mut s.frequency_penalty)?;
    last_n(m, "repeat_last_n", &mut s.penalty_last_n)?;
    set_f32(m, "dry_multiplier", &mut s.dry_multiplier)?;
    set_f32(m, "dry_base", &mut s.dry_base)?;
    if let Some(n) = opt_i64(m, "dry_allowed_length")? {
        s.dry_allowed_length = n.max(0) as usize;
    }
    last_n(m, "dry_penalty_last_n", &mut s.dry_penalty_last_n)?;
    let breakers: Vec<String> = match field(m, "dry_sequence_breakers") {
        None => crate::runtime::sampler::DRY_BREAKERS
            .iter()
            .map(|b| b.to_string())
            .collect(),
        Some(Value::Array(a)) => a
            .iter()
            .enumerate()
            .map(|(i, v)| match v {
                Value::String(b) => Ok(b.clone()),
                v => Err(wrong(&format!("dry_sequence_breakers[{i}]"), "a string", v)),
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(wrong("dry_sequence_breakers", "an array of strings", v)),
    };
    if let Some(v) = opt_i64(m, "mirostat")? {
        if !(0..=2).contains(&v) {
            return Err(ApiError::bad_request(format!(
                "'mirostat' = {v} must be 0 (off), 1 or 2"
            )));
        }
        s.mirostat = v as u8;
    }
    set_f32(m, "mirostat_tau", &mut s.mirostat_tau)?;
    set_f32(m, "mirostat_eta", &mut s.mirostat_eta)?;
    if let Some(k) = opt_i64(m, "min_keep")? {
        s.min_keep = k.max(0) as usize;
    }
    s.logit_bias = logit_bias(m, tok)?;
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
    if s.dry_multiplier > 0.0 && s.dry_base >= 1.0 && s.dry_penalty_last_n > 0 {
        let piece = |id: u32| tok.decode_bytes(&[id], false).unwrap_or_default();
        let enc = |t: &str| tok.encode(t, false, false).unwrap_or_default();
        s.dry_breakers =
            crate::runtime::sampler::dry_breakers(&breakers, &piece, tok.n_vocab(), &enc);
    }
    let n = match opt_i64(m, "n")? {
        None => 1,
        Some(n) if n < 1 => {
            return Err(ApiError::bad_request(format!(
                "'n' = {n} must be at least 1"
            )))
        }
        Some(n) if n > 1 && endpoint == Endpoint::Completion => {
            return Err(ApiError::bad_request(format!(
                "'n' = {n}: /completion returns one completion; use /v1/completions or /v1/chat/completions for several choices"
            )))
        }
        Some(n) => n.min(1024) as usize,
    };
    let post_sampling = opt_bool(m, "post_sampling_probs")?.unwrap_or(false);
    let count = |key: &str, n: i64| -> Result<usize, ApiError> {
        if !(0..=1024).contains(&n) {
            return Err(ApiError::bad_request(format!(
                "'{key}' = {n} must be between 0 and 1024"
            )));
        }
        Ok(n as usize)
    };
    let n_probs = match endpoint {
        Endpoint::Chat => {
            let top = opt_i64(m, "top_logprobs")?;
            match (opt_bool(m, "logprobs")?, top) {
                // llama-server reports 20 alternatives when top_logprobs is not given.
                (Some(true), t) => Some(count("top_logprobs", t.unwrap_or(20))?),
                (_, Some(_)) => {
                    return Err(ApiError::bad_request(
                        "'top_logprobs' requires 'logprobs' to be true",
                    ))
                }
                _ => None,
            }
        }
        Endpoint::OpenAiCompletion => match field(m, "logprobs") {
            None => opt_i64(m, "n_probs")?
                .filter(|&n| n > 0)
                .map(|n| count("n_probs", n))
                .transpose()?,
            Some(Value::Bool(b)) => b.then_some(1),
            Some(_) => Some(count("logprobs", opt_i64(m, "logprobs")?.unwrap_or(0))?),
        },
        Endpoint::Completion => opt_i64(m, "n_probs")?
            .filter(|&n| n > 0)
            .map(|n| count("n_probs", n))
            .transpose()?,
    };
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
        n,
        probs: n_probs.map(|n| ProbsRequest { n, post_sampling }),
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

pub fn prompt_value(v: &Value, key: &str) -> Result<Prompt, ApiError> {
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
