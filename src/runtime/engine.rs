//! The serving engine: `parallel` slots over one KV pool of `ctx_size` tokens, decoded together
//! in shared batched steps, prompts fed in `ubatch` chunks between other slots' decode rounds,
//! prefix reuse per slot, MTP drafting, stop conditions, timings and metrics. It runs on its own
//! thread; callers submit requests and read a stream of events.

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{self, Receiver, Sender, TryRecvError};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Instant;

use crate::backend::{Backend, KvTypes};
use crate::gguf::Gguf;
use crate::model::phase;
use crate::model::vision::{Prepared, Projector, VisionConfig};
use crate::model::{BatchItem, ImageRows, Model, ModelError};
use crate::tokenizer::Tokenizer;

use super::budget::BudgetConfig;
use super::constraint::{Constraint, Masks};
use super::sampler::{ProbsRequest, Sampler, SamplerConfig, TokenProbs};
use super::speculative::{
    Company, RoundCostSummary, RoundCosts, SlotDecoder, SpecConfig, SpecStats,
};

#[derive(Clone, Debug, thiserror::Error, PartialEq)]
pub enum EngineError {
    #[error("ctx-size {ctx_size} does not divide evenly across parallel {parallel} slots")]
    UnevenPool { ctx_size: usize, parallel: usize },
    #[error("the slot window n_ctx_slot = {n_ctx_slot} (ctx-size / parallel) exceeds the model's trained context_length {trained}")]
    WindowTooLong { n_ctx_slot: usize, trained: usize },
    #[error("{0}")]
    Config(String),
    #[error(
        "the prompt has {n_prompt} tokens, more than the slot window n_ctx_slot = {n_ctx_slot}"
    )]
    PromptTooLong { n_prompt: usize, n_ctx_slot: usize },
    #[error("the prompt is empty")]
    EmptyPrompt,
    #[error("bad sampling parameters: {0}")]
    Sampling(String),
    #[error("n = {n} choices need {n} slots; this server has {parallel}")]
    TooManyChoices { n: usize, parallel: usize },
    #[error("grammar: {0}")]
    Grammar(String),
    #[error("model error: {0}")]
    Model(String),
    #[error("the engine has stopped")]
    Stopped,
}

#[derive(Clone, Debug, PartialEq)]
pub struct EngineConfig {
    /// The KV pool, in tokens, shared evenly by the slots.
    pub ctx_size: usize,
    pub parallel: usize,
    /// Most prompt tokens one slot feeds per step.
    pub ubatch: usize,
    pub kv_types: KvTypes,
    pub spec: Option<SpecConfig>,
    /// The MTP head's cache dtypes (`--spec-draft-type-k/-v`, llama.cpp default f16).
    pub draft_kv_types: KvTypes,
}

impl EngineConfig {
    pub fn n_ctx_slot(&self) -> usize {
        self.ctx_size / self.parallel.max(1)
    }

    pub fn validate(&self, trained: usize, has_mtp: bool) -> Result<(), EngineError> {
        if self.parallel == 0 || self.ctx_size == 0 || self.ubatch == 0 {
            return Err(EngineError::Config(
                "ctx-size, parallel and ubatch-size must be positive".into(),
            ));
        }
        if !self.ctx_size.is_multiple_of(self.parallel) {
            return Err(EngineError::UnevenPool {
                ctx_size: self.ctx_size,
                parallel: self.parallel,
            });
        }
        if self.n_ctx_slot() > trained {
            return Err(EngineError::WindowTooLong {
                n_ctx_slot: self.n_ctx_slot(),
                trained,
            });
        }
        if self.spec.is_some() && !has_mtp {
            return Err(EngineError::Config(
                "--spec-type draft-mtp needs a model with an MTP block (nextn_predict_layers > 0)"
                    .into(),
            ));
        }
        if let Some(s) = &self.spec {
            if s.n_max == 0 || s.n_min > s.n_max || !(0.0..=1.0).contains(&s.p_min) {
                return Err(EngineError::Config(format!(
                    "bad draft settings: n_max {} n_min {} p_min {}",
                    s.n_max, s.n_min, s.p_min
                )));
            }
        }
        self.kv_types
            .check()
            .map_err(|e| EngineError::Config(e.to_string()))
    }
}

/// The prompt entry of each of an image's rows: no token id, the image's embedding row runs
/// there (llama-server's LLAMA_TOKEN_NULL).
pub const IMAGE_ROW: u32 = u32::MAX;

/// An image in a request's prompt: the pixels ready for the projector, its token grid, and the
/// hash of its file's bytes, which is what prefix reuse compares (its rows have no token ids).
#[derive(Clone, Debug)]
pub struct PromptImage {
    /// Index in [`Request::prompt`] of its first row; the prompt holds [`IMAGE_ROW`] for each
    /// of its `rows · cols` rows.
    pub at: usize,
    pub rows: usize,
    pub cols: usize,
    pub hash: [u8; 32],
    pub pixels: Arc<Prepared>,
}

impl PromptImage {
    pub fn n_tokens(&self) -> usize {
        self.rows * self.cols
    }
}

#[derive(Clone, Debug)]
pub struct Request {
    /// One entry per position: a token id, or [`IMAGE_ROW`] for each row of an image in
    /// `images`.
    pub prompt: Vec<u32>,
    /// The prompt's images, in order (the projector encodes each where the prefill reaches it).
    pub images: Vec<PromptImage>,
    /// Tokens to generate at most; 0 evaluates the prompt into the slot and generates nothing
    /// (llama.cpp's n_predict 0).
    pub max_tokens: usize,
    pub sampler: SamplerConfig,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// `--reasoning-budget`: close the thinking block after this many thinking tokens.
    pub reasoning_budget: Option<BudgetConfig>,
    /// Reuse the slot's cached prefix (llama-server's cache_prompt; default true).
    pub cache_prompt: bool,
    /// Render special tokens in the text (`--special`).
    pub special: bool,
    /// Scale of each loaded LoRA adapter, in load order (empty: every adapter at 0). The server
    /// resolves llama-server's rules (a request's `lora` list, else the global scales) into it.
    pub lora: Vec<f32>,
    /// The grammar the output keeps to.
    pub constraint: Option<Constraint>,
    /// Report each token's probabilities (`n_probs`, `logprobs`).
    pub probs: Option<ProbsRequest>,
    /// Choices: the prompt runs once on one slot, whose state is then copied to `n - 1` more;
    /// choice i draws with seed `seed + i`.
    pub n: usize,
    /// Embed the prompt instead of generating: the slot runs it and sends
    /// [`Event::Embedding`] (pooled as given), then `Done` with no completion.
    pub embed: Option<Pooling>,
}

/// How a prompt's rows (the hidden state after the output norm, llama.cpp's `t_embd`) become
/// its embedding (`--pooling`).
#[derive(
    Copy, Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "kebab-case")]
pub enum Pooling {
    /// Every row, unpooled.
    None,
    /// The mean of the rows.
    Mean,
    /// The first row.
    Cls,
    /// The last row (qwen35's default: a causal model's summary of the whole prompt).
    Last,
}

impl Default for Request {
    fn default() -> Request {
        Request {
            prompt: Vec::new(),
            images: Vec::new(),
            max_tokens: 0,
            sampler: SamplerConfig::default(),
            stop: Vec::new(),
            ignore_eos: false,
            reasoning_budget: None,
            cache_prompt: true,
            special: false,
            lora: Vec::new(),
            constraint: None,
            probs: None,
            n: 1,
            embed: None,
        }
    }
}

/// CPU thread pools for the engine's steps (`--threads`, `--threads-batch`): a step of one
/// token runs on `decode`, any other on `batch` (llama.cpp's rule). `None` is rayon's global
/// pool (every core).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Threads {
    pub decode: Option<usize>,
    pub batch: Option<usize>,
}

#[derive(Clone, Debug, Default, PartialEq)]
pub struct Timings {
    pub prompt_n: usize,
    pub prompt_ms: f64,
    pub predicted_n: usize,
    pub predicted_ms: f64,
    pub draft_n: u64,
    pub draft_n_accepted: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FinishReason {
    /// An end-of-generation token or a stop string.
    Stop,
    /// max_tokens or the slot window.
    Length,
    Cancelled,
}

#[derive(Clone, Debug, PartialEq)]
pub struct Finish {
    /// Which choice (0 unless the request asked for n > 1).
    pub choice: usize,
    pub reason: FinishReason,
    pub stop_word: Option<String>,
    pub prompt_tokens: usize,
    pub cached_tokens: usize,
    pub completion_tokens: usize,
    pub timings: Timings,
}

#[derive(Clone, Debug, PartialEq)]
pub enum Event {
    /// The request has a slot (its first choice's); `cached_tokens` of its prompt were reused
    /// from the slot; `choices` Done events will follow.
    Started {
        slot: usize,
        cached_tokens: usize,
        choices: usize,
    },
    /// A generated token and the text it completes (stop-string-safe, whole UTF-8), with its
    /// probabilities when the request asked for them.
    Token {
        choice: usize,
        id: u32,
        text: String,
        probs: Option<TokenProbs>,
    },
    /// Text held back (for a stop string that never came), released at the end.
    Text {
        choice: usize,
        text: String,
    },
    /// The prompt's embedding rows (one pooled row, or every row with [`Pooling::None`]),
    /// before any normalization; `Done` follows.
    Embedding(Vec<Vec<f32>>),
    /// One choice has ended (a request with n choices sends n of these).
    Done(Finish),
    Error(EngineError),
}

pub struct RequestHandle {
    pub events: Receiver<Event>,
    cancel: Arc<AtomicBool>,
}

impl RequestHandle {
    /// Stops the request at the next step; its slot is freed.
    pub fn cancel(&self) {
        self.cancel.store(true, Ordering::Relaxed);
    }

    /// Waits for the whole result: the tokens, the text and how it ended (a request with one
    /// choice).
    pub fn collect(self) -> Result<(Vec<u32>, String, Finish), EngineError> {
        self.collect_all()?
            .into_iter()
            .next()
            .ok_or(EngineError::Stopped)
    }

    /// Waits for every choice: per choice, the tokens, the text and how it ended.
    pub fn collect_all(self) -> Result<Vec<(Vec<u32>, String, Finish)>, EngineError> {
        let mut out: Vec<(Vec<u32>, String, Option<Finish>)> = Vec::new();
        let grow = |out: &mut Vec<(Vec<u32>, String, Option<Finish>)>, c: usize| {
            while out.len() <= c {
                out.push((Vec::new(), String::new(), None));
            }
        };
        let mut n = 1;
        for ev in self.events.iter() {
            match ev {
                Event::Started { choices, .. } => n = choices,
                Event::Text { choice, text } => {
                    grow(&mut out, choice);
                    out[choice].1.push_str(&text);
                }
                Event::Token {
                    choice, id, text, ..
                } => {
                    grow(&mut out, choice);
                    out[choice].0.push(id);
                    out[choice].1.push_str(&text);
                }
                Event::Done(f) => {
                    grow(&mut out, f.choice);
                    let c = f.choice;
                    out[c].2 = Some(f);
                    if out.iter().filter(|o| o.2.is_some()).count() >= n {
                        return Ok(out
                            .into_iter()
                            .map(|(a, b, f)| (a, b, f.expect("every choice is done")))
                            .collect());
                    }
                }
                Event::Error(e) => return Err(e),
                Event::Embedding(_) => {}
            }
        }
        Err(EngineError::Stopped)
    }
}

/// Counters for `/metrics` (llama-server's families) and `/slots`.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Metrics {
    pub prompt_tokens_total: u64,
    pub prompt_tokens_cached_total: u64,
    pub prompt_seconds_total: f64,
    pub tokens_predicted_total: u64,
    pub tokens_predicted_seconds_total: f64,
    pub n_decode_total: u64,
    pub n_tokens_max: u64,
    pub n_busy_slots_total: u64,
    pub requests_processing: u64,
    pub requests_deferred: u64,
    pub spec: SpecStats,
    /// What draft rounds' parts cost, as measured while decoding (the adaptive depth's input).
    pub round_costs: RoundCostSummary,
    /// Per slot: (is_processing, tokens in the slot's cache).
    pub slots: Vec<(bool, usize)>,
    /// Bytes the slots hold now: attention caches (trunk and MTP) and recurrent state (live,
    /// rollback cells and prompt checkpoints), as the backend allocated them.
    pub kv_bytes: u64,
    pub recurrent_bytes: u64,
    /// The prompt checkpoints' recurrent states (prefix reuse), one copy per slot.
    pub checkpoint_bytes: u64,
    /// Time the grammars took to compute their masks (beside the forward, on its pool).
    pub grammar_mask_seconds_total: f64,
    /// Time steps waited for masks after their forward had finished: the grammars' cost not
    /// hidden behind the forward.
    pub grammar_wait_seconds_total: f64,
    /// Steps that carried no prompt rows, and their wall time (forward, masks, sampling, MTP
    /// fill): a decode step's cost apart from prefills batched beside it.
    pub decode_only_steps_total: u64,
    pub decode_only_seconds_total: f64,
}

struct Submitted {
    req: Request,
    tx: Sender<Event>,
    cancel: Arc<AtomicBool>,
}

enum Phase {
    /// Feeding prompt tokens from `next`.
    Prefill {
        next: usize,
    },
    /// A choice of a request whose prompt another slot runs; it starts from a copy of that
    /// slot's state when the prompt is in.
    Forked,
    Decode,
}

struct Task {
    req: Request,
    /// Which choice this slot generates, and (on the slot running the prompt) the slots of
    /// the other choices.
    choice: usize,
    forks: Vec<usize>,
    tx: Sender<Event>,
    cancel: Arc<AtomicBool>,
    phase: Phase,
    cached: usize,
    generated: Vec<u32>,
    bytes: Vec<u8>,
    /// Bytes of `bytes` already sent as text.
    sent: usize,
    t_start: Instant,
    t_decode: Option<Instant>,
    prompt_ms: f64,
    stats_at_start: SpecStats,
    /// An embedding request's rows so far (the sum for mean pooling).
    embd: Vec<Vec<f32>>,
}

/// The recurrent state, MTP hidden and positions at the end of the last prompt: where a
/// follow-up request that shares that prompt resumes. The states are allocated with the slot
/// (the planner's `checkpoint` term) and overwritten at each prompt's end.
struct PromptCheckpoint<B: Backend> {
    /// The prompt length the states hold, when they hold one.
    pos: Option<usize>,
    rs: Vec<Option<B::Rs>>,
    pending_h: Option<B::T>,
    /// The trunk's position lag, the MTP head's rows and position skip, and how many of the
    /// slot's images the prompt held, at that point.
    lag: usize,
    mtp_pos: usize,
    mtp_skip: usize,
    images: usize,
}

/// An image in a slot's cache: where its rows start in `tokens`, how many there are, and the
/// hash of its bytes.
#[derive(Clone, Debug, PartialEq)]
struct SlotImage {
    at: usize,
    n: usize,
    hash: [u8; 32],
}

struct Slot<B: Backend> {
    dec: SlotDecoder<B>,
    /// Every token fed to the trunk, in order, [`IMAGE_ROW`] for image rows (with `images`, the
    /// prefix cache key).
    tokens: Vec<u32>,
    images: Vec<SlotImage>,
    /// The projector's output for the request's image being fed (its index in the request's
    /// images): encoded once, fed in `ubatch` pieces.
    embd: Option<(usize, B::T)>,
    ckpt: PromptCheckpoint<B>,
    task: Option<Task>,
}

/// What one busy slot feeds a step: prompt tokens or rows of one of its request's images
/// (`(image, first row, rows)`), or a verify batch.
struct Feed {
    slot: usize,
    tokens: Vec<u32>,
    image: Option<(usize, usize, usize)>,
    rows: bool,
    prefill: bool,
}

impl Feed {
    fn len(&self) -> usize {
        self.image.map_or(self.tokens.len(), |im| im.2)
    }
}

pub struct Engine {
    tx: Option<Sender<Submitted>>,
    worker: Option<JoinHandle<()>>,
    metrics: Arc<Mutex<Metrics>>,
    pub config: EngineConfig,
    pub n_vocab: usize,
    /// What boot allocated (weights, caches, states) and the warm-up's compute peak.
    pub allocated: crate::plan::Allocated,
}

impl Engine {
    /// Starts the worker thread that owns the model and the backend.
    pub fn start<B: Backend + 'static>(
        model: Model<B>,
        be: B,
        tok: Arc<Tokenizer>,
        config: EngineConfig,
    ) -> Result<Engine, EngineError>
    where
        B::W: 'static,
    {
        Engine::start_with(model, be, tok, config, Threads::default())
    }

    /// [`Engine::start`] with its own CPU thread pools.
    pub fn start_with<B: Backend + 'static>(
        model: Model<B>,
        be: B,
        tok: Arc<Tokenizer>,
        config: EngineConfig,
        threads: Threads,
    ) -> Result<Engine, EngineError>
    where
        B::W: 'static,
    {
        Engine::start_full(model, be, tok, config, threads, None)
    }

    /// [`Engine::start_with`] and a vision projector (`--mmproj`, with the tower's checked
    /// hparams and token limits), loaded at boot on the model's backend by the engine's thread,
    /// which runs every image through it: encodes are serialized with the steps, whatever the
    /// number of slots.
    pub fn start_full<B: Backend + 'static>(
        model: Model<B>,
        be: B,
        tok: Arc<Tokenizer>,
        config: EngineConfig,
        threads: Threads,
        projector: Option<(Arc<Gguf>, VisionConfig)>,
    ) -> Result<Engine, EngineError>
    where
        B::W: 'static,
    {
        config.validate(model.cfg.context_length, model.cfg.has_mtp())?;
        let pools = Pools::new(threads)?;
        let n_vocab = model.cfg.n_vocab;
        let metrics = Arc::new(Mutex::new(Metrics {
            slots: vec![(false, 0); config.parallel],
            ..Default::default()
        }));
        let (tx, rx) = mpsc::channel::<Submitted>();
        let (boot_tx, boot_rx) = mpsc::channel();
        let cfg = config.clone();
        let m2 = metrics.clone();
        let worker = std::thread::Builder::new()
            .name("tern-engine".into())
            .spawn(move || {
                // Boot (allocation and warm-up) runs on the worker, which owns the backend;
                // `start` waits for its outcome so a shape that cannot be allocated is refused
                // at boot rather than at the first request.
                let booted = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                    Worker::new(model, be, tok, cfg, m2, projector)
                }))
                .unwrap_or_else(|p| {
                    Err(EngineError::Model(format!(
                        "boot failed: {}",
                        panic_text(&p)
                    )))
                });
                match booted {
                    Ok((mut w, allocated)) => {
                        let _ = boot_tx.send(Ok(allocated));
                        w.pools = pools;
                        w.run(rx);
                    }
                    Err(e) => {
                        let _ = boot_tx.send(Err(e));
                    }
                }
            })
            .map_err(|e| EngineError::Model(format!("cannot start the engine thread: {e}")))?;
        let allocated = match boot_rx.recv() {
            Ok(Ok(a)) => a,
            Ok(Err(e)) => {
                let _ = worker.join();
                return Err(e);
            }
            Err(_) => {
                let _ = worker.join();
                return Err(EngineError::Model("the engine thread died at boot".into()));
            }
        };
        Ok(Engine {
            tx: Some(tx),
            worker: Some(worker),
            metrics,
            config,
            n_vocab,
            allocated,
        })
    }

    /// Queues a request; it waits for a free slot if all are busy.
    pub fn submit(&self, req: Request) -> RequestHandle {
        let (tx, rx) = mpsc::channel();
        let cancel = Arc::new(AtomicBool::new(false));
        let sub = Submitted {
            req,
            tx: tx.clone(),
            cancel: cancel.clone(),
        };
        match &self.tx {
            Some(t) if t.send(sub).is_ok() => {}
            _ => {
                let _ = tx.send(Event::Error(EngineError::Stopped));
            }
        }
        RequestHandle { events: rx, cancel }
    }

    pub fn metrics(&self) -> Metrics {
        self.metrics.lock().unwrap().clone()
    }

    /// Stops accepting work, cancels what is in flight and joins the worker.
    pub fn shutdown(&mut self) {
        self.tx.take();
        if let Some(w) = self.worker.take() {
            let _ = w.join();
        }
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        self.shutdown();
    }
}

struct Worker<B: Backend> {
    model: Model<B>,
    projector: Option<Projector<B>>,
    be: B,
    tok: Arc<Tokenizer>,
    cfg: EngineConfig,
    slots: Vec<Slot<B>>,
    queue: VecDeque<Submitted>,
    metrics: Arc<Mutex<Metrics>>,
    closed: bool,
    pools: Pools,
    costs: RoundCosts,
}

/// The masks for a verify batch; a panic inside the grammar engine fails this request only.
fn guarded_masks(c: &mut Constraint, drafts: &[u32]) -> Result<Masks, String> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| c.masks_for(drafts)))
        .unwrap_or_else(|p| Err(format!("the grammar engine failed: {}", panic_text(&p))))
}

/// A constrained slot's grammar while its masks are computed beside the forward: (slot,
/// grammar, drafts, the masks once computed).
type MaskJob = (usize, Constraint, Vec<u32>, Option<Result<Masks, String>>);

/// The engine's own rayon pools (empty: the global pool).
#[derive(Clone, Default)]
struct Pools {
    decode: Option<Arc<rayon::ThreadPool>>,
    batch: Option<Arc<rayon::ThreadPool>>,
}

impl Pools {
    fn new(t: Threads) -> Result<Pools, EngineError> {
        let build = |n: usize, name: &'static str| {
            rayon::ThreadPoolBuilder::new()
                .num_threads(n)
                .thread_name(move |i| format!("tern-{name}-{i}"))
                .build()
                .map(Arc::new)
                .map_err(|e| EngineError::Config(format!("cannot start {n} {name} threads: {e}")))
        };
        let decode = t.decode.map(|n| build(n, "decode")).transpose()?;
        let batch = match (t.batch, t.decode) {
            (Some(b), Some(d)) if b == d => decode.clone(),
            (Some(b), _) => Some(build(b, "batch")?),
            (None, _) => decode.clone(),
        };
        Ok(Pools { decode, batch })
    }
}

/// The text of `bytes` up to an incomplete trailing UTF-8 sequence (held back until its last
/// byte arrives); invalid bytes become U+FFFD as in a lossy decode. Returns the text and the
/// bytes it consumed.
pub fn utf8_prefix(bytes: &[u8]) -> (String, usize) {
    let mut out = String::new();
    let mut i = 0;
    loop {
        match std::str::from_utf8(&bytes[i..]) {
            Ok(s) => {
                out.push_str(s);
                return (out, bytes.len());
            }
            Err(e) => {
                let good = i + e.valid_up_to();
                out.push_str(std::str::from_utf8(&bytes[i..good]).expect("valid prefix"));
                match e.error_len() {
                    Some(n) => {
                        out.push('\u{FFFD}');
                        i = good + n;
                    }
                    None => return (out, good),
                }
            }
        }
    }
}

fn floor_char_boundary(s: &str, mut i: usize) -> usize {
    i = i.min(s.len());
    while !s.is_char_boundary(i) {
        i -= 1;
    }
    i
}

fn panic_text(p: &Box<dyn std::any::Any + Send>) -> String {
    p.downcast_ref::<String>()
        .cloned()
        .or_else(|| p.downcast_ref::<&str>().map(|s| s.to_string()))
        .unwrap_or_default()
}

fn model_err(e: ModelError) -> EngineError {
    EngineError::Model(e.to_string())
}

impl<B: Backend> Worker<B> {
    fn new(
        model: Model<B>,
        be: B,
        tok: Arc<Tokenizer>,
        cfg: EngineConfig,
        metrics: Arc<Mutex<Metrics>>,
        projector: Option<(Arc<Gguf>, VisionConfig)>,
    ) -> Result<(Self, crate::plan::Allocated), EngineError> {
        let projector = projector
            .map(|(f, vcfg)| {
                let mut p = Projector::load(&be, f, model.cfg.n_embd)?;
                p.set_token_limits(Some(vcfg.min_tokens), Some(vcfg.max_tokens))?;
                Ok(p)
            })
            .transpose()
            .map_err(|e: crate::model::vision::VisionError| {
                EngineError::Config(format!("the projector (--mmproj): {e}"))
            })?;
        let mut slots = Vec::with_capacity(cfg.parallel);
        let gp = model.cfg.gdn_params();
        for _ in 0..cfg.parallel {
            // The slot's whole window is allocated now: decoding never allocates cache memory.
            let mut seq = model.new_state_with(&be, cfg.kv_types).map_err(model_err)?;
            seq.lora = vec![0.0; model.adapters.len()];
            seq.reserve(&be, cfg.n_ctx_slot())
                .map_err(|e| EngineError::Model(format!("KV cache: {e}")))?;
            let mut dec = SlotDecoder::new(
                &model,
                &be,
                seq,
                Sampler::new(SamplerConfig::greedy()),
                cfg.spec.as_ref().map(|sp| (cfg.draft_kv_types, sp.n_max)),
            )
            .map_err(model_err)?;
            if let Some(m) = dec.mtp.as_mut() {
                m.state.lora = vec![0.0; model.adapters.len()];
                be.kv_reserve(&mut m.state.kv, cfg.n_ctx_slot())
                    .map_err(|e| EngineError::Model(format!("draft KV cache: {e}")))?;
            }
            let ckpt_rs = dec
                .seq
                .rs
                .iter()
                .map(|r| r.as_ref().map(|_| be.new_recurrent(&gp)))
                .collect();
            slots.push(Slot {
                dec,
                tokens: Vec::new(),
                images: Vec::new(),
                embd: None,
                ckpt: PromptCheckpoint {
                    pos: None,
                    rs: ckpt_rs,
                    pending_h: None,
                    lag: 0,
                    mtp_pos: 0,
                    mtp_skip: 0,
                    images: 0,
                },
                task: None,
            });
        }
        let mut w = Worker {
            model,
            projector,
            be,
            tok,
            cfg,
            slots,
            queue: VecDeque::new(),
            metrics,
            closed: false,
            pools: Pools::default(),
            costs: RoundCosts::default(),
        };
        let allocated = w.boot_ledger()?;
        Ok((w, allocated))
    }

    /// Weights, caches and states as allocated, then a warm-up step of the largest batch the
    /// scheduler forms (a full ubatch of prompt on slot 0 through the trunk and the MTP block,
    /// a verify batch of `1 + draft depth` rows on every other slot), measuring the compute
    /// it takes; the slots are reset afterwards.
    fn boot_ledger(&mut self) -> Result<crate::plan::Allocated, EngineError> {
        let be = &self.be;
        let mut weights = crate::backend::WeightTally::default();
        self.model.w.each(|w| weights.add(be.weight_bytes(w)));
        let mut a = crate::plan::Allocated {
            weights: weights.total(),
            ..Default::default()
        };
        (a.kv, a.draft_kv, a.recurrent, a.checkpoint) = self.holdings();
        for ad in &self.model.adapters {
            let mut t = crate::backend::WeightTally::default();
            for p in ad.pairs.values() {
                t.add(be.weight_bytes(&p.a));
                t.add(be.weight_bytes(&p.b));
            }
            a.lora = a.lora.saturating_add(t.total());
        }
        if let Some(p) = &self.projector {
            (a.projector, a.vision_compute, a.vision_how) =
                crate::plan::boot::projector_allocated(be, p);
        }
        let heap = crate::alloc::mark();
        // Every adapter on, so the step measures their compute too.
        self.set_lora_all(1.0);
        self.warm_up()?;
        self.set_lora_all(0.0);
        let be = &self.be;
        (a.compute, a.compute_how) = match be.compute_bytes() {
            Some(after) => (
                Some(after),
                format!("{}'s buffer pool after the warm-up step", be.name()),
            ),
            None => match crate::alloc::peak_since(heap) {
                Some(p) => (
                    Some(p),
                    "the heap's peak growth over the warm-up step".to_string(),
                ),
                None => (None, "not measured (no counting allocator)".to_string()),
            },
        };
        for i in 0..self.slots.len() {
            self.reset_slot(i);
        }
        Ok(a)
    }

    fn set_lora_all(&mut self, scale: f32) {
        let n = self.model.adapters.len();
        for s in &mut self.slots {
            s.dec.seq.lora = vec![scale; n];
            if let Some(m) = s.dec.mtp.as_mut() {
                m.state.lora = vec![scale; n];
            }
        }
    }

    fn warm_up(&mut self) -> Result<(), EngineError> {
        let n_ctx_slot = self.cfg.n_ctx_slot();
        let depth = self.cfg.spec.as_ref().map_or(0, |sp| sp.n_max);
        let first = vec![0u32; self.cfg.ubatch.min(n_ctx_slot).max(1)];
        let verify = vec![0u32; (1 + depth).min(n_ctx_slot)];
        let outs = {
            let mut items: Vec<BatchItem<B>> = self
                .slots
                .iter_mut()
                .enumerate()
                .map(|(i, s)| {
                    let tokens: &[u32] = if i == 0 { &first } else { &verify };
                    let wants = s.dec.wants_rows();
                    BatchItem {
                        seq: &mut s.dec.seq,
                        tokens,
                        image: None,
                        all_rows: i > 0,
                        hidden_rows: i == 0 && wants,
                        snapshot: i > 0 && tokens.len() > 1,
                    }
                })
                .collect();
            self.model
                .forward_batch(&self.be, &mut items)
                .map_err(model_err)?
        };
        let first_h = &outs[0].h;
        self.slots[0]
            .dec
            .mtp_process(&self.model, &self.be, &first, first_h, false)
            .map_err(model_err)?;
        for o in &outs {
            // Reading the ids back finishes the step on a device.
            let _ = self.be.argmax_rows(&o.logits);
        }
        Ok(())
    }

    fn run(&mut self, rx: Receiver<Submitted>) {
        loop {
            let busy = self.slots.iter().any(|s| s.task.is_some());
            // Block only when there is nothing to do.
            if !busy && self.queue.is_empty() {
                if self.closed {
                    return;
                }
                match rx.recv() {
                    Ok(s) => self.queue.push_back(s),
                    Err(_) => return,
                }
            }
            loop {
                match rx.try_recv() {
                    Ok(s) => self.queue.push_back(s),
                    Err(TryRecvError::Empty) => break,
                    Err(TryRecvError::Disconnected) => {
                        self.closed = true;
                        break;
                    }
                }
            }
            if self.closed {
                // Shutdown: cancel everything still queued or running.
                for s in self.queue.drain(..) {
                    let _ = s.tx.send(Event::Error(EngineError::Stopped));
                }
                for i in 0..self.slots.len() {
                    if self.slots[i].task.is_some() {
                        self.finish(i, FinishReason::Cancelled, None);
                    }
                }
                return;
            }
            self.assign();
            self.publish();
            // A step of one token runs on the decode pool, any other on the batch pool.
            let pool = if self.one_token_step() {
                self.pools.decode.clone()
            } else {
                self.pools.batch.clone()
            };
            // A bug in a step must fail the requests in flight, not kill the engine. The step
            // runs where the backend runs a step best (on the CPU: on a worker of the pool,
            // the others kept hot until it ends).
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| match &pool {
                Some(p) => p.install(|| B::run_step(|| self.step())),
                None => B::run_step(|| self.step()),
            }))
            .unwrap_or_else(|p| {
                Err(EngineError::Model(format!(
                    "internal error: {}",
                    panic_text(&p)
                )))
            });
            if let Err(e) = r {
                // A model error fails the requests in flight, never the process.
                for i in 0..self.slots.len() {
                    if let Some(t) = self.slots[i].task.take() {
                        let _ = t.tx.send(Event::Error(e.clone()));
                        self.reset_slot(i);
                    }
                }
            }
            self.publish();
        }
    }

    /// Whether the next step feeds one token: a single busy slot decoding without drafts.
    fn one_token_step(&self) -> bool {
        let mut busy = self.slots.iter().filter_map(|s| s.task.as_ref());
        match (busy.next(), busy.next()) {
            (Some(t), None) => matches!(t.phase, Phase::Decode) && self.cfg.spec.is_none(),
            _ => false,
        }
    }

    fn publish(&self) {
        let mut m = self.metrics.lock().unwrap();
        m.requests_processing = self.slots.iter().filter(|s| s.task.is_some()).count() as u64;
        m.requests_deferred = self.queue.len() as u64;
        m.slots = self
            .slots
            .iter()
            .map(|s| (s.task.is_some(), s.tokens.len()))
            .collect();
        let (kv, draft_kv, rec, ckpt) = self.holdings();
        m.kv_bytes = kv + draft_kv;
        m.recurrent_bytes = rec;
        m.checkpoint_bytes = ckpt;
    }

    /// Bytes the slots hold, as the backend allocated them: (trunk KV, MTP KV, recurrent
    /// states with their rollback cells, prompt checkpoints).
    fn holdings(&self) -> (u64, u64, u64, u64) {
        let be = &self.be;
        let states = |rs: &mut dyn Iterator<Item = &B::Rs>| -> u64 {
            rs.map(|r| be.recurrent_bytes(r)).sum()
        };
        let mut t = (0u64, 0u64, 0u64, 0u64);
        for s in &self.slots {
            t.0 += s
                .dec
                .seq
                .kv
                .iter()
                .flatten()
                .map(|k| be.kv_bytes(k))
                .sum::<u64>();
            t.1 += s.dec.mtp.as_ref().map_or(0, |m| be.kv_bytes(&m.state.kv));
            t.2 += states(
                &mut s
                    .dec
                    .seq
                    .rs
                    .iter()
                    .flatten()
                    .chain(s.dec.seq.cells.iter().flatten()),
            );
            t.3 += states(&mut s.ckpt.rs.iter().flatten());
        }
        t
    }

    fn reset_slot(&mut self, i: usize) {
        let s = &mut self.slots[i];
        for kv in s.dec.seq.kv.iter_mut().flatten() {
            self.be.kv_truncate(kv, 0);
        }
        let gp = self.model.cfg.gdn_params();
        let zero = self.be.new_recurrent(&gp);
        for r in s.dec.seq.rs.iter_mut().flatten() {
            self.be.recurrent_copy(&zero, r);
        }
        s.dec.seq.pos = 0;
        s.dec.seq.lag = 0;
        if let Some(m) = s.dec.mtp.as_mut() {
            self.be.kv_truncate(&mut m.state.kv, 0);
            m.state.pos = 0;
            m.state.skip = 0;
            let ne = self.model.cfg.n_embd;
            m.pending_h = self.be.from_host(&vec![0.0; ne], 1, ne);
            m.drop_held();
        }
        s.tokens.clear();
        s.images.clear();
        s.embd = None;
        s.ckpt.pos = None;
        s.ckpt.pending_h = None;
    }

    /// Rolls a slot back to `pos`, which is either its end or its prompt checkpoint.
    fn rewind(&mut self, i: usize, pos: usize) {
        let s = &mut self.slots[i];
        if pos == s.tokens.len() {
            return;
        }
        let ck = &s.ckpt;
        debug_assert_eq!(ck.pos, Some(pos), "rewind to the prompt checkpoint");
        for (c, r) in ck.rs.iter().zip(s.dec.seq.rs.iter_mut()) {
            if let (Some(c), Some(r)) = (c.as_ref(), r.as_mut()) {
                self.be.recurrent_copy(c, r);
            }
        }
        for kv in s.dec.seq.kv.iter_mut().flatten() {
            self.be.kv_truncate(kv, pos);
        }
        s.dec.seq.pos = pos;
        s.dec.seq.lag = ck.lag;
        if let (Some(m), Some(h)) = (s.dec.mtp.as_mut(), ck.pending_h.as_ref()) {
            self.be.kv_truncate(&mut m.state.kv, ck.mtp_pos);
            m.state.pos = ck.mtp_pos;
            m.state.skip = ck.mtp_skip;
            m.pending_h = self.be.rows(h, 0, 1);
            m.drop_held();
        }
        s.tokens.truncate(pos);
        s.images.truncate(ck.images);
        s.embd = None;
    }

    /// How much of `prompt` slot `i` can reuse: its whole history when the prompt extends it,
    /// else its last prompt when the prompt extends that; at least one token is left to run.
    /// Nothing is reusable under other adapter scales: the cache was computed with them. An
    /// image is reused whole or not at all, and only where the same bytes (its hash) sit at the
    /// same place.
    fn reusable(&self, i: usize, prompt: &[u32], images: &[PromptImage], lora: &[f32]) -> usize {
        let s = &self.slots[i];
        if s.dec.seq.lora != lora {
            return 0;
        }
        let mut common = s
            .tokens
            .iter()
            .zip(prompt)
            .take_while(|(a, b)| a == b)
            .count();
        let ours = s.images.iter().map(|im| (im.at, im.n, &im.hash));
        let theirs = images.iter().map(|im| (im.at, im.n_tokens(), &im.hash));
        let mut starts: Vec<_> = ours.clone().chain(theirs.clone()).map(|x| x.0).collect();
        starts.sort_unstable();
        for at in starts.into_iter().take_while(|&at| at < common) {
            let a = ours.clone().find(|x| x.0 == at);
            let b = theirs.clone().find(|x| x.0 == at);
            if a.is_none() || a != b || at + a.map_or(0, |x| x.1) > common {
                common = at;
                break;
            }
        }
        if common == s.tokens.len() && common < prompt.len() {
            return common;
        }
        match s.ckpt.pos {
            Some(pos) if pos <= common && pos < prompt.len() => pos,
            _ => 0,
        }
    }

    /// A request's adapter scales as a sequence takes them: one per loaded adapter.
    fn lora_scales(&self, req: &[f32]) -> Result<Vec<f32>, EngineError> {
        let n = self.model.adapters.len();
        if req.is_empty() {
            return Ok(vec![0.0; n]);
        }
        if req.len() != n {
            return Err(EngineError::Config(format!(
                "lora: {} scales for {n} loaded adapters",
                req.len()
            )));
        }
        if let Some(s) = req.iter().find(|s| !s.is_finite()) {
            return Err(EngineError::Config(format!(
                "lora: scale {s} is not a finite number"
            )));
        }
        Ok(req.to_vec())
    }

    /// A request's images against its prompt and this engine: a projector is loaded, each
    /// image's grid is the one its pixels give, and the prompt holds [`IMAGE_ROW`] exactly at
    /// their rows.
    fn check_images(&self, req: &Request) -> Result<(), EngineError> {
        let rows = req.prompt.iter().filter(|&&t| t == IMAGE_ROW).count();
        if req.images.is_empty() && rows == 0 {
            return Ok(());
        }
        let Some(proj) = self.projector.as_ref() else {
            return Err(EngineError::Config(
                "the prompt has images but no projector (--mmproj) is loaded".into(),
            ));
        };
        let mut end = 0;
        let mut held = 0;
        for (k, im) in req.images.iter().enumerate() {
            let n = im.n_tokens();
            let grid = im.pixels.grid(&proj.cfg);
            let placed = im.at >= end
                && im.at + n <= req.prompt.len()
                && req.prompt[im.at..im.at + n].iter().all(|&t| t == IMAGE_ROW);
            if n == 0 || grid != (im.rows, im.cols) || !placed {
                return Err(EngineError::Config(format!(
                    "image {k}: a {}x{} grid at prompt row {} does not match its pixels ({}x{}) or the prompt",
                    im.rows, im.cols, im.at, grid.0, grid.1
                )));
            }
            end = im.at + n;
            held += n;
        }
        if held != rows {
            return Err(EngineError::Config(format!(
                "the prompt has {rows} image rows; its images have {held}"
            )));
        }
        Ok(())
    }

    fn assign(&mut self) {
        while let Some(sub) = self.queue.front() {
            if sub.cancel.load(Ordering::Relaxed) {
                let sub = self.queue.pop_front().unwrap();
                let _ = sub.tx.send(Event::Error(EngineError::Config(
                    "cancelled before it started".into(),
                )));
                continue;
            }
            let n_ctx_slot = self.cfg.n_ctx_slot();
            let err = if sub.req.prompt.is_empty() {
                Some(EngineError::EmptyPrompt)
            } else if sub.req.prompt.len() >= n_ctx_slot {
                Some(EngineError::PromptTooLong {
                    n_prompt: sub.req.prompt.len(),
                    n_ctx_slot,
                })
            } else if let Err(e) = self.check_images(&sub.req) {
                Some(e)
            } else if let Some(&id) = sub
                .req
                .prompt
                .iter()
                .find(|&&t| t != IMAGE_ROW && t as usize >= self.model.cfg.n_vocab)
            {
                Some(EngineError::Model(format!(
                    "token id {id} is outside the vocabulary of {}",
                    self.model.cfg.n_vocab
                )))
            } else if let Err(e) = self.lora_scales(&sub.req.lora) {
                Some(e)
            } else {
                sub.req.sampler.validate().err().map(EngineError::Sampling)
            };
            if let Some(e) = err {
                let sub = self.queue.pop_front().unwrap();
                let _ = sub.tx.send(Event::Error(e));
                continue;
            }
            let lora = self.lora_scales(&sub.req.lora).unwrap_or_default();
            let n = sub.req.n.max(1);
            if n > self.slots.len() {
                let sub = self.queue.pop_front().unwrap();
                let _ = sub.tx.send(Event::Error(EngineError::TooManyChoices {
                    n,
                    parallel: self.slots.len(),
                }));
                continue;
            }
            // The free slot that reuses the most of this prompt runs it; n - 1 more wait for
            // its state.
            let free: Vec<usize> = (0..self.slots.len())
                .filter(|&i| self.slots[i].task.is_none())
                .collect();
            if free.len() < n {
                return;
            }
            let Some(&best) = free.iter().max_by_key(|&&i| {
                let r = self.reusable(i, &sub.req.prompt, &sub.req.images, &lora);
                (r, usize::MAX - i)
            }) else {
                return;
            };
            let forks: Vec<usize> = free
                .iter()
                .copied()
                .filter(|&i| i != best)
                .take(n - 1)
                .collect();
            let sub = self.queue.pop_front().unwrap();
            let mut reuse = if sub.req.cache_prompt {
                self.reusable(best, &sub.req.prompt, &sub.req.images, &lora)
            } else {
                0
            };
            // Pooling over rows needs every row of this prompt computed afresh.
            if sub.req.embed.is_some_and(|p| p != Pooling::Last) {
                reuse = 0;
            }
            if reuse == 0 {
                self.reset_slot(best);
            } else {
                self.rewind(best, reuse);
            }
            // An image a cancelled request left half-fed is not this request's.
            self.slots[best].embd = None;
            // The forks take the scales from fork_state, with the state computed under them.
            let slot = &mut self.slots[best];
            if let Some(m) = slot.dec.mtp.as_mut() {
                m.state.lora = lora.clone();
            }
            slot.dec.seq.lora = lora;
            let _ = sub.tx.send(Event::Started {
                slot: best,
                cached_tokens: reuse,
                choices: n,
            });
            let mut req = sub.req;
            let constraint = req.constraint.take();
            // One grammar state per choice, popped from the back: choice 0 takes the original.
            let mut fork_constraints: Vec<Option<Constraint>> = (1..n)
                .map(|_| constraint.as_ref().map(Constraint::fork))
                .collect();
            fork_constraints.reverse();
            fork_constraints.push(constraint);
            for (c, &i) in std::iter::once(&best).chain(forks.iter()).enumerate() {
                let slot = &mut self.slots[i];
                let mut cfg = req.sampler.clone();
                cfg.seed = cfg.seed.wrapping_add(c as u64);
                let mut sampler = Sampler::new(cfg).with_budget(req.reasoning_budget.clone());
                // llama-server feeds the prompt to the sampler (penalties and DRY see it).
                for &t in req.prompt.iter().filter(|&&t| t != IMAGE_ROW) {
                    sampler.accept_prompt(t);
                }
                let con = fork_constraints.pop().flatten();
                slot.dec.start_request(sampler, con, req.probs);
                slot.task = Some(Task {
                    req: req.clone(),
                    choice: c,
                    forks: if c == 0 { forks.clone() } else { Vec::new() },
                    tx: sub.tx.clone(),
                    cancel: sub.cancel.clone(),
                    phase: if c == 0 {
                        Phase::Prefill { next: reuse }
                    } else {
                        Phase::Forked
                    },
                    cached: if c == 0 { reuse } else { req.prompt.len() },
                    generated: Vec::new(),
                    bytes: Vec::new(),
                    sent: 0,
                    t_start: Instant::now(),
                    t_decode: None,
                    prompt_ms: 0.0,
                    stats_at_start: slot.dec.stats.clone(),
                    embd: Vec::new(),
                });
            }
        }
    }

    /// Copies slot `from`'s state (caches, recurrent states, MTP head, prompt checkpoint) to
    /// slot `to`: a fork for another choice of the same prompt.
    fn fork_state(&mut self, from: usize, to: usize) {
        assert_ne!(from, to);
        let (a, b) = if from < to {
            let (l, r) = self.slots.split_at_mut(to);
            (&l[from], &mut r[0])
        } else {
            let (l, r) = self.slots.split_at_mut(from);
            (&r[0], &mut l[to])
        };
        let be = &self.be;
        for (x, y) in a.dec.seq.kv.iter().zip(b.dec.seq.kv.iter_mut()) {
            if let (Some(x), Some(y)) = (x, y) {
                be.kv_copy(x, y);
            }
        }
        for (x, y) in a.dec.seq.rs.iter().zip(b.dec.seq.rs.iter_mut()) {
            if let (Some(x), Some(y)) = (x, y) {
                be.recurrent_copy(x, y);
            }
        }
        b.dec.seq.pos = a.dec.seq.pos;
        b.dec.seq.lag = a.dec.seq.lag;
        // The copied cache was computed under these adapter scales (reusable() compares them).
        b.dec.seq.lora = a.dec.seq.lora.clone();
        if let (Some(x), Some(y)) = (a.dec.mtp.as_ref(), b.dec.mtp.as_mut()) {
            be.kv_copy(&x.state.kv, &mut y.state.kv);
            y.state.pos = x.state.pos;
            y.state.skip = x.state.skip;
            y.state.lora = x.state.lora.clone();
            y.pending_h = be.rows(&x.pending_h, 0, 1);
            y.held = x.held.clone();
            y.held_h = x.held_h.as_ref().map(|h| be.rows(h, 0, x.held.len()));
            y.ahead = x.ahead;
        }
        for (x, y) in a.ckpt.rs.iter().zip(b.ckpt.rs.iter_mut()) {
            if let (Some(x), Some(y)) = (x, y) {
                be.recurrent_copy(x, y);
            }
        }
        b.ckpt.pos = a.ckpt.pos;
        b.ckpt.pending_h = a.ckpt.pending_h.as_ref().map(|h| be.rows(h, 0, 1));
        b.ckpt.lag = a.ckpt.lag;
        b.ckpt.mtp_pos = a.ckpt.mtp_pos;
        b.ckpt.mtp_skip = a.ckpt.mtp_skip;
        b.ckpt.images = a.ckpt.images;
        b.tokens = a.tokens.clone();
        b.images = a.images.clone();
        b.embd = None;
    }

    /// One batched step over every busy slot.
    fn step(&mut self) -> Result<(), EngineError> {
        let t_step = Instant::now();
        phase::discard();
        // Cancelled requests free their slots first.
        for i in 0..self.slots.len() {
            let cancelled = self.slots[i]
                .task
                .as_ref()
                .is_some_and(|t| t.cancel.load(Ordering::Relaxed));
            if cancelled {
                self.finish(i, FinishReason::Cancelled, None);
            }
        }
        let spec = self.cfg.spec.clone();
        let n_ctx_slot = self.cfg.n_ctx_slot();
        // The rows decoding slots fed last step, and how many they are: a slot's depth is
        // priced beside the others'.
        let (decode_rows, decode_slots) = self
            .slots
            .iter()
            .filter(|s| matches!(s.task.as_ref().map(|t| &t.phase), Some(Phase::Decode)))
            .fold((0usize, 0usize), |(r, n), s| {
                (r + 1 + s.dec.depth.depth, n + 1)
            });
        // What each busy slot feeds this step.
        let mut plan: Vec<Feed> = Vec::new();
        for i in 0..self.slots.len() {
            let Some(task) = self.slots[i].task.as_ref() else {
                continue;
            };
            match task.phase {
                Phase::Forked => {}
                Phase::Prefill { next } => {
                    let pooled_rows = task.req.embed.is_some_and(|p| p != Pooling::Last);
                    let rows = self.slots[i].dec.wants_rows() || pooled_rows;
                    let images = &task.req.images;
                    let within = images
                        .iter()
                        .position(|im| im.at <= next && next < im.at + im.n_tokens())
                        .map(|k| (k, next - images[k].at, images[k].n_tokens()));
                    let stop = images
                        .iter()
                        .map(|im| im.at)
                        .filter(|&at| at > next)
                        .min()
                        .unwrap_or(task.req.prompt.len());
                    let end = (next + self.cfg.ubatch).min(stop);
                    let chunk = task.req.prompt[next..end].to_vec();
                    let pixels = within.map(|(k, ..)| images[k].pixels.clone());
                    if let (Some((k, first, total)), Some(pixels)) = (within, pixels) {
                        // An image's rows: encoded when the prefill first reaches it.
                        let n = (total - first).min(self.cfg.ubatch);
                        if self.slots[i].embd.as_ref().map(|e| e.0) != Some(k) {
                            let proj = self.projector.as_ref().ok_or_else(|| {
                                EngineError::Config("no projector (--mmproj) is loaded".into())
                            })?;
                            let e = proj.encode(&self.be, &pixels);
                            self.slots[i].embd = Some((k, e));
                        }
                        plan.push(Feed {
                            slot: i,
                            tokens: Vec::new(),
                            image: Some((k, first, n)),
                            // The MTP head never reads an image's rows.
                            rows: pooled_rows,
                            prefill: true,
                        });
                        continue;
                    }
                    plan.push(Feed {
                        slot: i,
                        tokens: chunk,
                        image: None,
                        rows,
                        prefill: true,
                    });
                }
                Phase::Decode => {
                    let room = n_ctx_slot.saturating_sub(self.slots[i].dec.seq.pos + 1);
                    let mut drafts = match &spec {
                        Some(sp) => {
                            let s = &mut self.slots[i];
                            let others = Company {
                                rows: decode_rows.saturating_sub(1 + s.dec.depth.depth),
                                slots: decode_slots.saturating_sub(1),
                            };
                            let depth = if sp.adaptive {
                                s.dec.depth.pick(sp.n_max, &self.costs, others)
                            } else {
                                sp.n_max
                            };
                            s.dec
                                .draft(&self.model, &self.be, sp, room.min(depth), &mut self.costs)
                                .map_err(model_err)?
                        }
                        None => Vec::new(),
                    };
                    // Drafts the grammar rejects would only be rejected again at verify.
                    if let (Some(c), Some(sp)) = (self.slots[i].dec.constraint.as_mut(), &spec) {
                        drafts.truncate(c.valid_prefix(&drafts));
                        if drafts.len() < sp.n_min {
                            drafts.clear();
                        }
                    }
                    let batch = self.slots[i]
                        .dec
                        .begin_verify(&self.model, &self.be, &drafts);
                    let rows = !drafts.is_empty() || self.slots[i].dec.wants_rows();
                    plan.push(Feed {
                        slot: i,
                        tokens: batch,
                        image: None,
                        rows,
                        prefill: false,
                    });
                }
            }
        }
        if plan.is_empty() {
            return Ok(());
        }
        // The grammar masks for the rows this step samples (a verify batch's rows after the
        // drafts so far, a prompt's first token) are rayon jobs in the forward's own pool: a
        // worker takes them in the gaps of the forward's parallel loops. A thread of their own
        // would contend with the pool's workers for the cores, and a preempted worker stalls
        // every parallel matmul of the step.
        let mut mask_jobs: Vec<MaskJob> = Vec::new();
        for f in &plan {
            let s = &mut self.slots[f.slot];
            let last_chunk = match s.task.as_ref().map(|t| (&t.phase, t.req.prompt.len())) {
                Some((Phase::Prefill { next }, n)) => next + f.len() >= n,
                _ => false,
            };
            if (f.prefill && !last_chunk)
                || !s.dec.constraint.as_ref().is_some_and(Constraint::is_active)
            {
                continue;
            }
            let drafts = if f.prefill {
                Vec::new()
            } else {
                f.tokens[1..].to_vec()
            };
            let c = s.dec.constraint.take().expect("active");
            mask_jobs.push((f.slot, c, drafts, None));
        }
        let t0 = Instant::now();
        let mut forward_s = 0f64;
        let outs = rayon::in_place_scope(|scope| {
            for (_, c, drafts, out) in mask_jobs.iter_mut() {
                scope.spawn(move |_| *out = Some(guarded_masks(c, drafts)));
            }
            type Parts<'a, B> = (
                &'a mut crate::model::SeqState<B>,
                Option<&'a <B as Backend>::T>,
                Option<&'a Task>,
            );
            let mut parts: Vec<Option<Parts<B>>> = self
                .slots
                .iter_mut()
                .map(|s| {
                    Some((
                        &mut s.dec.seq,
                        s.embd.as_ref().map(|e| &e.1),
                        s.task.as_ref(),
                    ))
                })
                .collect();
            let mut items: Vec<BatchItem<B>> = plan
                .iter()
                .map(|f| {
                    let (seq, embd, task) = parts[f.slot].take().unwrap();
                    let image = f.image.map(|(k, first, n)| {
                        let im = &task.expect("a feeding slot has a task").req.images[k];
                        ImageRows {
                            embd: embd.expect("the image was encoded"),
                            rows: im.rows,
                            cols: im.cols,
                            first,
                            n,
                        }
                    });
                    BatchItem {
                        seq,
                        tokens: &f.tokens,
                        image,
                        // A prompt chunk feeding the MTP head wants h of every row, logits of
                        // the last; a verify batch wants both of every row.
                        all_rows: f.rows && !f.prefill,
                        hidden_rows: f.rows && f.prefill,
                        // A verify batch with drafts keeps per-row rollback cells.
                        snapshot: !f.prefill && f.tokens.len() > 1,
                    }
                })
                .collect();
            let outs = self.model.forward_batch_joined(&self.be, &mut items);
            forward_s = t0.elapsed().as_secs_f64();
            outs
        });
        let step_s = t0.elapsed().as_secs_f64();
        let mut mask_s = 0f64;
        for (i, c, _, masks) in mask_jobs {
            let d = &mut self.slots[i].dec;
            mask_s += c.mask_cost().as_secs_f64();
            d.constraint = Some(c);
            match masks.expect("the scope ran every mask job") {
                Ok(m) => d.masks = m,
                Err(e) => d.constraint_error = Some(e),
            }
        }
        // Each item's logits rows stay where the forward left them, read in place by row.
        let joined = outs.map_err(model_err)?;
        let runs: Vec<(usize, usize)> = (0..plan.len()).map(|k| joined.logits_run(k)).collect();
        let n_logits = joined.logits_rows();
        let (logits, hs) = joined.split_h(&self.be);
        {
            let mut m = self.metrics.lock().unwrap();
            m.n_decode_total += 1;
            m.n_busy_slots_total += plan.len() as u64;
            m.grammar_mask_seconds_total += mask_s;
            m.grammar_wait_seconds_total += step_s - forward_s;
        }
        let mut emitted: Vec<(usize, Vec<u32>)> = Vec::new();
        // Decoding slots' kept rows and their trunk h, for the MTP block after the loop.
        let mut fills: Vec<(usize, &[u32], B::T)> = Vec::new();
        let mut prompt_only: Vec<usize> = Vec::new();
        for ((f, h), &(first, _)) in plan.iter().zip(hs).zip(&runs) {
            let (i, toks, rows) = (f.slot, &f.tokens, &f.rows);
            if f.prefill {
                let s = &mut self.slots[i];
                let task = s.task.as_mut().unwrap();
                match f.image {
                    Some((k, first, n)) => {
                        let im = &task.req.images[k];
                        if first == 0 {
                            s.images.push(SlotImage {
                                at: s.tokens.len(),
                                n: im.n_tokens(),
                                hash: im.hash,
                            });
                        }
                        s.tokens.extend(std::iter::repeat_n(IMAGE_ROW, n));
                        if first + n == im.n_tokens() {
                            s.dec.mtp_past_image(im.rows.max(im.cols));
                            s.embd = None;
                        }
                    }
                    None => {
                        s.tokens.extend_from_slice(toks);
                        s.dec
                            .mtp_process(&self.model, &self.be, toks, &h, false)
                            .map_err(model_err)?;
                    }
                }
                let fed = f.len();
                let Phase::Prefill { next } = task.phase else {
                    unreachable!()
                };
                if let Some(pooling) = task.req.embed {
                    let n_embd = self.model.cfg.n_embd;
                    let h = self.be.to_host(&h);
                    let rows = h.chunks_exact(n_embd);
                    match pooling {
                        Pooling::None => task.embd.extend(rows.map(<[f32]>::to_vec)),
                        Pooling::Cls if next == 0 => {
                            task.embd = rows.take(1).map(<[f32]>::to_vec).collect()
                        }
                        Pooling::Cls => {}
                        Pooling::Last => {
                            task.embd = rows.last().map(<[f32]>::to_vec).into_iter().collect()
                        }
                        Pooling::Mean => {
                            if task.embd.is_empty() {
                                task.embd.push(vec![0.0; n_embd]);
                            }
                            for r in rows {
                                for (a, b) in task.embd[0].iter_mut().zip(r) {
                                    *a += b;
                                }
                            }
                        }
                    }
                }
                let next = next + fed;
                {
                    let mut m = self.metrics.lock().unwrap();
                    m.prompt_tokens_total += fed as u64;
                    m.prompt_seconds_total += step_s;
                }
                if next < task.req.prompt.len() {
                    task.phase = Phase::Prefill { next };
                    continue;
                }
                // The prompt is in: checkpoint it for prefix reuse, then sample the first token.
                task.prompt_ms = task.t_start.elapsed().as_secs_f64() * 1e3;
                task.phase = Phase::Decode;
                task.t_decode = Some(Instant::now());
                for (r, c) in s.dec.seq.rs.iter().zip(s.ckpt.rs.iter_mut()) {
                    if let (Some(r), Some(c)) = (r, c) {
                        self.be.recurrent_copy(r, c);
                    }
                }
                s.ckpt.pos = Some(s.tokens.len());
                s.ckpt.pending_h = s.dec.mtp.as_ref().map(|m| self.be.rows(&m.pending_h, 0, 1));
                s.ckpt.lag = s.dec.seq.lag;
                s.ckpt.images = s.images.len();
                (s.ckpt.mtp_pos, s.ckpt.mtp_skip) = s
                    .dec
                    .mtp
                    .as_ref()
                    .map_or((0, 0), |m| (m.state.pos, m.state.skip));
                if task.req.embed.is_some() {
                    let mut embd = std::mem::take(&mut task.embd);
                    if task.req.embed == Some(Pooling::Mean) {
                        let n = task.req.prompt.len() as f32;
                        embd.iter_mut().flatten().for_each(|x| *x /= n);
                    }
                    let _ = task.tx.send(Event::Embedding(embd));
                    self.finish(i, FinishReason::Stop, None);
                    continue;
                }
                if task.req.max_tokens == 0 {
                    // n_predict 0: the prompt is in the slot's cache; nothing is generated.
                    prompt_only.push(i);
                    continue;
                }
                let forks = task.forks.clone();
                let masks: Masks = s.dec.masks.clone();
                for &j in &forks {
                    self.fork_state(i, j);
                    let f = &mut self.slots[j];
                    f.dec.masks = masks.clone();
                    if let Some(t) = f.task.as_mut() {
                        t.phase = Phase::Decode;
                        t.prompt_ms = t.t_start.elapsed().as_secs_f64() * 1e3;
                        t.t_decode = Some(Instant::now());
                    }
                }
                for j in std::iter::once(i).chain(forks) {
                    let d = &mut self.slots[j].dec;
                    d.sampled_probs.clear();
                    let (id, _) = d
                        .sample_row(&self.be, &logits, first, n_logits, 0)
                        .map_err(model_err)?;
                    d.masks.clear();
                    d.last = Some(id);
                    emitted.push((j, vec![id]));
                }
            } else {
                let s = &mut self.slots[i];
                let v = s
                    .dec
                    .finish_verify(&self.be, &logits, (first, n_logits), toks, *rows)
                    .map_err(model_err)?;
                // Rejected rows were rolled back from the rollback cells; the kept rows' h
                // feeds the MTP head.
                let kept = &toks[..v.kept];
                s.tokens.extend_from_slice(kept);
                if s.dec.mtp.is_some() {
                    let h = if v.kept < toks.len() {
                        self.be.rows(&h, 0, v.kept)
                    } else {
                        h
                    };
                    fills.push((i, kept, h));
                }
                emitted.push((i, v.produced));
            }
        }
        // The decoding slots' kept rows go through the MTP block together.
        if !fills.is_empty() {
            let mut slots = self.slots.iter_mut().enumerate();
            let mut work = Vec::with_capacity(fills.len());
            for (i, toks, h) in &fills {
                let (_, s) = slots
                    .find(|(j, _)| j == i)
                    .expect("the plan feeds slots in order");
                work.push((&mut s.dec, *toks, h));
            }
            SlotDecoder::mtp_process_many(&self.model, &self.be, &mut work, true)
                .map_err(model_err)?;
        }
        // A decode-only step's cost by its rows: forward, sampling and MTP fill.
        let decode_only = plan.iter().all(|f| !f.prefill);
        if decode_only {
            let rows = plan.iter().map(Feed::len).sum();
            let s = t0.elapsed().as_secs_f64();
            self.costs.observe_forward(rows, s);
            let mut m = self.metrics.lock().unwrap();
            m.decode_only_steps_total += 1;
            m.decode_only_seconds_total += s;
        }
        for i in prompt_only {
            self.finish(i, FinishReason::Length, None);
        }
        // llama-server's n_tokens_max: the longest sequence any slot held after a decode.
        {
            let longest = self.slots.iter().map(|s| s.tokens.len()).max().unwrap_or(0);
            let mut m = self.metrics.lock().unwrap();
            m.n_tokens_max = m.n_tokens_max.max(longest as u64);
            m.round_costs = self.costs.summary();
        }
        for (i, ids) in emitted {
            let mut probs = std::mem::take(&mut self.slots[i].dec.sampled_probs).into_iter();
            let grammar_err = self.slots[i].dec.constraint_error.take();
            for id in ids {
                if self.slots[i].task.is_none() {
                    break;
                }
                self.emit(i, id, probs.next());
            }
            if let Some(e) = grammar_err {
                if let Some(t) = self.slots[i].task.take() {
                    let _ = t.tx.send(Event::Error(EngineError::Grammar(e)));
                }
            }
        }
        if decode_only {
            let rows = plan.iter().map(Feed::len).sum();
            let drafted = plan.iter().map(|f| f.len() - 1).sum();
            phase::end_step(rows, drafted, t_step.elapsed().as_nanos() as u64);
        }
        Ok(())
    }

    /// Hands one generated token to the request and checks its stop conditions.
    fn emit(&mut self, i: usize, id: u32, probs: Option<TokenProbs>) {
        let n_ctx_slot = self.cfg.n_ctx_slot();
        let pos = self.slots[i].dec.seq.pos;
        let tok = self.tok.clone();
        let task = self.slots[i].task.as_mut().unwrap();
        if tok.is_eog(id) && !task.req.ignore_eos {
            self.finish(i, FinishReason::Stop, None);
            return;
        }
        task.generated.push(id);
        task.bytes.extend(
            tok.decode_bytes(&[id], !task.req.special)
                .unwrap_or_default(),
        );
        let (text, _) = utf8_prefix(&task.bytes);
        let valid = text.len();
        let mut stop_hit = None;
        let mut safe = valid;
        for s in task.req.stop.iter().filter(|s| !s.is_empty()) {
            let from = floor_char_boundary(&text, task.sent.saturating_sub(s.len()));
            if let Some(at) = text[from..].find(s.as_str()) {
                let at = at + from;
                if stop_hit.as_ref().is_none_or(|(a, _)| at < *a) {
                    stop_hit = Some((at, s.clone()));
                }
            } else {
                // Hold back a tail that could still become this stop string.
                for k in (1..s.len()).rev() {
                    if text.len() >= k && s.is_char_boundary(k) && text.ends_with(&s[..k]) {
                        safe = safe.min(text.len() - k);
                        break;
                    }
                }
            }
        }
        if let Some((at, word)) = stop_hit {
            let piece = text[task.sent.min(at)..at].to_string();
            task.sent = at;
            let choice = task.choice;
            let _ = task.tx.send(Event::Token {
                choice,
                id,
                text: piece,
                probs,
            });
            self.finish(i, FinishReason::Stop, Some(word));
            return;
        }
        let piece = text[task.sent.min(safe)..safe].to_string();
        task.sent = task.sent.max(safe);
        let choice = task.choice;
        let sent = task.tx.send(Event::Token {
            choice,
            id,
            text: piece,
            probs,
        });
        if sent.is_err() {
            // The client is gone: free the slot.
            self.finish(i, FinishReason::Cancelled, None);
            return;
        }
        // A grammar that allows nothing more ends the output, as its end-of-generation would.
        let done = self.slots[i]
            .dec
            .constraint
            .as_ref()
            .is_some_and(Constraint::is_done);
        let task = self.slots[i].task.as_ref().unwrap();
        if done {
            self.finish(i, FinishReason::Stop, None);
        } else if task.generated.len() >= task.req.max_tokens || pos + 1 >= n_ctx_slot {
            self.finish(i, FinishReason::Length, None);
        }
    }

    fn finish(&mut self, i: usize, reason: FinishReason, stop_word: Option<String>) {
        let Some(mut task) = self.slots[i].task.take() else {
            return;
        };
        // Text held back for a stop string that never came is still the model's output.
        if reason != FinishReason::Stop || stop_word.is_none() {
            let valid = String::from_utf8_lossy(&task.bytes).to_string();
            if task.sent < valid.len() && reason != FinishReason::Cancelled {
                let _ = task.tx.send(Event::Text {
                    choice: task.choice,
                    text: valid[task.sent..].to_string(),
                });
                task.sent = valid.len();
            }
        }
        let mut stats = self.slots[i].dec.stats.clone();
        stats.drafts -= task.stats_at_start.drafts;
        stats.drafted -= task.stats_at_start.drafted;
        stats.accepted -= task.stats_at_start.accepted;
        for (a, b) in stats
            .accepted_per_pos
            .iter_mut()
            .zip(&task.stats_at_start.accepted_per_pos)
        {
            *a -= b;
        }
        let predicted_ms = task
            .t_decode
            .map(|t| t.elapsed().as_secs_f64() * 1e3)
            .unwrap_or(0.0);
        let prompt_n = task.req.prompt.len() - task.cached;
        let timings = Timings {
            prompt_n,
            prompt_ms: task.prompt_ms,
            predicted_n: task.generated.len(),
            predicted_ms,
            draft_n: stats.drafted,
            draft_n_accepted: stats.accepted,
        };
        {
            let mut m = self.metrics.lock().unwrap();
            m.prompt_tokens_cached_total += task.cached as u64;
            m.tokens_predicted_total += task.generated.len() as u64;
            m.tokens_predicted_seconds_total += predicted_ms / 1e3;
            m.spec.add(&stats);
            // The slot shows idle before the request hears it ended: a client that reads
            // /slots once its reply is in must not find the slot still processing (the step's
            // own publish comes only after every slot of the step has been handled).
            if let Some(s) = m.slots.get_mut(i) {
                *s = (false, self.slots[i].tokens.len());
            }
            m.requests_processing = self.slots.iter().filter(|s| s.task.is_some()).count() as u64;
        }
        let _ = task.tx.send(Event::Done(Finish {
            choice: task.choice,
            reason,
            stop_word,
            prompt_tokens: task.req.prompt.len(),
            cached_tokens: task.cached,
            completion_tokens: task.generated.len(),
            timings,
        }));
    }
}
