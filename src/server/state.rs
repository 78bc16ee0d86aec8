//! What the handlers share: the boot-time configuration, the engine once it is loaded, the
//! per-slot view for `/slots`, and the flags that drive shutdown.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant};

use serde_json::{json, Map, Value};

use crate::chat::ChatTemplate;
use crate::config::{Reasoning, ReasoningFormat};
use crate::runtime::engine::Engine;
use crate::runtime::sampler::SamplerConfig;
use crate::runtime::speculative::SpecConfig;
use crate::tokenizer::Tokenizer;

/// The model facts `/v1/models` and `/props` report.
#[derive(Clone, Debug, Default)]
pub struct ModelMeta {
    pub n_vocab: usize,
    pub n_ctx_train: usize,
    pub n_embd: usize,
    pub n_params: u64,
    /// File size in bytes.
    pub size: u64,
    pub ftype: String,
    pub bos_token: String,
    pub eos_token: String,
}

/// `--cors-*`, as llama-server applies them.
#[derive(Clone, Debug, PartialEq)]
pub struct Cors {
    /// `*`, `localhost` (reflect a localhost Origin only) or a comma-separated list.
    pub origins: String,
    pub methods: String,
    pub headers: String,
    pub credentials: bool,
}

impl Default for Cors {
    fn default() -> Cors {
        Cors {
            origins: "*".into(),
            methods: "GET, POST, DELETE, OPTIONS".into(),
            headers: "*".into(),
            credentials: true,
        }
    }
}

/// `--reasoning-budget`: what every chat request starts from (a request may override the
/// count and the message).
#[derive(Clone, Debug, Default)]
pub struct BudgetDefaults {
    /// -1 = unrestricted.
    pub tokens: i64,
    pub message: String,
    pub start: Vec<u32>,
    pub end: Vec<u32>,
    /// Per token id: its text ends mid-character.
    pub incomplete: Arc<Vec<bool>>,
}

/// Settled at boot, read by every handler.
#[derive(Clone, Debug)]
pub struct ServerConfig {
    /// The model id (`--alias`: the first of the aliases in sorted order, as llama-server).
    pub alias: String,
    pub aliases: Vec<String>,
    pub tags: Vec<String>,
    pub model_path: String,
    /// `--api-key` (comma-separated) and `--api-key-file`: any one is accepted.
    pub api_keys: Vec<String>,
    pub metrics: bool,
    /// `--slots` (default on): /slots answers 501 without it.
    pub endpoint_slots: bool,
    /// `--props`: POST /props is accepted.
    pub endpoint_props: bool,
    /// `--webui` (default on): the chat page at / (server/webui.rs); with `--no-webui`, /
    /// answers 404 and /sw.js unregisters a cached UI, as llama-server.
    pub webui: bool,
    /// `--ui-config`/`--ui-config-file`: the page's default settings (/props `ui_settings`).
    pub ui_settings: Value,
    pub api_prefix: String,
    pub cors: Cors,
    /// `--timeout`: the request head and body must arrive, and each write complete, within it.
    pub timeout: Duration,
    /// `--sse-ping-interval`: a `:` comment after this much silence on a stream.
    pub sse_ping: Option<Duration>,
    /// `--n-predict` when a request sets no limit (None: until the slot window is full).
    pub n_predict: Option<usize>,
    /// `--reverse-prompt`: stop strings for requests that give none.
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    pub cache_prompt: bool,
    pub special: bool,
    pub skip_chat_parsing: bool,
    /// `--chat-template-kwargs`, `--reasoning-effort`, `--reasoning-preserve`.
    pub template_kwargs: Map<String, Value>,
    pub budget: BudgetDefaults,
    /// `--embeddings`: the embedding routes are served, pooled so.
    pub embeddings: Option<crate::runtime::engine::Pooling>,
    pub reasoning_format: ReasoningFormat,
    pub reasoning: Reasoning,
    /// The projector's tower (`--mmproj`): images are sized for it before they go to the
    /// engine, which loaded its weights.
    pub vision: Option<crate::model::vision::VisionConfig>,
    pub n_ctx_slot: usize,
    pub total_slots: usize,
    /// Model file defaults, then the flags.
    pub sampler: SamplerConfig,
    /// `--seed` when it fixes one (not -1).
    pub fixed_seed: Option<u64>,
    pub spec: Option<SpecConfig>,
    pub backend: String,
    pub build_info: String,
    /// The memory budget the shape was priced against (`--device-mib`, or the host's
    /// available memory for the CPU), when known, and the margin kept free (`--margin-mib`).
    pub memory_budget: Option<u64>,
    pub memory_margin: u64,
    /// The boot ledger, as (term, bytes), for `tern:` metrics.
    pub ledger: Vec<(String, u64)>,
    pub meta: ModelMeta,
}

/// One slot as `/slots` shows it: the task it runs or ran last.
#[derive(Clone, Debug, Default)]
pub struct SlotView {
    pub id_task: Option<u64>,
    pub processing: bool,
    pub n_prompt_tokens: usize,
    pub n_cached: usize,
    pub n_decoded: usize,
    pub max_tokens: Option<usize>,
    pub params: Value,
}

/// Counters at the previous `/metrics` scrape (the throughput gauges average over the window
/// between two scrapes, as llama-server's do).
#[derive(Clone, Debug, Default)]
pub struct Bucket {
    pub prompt_tokens: u64,
    pub prompt_seconds: f64,
    pub predicted_tokens: u64,
    pub predicted_seconds: f64,
}

pub struct AppState {
    pub cfg: ServerConfig,
    pub tok: Arc<Tokenizer>,
    pub template: ChatTemplate,
    pub engine: OnceLock<Arc<Engine>>,
    pub slots: Mutex<Vec<SlotView>>,
    pub bucket: Mutex<Bucket>,
    /// Set when shutdown gives up waiting: every bridge cancels its request.
    pub cancel_all: AtomicBool,
    pub next_task: AtomicU64,
    pub started: Instant,
    incomplete: OnceLock<Arc<Vec<bool>>>,
    /// LoRA adapters and their global scales (`/lora-adapters`).
    pub lora: super::lora::LoraState,
    /// The request work before the engine, bounded ([`super::limits`]).
    pub work: super::limits::Work,
    pub drain: super::drain::Drain,
}

impl AppState {
    pub fn new(cfg: ServerConfig, tok: Arc<Tokenizer>, template: ChatTemplate) -> AppState {
        let n = cfg.total_slots;
        let work = super::limits::Work::new(super::limits::longest_token(&tok));
        AppState {
            cfg,
            tok,
            template,
            engine: OnceLock::new(),
            slots: Mutex::new(vec![SlotView::default(); n]),
            bucket: Mutex::new(Bucket::default()),
            cancel_all: AtomicBool::new(false),
            next_task: AtomicU64::new(0),
            started: Instant::now(),
            incomplete: OnceLock::new(),
            lora: Default::default(),
            work,
            drain: Default::default(),
        }
    }

    pub fn with_lora(mut self, lora: super::lora::LoraState) -> AppState {
        self.lora = lora;
        self
    }

    pub fn ready(&self) -> Option<&Arc<Engine>> {
        self.engine.get()
    }

    /// What a request's generation settings start from.
    pub fn gen_defaults(&self) -> super::request::GenDefaults<'_> {
        super::request::GenDefaults {
            sampler: &self.cfg.sampler,
            fixed_seed: self.cfg.fixed_seed,
            stop: &self.cfg.stop,
            ignore_eos: self.cfg.ignore_eos,
            cache_prompt: self.cfg.cache_prompt,
        }
    }

    /// Per token id: whether its text ends inside a UTF-8 character (the reasoning budget
    /// waits for a whole character before forcing the end tag). Built at the first use.
    pub fn incomplete_tokens(&self) -> Arc<Vec<bool>> {
        self.incomplete
            .get_or_init(|| {
                Arc::new(
                    (0..self.cfg.meta.n_vocab as u32)
                        .map(|id| {
                            self.tok
                                .decode_bytes(&[id], false)
                                .map(|b| crate::runtime::budget::ends_mid_char(&b))
                                .unwrap_or(false)
                        })
                        .collect(),
                )
            })
            .clone()
    }

    pub fn new_task_id(&self) -> u64 {
        self.next_task.fetch_add(1, Ordering::Relaxed)
    }

    /// Logs at llama.cpp's verbosity levels (1 error, 2 warning, 3 info, 4 and up debug).
    pub fn log(&self, level: u32, msg: impl AsRef<str>) {
        log_line(level, msg.as_ref());
    }

    /// Updates one slot's view (a poisoned lock is recovered: the view is advisory).
    pub fn with_slot(&self, slot: usize, f: impl FnOnce(&mut SlotView)) {
        let mut g = self.slots.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(s) = g.get_mut(slot) {
            f(s);
        }
    }

    /// The generation settings llama-server reports (`/props`, `/slots`, `/completion`).
    pub fn params_json(
        &self,
        s: &SamplerConfig,
        max_tokens: Option<usize>,
        stop: &[String],
        stream: bool,
        ignore_eos: bool,
    ) -> Value {
        let n_predict = max_tokens.map(|n| n as i64).unwrap_or(-1);
        let spec = self.cfg.spec.as_ref();
        json!({
            "seed": s.seed,
            "temperature": f32j(s.temperature),
            "top_k": s.top_k,
            "top_p": f32j(s.top_p),
            "min_p": f32j(s.min_p),
            "repeat_last_n": if s.penalty_last_n == usize::MAX { -1 } else { s.penalty_last_n as i64 },
            "presence_penalty": f32j(s.presence_penalty),
            "frequency_penalty": f32j(s.frequency_penalty),
            "max_tokens": n_predict,
            "n_predict": n_predict,
            "stop": stop,
            "ignore_eos": ignore_eos,
            "stream": stream,
            "samplers": ["penalties", "top_k", "top_p", "min_p", "temperature"],
            "reasoning_format": match self.cfg.reasoning_format {
                ReasoningFormat::Deepseek => "deepseek",
                ReasoningFormat::None => "none",
                ReasoningFormat::Auto => "auto",
            },
            "speculative.type": if spec.is_some() { "draft-mtp" } else { "none" },
            "speculative.n_max": spec.map(|s| s.n_max).unwrap_or(0),
            "speculative.n_min": spec.map(|s| s.n_min).unwrap_or(0),
            "speculative.p_min": f32j(spec.map(|s| s.p_min).unwrap_or(0.0)),
        })
    }
}

/// An f32 as the decimal it was written as (0.95, not 0.949999988079071).
pub fn f32j(x: f32) -> Value {
    let v: f64 = format!("{x}").parse().unwrap_or(x as f64);
    json!(v)
}

/// One log event at a llama.cpp verbosity level.
pub fn log_line(level: u32, msg: &str) {
    match level {
        0 | 1 => tracing::error!(target: "tern::server", "{msg}"),
        2 => tracing::warn!(target: "tern::server", "{msg}"),
        3 => tracing::info!(target: "tern::server", "{msg}"),
        _ => tracing::debug!(target: "tern::server", "{msg}"),
    }
}
