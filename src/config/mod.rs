//! The settings of `serve`, `generate`, `fit` and `config`: one schema for the flags, the
//! `LLAMA_ARG_*` environment and the YAML config (`--config tern.yaml`).
//!
//! [`Settings`] is both the clap argument group and the serde struct, so a flag and a config
//! key cannot drift apart: the YAML keys are the flag names without the dashes (`ctx-size`,
//! `cache-type-k`, `spec-draft-n-max`, ...) as llama-server spells them
//! (server-contract.md), plus tern's own (`backend`, `device-mib`, `margin-mib`,
//! `log-format`). llama-server's other spellings, its short forms (`-np`, `-ngl`, `-ctk`) and
//! the flags that change nothing in tern or are refused go through the table in [`flags`],
//! from the command line, the environment and the YAML alike.
//!
//! Every field is optional so that merging is simple and total. Precedence: flag over
//! environment over config file over default ([`Sources`]); `tern config --print --explain`
//! shows where each value came from. Unknown keys and bad values are errors that name them.
//!
//! Relative paths in a config file (`model`, `mmproj`, `chat-template-file`, `api-key-file`,
//! `ui-config-file`, `log-file`, the adapters of `lora-scaled`) are relative to the file's directory; relative
//! paths in flags and variables are relative to the working directory.

pub mod flags;

use std::cell::RefCell;
use std::collections::BTreeMap;
use std::fmt;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};
use serde_json::{Map, Value};

pub use flags::{FlagError, Note, Origin};

use crate::plan::{BackendKind, FlashAttn, KvType, Shape, SpecType};

/// A config file larger than this is not a tern config (and reading `/dev/zero` must end).
pub const MAX_CONFIG_BYTES: u64 = 1 << 20;

/// The most tokens `--image-min-tokens` / `--image-max-tokens` may name: llama.cpp multiplies
/// them by the pixels of a merged token (1024 for Qwen-VL) into an `int`, so a larger value
/// overflows there; 2^20 tokens is already a 32,768-pixel square.
pub const MAX_IMAGE_TOKENS: u64 = 1 << 20;

/// llama.cpp's thread-count ceiling (GGML_MAX_N_THREADS).
pub const MAX_THREADS: i64 = 512;

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("config {}: larger than {limit} bytes; a tern config is a short YAML file", path.display())]
    TooLarge { path: PathBuf, limit: u64 },
    /// A YAML error: `key` is the path of the offending key (`cache-type-v`,
    /// `lora-scaled[1]`), empty when the document itself is malformed.
    #[error("config {}: {}{message}", path.display(), if key.is_empty() { String::new() } else { format!("key `{key}`: ") })]
    Yaml {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error("{key}: {why}")]
    Invalid { key: &'static str, why: String },
    /// An invalid value given on the command line, named as it was spelled.
    #[error("{flag}: {why}")]
    InvalidFlag { flag: String, why: String },
    #[error("no model: pass --model FILE or set `model:` in the config")]
    NoModel,
    #[error("cannot write the settings as YAML: {0}")]
    Serialize(String),
    #[error(transparent)]
    Flag(#[from] FlagError),
    #[error("environment {var}: {message}")]
    Env { var: String, message: String },
}

/// `--reasoning-format none|deepseek|auto`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ReasoningFormat {
    Deepseek,
    None,
    /// llama.cpp's default: the template's own parser, which for Qwen3.5 is deepseek's split.
    Auto,
}

impl ReasoningFormat {
    /// Whether thinking goes to `reasoning_content`.
    pub fn extracts(self) -> bool {
        !matches!(self, ReasoningFormat::None)
    }
}

/// `--reasoning auto|on|off`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Reasoning {
    Auto,
    On,
    Off,
}

/// `--log-format text|json`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LogFormat {
    Text,
    Json,
}

/// `--log-colors on|off|auto`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum LogColors {
    On,
    Off,
    Auto,
}

/// `--n-gpu-layers auto|all|N`.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GpuLayers {
    Auto,
    All,
    N(i64),
}

impl FromStr for GpuLayers {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s.trim() {
            "auto" => Ok(GpuLayers::Auto),
            "all" => Ok(GpuLayers::All),
            n => n
                .parse::<i32>()
                .map(|n| GpuLayers::N(n as i64))
                .map_err(|_| format!("{s:?} is not a layer count, 'auto' or 'all'")),
        }
    }
}

impl fmt::Display for GpuLayers {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuLayers::Auto => f.write_str("auto"),
            GpuLayers::All => f.write_str("all"),
            GpuLayers::N(n) => write!(f, "{n}"),
        }
    }
}

impl Serialize for GpuLayers {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        match self {
            GpuLayers::N(n) => s.serialize_i64(*n),
            other => s.serialize_str(&other.to_string()),
        }
    }
}

impl<'de> Deserialize<'de> for GpuLayers {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Raw {
            N(i64),
            S(String),
        }
        match Raw::deserialize(d)? {
            Raw::N(n) => Ok(GpuLayers::N(n)),
            Raw::S(s) => s.parse().map_err(serde::de::Error::custom),
        }
    }
}

/// `--lora-scaled FILE:SCALE`: one token, so a scale never reaches the engine without its
/// adapter. `SCALE` 0 is legal (inert but present).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraScaled {
    pub path: PathBuf,
    pub scale: f32,
}

impl FromStr for LoraScaled {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (file, scale) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("{s:?} is not FILE:SCALE"))?;
        if file.is_empty() {
            return Err(format!("{s:?} has no file before the ':'"));
        }
        let scale: f32 = scale
            .trim()
            .parse()
            .map_err(|_| format!("{s:?}: scale {scale:?} is not a number"))?;
        if !scale.is_finite() {
            return Err(format!("{s:?}: scale must be finite"));
        }
        Ok(LoraScaled {
            path: PathBuf::from(file),
            scale,
        })
    }
}

impl fmt::Display for LoraScaled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.path.display(), self.scale)
    }
}

impl<'de> Deserialize<'de> for LoraScaled {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for LoraScaled {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

/// A boolean flag's value, with llama.cpp's words for true and false.
fn bool_arg(s: &str) -> Result<bool, String> {
    flags::parse_bool(s).ok_or_else(|| {
        format!("{s:?} is not a boolean (true/false, on/off, 1/0, enabled/disabled)")
    })
}

/// `--fit-target MiB0,MiB1,...`: tern runs on one device, so the first figure.
fn mib_arg(s: &str) -> Result<u64, String> {
    let first = s.split(',').next().unwrap_or("").trim();
    first
        .parse()
        .map_err(|_| format!("{s:?} is not a number of MiB"))
}

/// The settings, as flags and as YAML keys. `None` = not set here (a default applies later, or
/// another source sets it). The doc comment of a field is its `--help` line; the spellings in
/// parentheses are llama-server's other names for it.
#[derive(Clone, Debug, Default, PartialEq, clap::Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Settings {
    /// GGUF model file (default: the bundled demo model).
    #[arg(long, short = 'm')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<PathBuf>,
    /// Model names for the API, comma-separated; the first in sorted order is the id
    /// (default: the file name).
    #[arg(long, short = 'a')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// Model tags for /v1/models, comma-separated (informational).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub tags: Option<String>,
    /// Address to bind (default 127.0.0.1).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Port to listen on (default 8080; 0 picks a free one).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// Serve every route under this prefix (e.g. /llm).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_prefix: Option<String>,
    /// KV pool in tokens across all slots, each slot getting ctx-size / parallel; 0 = the
    /// model's trained context (default 4096 per slot, at most the trained context).
    #[arg(long, short = 'c')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ctx_size: Option<u64>,
    /// Tokens per slot when --ctx-size is not given: the pool is parallel × this.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub kv_unified_per_slot: Option<u64>,
    /// Slots decoded together (-np; default 1; -1 = auto, which is 1 here).
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel: Option<i64>,
    /// Tokens to generate when a request does not say (-n, --predict; default -1 = until the
    /// slot window is full; 0 = evaluate the prompt only).
    #[arg(long, short = 'n', allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_predict: Option<i64>,
    /// K cache dtype (-ctk; default f16).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_type_k: Option<KvType>,
    /// V cache dtype (-ctv; default f16); q8_0/q4_0 need flash attention.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_type_v: Option<KvType>,
    /// Flash attention (-fa; default auto).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flash_attn: Option<FlashAttn>,
    /// Logical batch (default 2048).
    #[arg(long, short = 'b')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u64>,
    /// Physical micro-batch (-ub; default 512): sizes the compute buffers.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ubatch_size: Option<u64>,
    /// Layers on the device (-ngl; auto|all|N): tern runs every layer on the backend's device,
    /// so any value but 0 changes nothing; 0 keeps the model on the CPU (--backend cpu).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_gpu_layers: Option<GpuLayers>,
    /// CPU threads for single-token decode steps (-t; default: all cores; <= 0 = all cores).
    #[arg(long, short = 't', allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads: Option<i64>,
    /// CPU threads for prompt and multi-token steps (-tb; default: --threads).
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads_batch: Option<i64>,
    /// Threads answering HTTP (default: the CPU count; <= 0 = the CPU count).
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub threads_http: Option<i64>,
    /// A chat template: `chatml`, or Jinja source (default: the model's own).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template: Option<String>,
    /// A chat template file instead of the model's.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template_file: Option<PathBuf>,
    /// Extra template variables for every request, as a JSON object
    /// ('{"enable_thinking":false}'); a request's own chat_template_kwargs win.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template_kwargs: Option<String>,
    /// Where thinking goes: deepseek/auto = message.reasoning_content, none = in content.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_format: Option<ReasoningFormat>,
    /// Thinking on, off, or as the template decides (-rea).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Reasoning>,
    /// reasoning_effort for the template ('default' keeps the template's own).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_effort: Option<String>,
    /// Thinking tokens before the thinking block is closed (-1 = unrestricted, 0 = at once).
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_budget: Option<i64>,
    /// Text injected before the end-of-thinking tag when the budget runs out.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_budget_message: Option<String>,
    /// The template's preserve_reasoning variable (default true, as llama-server).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_preserve: Option<bool>,
    /// Put everything the model says in content: no reasoning or tool-call parsing.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub skip_chat_parsing: Option<bool>,
    /// Serve /metrics (Prometheus); 501 otherwise.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<bool>,
    /// Serve /v1/embeddings and /embedding.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub embeddings: Option<bool>,
    /// How an embedding pools the prompt's rows (default last, qwen35's).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pooling: Option<crate::runtime::engine::Pooling>,
    /// Serve /slots (default true; --no-slots answers 501).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub slots: Option<bool>,
    /// Accept POST /props (default false: 501).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub props: Option<bool>,
    /// The web UI at / (--ui; default true; --no-webui answers 404 there).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub webui: Option<bool>,
    /// JSON of the web UI's default settings (over its own; /props `ui_settings`).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ui_config: Option<String>,
    /// A file holding the web UI's default settings as JSON (--ui-config wins over it).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ui_config_file: Option<PathBuf>,
    /// Reuse a slot's cached prefix (default true; a request's cache_prompt wins).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_prompt: Option<bool>,
    /// HTTP read/write timeout in seconds (-to; default 3600).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub timeout: Option<u64>,
    /// Seconds of silence before an SSE stream gets a `:` ping (default 30; -1 = never).
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub sse_ping_interval: Option<i64>,
    /// Vision projector GGUF (-mm): loaded at boot on the model's backend; chat requests may
    /// then carry image_url parts.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mmproj: Option<PathBuf>,
    /// The fewest tokens an image is brought to (llama.cpp's size rule scales a smaller one
    /// up); 0 or less keeps the projector's own (8 for Qwen-VL).
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_min_tokens: Option<i64>,
    /// The most tokens an image is brought to (a larger one is scaled down); 0 or less keeps
    /// the projector's own (4096 for Qwen-VL). The planner prices the encoder for this size.
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_max_tokens: Option<i64>,
    /// LoRA adapter and its scale as one token, FILE:SCALE (repeatable or comma-separated).
    /// `--lora FILE` is `--lora-scaled FILE:1`, in its place among them (the adapters' ids
    /// follow the command line's order, as llama-server numbers them).
    #[arg(long, value_name = "FILE:SCALE", value_delimiter = ',')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora_scaled: Option<Vec<LoraScaled>>,
    /// YAML only: LoRA adapters at scale 1, numbered before those of `lora-scaled` (on the
    /// command line `--lora` joins the `--lora-scaled` list in order).
    #[arg(skip)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora: Option<Vec<PathBuf>>,
    /// Load the LoRA adapters with every global scale at 0 (set them with POST /lora-adapters).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora_init_without_apply: Option<bool>,
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency_penalty: Option<f32>,
    /// Repetition penalty (default 1.0 = off).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeat_penalty: Option<f32>,
    /// Recent tokens the penalties look at (default 64; 0 = off).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repeat_last_n: Option<i64>,
    /// Sampling temperature (--temperature).
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temp: Option<f32>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i32>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Sampling seed; -1 = random.
    #[arg(long, short = 's', allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Keep generating past end-of-generation tokens.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ignore_eos: Option<bool>,
    /// Default stop strings for requests that give none (repeatable).
    #[arg(long, short = 'r')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reverse_prompt: Option<Vec<String>>,
    /// Render special tokens (<|im_end|>, <think>) in the output text (-sp).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub special: Option<bool>,
    /// Speculative decoding: draft-mtp (the file's MTP head) or none (default).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_type: Option<SpecType>,
    /// Draft depth (default 3, llama.cpp's); each slot keeps 1 + this many recurrent-state
    /// copies, and a slot never drafts past its window.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_draft_n_max: Option<u64>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_draft_n_min: Option<u64>,
    /// Minimum draft probability (--draft-p-min; default 0).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_draft_p_min: Option<f32>,
    /// Adapt each slot's draft depth to its measured acceptance and step costs, down to plain
    /// decoding when drafting does not pay (default true; false drafts n-max every step, as
    /// llama.cpp does).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_adaptive: Option<bool>,
    /// Draft (MTP) K cache dtype (-ctkd; default f16).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_draft_type_k: Option<KvType>,
    /// Draft (MTP) V cache dtype (-ctvd; default f16).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_draft_type_v: Option<KvType>,
    /// API keys, comma-separated; requests must carry one as a Bearer token (env LLAMA_API_KEY).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    /// A file of API keys, one per line ('#' starts a comment line).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key_file: Option<PathBuf>,
    /// CORS allowed origins, comma-separated, or 'localhost' (default *).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cors_origins: Option<String>,
    /// CORS allowed methods (default "GET, POST, DELETE, OPTIONS").
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cors_methods: Option<String>,
    /// CORS allowed headers (default *).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cors_headers: Option<String>,
    /// CORS credentials (default true).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cors_credentials: Option<bool>,
    /// Log threshold: 0 output only, 1 errors, 2 warnings, 3 info (default), 4 more (the full
    /// memory ledger), 5 debug (-lv, --verbosity).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_verbosity: Option<u32>,
    /// Log everything (-v, --log-verbose).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub verbose: Option<bool>,
    /// No logs at all.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_disable: Option<bool>,
    /// Also write the logs to this file (appended).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_file: Option<PathBuf>,
    /// Log lines as text (default) or JSON objects (--log-jsonl).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_format: Option<LogFormat>,
    /// Colored text logs (default auto: on a terminal).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_colors: Option<LogColors>,
    /// Timestamps on text log lines (default true).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_timestamps: Option<bool>,
    /// The level on text log lines (default true).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_prefix: Option<bool>,
    /// Backend (default auto).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<BackendKind>,
    /// The CPU backend's f32 reference matmuls (default false: int8 activations against
    /// quantized weights, as llama.cpp; `tern logits` takes the reference unless
    /// `--cpu-exact=false`).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cpu_exact: Option<bool>,
    /// Whether the CPU serving path lays Q8_0, PQ2_0 and PTQ1_0 matrices out once at load for
    /// its int8 kernels (default true; `--no-repack` reads every weight in place from the file,
    /// the smallest footprint: a packed PTQ1_0 matrix takes 34 bytes a block for the file's 28).
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL", value_parser = bool_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub repack: Option<bool>,
    /// The device memory budget in MiB (the driver's free figure); required for wgpu until tern
    /// queries it.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_mib: Option<u64>,
    /// MiB kept free beyond the priced total (-fitt, --fit-target; default 1024).
    #[arg(long, value_parser = mib_arg)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub margin_mib: Option<u64>,
    /// The largest request body in MiB (default 32): a larger one is a 413.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_body_mb: Option<u64>,
    /// Seconds a SIGTERM lets running requests finish before they are cut (default 30).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub drain_timeout: Option<u64>,
    /// Open HTTP connections at most (default 8192, and no more than the descriptor limit
    /// allows); past it new connections wait in the listen backlog.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_connections: Option<u64>,
    /// Seconds a client has to send a request head, and an idle keep-alive connection to send
    /// its next one (default 30; `--timeout` still bounds the body and each write).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub header_timeout: Option<u64>,
}

/// Parses one `--key=value` into an otherwise empty [`Settings`] (the environment's values).
#[derive(clap::Parser)]
#[command(no_binary_name = true)]
struct One {
    #[command(flatten)]
    s: Settings,
}

fn to_map(s: &Settings) -> Map<String, Value> {
    match serde_json::to_value(s) {
        Ok(Value::Object(m)) => m,
        _ => Map::new(),
    }
}

fn from_map(m: Map<String, Value>) -> Result<Settings, String> {
    serde_json::from_value(Value::Object(m)).map_err(|e| e.to_string())
}

impl Settings {
    /// Every key, in schema order (the long flag names).
    pub fn keys() -> Vec<String> {
        use clap::{Args, Command};
        Settings::augment_args(Command::new("settings"))
            .get_arguments()
            .filter_map(|a| a.get_long().map(str::to_string))
            .collect()
    }

    /// Reads and parses a YAML config file, resolving its relative paths against its
    /// directory, and validates it. Keys that llama-server accepts but that change nothing
    /// here are dropped; [`Settings::load_with_notes`] also returns why.
    pub fn load(path: impl AsRef<Path>) -> Result<Settings, ConfigError> {
        Ok(Settings::load_with_notes(path)?.0)
    }

    /// [`Settings::load`], with the warnings for accepted keys that change nothing.
    pub fn load_with_notes(path: impl AsRef<Path>) -> Result<(Settings, Vec<Note>), ConfigError> {
        let path = path.as_ref();
        let read_err = |source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        };
        if path.is_dir() {
            return Err(read_err(std::io::Error::other(
                "is a directory; give the YAML file",
            )));
        }
        let f = std::fs::File::open(path).map_err(read_err)?;
        let mut bytes = Vec::new();
        f.take(MAX_CONFIG_BYTES + 1)
            .read_to_end(&mut bytes)
            .map_err(read_err)?;
        if bytes.len() as u64 > MAX_CONFIG_BYTES {
            return Err(ConfigError::TooLarge {
                path: path.to_path_buf(),
                limit: MAX_CONFIG_BYTES,
            });
        }
        let text = String::from_utf8(bytes).map_err(|e| ConfigError::Yaml {
            path: path.to_path_buf(),
            key: String::new(),
            message: format!("not UTF-8 text: {e}"),
        })?;
        let (mut s, notes) = Settings::from_yaml_with_notes(&text, path)?;
        if let Some(dir) = path.parent() {
            s.resolve_relative_to(dir);
        }
        s.validate()?;
        Ok((s, notes))
    }

    /// Parses YAML text (`origin` names the source in errors). Unknown keys, duplicate keys,
    /// wrong types and bad enum values are errors naming the key.
    pub fn from_yaml(text: &str, origin: &Path) -> Result<Settings, ConfigError> {
        Ok(Settings::from_yaml_with_notes(text, origin)?.0)
    }

    fn from_yaml_strict(text: &str, origin: &Path) -> Result<Settings, ConfigError> {
        let key = RefCell::new(String::new());
        let r: Result<Settings, serde_saphyr::Error> =
            serde_saphyr::with_deserializer_from_str(text, |de| {
                serde_path_to_error::deserialize(de).map_err(|e| {
                    let p = e.path().to_string();
                    *key.borrow_mut() = if p == "." { String::new() } else { p };
                    e.into_inner()
                })
            });
        r.map_err(|e| ConfigError::Yaml {
            path: origin.to_path_buf(),
            key: key.into_inner(),
            message: e.to_string(),
        })
    }

    /// [`Settings::from_yaml`], with the warnings for keys that llama-server accepts and that
    /// change nothing here (`jinja: true`, `cont-batching: true`). llama-server's other
    /// spellings of a key are read as the key (`temperature` is `temp`); a key it would
    /// refuse is an error naming it.
    pub fn from_yaml_with_notes(
        text: &str,
        origin: &Path,
    ) -> Result<(Settings, Vec<Note>), ConfigError> {
        let strict = match Settings::from_yaml_strict(text, origin) {
            Ok(s) => return Ok((s, Vec::new())),
            Err(e) => e,
        };
        let unknown_key = matches!(&strict, ConfigError::Yaml { message, .. } if message.contains("unknown field"));
        if !unknown_key {
            return Err(strict);
        }
        let Ok(Value::Object(doc)) = serde_saphyr::from_str::<Value>(text) else {
            return Err(strict);
        };
        let known = Settings::keys();
        let yaml_err = |key: &str, message: String| ConfigError::Yaml {
            path: origin.to_path_buf(),
            key: key.to_string(),
            message,
        };
        let mut out = Map::new();
        let mut notes = Vec::new();
        for (k, mut v) in doc {
            // YAML 1.1 reads `on`/`off` as booleans; these keys take them as words.
            if let (true, Some(b)) = (
                matches!(k.as_str(), "flash-attn" | "log-colors" | "reasoning"),
                v.as_bool(),
            ) {
                v = Value::String(if b { "on" } else { "off" }.into());
            }
            if known.contains(&k) {
                if out.contains_key(&k) {
                    return Err(yaml_err(&k, "set twice (under two of its names)".into()));
                }
                out.insert(k, v);
                continue;
            }
            let file_origin = Origin::File {
                path: origin.display().to_string(),
                key: k.clone(),
            };
            let (to, value) = match flags::yaml_key(&k, v.as_bool()) {
                flags::YamlKey::Unknown => return Err(strict),
                flags::YamlKey::Rename(to) => (to, v),
                flags::YamlKey::SetTo(to, fixed) => (to, Value::String(fixed.into())),
                flags::YamlKey::Negate(to) => match v.as_bool() {
                    Some(b) => (to, Value::Bool(!b)),
                    None => return Err(yaml_err(&k, "expected a boolean".into())),
                },
                flags::YamlKey::Warn(why) => {
                    notes.push(Note {
                        origin: file_origin,
                        why: why.to_string(),
                    });
                    continue;
                }
                flags::YamlKey::Refuse(why) => {
                    return Err(ConfigError::Flag(FlagError::Refused {
                        origin: file_origin,
                        why: why.to_string(),
                    }))
                }
            };
            if out.contains_key(to) {
                return Err(yaml_err(
                    &k,
                    format!("sets `{to}`, which the file already sets"),
                ));
            }
            out.insert(to.to_string(), value);
        }
        let key = RefCell::new(String::new());
        let r: Result<Settings, serde_json::Error> =
            serde_path_to_error::deserialize(Value::Object(out)).map_err(|e| {
                *key.borrow_mut() = e.path().to_string();
                e.into_inner()
            });
        let s = r.map_err(|e| yaml_err(&key.into_inner(), e.to_string()))?;
        Ok((s, notes))
    }

    /// The settings as YAML (the keys that are set, in schema order). The API key is
    /// redacted.
    pub fn to_yaml(&self) -> Result<String, ConfigError> {
        let s = self.redacted();
        let y = serde_saphyr::to_string(&s).map_err(|e| ConfigError::Serialize(e.to_string()))?;
        Ok(if y.trim() == "{}" { String::new() } else { y })
    }

    fn redacted(&self) -> Settings {
        let mut s = self.clone();
        if s.api_key.is_some() {
            s.api_key = Some("<redacted>".into());
        }
        s
    }

    /// `self` overridden by every field `over` sets.
    pub fn merge(self, over: Settings) -> Settings {
        let mut base = to_map(&self);
        base.extend(to_map(&over));
        from_map(base).unwrap_or(over)
    }

    fn resolve_relative_to(&mut self, dir: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        };
        for p in [
            &mut self.model,
            &mut self.mmproj,
            &mut self.chat_template_file,
            &mut self.api_key_file,
            &mut self.ui_config_file,
            &mut self.log_file,
        ]
        .into_iter()
        .flatten()
        {
            fix(p);
        }
        for l in self.lora_scaled.iter_mut().flatten() {
            fix(&mut l.path);
        }
        for p in self.lora.iter_mut().flatten() {
            fix(p);
        }
    }

    /// Value checks that the types alone do not make (ranges, pairs that must agree), with
    /// llama.cpp's ranges where it has them.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let bad = |key: &'static str, why: String| Err(ConfigError::Invalid { key, why });
        let unit = |key: &'static str, v: Option<f32>| match v {
            Some(x) if !(0.0..=1.0).contains(&x) => bad(key, format!("{x} is outside [0, 1]")),
            _ => Ok(()),
        };
        unit("top-p", self.top_p)?;
        unit("min-p", self.min_p)?;
        unit("spec-draft-p-min", self.spec_draft_p_min)?;
        if let Some(t) = self.temp {
            if !t.is_finite() {
                return bad("temp", format!("{t} must be a finite number"));
            }
        }
        for (key, v) in [
            ("presence-penalty", self.presence_penalty),
            ("frequency-penalty", self.frequency_penalty),
        ] {
            if let Some(p) = v {
                if !(-2.0..=2.0).contains(&p) {
                    return bad(key, format!("{p} is outside [-2, 2]"));
                }
            }
        }
        if let Some(p) = self.repeat_penalty {
            if !(p.is_finite() && p > 0.0 && (1.0 / p).is_finite()) {
                return bad(
                    "repeat-penalty",
                    format!("{p} must be finite and greater than 0"),
                );
            }
        }
        if let Some(n) = self.repeat_last_n {
            if !(0..=i32::MAX as i64).contains(&n) {
                return bad("repeat-last-n", format!("{n} must be in 0..={}", i32::MAX));
            }
        }
        if let Some(s) = self.seed {
            if !(-1..=u32::MAX as i64).contains(&s) {
                return bad(
                    "seed",
                    format!("{s} must be -1 (random) or in 0..={}", u32::MAX),
                );
            }
        }
        let int32 = i32::MAX as u64;
        for (key, v, min) in [
            ("ctx-size", self.ctx_size, 0),
            ("batch-size", self.batch_size, 1),
            ("ubatch-size", self.ubatch_size, 1),
            ("kv-unified-per-slot", self.kv_unified_per_slot, 1),
            ("spec-draft-n-max", self.spec_draft_n_max, 0),
            ("spec-draft-n-min", self.spec_draft_n_min, 0),
            ("timeout", self.timeout, 0),
            ("max-body-mb", self.max_body_mb, 1),
            ("drain-timeout", self.drain_timeout, 0),
            ("max-connections", self.max_connections, 1),
            ("header-timeout", self.header_timeout, 1),
        ] {
            if let Some(v) = v {
                if v < min || v > int32 {
                    return bad(key, format!("{v} must be in {min}..={int32}"));
                }
            }
        }
        if let Some(p) = self.parallel {
            if p == 0 || !(-1..=MAX_THREADS * 16).contains(&p) {
                return bad(
                    "parallel",
                    format!("{p} must be -1 (auto) or in 1..={}", MAX_THREADS * 16),
                );
            }
        }
        for (key, v) in [
            ("threads", self.threads),
            ("threads-batch", self.threads_batch),
            ("threads-http", self.threads_http),
        ] {
            if let Some(n) = v {
                if n > MAX_THREADS {
                    return bad(
                        key,
                        format!("{n} is more than {MAX_THREADS} threads (llama.cpp's GGML_MAX_N_THREADS)"),
                    );
                }
            }
        }
        for (key, v) in [
            ("n-predict", self.n_predict),
            ("reasoning-budget", self.reasoning_budget),
            ("sse-ping-interval", self.sse_ping_interval),
        ] {
            if let Some(n) = v {
                if !(-1..=i32::MAX as i64).contains(&n) {
                    return bad(key, format!("{n} must be -1 or in 0..={}", i32::MAX));
                }
            }
        }
        for (key, v) in [
            ("image-min-tokens", self.image_min_tokens),
            ("image-max-tokens", self.image_max_tokens),
        ] {
            if let Some(n) = v {
                if n > MAX_IMAGE_TOKENS as i64 {
                    return bad(
                        key,
                        format!(
                            "{n} is more than {MAX_IMAGE_TOKENS} tokens (0 or less keeps the \
                             projector's own limit)"
                        ),
                    );
                }
            }
        }
        if let (Some(lo), Some(hi)) = self.image_token_limits() {
            if hi < lo {
                return bad(
                    "image-max-tokens",
                    format!(
                        "{hi} is less than image-min-tokens {lo} (llama.cpp refuses the \
                         projector too: image_max_pixels is less than image_min_pixels)"
                    ),
                );
            }
        }
        if let (Some(lo), Some(hi)) = (self.spec_draft_n_min, self.spec_draft_n_max) {
            if lo > hi {
                return bad(
                    "spec-draft-n-min",
                    format!("{lo} exceeds spec-draft-n-max {hi}"),
                );
            }
        }
        if let (Some(c), Some(p)) = (self.ctx_size, self.parallel) {
            if p > 0 && c > 0 && c % p as u64 != 0 {
                let p = p as u64;
                return bad(
                    "ctx-size",
                    format!(
                        "{c} does not divide evenly by parallel {p}; use a multiple of {p}, e.g. {}",
                        c - c % p
                    ),
                );
            }
        }
        if let Some(k) = &self.chat_template_kwargs {
            match serde_json::from_str::<Value>(k) {
                Ok(Value::Object(_)) => {}
                Ok(_) => {
                    return bad(
                        "chat-template-kwargs",
                        format!("{k:?} is not a JSON object"),
                    )
                }
                Err(e) => {
                    return bad(
                        "chat-template-kwargs",
                        format!("{k:?} is not valid JSON: {e}"),
                    )
                }
            }
        }
        if let Some(p) = &self.api_prefix {
            if !p.is_empty() && (!p.starts_with('/') || p.ends_with('/')) {
                return bad(
                    "api-prefix",
                    format!("{p:?} must start with '/' and not end with one (e.g. /llm)"),
                );
            }
        }
        if let (Some(GpuLayers::N(0)), Some(b)) = (self.n_gpu_layers, self.backend) {
            if b != BackendKind::Cpu {
                return bad(
                    "n-gpu-layers",
                    format!(
                        "0 keeps every layer on the CPU, but --backend is {}",
                        b.name()
                    ),
                );
            }
        }
        Ok(())
    }

    /// The model file, required by everything that opens it.
    pub fn model_path(&self) -> Result<&Path, ConfigError> {
        self.model.as_deref().ok_or(ConfigError::NoModel)
    }

    /// `--image-min-tokens` / `--image-max-tokens` as set: `None` keeps the projector's own
    /// (llama.cpp reads a value of 0 or less as unset too).
    pub fn image_token_limits(&self) -> (Option<u64>, Option<u64>) {
        let set = |v: Option<i64>| v.filter(|&n| n > 0).map(|n| n as u64);
        (set(self.image_min_tokens), set(self.image_max_tokens))
    }

    /// Slots (`-1`, auto, is one).
    pub fn slots_n(&self) -> u64 {
        match self.parallel {
            Some(p) if p > 0 => p as u64,
            _ => 1,
        }
    }

    /// Whether the CPU backend runs its f32 reference matmuls (`--cpu-exact`).
    pub fn cpu_exact(&self) -> bool {
        self.cpu_exact.unwrap_or(false)
    }

    /// Whether the CPU serving path packs its matrices at load (`--repack`, default true).
    pub fn repack(&self) -> bool {
        self.repack.unwrap_or(true)
    }

    /// The backend: `--backend`, or the CPU for `-ngl 0`, or auto.
    pub fn backend_kind(&self) -> BackendKind {
        match (self.backend, self.n_gpu_layers) {
            (Some(b), _) => b,
            (None, Some(GpuLayers::N(0))) => BackendKind::Cpu,
            (None, _) => BackendKind::Auto,
        }
    }

    /// The shape these settings price (defaults: [`Shape::default`]). A pool of 0 (the model's
    /// trained context) and the per-slot default are settled at boot, where the model is known.
    pub fn shape(&self) -> Shape {
        let d = Shape::default();
        let parallel = self.slots_n();
        Shape {
            ctx_size: self
                .ctx_size
                .or(self.kv_unified_per_slot.map(|n| n.saturating_mul(parallel)))
                .unwrap_or(d.ctx_size),
            parallel,
            cache_type_k: self.cache_type_k.unwrap_or(d.cache_type_k),
            cache_type_v: self.cache_type_v.unwrap_or(d.cache_type_v),
            flash_attn: self.flash_attn.unwrap_or(d.flash_attn),
            spec: self.spec_type.unwrap_or(d.spec),
            draft_n_max: self.spec_draft_n_max.unwrap_or(d.draft_n_max),
            spec_draft_type_k: self.spec_draft_type_k.unwrap_or(d.spec_draft_type_k),
            spec_draft_type_v: self.spec_draft_type_v.unwrap_or(d.spec_draft_type_v),
            ubatch_size: self.ubatch_size.unwrap_or(d.ubatch_size),
            batch_size: self.batch_size.unwrap_or(d.batch_size),
            mmproj: self.mmproj.clone(),
            image_min_tokens: self.image_token_limits().0,
            image_max_tokens: self.image_token_limits().1,
            lora: self.adapters().into_iter().map(|l| l.path).collect(),
            backend: self.backend_kind(),
            cpu_exact: self.cpu_exact(),
            repack: self.repack(),
            margin_mib: self.margin_mib.unwrap_or(d.margin_mib),
        }
    }

    /// The LoRA adapters in id order with their boot scales: `lora` (scale 1), then
    /// `lora-scaled`; every scale 0 with `lora-init-without-apply`.
    pub fn adapters(&self) -> Vec<LoraScaled> {
        let zero = self.lora_init_without_apply == Some(true);
        self.lora
            .iter()
            .flatten()
            .map(|p| LoraScaled {
                path: p.clone(),
                scale: 1.0,
            })
            .chain(self.lora_scaled.iter().flatten().cloned())
            .map(|l| LoraScaled {
                scale: if zero { 0.0 } else { l.scale },
                ..l
            })
            .collect()
    }

    /// The API keys: `--api-key` (comma-separated) and the lines of `--api-key-file` that are
    /// neither empty nor comments, as llama-server reads them.
    pub fn api_keys(&self) -> Result<Vec<String>, ConfigError> {
        let mut keys: Vec<String> = self
            .api_key
            .iter()
            .flat_map(|k| k.split(','))
            .map(|k| k.trim().to_string())
            .filter(|k| !k.is_empty())
            .collect();
        if let Some(p) = &self.api_key_file {
            let text = std::fs::read_to_string(p).map_err(|e| ConfigError::Invalid {
                key: "api-key-file",
                why: format!("cannot read {}: {e}", p.display()),
            })?;
            keys.extend(
                text.lines()
                    .map(|l| l.trim_end_matches('\r'))
                    .filter(|l| !l.is_empty() && !l.starts_with('#'))
                    .map(str::to_string),
            );
        }
        Ok(keys)
    }

    /// The web UI's default settings (`--ui-config`, else `--ui-config-file`): JSON, served
    /// as /props `ui_settings`, an empty object when neither is given. Text that does not
    /// parse stops the boot, as in llama-server.
    pub fn ui_settings(&self) -> Result<Value, ConfigError> {
        let (key, text) = match (&self.ui_config, &self.ui_config_file) {
            (Some(t), _) => ("ui-config", t.clone()),
            (None, Some(p)) => (
                "ui-config-file",
                std::fs::read_to_string(p).map_err(|e| ConfigError::Invalid {
                    key: "ui-config-file",
                    why: format!("cannot read {}: {e}", p.display()),
                })?,
            ),
            (None, None) => return Ok(Value::Object(Map::new())),
        };
        serde_json::from_str(&text).map_err(|e| ConfigError::Invalid {
            key,
            why: format!("not JSON: {e}"),
        })
    }
}

/// Where the value of a key came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Source {
    Flag,
    Env(String),
    File(PathBuf),
    Default,
}

/// The settings from each source, before they are merged.
#[derive(Clone, Debug, Default)]
pub struct Sources {
    /// The config file and what it sets.
    pub file: Option<(PathBuf, Settings)>,
    /// What the environment sets, and which variable set each key.
    pub env: Settings,
    pub env_vars: BTreeMap<String, String>,
    pub flags: Settings,
    /// How the command line spelled each flag it set (`-ngl` for `n-gpu-layers`).
    pub spellings: BTreeMap<String, String>,
    /// Accepted flags, variables and keys that change nothing, with why.
    pub notes: Vec<Note>,
}

impl Sources {
    /// Reads the config file (when given) and the environment (`get`, usually
    /// `std::env::var`), beside the flags clap parsed and the notes of their rewrite.
    pub fn gather(
        config: Option<&Path>,
        get: &dyn Fn(&str) -> Option<String>,
        flags: Settings,
        given: flags::Rewritten,
    ) -> Result<Sources, ConfigError> {
        let flag_notes = given.notes;
        let mut notes = Vec::new();
        let file = match config {
            Some(p) => {
                let (s, n) = Settings::load_with_notes(p)?;
                notes.extend(n);
                Some((p.to_path_buf(), s))
            }
            None => None,
        };
        let from_env = flags::from_env(get)?;
        notes.extend(from_env.notes);
        let mut env = Settings::default();
        let mut env_vars = BTreeMap::new();
        for (var, arg) in from_env.args {
            let one = <One as clap::Parser>::try_parse_from([arg.as_str()]).map_err(|e| {
                let msg = e.to_string();
                let first = msg
                    .lines()
                    .next()
                    .unwrap_or("")
                    .trim_start_matches("error: ");
                ConfigError::Env {
                    var: var.clone(),
                    message: first.to_string(),
                }
            })?;
            for k in to_map(&one.s).keys() {
                env_vars.insert(k.clone(), var.clone());
            }
            env = env.merge(one.s);
        }
        env.validate().map_err(|e| match e {
            ConfigError::Invalid { key, why } => ConfigError::Env {
                var: env_vars
                    .get(key)
                    .cloned()
                    .unwrap_or_else(|| key.to_string()),
                message: format!("{key}: {why}"),
            },
            e => e,
        })?;
        notes.extend(flag_notes);
        Ok(Sources {
            file,
            env,
            env_vars,
            flags,
            spellings: given.spellings,
            notes,
        })
    }

    /// Only the flags (tests, embedding).
    pub fn of_flags(flags: Settings) -> Sources {
        Sources {
            flags,
            ..Default::default()
        }
    }

    /// The default, then the file, then the environment, then the flags.
    pub fn merged(&self) -> Settings {
        let base = self
            .file
            .as_ref()
            .map(|(_, s)| s.clone())
            .unwrap_or_default();
        base.merge(self.env.clone()).merge(self.flags.clone())
    }

    pub fn source_of(&self, key: &str) -> Source {
        if to_map(&self.flags).contains_key(key) {
            return Source::Flag;
        }
        if to_map(&self.env).contains_key(key) {
            return Source::Env(
                self.env_vars
                    .get(key)
                    .cloned()
                    .unwrap_or_else(|| "the environment".into()),
            );
        }
        if let Some((p, s)) = &self.file {
            if to_map(s).contains_key(key) {
                return Source::File(p.clone());
            }
        }
        Source::Default
    }

    fn origin_of(&self, key: &str, value: &str) -> Origin {
        match self.source_of(key) {
            Source::Flag | Source::Default => {
                let spelled = self
                    .spellings
                    .get(key)
                    .cloned()
                    .unwrap_or_else(|| format!("--{key}"));
                Origin::Flag(format!("{spelled} {value}"))
            }
            Source::Env(v) => Origin::Env(v),
            Source::File(p) => Origin::File {
                path: p.display().to_string(),
                key: key.to_string(),
            },
        }
    }

    /// The merged settings, validated, with the warnings of every accepted flag that changes
    /// nothing: the table's, and those that depend on the value (`-ngl 99`).
    pub fn resolve(&self) -> Result<Resolved, ConfigError> {
        let s = self.merged();
        s.validate().map_err(|e| self.name_source(e))?;
        let mut notes = self.notes.clone();
        if let Some(n) = s.n_gpu_layers {
            if n != GpuLayers::N(0) {
                notes.push(Note {
                    origin: self.origin_of("n-gpu-layers", &n.to_string()),
                    why: "tern runs every layer on the one device its backend picks (--backend); a model cannot be split between the CPU and a device, and 0 selects the CPU".into(),
                });
            }
        }
        if s.parallel == Some(-1) {
            notes.push(Note {
                origin: self.origin_of("parallel", "-1"),
                why: "tern has no automatic slot count: it runs 1 slot".into(),
            });
        }
        Ok(Resolved { settings: s, notes })
    }

    /// An invalid value, with where it came from.
    fn name_source(&self, e: ConfigError) -> ConfigError {
        match e {
            ConfigError::Invalid { key, why } => match self.source_of(key) {
                Source::Env(var) => ConfigError::Env {
                    var,
                    message: format!("{key}: {why}"),
                },
                Source::File(p) => ConfigError::Yaml {
                    path: p,
                    key: key.to_string(),
                    message: why,
                },
                Source::Flag => ConfigError::InvalidFlag {
                    flag: self
                        .spellings
                        .get(key)
                        .cloned()
                        .unwrap_or_else(|| format!("--{key}")),
                    why,
                },
                Source::Default => ConfigError::Invalid { key, why },
            },
            e => e,
        }
    }

    /// Every key with its value and where it came from, as YAML with comments
    /// (`tern config --print --explain`); keys left at their default are commented out.
    pub fn explain(&self) -> String {
        let merged = self.merged().redacted();
        let values = to_map(&merged);
        let mut out = String::new();
        for key in Settings::keys() {
            match values.get(&key) {
                Some(v) => {
                    let source = match self.source_of(&key) {
                        Source::Flag => "flag".to_string(),
                        Source::Env(var) => format!("env {var}"),
                        Source::File(p) => format!("file {}", p.display()),
                        Source::Default => "default".to_string(),
                    };
                    out.push_str(&format!("{key}: {}  # {source}\n", yaml_scalar(v)));
                }
                None => out.push_str(&format!("# {key}: {}  # default\n", default_of(&key))),
            }
        }
        for n in &self.notes {
            out.push_str(&format!("# warning: {n}\n"));
        }
        out
    }
}

/// A JSON value as a one-line YAML value.
fn yaml_scalar(v: &Value) -> String {
    match v {
        Value::String(s) => {
            let plain = !s.is_empty()
                && s.chars()
                    .all(|c| c.is_ascii_alphanumeric() || "-_./:".contains(c))
                && flags::parse_bool(s).is_none()
                && s.parse::<f64>().is_err();
            if plain {
                s.clone()
            } else {
                Value::String(s.clone()).to_string()
            }
        }
        // An f32 setting reads as it was written (0.7, not 0.699999988079071).
        Value::Number(n) if n.is_f64() => {
            let f = n.as_f64().unwrap_or(0.0);
            let short = f as f32;
            if short as f64 == f {
                format!("{short}")
            } else {
                n.to_string()
            }
        }
        other => other.to_string(),
    }
}

/// The default a key takes when no source sets it, as `explain` prints it.
pub fn default_of(key: &str) -> &'static str {
    match key {
        "model" => "the bundled demo model",
        "alias" => "the model's file name",
        "host" => "127.0.0.1",
        "port" => "8080",
        "ctx-size" => "4096 per slot, at most the model's trained context",
        "parallel" => "1",
        "n-predict" => "-1 (until the slot window is full)",
        "cache-type-k" | "cache-type-v" | "spec-draft-type-k" | "spec-draft-type-v" => "f16",
        "flash-attn" => "auto",
        "batch-size" => "2048",
        "ubatch-size" => "512",
        "threads" => "all cores",
        "threads-batch" => "--threads",
        "threads-http" => "the CPU count",
        "chat-template" | "chat-template-file" => "the model's tokenizer.chat_template",
        "reasoning-format" => "deepseek",
        "reasoning" => "auto",
        "reasoning-effort" => "the template's own",
        "reasoning-budget" => "-1 (unrestricted)",
        "reasoning-preserve" => "true",
        "metrics" | "props" | "skip-chat-parsing" | "ignore-eos" | "special" | "verbose"
        | "log-disable" | "embeddings" => "false",
        "pooling" => "last",
        "slots" | "webui" | "cache-prompt" | "cors-credentials" | "log-timestamps"
        | "log-prefix" => "true",
        "timeout" => "3600",
        "sse-ping-interval" => "30",
        "temp" | "top-p" | "top-k" | "min-p" => {
            "the model's general.sampling.*, else llama.cpp's (0.8, 0.95, 40, 0.05)"
        }
        "presence-penalty" | "frequency-penalty" => "0",
        "repeat-penalty" => "1.0 (off)",
        "repeat-last-n" => "the model's general.sampling.penalty_last_n, else 64",
        "seed" => "-1 (random)",
        "spec-type" => "none",
        "spec-draft-n-max" => "3",
        "spec-draft-n-min" => "0",
        "spec-draft-p-min" => "0",
        "cors-origins" | "cors-headers" => "*",
        "cors-methods" => "GET, POST, DELETE, OPTIONS",
        "log-verbosity" => "3 (info)",
        "log-format" => "text",
        "log-colors" => "auto",
        "backend" => "auto",
        "cpu-exact" => "false (int8 activations on quantized weights)",
        "repack" => {
            "true (Q8_0, PQ2_0 and PTQ1_0 matrices packed at load for the CPU's int8 kernels)"
        }
        "margin-mib" => "1024",
        "max-body-mb" => "32",
        "drain-timeout" => "30",
        "max-connections" => "8192, at most the descriptor limit less 64",
        "header-timeout" => "30",
        "image-min-tokens" => "the projector's own (8 for Qwen-VL)",
        "image-max-tokens" => "the projector's own (4096 for Qwen-VL)",
        _ => "unset",
    }
}

/// The merged settings and the warnings to print once logging is up.
#[derive(Clone, Debug)]
pub struct Resolved {
    pub settings: Settings,
    pub notes: Vec<Note>,
}
