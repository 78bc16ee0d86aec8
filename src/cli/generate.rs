//! `tern generate --prompt P [settings]`: the serving engine on a prompt, from the command line.
//!
//! It reads the same settings as `serve` (the one flag table, the environment, `--config`):
//! `--ctx-size` is the pool of all slots, `-n` the tokens to generate (-1 = until the slot
//! window is full or the model ends), `--parallel N` runs the prompt once per slot (seeds
//! seed, seed+1, ...). The text goes to stdout, the timings to stderr. With `--mmproj P
//! --image F` each image goes where the prompt has a `<__media__>` marker, or before the prompt
//! when it has none (as llama-mtmd-cli does).

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};

use crate::backend::pick::Picked;
use crate::backend::Backend;
use crate::config::flags::Rewritten;
use crate::config::Settings;
use crate::gguf::Gguf;
use crate::model::vision::{VisionConfig, MEDIA_MARKER};
use crate::plan::boot;
use crate::plan::BackendKind;
use crate::runtime::engine::{Engine, EngineConfig, Event, Request, Threads};
use crate::runtime::media::prompt_with_images;
use crate::runtime::sampler::SamplerConfig;
use crate::tokenizer::Tokenizer;

#[derive(clap::Args, Debug, Clone)]
pub struct GenerateArgs {
    /// The prompt (special tokens are parsed).
    #[arg(long, short = 'p')]
    pub prompt: String,
    /// An image for the prompt (PNG, JPEG, WebP, GIF), with --mmproj; repeat for several.
    #[arg(long, value_name = "FILE")]
    pub image: Vec<PathBuf>,
    /// YAML config file; the environment (LLAMA_ARG_*) and flags override its keys.
    #[arg(long, value_name = "FILE.yaml")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub settings: Settings,
}

fn kind(p: &Picked) -> BackendKind {
    match p {
        Picked::Cpu(_) => BackendKind::Cpu,
        Picked::Wgpu(_) => BackendKind::Wgpu,
        #[cfg(feature = "cuda")]
        Picked::Cuda(_) => BackendKind::Cuda,
    }
}

pub fn run(args: &GenerateArgs, given: Rewritten) -> Result<()> {
    let r = super::resolve(args.config.as_deref(), &args.settings, given)?;
    super::start_logging(&r)?;
    let s = r.settings;
    let model = boot::open_model(s.model.as_deref())?;
    let mcfg = crate::model::Config::from_gguf(&model.file)
        .with_context(|| format!("{} is not a loadable qwen35 model", model.path))?;
    let (sampler, fixed) = boot::sampler(&model.file, &s)
        .map_err(|e| anyhow::anyhow!("bad sampling settings: {e}"))?;
    // A random seed unless --seed fixes one, as llama.cpp.
    let sampler = SamplerConfig {
        seed: fixed.unwrap_or_else(crate::server::request::random_seed),
        ..sampler
    };
    let picked =
        crate::backend::pick::pick_serving(s.backend_kind().name(), s.cpu_exact(), s.repack())?;
    let mut shape = s.shape();
    shape.ctx_size = boot::settle_pool(
        s.ctx_size.or(s
            .kv_unified_per_slot
            .map(|n| n.saturating_mul(shape.parallel))),
        shape.parallel,
        mcfg.context_length as u64,
    );
    shape.backend = kind(&picked);
    shape
        .validate()
        .map_err(|e| anyhow::anyhow!(e))
        .context("the shape")?;
    boot::check_draft_depth(&shape)?;
    let ledger = boot::plan(&model.file, &shape, s.device_mib, &model.path)?;
    let cfg = boot::engine_config(&shape, &s);
    let n = match s.n_predict {
        Some(n) if n >= 0 => n as usize,
        _ => cfg.n_ctx_slot(),
    };
    if !args.image.is_empty() && s.mmproj.is_none() {
        bail!("--image needs a projector: give its GGUF with --mmproj");
    }
    let images = args
        .image
        .iter()
        .map(|p| std::fs::read(p).with_context(|| format!("reading the image {}", p.display())))
        .collect::<Result<Vec<_>>>()?;
    let projector = match (&s.mmproj, images.is_empty()) {
        (Some(p), false) => {
            let g = Gguf::open(p)
                .with_context(|| format!("the projector (--mmproj) {}", p.display()))?;
            let what = || format!("the projector (--mmproj) {}", p.display());
            let mut vcfg = VisionConfig::from_gguf(&g, mcfg.n_embd).with_context(what)?;
            let (min, max) = s.image_token_limits();
            vcfg.set_token_limits(min.map(|n| n as usize), max.map(|n| n as usize))
                .with_context(what)?;
            Some((Arc::new(g), vcfg))
        }
        _ => None,
    };
    let job = Job {
        prompt: &args.prompt,
        images,
        projector,
        n,
        sampler,
        ignore_eos: s.ignore_eos.unwrap_or(false),
        special: s.special.unwrap_or(false),
        stop: s.reverse_prompt.clone().unwrap_or_default(),
        threads: boot::threads(&s),
        adapters: s.adapters(),
    };
    let file = model.file;
    match picked {
        Picked::Cpu(be) => generate(be, file, cfg, &ledger, &job),
        Picked::Wgpu(be) => generate(be, file, cfg, &ledger, &job),
        #[cfg(feature = "cuda")]
        Picked::Cuda(be) => generate(be, file, cfg, &ledger, &job),
    }
}

struct Job<'a> {
    prompt: &'a str,
    images: Vec<Vec<u8>>,
    projector: Option<(Arc<Gguf>, VisionConfig)>,
    n: usize,
    sampler: SamplerConfig,
    ignore_eos: bool,
    special: bool,
    stop: Vec<String>,
    threads: Threads,
    /// LoRA adapters and their scales (`--lora`, `--lora-scaled`).
    adapters: Vec<crate::config::LoraScaled>,
}

fn generate<B: Backend + 'static>(
    be: B,
    file: Arc<Gguf>,
    cfg: EngineConfig,
    ledger: &crate::plan::Ledger,
    job: &Job,
) -> Result<()>
where
    B::W: 'static,
{
    let tok = Arc::new(Tokenizer::from_gguf(&file)?);
    let name = be.name();
    boot::read_with_progress(&file);
    let paths: Vec<_> = job.adapters.iter().map(|l| l.path.clone()).collect();
    let m = boot::load_model(&be, file, &paths, cfg.spec.is_some())?;
    let (ids, images) = match &job.projector {
        Some((_, vcfg)) => {
            // No marker: the images go first, as llama-mtmd-cli puts them.
            let prompt = if job.prompt.contains(MEDIA_MARKER) {
                job.prompt.to_string()
            } else {
                MEDIA_MARKER.repeat(job.images.len()) + job.prompt
            };
            let bytes: Vec<&[u8]> = job.images.iter().map(Vec::as_slice).collect();
            prompt_with_images(&tok, vcfg, &prompt, MEDIA_MARKER, &bytes)?
        }
        None => (tok.encode(job.prompt, true, true)?, Vec::new()),
    };
    if ids.is_empty() {
        bail!("the prompt tokenizes to nothing");
    }
    let proj = job.projector.clone();
    let engine = Engine::start_full(m, be, tok, cfg.clone(), job.threads, proj)?;
    boot::report(ledger, &engine.allocated);
    let t0 = Instant::now();
    let handles: Vec<_> = (0..cfg.parallel)
        .map(|i| {
            engine.submit(Request {
                prompt: ids.clone(),
                images: images.clone(),
                max_tokens: job.n,
                sampler: SamplerConfig {
                    seed: job.sampler.seed + i as u64,
                    ..job.sampler.clone()
                },
                stop: job.stop.clone(),
                ignore_eos: job.ignore_eos,
                special: job.special,
                lora: job.adapters.iter().map(|l| l.scale).collect(),
                ..Default::default()
            })
        })
        .collect();
    let mut finishes = Vec::new();
    let mut stdout = std::io::stdout().lock();
    for (i, h) in handles.into_iter().enumerate() {
        if cfg.parallel > 1 {
            writeln!(stdout, "--- stream {i} ---")?;
        }
        // Streams as the tokens arrive (the other slots keep decoding meanwhile).
        let fin = loop {
            match h.events.recv() {
                Ok(Event::Token { text, .. }) | Ok(Event::Text { text, .. }) => {
                    stdout.write_all(text.as_bytes())?;
                    stdout.flush()?;
                }
                Ok(Event::Started { .. }) | Ok(Event::Embedding(_)) => {}
                Ok(Event::Done(f)) => break f,
                Ok(Event::Error(e)) => bail!("{e}"),
                Err(_) => bail!("the engine stopped"),
            }
        };
        writeln!(stdout)?;
        finishes.push(fin);
    }
    let wall = t0.elapsed().as_secs_f64();
    let total: usize = finishes.iter().map(|f| f.completion_tokens).sum();
    for (i, f) in finishes.iter().enumerate() {
        let t = &f.timings;
        eprintln!(
            "stream {i}: prompt {} tokens in {:.1} ms ({:.1} t/s); generated {} tokens in {:.1} ms ({:.1} t/s); drafted {} accepted {}; finish {:?}",
            t.prompt_n,
            t.prompt_ms,
            t.prompt_n as f64 / (t.prompt_ms / 1e3).max(1e-9),
            t.predicted_n,
            t.predicted_ms,
            t.predicted_n as f64 / (t.predicted_ms / 1e3).max(1e-9),
            t.draft_n,
            t.draft_n_accepted,
            f.reason
        );
    }
    let m = engine.metrics();
    eprintln!(
        "backend {name}: {} streams, {total} tokens in {wall:.3} s ({:.1} t/s aggregate); draft acceptance rate = {:.3} ({} accepted / {} generated)",
        cfg.parallel,
        total as f64 / wall.max(1e-9),
        m.spec.acceptance_rate(),
        m.spec.accepted,
        m.spec.drafted
    );
    Ok(())
}
