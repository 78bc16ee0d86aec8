//! `tern serve`: a drop-in for llama-server's HTTP contract (`server-contract.md`).
//!
//! It takes the settings already resolved (`config::Sources`: flags over environment over
//! config file). Boot order: open the model (a directory or another architecture is refused
//! first), projector and adapters (refusing, naming the file, when one is missing) → compile
//! the chat template → pick the backend → price the shape with the planner (the summary at
//! info, the ledger at debug; a shape that does not fit is refused) → bind the port and answer
//! `/health` with 503 while the weights load → ready. SIGTERM (or Ctrl-C) drains
//! ([`drain`]): no new connections, 503 with `Retry-After` for requests not started, the
//! running ones finish within `--drain-timeout` or are cut; then exit 0.

pub mod access;
pub mod chat;
pub mod completion;
pub mod drain;
pub mod embeddings;
pub mod error;
pub mod generate;
pub mod limits;
pub mod listen;
pub mod lora;
pub mod metrics;
pub mod request;
pub mod routes;
pub mod state;
pub mod systemd;
pub mod vision;
pub mod webui;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use serde_json::{Map, Value};

use crate::backend::pick::Picked;
use crate::backend::Backend;
use crate::chat::ChatTemplate;
use crate::config::{Reasoning, ReasoningFormat, Settings};
use crate::gguf::Gguf;
use crate::model::vision::VisionConfig;
use crate::plan::boot::{self as boot, OpenedModel};
use crate::plan::{BackendKind, Ledger, Shape};
use crate::runtime::engine::{Engine, EngineConfig, Threads};
use crate::tokenizer::Tokenizer;

pub use access::Access;
pub use error::ApiError;
pub use state::{AppState, BudgetDefaults, Cors, ModelMeta, ServerConfig};

/// The connection layer's bounds and the drain's limits ([`Options::from_settings`]; tests
/// shrink them).
#[derive(Clone, Debug)]
pub struct Options {
    /// The largest request body, in bytes (`--max-body-mb`).
    pub body_limit: usize,
    /// The request head must arrive within this; idle keep-alive connections close after it
    /// (`--header-timeout`).
    pub header_timeout: Duration,
    /// Open connections at most (`--max-connections`; no more than the descriptor limit allows).
    pub max_connections: usize,
    /// How long shutdown lets requests in flight finish before cutting them (`--drain-timeout`).
    pub drain: Duration,
    /// How long it then waits for the cut requests to close.
    pub cancel_wait: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            body_limit: 32 << 20,
            header_timeout: Duration::from_secs(30),
            max_connections: 8192,
            drain: Duration::from_secs(30),
            cancel_wait: Duration::from_millis(1500),
        }
    }
}

impl Options {
    pub fn from_settings(s: &Settings) -> Options {
        let d = Options::default();
        Options {
            body_limit: s
                .max_body_mb
                .map_or(d.body_limit, |m| (m as usize).saturating_mul(1 << 20)),
            header_timeout: s
                .header_timeout
                .map_or(d.header_timeout, Duration::from_secs),
            max_connections: s.max_connections.map_or(d.max_connections, |n| n as usize),
            drain: s.drain_timeout.map_or(d.drain, Duration::from_secs),
            cancel_wait: d.cancel_wait,
        }
    }
}

/// A request body and the request's access-log record. A body over `--max-body-mb` is a 413
/// (by its `Content-Length` before any of it is read, else as soon as it passes the limit); one
/// that cannot be read (cut off, or not in within `--timeout`) is a 400, in OpenAI's shape.
pub struct Body(pub Bytes, pub Access);

impl FromRequest<Arc<AppState>> for Body {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &Arc<AppState>) -> Result<Self, ApiError> {
        let access = req
            .extensions()
            .get::<Access>()
            .cloned()
            .unwrap_or_default();
        let limit = req
            .extensions()
            .get::<limits::BodyLimit>()
            .map_or(Options::default().body_limit, |l| l.0);
        let declared = req
            .headers()
            .get(axum::http::header::CONTENT_LENGTH)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.parse::<u64>().ok());
        if declared.is_some_and(|n| n > limit as u64) {
            return Err(limits::too_large(limit));
        }
        let timeout = state.cfg.timeout;
        let read = Bytes::from_request(req, state);
        match tokio::time::timeout(timeout, read).await {
            Ok(Ok(b)) => Ok(Body(b, access)),
            Ok(Err(e)) if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE => {
                Err(limits::too_large(limit))
            }
            Ok(Err(e)) => Err(ApiError::bad_request(format!(
                "cannot read the request body: {}",
                e.body_text()
            ))),
            Err(_) => Err(ApiError::bad_request(format!(
                "the request body did not arrive within {} s (--timeout)",
                timeout.as_secs()
            ))),
        }
    }
}

/// The default chat template when the model has none, and `--chat-template chatml`
/// (llama.cpp's CHATML_TEMPLATE_SRC).
const CHATML: &str = "{%- for message in messages -%}\n  {{- '<|im_start|>' + message.role + '\n' + message.content + '<|im_end|>\n' -}}\n{%- endfor -%}\n{%- if add_generation_prompt -%}\n  {{- '<|im_start|>assistant\n' -}}\n{%- endif -%}";

/// llama.cpp's built-in template names (src/llama-chat.cpp). With Jinja on (its default and
/// tern's only mode) llama.cpp treats any of them but `chatml` as literal template text, so
/// they are refused rather than rendered as that word.
const BUILTIN_TEMPLATES: &[&str] = &[
    "llama2",
    "llama2-sys",
    "llama2-sys-bos",
    "llama2-sys-strip",
    "mistral-v1",
    "mistral-v3",
    "mistral-v3-tekken",
    "mistral-v7",
    "mistral-v7-tekken",
    "phi3",
    "phi4",
    "falcon3",
    "zephyr",
    "monarch",
    "gemma",
    "orion",
    "openchat",
    "vicuna",
    "vicuna-orca",
    "deepseek",
    "deepseek2",
    "deepseek3",
    "deepseek-ocr",
    "command-r",
    "llama3",
    "chatglm3",
    "chatglm4",
    "glmedge",
    "minicpm",
    "exaone3",
    "exaone4",
    "exaone-moe",
    "rwkv-world",
    "granite",
    "granite-4.0",
    "granite-4.1",
    "gigachat",
    "megrez",
    "yandex",
    "bailing",
    "bailing-think",
    "bailing2",
    "llama4",
    "smolvlm",
    "hunyuan-moe",
    "gpt-oss",
    "hunyuan-dense",
    "hunyuan-vl",
    "kimi-k2",
    "seed_oss",
    "grok-2",
    "pangu-embedded",
    "solar-open",
];

fn picked_kind(p: &Picked) -> BackendKind {
    match p {
        Picked::Cpu(_) => BackendKind::Cpu,
        Picked::Wgpu(_) => BackendKind::Wgpu,
        #[cfg(feature = "cuda")]
        Picked::Cuda(_) => BackendKind::Cuda,
    }
}

fn start_engine<B: Backend + 'static>(
    be: B,
    file: Arc<Gguf>,
    tok: Arc<Tokenizer>,
    cfg: EngineConfig,
    threads: Threads,
    adapters: &[PathBuf],
    projector: Option<(Arc<Gguf>, VisionConfig)>,
) -> Result<Engine>
where
    B::W: 'static,
{
    boot::read_with_progress(&file);
    let m = boot::load_model(&be, file, adapters, cfg.spec.is_some())?;
    Ok(Engine::start_full(m, be, tok, cfg, threads, projector)?)
}

type Loader = Box<dyn FnOnce() -> Result<Engine> + Send>;

/// The adapters as `/lora-adapters` lists them, with their boot scales. The planner has
/// already read and checked each against the model.
fn lora_state(s: &Settings) -> Result<lora::LoraState> {
    let mut adapters = Vec::new();
    let mut scales = Vec::new();
    for l in s.adapters() {
        let g = Gguf::open(&l.path)
            .with_context(|| format!("the LoRA adapter {}", l.path.display()))?;
        let meta = |k: &str| g.get_str(k).unwrap_or("").to_string();
        adapters.push(lora::LoadedAdapter {
            path: l.path.clone(),
            task_name: meta("adapter.lora.task_name"),
            prompt_prefix: meta("adapter.lora.prompt_prefix"),
        });
        scales.push(l.scale);
    }
    Ok(lora::LoraState::new(adapters, scales))
}

/// Everything checked and priced; the weights not loaded yet.
pub struct Prepared {
    state: Arc<AppState>,
    loader: Loader,
    host: String,
    port: u16,
    threads_http: Option<usize>,
    opts: Options,
}

impl Prepared {
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }
}

fn readable(what: &str, p: &Path) -> Result<()> {
    let f = std::fs::File::open(p)
        .with_context(|| format!("cannot read the {what} {}", p.display()))?;
    let md = f
        .metadata()
        .with_context(|| format!("cannot read the {what} {}", p.display()))?;
    if !md.is_file() {
        bail!("the {what} {} is not a file", p.display());
    }
    Ok(())
}

/// The projector and the adapters must exist: a path at a missing file is a boot refusal, never
/// silent blindness. The projector's header is read: a file that is not a GGUF vision projector
/// (`general.architecture` clip) is refused too.
fn check_side_files(s: &Settings) -> Result<()> {
    if let Some(p) = &s.mmproj {
        readable("projector (--mmproj)", p)?;
        let g =
            Gguf::open(p).with_context(|| format!("the projector (--mmproj) {}", p.display()))?;
        match g.architecture() {
            Some("clip") => {}
            other => bail!(
                "the projector (--mmproj) {} is not a vision projector: its general.architecture is {}, not clip",
                p.display(),
                other.map_or("missing".to_string(), |a| format!("`{a}`"))
            ),
        }
    }
    for l in s.adapters() {
        readable("LoRA adapter (--lora / --lora-scaled)", &l.path)?;
    }
    Ok(())
}

/// The projector (`--mmproj`), its hparams checked against the text model (a projector for
/// another width, or with deepstack layers, is refused here, before any weight loads), and the
/// text model's vocabulary checked for the tokens an image is wrapped in.
fn open_projector(
    s: &Settings,
    n_embd: usize,
    tok: &Tokenizer,
) -> Result<Option<(Arc<Gguf>, VisionConfig)>> {
    let Some(p) = &s.mmproj else {
        return Ok(None);
    };
    let what = || format!("the projector (--mmproj) {}", p.display());
    let g = Arc::new(Gguf::open(p).with_context(what)?);
    let mut cfg = VisionConfig::from_gguf(&g, n_embd).with_context(what)?;
    let (min, max) = s.image_token_limits();
    cfg.set_token_limits(min.map(|n| n as usize), max.map(|n| n as usize))
        .with_context(what)?;
    for t in [
        crate::model::vision::VISION_START,
        crate::model::vision::VISION_END,
    ] {
        if tok.token_id(t).is_none() {
            bail!(
                "{}: the text model's vocabulary has no {t} token, which a Qwen-VL image needs around it: this projector does not belong to this model",
                what()
            );
        }
    }
    Ok(Some((g, cfg)))
}

/// The chat template: `--chat-template-file`, `--chat-template` (`chatml` or Jinja source),
/// else the model's own, else ChatML.
fn chat_template(s: &Settings, file: &Gguf) -> Result<ChatTemplate> {
    let src = match (&s.chat_template_file, &s.chat_template) {
        (Some(p), _) => std::fs::read_to_string(p)
            .with_context(|| format!("cannot read the chat template {}", p.display()))?,
        (None, Some(t)) if t.trim() == "chatml" => CHATML.to_string(),
        (None, Some(t)) if BUILTIN_TEMPLATES.contains(&t.trim()) => bail!(
            "--chat-template {t}: not supported: it names one of llama.cpp's built-in templates for another model family; tern takes `chatml` or Jinja template source (--chat-template-file for a file)"
        ),
        (None, Some(t)) => t.clone(),
        (None, None) => match file.get_str("tokenizer.chat_template") {
            Some(t) => t.to_string(),
            None => {
                tracing::warn!(
                    target: "tern::boot",
                    "the model has no tokenizer.chat_template; using ChatML"
                );
                CHATML.to_string()
            }
        },
    };
    ChatTemplate::new(&src)
        .map_err(anyhow::Error::msg)
        .context("the chat template")
}

/// The template variables every request starts from: `--chat-template-kwargs`, then
/// `--reasoning-effort` and `--reasoning-preserve` (llama-server passes `preserve_reasoning`
/// true unless told otherwise).
fn template_kwargs(s: &Settings) -> Result<Map<String, Value>> {
    let mut kw = match &s.chat_template_kwargs {
        Some(k) => match serde_json::from_str::<Value>(k) {
            Ok(Value::Object(m)) => m,
            _ => bail!("--chat-template-kwargs {k:?} is not a JSON object"),
        },
        None => Map::new(),
    };
    if let Some(e) = &s.reasoning_effort {
        if e == "default" {
            kw.remove("reasoning_effort");
        } else {
            kw.insert("reasoning_effort".into(), Value::String(e.clone()));
        }
    }
    if let Some(p) = s.reasoning_preserve {
        kw.insert("preserve_reasoning".into(), Value::Bool(p));
    }
    kw.entry("preserve_reasoning").or_insert(Value::Bool(true));
    Ok(kw)
}

/// The shape of these settings on this model and backend, settled: the pool from the model's
/// trained context when the settings leave it open, a draft no deeper than a slot can use.
fn settled_shape(s: &Settings, trained: u64, backend: BackendKind) -> Result<Shape> {
    let mut shape = s.shape();
    let asked = s.ctx_size.or(s
        .kv_unified_per_slot
        .map(|n| n.saturating_mul(shape.parallel)));
    shape.ctx_size = boot::settle_pool(asked, shape.parallel, trained);
    shape.backend = backend;
    shape
        .validate()
        .map_err(|e| anyhow::anyhow!(e))
        .context("the shape")?;
    boot::check_draft_depth(&shape)?;
    Ok(shape)
}

/// The API id and aliases: llama-server keeps `--alias` as a sorted set and serves the first.
fn aliases(s: &Settings, file_name: &str) -> Vec<String> {
    let mut a: Vec<String> = s
        .alias
        .iter()
        .flat_map(|a| a.split(','))
        .map(|a| a.trim().to_string())
        .filter(|a| !a.is_empty())
        .collect();
    a.sort();
    a.dedup();
    if a.is_empty() {
        a.push(file_name.to_string());
    }
    a
}

fn list(v: &Option<String>) -> Vec<String> {
    let mut l: Vec<String> = v
        .iter()
        .flat_map(|t| t.split(','))
        .map(|t| t.trim().to_string())
        .filter(|t| !t.is_empty())
        .collect();
    l.sort();
    l.dedup();
    l
}

#[allow(clippy::too_many_arguments)]
fn server_config(
    s: &Settings,
    model: &OpenedModel,
    mcfg: &crate::model::Config,
    tok: &Tokenizer,
    ecfg: &EngineConfig,
    ledger: &Ledger,
    backend: &str,
    api_keys: Vec<String>,
    vision: Option<VisionConfig>,
) -> Result<ServerConfig> {
    let (sampler, fixed_seed) =
        boot::sampler(&model.file, s).map_err(|e| anyhow::anyhow!("bad sampling settings: {e}"))?;
    let token_text = |id: Option<u32>| {
        id.and_then(|i| tok.decode(&[i], false).ok())
            .unwrap_or_default()
    };
    let file = &model.file;
    let meta = ModelMeta {
        n_vocab: mcfg.n_vocab,
        n_ctx_train: mcfg.context_length,
        n_embd: mcfg.n_embd,
        n_params: file.tensors().iter().map(|t| t.n_elements()).sum(),
        size: file.file_len(),
        ftype: file
            .get_u64("general.file_type")
            .map(|t| t.to_string())
            .unwrap_or_default(),
        bos_token: token_text(tok.bos()),
        eos_token: token_text(tok.eos()),
    };
    let encode = |t: &str| tok.encode(t, false, true).unwrap_or_default();
    let aliases = aliases(s, &model.file_name);
    let secs = |n: i64| (n > 0).then(|| Duration::from_secs(n as u64));
    Ok(ServerConfig {
        alias: aliases[0].clone(),
        aliases,
        tags: list(&s.tags),
        model_path: model.path.clone(),
        api_keys,
        metrics: s.metrics.unwrap_or(false),
        endpoint_slots: s.slots.unwrap_or(true),
        endpoint_props: s.props.unwrap_or(false),
        webui: s.webui.unwrap_or(true),
        ui_settings: s.ui_settings()?,
        api_prefix: s.api_prefix.clone().unwrap_or_default(),
        cors: Cors {
            origins: s
                .cors_origins
                .clone()
                .unwrap_or_else(|| Cors::default().origins),
            methods: s
                .cors_methods
                .clone()
                .unwrap_or_else(|| Cors::default().methods),
            headers: s
                .cors_headers
                .clone()
                .unwrap_or_else(|| Cors::default().headers),
            credentials: s.cors_credentials.unwrap_or(true),
        },
        timeout: Duration::from_secs(s.timeout.unwrap_or(3600)),
        sse_ping: secs(s.sse_ping_interval.unwrap_or(30)),
        n_predict: s.n_predict.filter(|&n| n >= 0).map(|n| n as usize),
        stop: s.reverse_prompt.clone().unwrap_or_default(),
        ignore_eos: s.ignore_eos.unwrap_or(false),
        cache_prompt: s.cache_prompt.unwrap_or(true),
        special: s.special.unwrap_or(false),
        skip_chat_parsing: s.skip_chat_parsing.unwrap_or(false),
        template_kwargs: template_kwargs(s)?,
        budget: BudgetDefaults {
            tokens: s.reasoning_budget.unwrap_or(-1),
            message: s.reasoning_budget_message.clone().unwrap_or_default(),
            start: encode("<think>"),
            end: encode("</think>"),
            incomplete: Default::default(),
        },
        reasoning_format: s.reasoning_format.unwrap_or(ReasoningFormat::Deepseek),
        reasoning: s.reasoning.unwrap_or(Reasoning::Auto),
        vision,
        embeddings: s
            .embeddings
            .unwrap_or(false)
            .then(|| s.pooling.unwrap_or(crate::runtime::engine::Pooling::Last)),
        n_ctx_slot: ecfg.n_ctx_slot(),
        total_slots: ecfg.parallel,
        sampler,
        fixed_seed,
        spec: ecfg.spec.clone(),
        backend: backend.to_string(),
        build_info: crate::build_info(),
        memory_budget: crate::plan::Budget::resolve(ledger.shape.backend, s.device_mib)
            .ok()
            .map(|b| b.bytes),
        memory_margin: ledger.shape.margin_mib << 20,
        ledger: ledger
            .lines
            .iter()
            .map(|l| (l.term.name().replace(' ', "_"), l.bytes))
            .collect(),
        meta,
    })
}

/// Checks and prices everything short of loading the weights, in the order that fails
/// soonest: the settings, the model file (a directory or another architecture is refused
/// first), the side files, the template, the backend, the shape against the budget. Logs the
/// summary (the full ledger at debug).
pub fn prepare(settings: Settings) -> Result<Prepared> {
    let s = settings;
    s.validate()?;
    let model = boot::open_model(s.model.as_deref())?;
    check_side_files(&s)?;
    let api_keys = s.api_keys()?;
    let mcfg = crate::model::Config::from_gguf(&model.file)
        .with_context(|| format!("{} is not a loadable qwen35 model", model.path))?;
    let tok = Arc::new(
        Tokenizer::from_gguf(&model.file)
            .with_context(|| format!("the tokenizer of {}", model.path))?,
    );
    let template = chat_template(&s, &model.file)?;
    let projector = open_projector(&s, mcfg.n_embd, &tok)?;
    let picked =
        crate::backend::pick::pick_serving(s.backend_kind().name(), s.cpu_exact(), s.repack())?;
    let shape = settled_shape(&s, mcfg.context_length as u64, picked_kind(&picked))?;
    let ledger = boot::plan(&model.file, &shape, s.device_mib, &model.path)?;
    let ecfg = boot::engine_config(&shape, &s);
    ecfg.validate(mcfg.context_length, mcfg.has_mtp())?;
    let cfg = server_config(
        &s,
        &model,
        &mcfg,
        &tok,
        &ecfg,
        &ledger,
        picked.name(),
        api_keys,
        projector.as_ref().map(|p| p.1.clone()),
    )?;
    let lora = lora_state(&s)?;
    let state = Arc::new(AppState::new(cfg, tok.clone(), template).with_lora(lora));
    let threads = boot::threads(&s);
    let file = model.file.clone();
    let adapters: Vec<PathBuf> = s.adapters().into_iter().map(|l| l.path).collect();
    let loader: Loader = Box::new(move || {
        let a = &adapters;
        let engine = match picked {
            Picked::Cpu(be) => start_engine(be, file, tok, ecfg, threads, a, projector),
            Picked::Wgpu(be) => start_engine(be, file, tok, ecfg, threads, a, projector),
            #[cfg(feature = "cuda")]
            Picked::Cuda(be) => start_engine(be, file, tok, ecfg, threads, a, projector),
        }?;
        boot::report(&ledger, &engine.allocated);
        Ok(engine)
    });
    Ok(Prepared {
        state,
        loader,
        host: s.host.clone().unwrap_or_else(|| "127.0.0.1".into()),
        port: s.port.unwrap_or(8080),
        threads_http: s.threads_http.filter(|&n| n > 0).map(|n| n as usize),
        opts: Options::from_settings(&s),
    })
}

fn runtime(threads: Option<usize>) -> Result<tokio::runtime::Runtime> {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    if let Some(n) = threads {
        b.worker_threads(n);
    }
    // A worker busy reading large bodies polls a task up to its coop budget (megabytes of
    // copying) per tick, and by default looks for new I/O events only every 61 ticks: with
    // 4 x 30 MB bodies arriving, a /health connection waited for that (p99 115-400 ms). Every
    // other tick keeps new connections within a couple of those polls.
    b.event_interval(2);
    b.enable_all()
        .build()
        .context("cannot start the async runtime")
}

/// The `tern serve` command: boots with the resolved settings, serves until SIGTERM or
/// Ctrl-C, drains, exits 0; a second signal exits at once.
pub fn run(settings: Settings) -> Result<()> {
    let prepared = prepare(settings)?;
    let listener = std::net::TcpListener::bind((prepared.host.as_str(), prepared.port))
        .with_context(|| format!("cannot listen on {}:{}", prepared.host, prepared.port))?;
    let rt = runtime(prepared.threads_http)?;
    let opts = prepared.opts.clone();
    let (first_tx, first_rx) = tokio::sync::oneshot::channel::<()>();
    rt.spawn(signals(first_tx));
    let r = rt.block_on(serve(listener, prepared, opts, async move {
        let _ = first_rx.await;
    }));
    rt.shutdown_timeout(Duration::from_millis(300));
    if r.is_ok() {
        tracing::info!(target: "tern::server", "stopped");
    }
    r
}

/// The first SIGTERM or Ctrl-C starts the drain; a second one exits at once (status 1: the
/// requests still running are cut without their final event).
async fn signals(first: tokio::sync::oneshot::Sender<()>) {
    use tokio::signal::unix::{signal, Signal, SignalKind};
    async fn one(s: &mut Option<Signal>) {
        match s {
            Some(s) => {
                s.recv().await;
            }
            None => std::future::pending::<()>().await,
        }
    }
    async fn next(term: &mut Option<Signal>, int: &mut Option<Signal>) {
        tokio::select! {
            _ = one(term) => {}
            _ = one(int) => {}
        }
    }
    let mut term = signal(SignalKind::terminate()).ok();
    let mut int = signal(SignalKind::interrupt()).ok();
    next(&mut term, &mut int).await;
    let _ = first.send(());
    next(&mut term, &mut int).await;
    tracing::warn!(
        target: "tern::server",
        "a second stop signal: exiting now, without finishing the drain"
    );
    std::process::exit(1);
}

/// Serves on `listener` until `stop` resolves: loads the model in the background (503 until
/// then), then drains as described in the module docs. A failed load is an error.
pub async fn serve(
    listener: std::net::TcpListener,
    prepared: Prepared,
    opts: Options,
    stop: impl std::future::Future<Output = ()> + Send,
) -> Result<()> {
    listener.set_nonblocking(true)?;
    let listener = tokio::net::TcpListener::from_std(listener)?;
    let addr = listener.local_addr()?;
    let Prepared { state, loader, .. } = prepared;
    state.log(
        3,
        format!(
            "listening on http://{addr} ({} slot{} × {} tokens, backend {}); loading the model",
            state.cfg.total_slots,
            if state.cfg.total_slots == 1 { "" } else { "s" },
            state.cfg.n_ctx_slot,
            state.cfg.backend
        ),
    );
    let (fail_tx, mut fail_rx) = tokio::sync::oneshot::channel::<anyhow::Error>();
    {
        let state = state.clone();
        std::thread::Builder::new()
            .name("tern-load".into())
            .spawn(move || match loader() {
                Ok(engine) => {
                    let _ = state.engine.set(Arc::new(engine));
                    state.log(
                        3,
                        format!(
                            "model loaded in {:.2} s; ready",
                            state.started.elapsed().as_secs_f64()
                        ),
                    );
                    systemd::ready(&state);
                }
                Err(e) => {
                    let _ = fail_tx.send(e);
                }
            })
            .context("cannot start the loader thread")?;
    }
    let app = routes::router(state.clone(), opts.body_limit);
    let notify = Arc::new(tokio::sync::Notify::new());
    let n2 = notify.clone();
    let bounds = listen::Bounds {
        // llama-server's `--timeout` is its read timeout, which a slow request head hits too.
        header: opts.header_timeout.min(state.cfg.timeout),
        write: state.cfg.timeout,
        connections: opts
            .max_connections
            .min(limits::connection_ceiling() as usize),
    };
    let server = listen::serve(listener, app, bounds, async move {
        n2.notified().await;
    });
    let mut server = tokio::spawn(server);
    if systemd::enabled() {
        let state = state.clone();
        tokio::spawn(async move {
            let mut every = tokio::time::interval(Duration::from_secs(5));
            loop {
                every.tick().await;
                systemd::status(&state);
            }
        });
    }
    let outcome = tokio::select! {
        r = &mut server => {
            return match r {
                Ok(()) => Ok(()),
                Err(e) => Err(anyhow::anyhow!("the HTTP server task failed: {e}")),
            };
        }
        _ = stop => Ok(()),
        Ok(e) = &mut fail_rx => Err(e.context("cannot load the model")),
    };
    let t0 = std::time::Instant::now();
    state.log(
        3,
        format!(
            "draining: no new connections, requests waiting for a slot get 503, running ones have {:.0} s to finish (--drain-timeout)",
            opts.drain.as_secs_f64()
        ),
    );
    state.drain.begin();
    systemd::stopping(&state);
    notify.notify_one();
    let mut cut = 0;
    if tokio::time::timeout(opts.drain, &mut server).await.is_err() {
        cut = busy_slots(&state);
        state.log(
            2,
            format!("drain limit reached: cutting {cut} running request(s)"),
        );
        state.cancel_all.store(true, Ordering::Relaxed);
        if tokio::time::timeout(opts.cancel_wait, &mut server)
            .await
            .is_err()
        {
            state.log(2, "connections still open after cutting; closing anyway");
            server.abort();
        }
    }
    state.log(
        3,
        format!(
            "drained in {:.2} s: {} request(s) refused with 503 (not started), {cut} cut",
            t0.elapsed().as_secs_f64(),
            state.drain.refused.load(Ordering::Relaxed),
        ),
    );
    outcome
}

/// Slots running a request now.
pub fn busy_slots(state: &AppState) -> usize {
    state
        .slots
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .filter(|s| s.processing)
        .count()
}

/// A server running on its own thread (for tests and embedding).
pub struct Handle {
    pub addr: SocketAddr,
    state: Arc<AppState>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<Result<()>>>,
}

impl Handle {
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }

    /// Waits until the model is loaded (or `timeout` passes); true when ready.
    pub fn wait_ready(&self, timeout: Duration) -> bool {
        let t0 = std::time::Instant::now();
        while t0.elapsed() < timeout {
            if self.state.ready().is_some() {
                return true;
            }
            if self.thread.as_ref().is_none_or(|t| t.is_finished()) {
                return false;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        false
    }

    /// Stops as SIGTERM would and waits for the server thread.
    pub fn stop(mut self) -> Result<()> {
        self.stop_inner()
    }

    fn stop_inner(&mut self) -> Result<()> {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        match self.thread.take() {
            Some(t) => t
                .join()
                .map_err(|_| anyhow::anyhow!("the server thread panicked"))?,
            None => Ok(()),
        }
    }
}

impl Drop for Handle {
    fn drop(&mut self) {
        let _ = self.stop_inner();
    }
}

/// Prepares, binds `host:port` (port 0 picks a free one) and serves on a new thread.
pub fn spawn(settings: Settings, opts: Options) -> Result<Handle> {
    let prepared = prepare(settings)?;
    let listener = std::net::TcpListener::bind((prepared.host.as_str(), prepared.port))
        .with_context(|| format!("cannot listen on {}:{}", prepared.host, prepared.port))?;
    let addr = listener.local_addr()?;
    let state = prepared.state.clone();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let thread = std::thread::Builder::new()
        .name("tern-serve".into())
        .spawn(move || -> Result<()> {
            let rt = runtime(Some(prepared.threads_http.unwrap_or(2)))?;
            let r = rt.block_on(serve(listener, prepared, opts, async move {
                let _ = rx.await;
            }));
            rt.shutdown_timeout(Duration::from_millis(300));
            r
        })?;
    Ok(Handle {
        addr,
        state,
        stop: Some(tx),
        thread: Some(thread),
    })
}
