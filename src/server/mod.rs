//! `tern serve`: a drop-in for llama-server's HTTP contract (`server-contract.md`).
//!
//! Boot order: merge the settings (config file, then flags) → open the model, projector and
//! adapters (refusing, naming the file, when one is missing) → compile the chat template →
//! pick the backend → price the shape with the planner and print the ledger (refusing a shape
//! that does not fit) → bind the port and answer `/health` with 503 while the weights load →
//! ready. SIGTERM (or Ctrl-C) stops accepting, lets requests in flight finish for a moment,
//! cancels the rest and exits 0 within a few seconds.

pub mod chat;
pub mod completion;
pub mod error;
pub mod generate;
pub mod metrics;
pub mod request;
pub mod routes;
pub mod state;

use std::net::SocketAddr;
use std::path::PathBuf;
use std::sync::atomic::Ordering;
use std::sync::Arc;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};

use crate::backend::pick::Picked;
use crate::backend::Backend;
use crate::chat::ChatTemplate;
use crate::config::{Reasoning, ReasoningFormat, Settings};
use crate::gguf::Gguf;
use crate::model::Model;
use crate::plan::{self, BackendKind};
use crate::runtime::engine::{Engine, EngineConfig};
use crate::runtime::sampler::SamplerConfig;
use crate::runtime::speculative::SpecConfig;
use crate::tokenizer::Tokenizer;

pub use error::ApiError;
pub use state::{AppState, ModelMeta, ServerConfig};

/// `tern serve [--config FILE.yaml] [flags]`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// YAML config file; flags override its keys.
    #[arg(long, value_name = "FILE.yaml")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub settings: Settings,
}

/// Knobs that are not deployment settings (tests shrink them).
#[derive(Clone, Debug)]
pub struct Options {
    /// The largest request body, in bytes.
    pub body_limit: usize,
    /// How long shutdown lets requests in flight finish before cancelling them.
    pub drain: Duration,
    /// How long it then waits for the cancelled requests to close.
    pub cancel_wait: Duration,
}

impl Default for Options {
    fn default() -> Self {
        Options {
            body_limit: 32 << 20,
            drain: Duration::from_millis(2500),
            cancel_wait: Duration::from_millis(1500),
        }
    }
}

/// A request body; a body that cannot be read (too large, cut off) is a 400 in OpenAI's shape.
pub struct Body(pub Bytes);

impl<S: Send + Sync> FromRequest<S> for Body {
    type Rejection = ApiError;

    async fn from_request(req: Request, state: &S) -> Result<Self, ApiError> {
        match Bytes::from_request(req, state).await {
            Ok(b) => Ok(Body(b)),
            Err(e) if e.status() == axum::http::StatusCode::PAYLOAD_TOO_LARGE => Err(
                ApiError::bad_request("the request body is larger than this server accepts"),
            ),
            Err(e) => Err(ApiError::bad_request(format!(
                "cannot read the request body: {}",
                e.body_text()
            ))),
        }
    }
}

/// The default chat template when the model has none (ChatML, as llama.cpp falls back to).
const CHATML: &str = "{%- for message in messages -%}{{- '<|im_start|>' + message.role + '\n' + (message.content if message.content is string else '') + '<|im_end|>\n' -}}{%- endfor -%}{%- if add_generation_prompt -%}{{- '<|im_start|>assistant\n' -}}{%- endif -%}";

fn pick_backend(kind: BackendKind) -> Result<Picked> {
    Ok(crate::backend::pick::pick(kind.name())?)
}

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
) -> Result<Engine>
where
    B::W: 'static,
{
    let m = Model::load(&be, file)?;
    Ok(Engine::start(m, be, tok, cfg)?)
}

type Loader = Box<dyn FnOnce() -> Result<Engine> + Send>;

/// Everything checked and priced; the weights not loaded yet.
pub struct Prepared {
    state: Arc<AppState>,
    loader: Loader,
    host: String,
    port: u16,
}

impl Prepared {
    pub fn state(&self) -> &Arc<AppState> {
        &self.state
    }
}

fn readable(what: &str, p: &std::path::Path) -> Result<()> {
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

/// Checks and prices everything short of loading the weights. Prints the ledger; refuses a
/// shape that does not fit, a missing file, a bad template.
pub fn prepare(mut settings: Settings) -> Result<Prepared> {
    settings.validate()?;
    let (file, model_path, file_name) = match &settings.model {
        Some(p) => {
            let g =
                Gguf::open(p).with_context(|| format!("cannot open the model {}", p.display()))?;
            let name = p
                .file_name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_else(|| p.display().to_string());
            (g, p.display().to_string(), name)
        }
        None => {
            let g = crate::bundled::default_model().context("the bundled model")?;
            let path = g.path().display().to_string();
            (g, path, crate::bundled::DEFAULT_MODEL_NAME.to_string())
        }
    };
    let file = Arc::new(file);
    if let Some(p) = &settings.mmproj {
        readable("projector (--mmproj)", p)?;
        eprintln!(
            "W serve: --mmproj {}: tern cannot run vision projectors yet; requests with image parts will get a 400",
            p.display()
        );
    }
    for l in settings.lora_scaled.iter().flatten() {
        readable("LoRA adapter (--lora-scaled)", &l.path)?;
        if l.scale != 0.0 {
            bail!(
                "--lora-scaled {}: tern cannot apply LoRA adapters yet; refusing to serve the model without it (scale 0 keeps the flag inert)",
                l
            );
        }
    }
    let mcfg = crate::model::Config::from_gguf(&file)
        .with_context(|| format!("{model_path} is not a loadable qwen35 model"))?;
    let tok = Arc::new(
        Tokenizer::from_gguf(&file).with_context(|| format!("the tokenizer of {model_path}"))?,
    );
    let template_src = match &settings.chat_template_file {
        Some(p) => std::fs::read_to_string(p)
            .with_context(|| format!("cannot read the chat template {}", p.display()))?,
        None => match file.get_str("tokenizer.chat_template") {
            Some(t) => t.to_string(),
            None => {
                eprintln!("W serve: the model has no tokenizer.chat_template; using ChatML");
                CHATML.to_string()
            }
        },
    };
    let template = ChatTemplate::new(&template_src).map_err(anyhow::Error::msg)?;

    // The pool: the default 4096 tokens, split evenly, never past the trained window per slot.
    let parallel = settings.parallel.unwrap_or(1).max(1);
    if settings.ctx_size.is_none() {
        let trained = mcfg.context_length as u64;
        let per_slot = (plan::Shape::default().ctx_size / parallel).clamp(1, trained.max(1));
        settings.ctx_size = Some(per_slot * parallel);
    }
    let picked = pick_backend(settings.backend.unwrap_or(BackendKind::Auto))?;
    let mut shape = settings.shape();
    shape.backend = picked_kind(&picked);
    let ledger = crate::cli::boot::plan(&file, &shape, settings.device_mib, &model_path)?;
    let spec = shape.drafting().then(|| SpecConfig {
        n_max: shape.draft_n_max as usize,
        n_min: settings.spec_draft_n_min.unwrap_or(0) as usize,
        p_min: settings.spec_draft_p_min.unwrap_or(0.0),
    });
    let ecfg = EngineConfig {
        ctx_size: shape.ctx_size as usize,
        parallel: shape.parallel as usize,
        ubatch: shape.effective_ubatch() as usize,
        kv_types: shape.kv_types(),
        spec: spec.clone(),
        draft_kv_types: shape.draft_kv_types(),
    };
    ecfg.validate(mcfg.context_length, mcfg.has_mtp())?;

    let mut sampler = SamplerConfig::from_gguf(&file);
    if let Some(t) = settings.temp {
        sampler.temperature = t;
    }
    if let Some(p) = settings.top_p {
        sampler.top_p = p;
    }
    if let Some(k) = settings.top_k {
        sampler.top_k = k.max(0) as usize;
    }
    if let Some(p) = settings.min_p {
        sampler.min_p = p;
    }
    if let Some(p) = settings.presence_penalty {
        sampler.presence_penalty = p;
    }
    sampler.validate().map_err(anyhow::Error::msg)?;
    let fixed_seed = settings.seed.filter(|&s| s >= 0).map(|s| s as u64);
    sampler.seed = fixed_seed.unwrap_or(u32::MAX as u64);

    let token_text = |id: Option<u32>| {
        id.and_then(|i| tok.decode(&[i], false).ok())
            .unwrap_or_default()
    };
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
    let backend_name = picked.name().to_string();
    let cfg = ServerConfig {
        alias: settings.alias.clone().unwrap_or(file_name),
        model_path,
        api_key: settings.api_key.clone().filter(|k| !k.is_empty()),
        metrics: settings.metrics.unwrap_or(false),
        reasoning_format: settings
            .reasoning_format
            .unwrap_or(ReasoningFormat::Deepseek),
        reasoning: settings.reasoning.unwrap_or(Reasoning::Auto),
        mmproj: settings.mmproj.as_ref().map(|p| p.display().to_string()),
        n_ctx_slot: ecfg.n_ctx_slot(),
        total_slots: ecfg.parallel,
        sampler,
        fixed_seed,
        spec,
        backend: backend_name,
        build_info: format!("tern-{}", env!("CARGO_PKG_VERSION")),
        verbosity: settings.log_verbosity.unwrap_or(3),
        ledger: ledger
            .clone()
            .lines
            .iter()
            .map(|l| (l.term.name().replace(' ', "_"), l.bytes))
            .collect(),
        meta,
    };
    let state = Arc::new(AppState::new(cfg, tok.clone(), template));
    let loader: Loader = Box::new(move || {
        let engine = match picked {
            Picked::Cpu(be) => start_engine(be, file, tok, ecfg),
            Picked::Wgpu(be) => start_engine(be, file, tok, ecfg),
            #[cfg(feature = "cuda")]
            Picked::Cuda(be) => start_engine(be, file, tok, ecfg),
        }?;
        crate::cli::boot::report(&ledger, &engine.allocated);
        Ok(engine)
    });
    Ok(Prepared {
        state,
        loader,
        host: settings.host.clone().unwrap_or_else(|| "127.0.0.1".into()),
        port: settings.port.unwrap_or(8080),
    })
}

/// The `tern serve` command: boots, serves until SIGTERM or Ctrl-C, exits.
pub fn run(args: &ServeArgs) -> Result<()> {
    let settings = crate::cli::merged_settings(args.config.as_ref(), &args.settings)?;
    let prepared = prepare(settings)?;
    let listener = std::net::TcpListener::bind((prepared.host.as_str(), prepared.port))
        .with_context(|| format!("cannot listen on {}:{}", prepared.host, prepared.port))?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    let r = rt.block_on(serve(
        listener,
        prepared,
        Options::default(),
        shutdown_signal(),
    ));
    rt.shutdown_timeout(Duration::from_millis(300));
    if r.is_ok() {
        eprintln!("I serve: stopped");
    }
    r
}

/// SIGTERM or Ctrl-C.
pub async fn shutdown_signal() {
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        _ = tokio::signal::ctrl_c() => {}
        _ = term => {}
    }
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
            "listening on http://{addr} ({} slots × {} tokens, backend {}); loading the model",
            state.cfg.total_slots, state.cfg.n_ctx_slot, state.cfg.backend
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
    let server = axum::serve(listener, app).with_graceful_shutdown(async move {
        n2.notified().await;
    });
    let mut server = tokio::spawn(std::future::IntoFuture::into_future(server));
    let outcome = tokio::select! {
        r = &mut server => {
            return match r {
                Ok(Ok(())) => Ok(()),
                Ok(Err(e)) => Err(anyhow::Error::new(e).context("the HTTP server failed")),
                Err(e) => Err(anyhow::anyhow!("the HTTP server task failed: {e}")),
            };
        }
        _ = stop => Ok(()),
        Ok(e) = &mut fail_rx => Err(e.context("cannot load the model")),
    };
    state.log(
        3,
        format!(
            "shutting down: no new connections; requests in flight have {:.1} s to finish",
            opts.drain.as_secs_f64()
        ),
    );
    notify.notify_one();
    if tokio::time::timeout(opts.drain, &mut server).await.is_err() {
        state.log(3, "cancelling the requests still in flight");
        state.cancel_all.store(true, Ordering::Relaxed);
        if tokio::time::timeout(opts.cancel_wait, &mut server)
            .await
            .is_err()
        {
            state.log(2, "connections still open after cancelling; closing anyway");
            server.abort();
        }
    }
    outcome
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
            let rt = tokio::runtime::Builder::new_multi_thread()
                .worker_threads(2)
                .enable_all()
                .build()?;
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
