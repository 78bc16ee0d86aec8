use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Result};
use clap::{Parser, Subcommand, ValueEnum};

use tern::backend::pick::Picked;
use tern::backend::Backend;
use tern::backend::KvTypes;
use tern::gguf::Gguf;
use tern::model::Model;
use tern::runtime::engine::{Engine, EngineConfig, Event, Request};
use tern::runtime::sampler::SamplerConfig;
use tern::runtime::speculative::SpecConfig;
use tern::tensor::GgmlType;
use tern::tokenizer::Tokenizer;

#[derive(Parser)]
#[command(
    name = "tern",
    version,
    about = "Inference engine for Qwen3.5 (qwen35) GGUF models"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Copy, Clone, Debug, ValueEnum, PartialEq)]
enum BackendName {
    Auto,
    Cpu,
    Wgpu,
    Cuda,
}

#[derive(Copy, Clone, Debug, ValueEnum, PartialEq)]
enum LogitsMode {
    /// All tokens in one forward call (one batch).
    Prefill,
    /// One token per forward call, carrying the state.
    Decode,
}

#[derive(Subcommand)]
enum Cmd {
    /// Print a GGUF file's metadata and tensor table.
    Inspect {
        /// GGUF file (default: the bundled model).
        #[arg(long, short = 'm')]
        model: Option<PathBuf>,
        /// Print every tensor instead of a summary per type.
        #[arg(long)]
        tensors: bool,
    },
    /// Evaluate tokens and write one logits row per token as a float32 .npy [n_tokens, n_vocab].
    Logits {
        #[arg(long, short = 'm')]
        model: Option<PathBuf>,
        /// Comma-separated token ids.
        #[arg(long, value_delimiter = ',', conflicts_with = "prompt")]
        tokens: Option<Vec<u32>>,
        /// Text to tokenize instead of --tokens (special tokens are parsed).
        #[arg(long, short = 'p')]
        prompt: Option<String>,
        #[arg(long, value_enum, default_value = "auto")]
        backend: BackendName,
        #[arg(long, value_enum, default_value = "prefill")]
        mode: LogitsMode,
        #[arg(long, short = 'o')]
        out: PathBuf,
    },
    /// Generate text from a prompt.
    Generate {
        #[arg(long, short = 'm')]
        model: Option<PathBuf>,
        #[arg(long, short = 'p')]
        prompt: String,
        /// Tokens to generate.
        #[arg(short = 'n', long = "n-predict", default_value_t = 64)]
        n_predict: usize,
        /// Sampling temperature; 0 is greedy. Unset fields take the model's own defaults
        /// (general.sampling.*), then llama.cpp's.
        #[arg(long)]
        temp: Option<f32>,
        #[arg(long, default_value_t = 0)]
        seed: u64,
        #[arg(long = "top-k")]
        top_k: Option<usize>,
        #[arg(long = "top-p")]
        top_p: Option<f32>,
        #[arg(long = "min-p")]
        min_p: Option<f32>,
        #[arg(long = "presence-penalty")]
        presence_penalty: Option<f32>,
        #[arg(long = "frequency-penalty")]
        frequency_penalty: Option<f32>,
        #[arg(long, value_enum, default_value = "auto")]
        backend: BackendName,
        #[command(flatten)]
        engine: EngineArgs,
    },
    /// Price a shape (KV, draft KV, recurrent state, weights, buffers) against the device budget.
    Fit(tern::cli::fit::FitArgs),
    /// Show the merged settings (config file, then flags) as YAML.
    Config(tern::cli::config::ConfigArgs),
    /// Check files' byte counts and sha256 (streamed; progress bar on a terminal).
    Verify(tern::cli::verify::VerifyArgs),
    /// Serve the model over llama-server's HTTP API (OpenAI-compatible).
    Serve(tern::server::ServeArgs),
    /// Perplexity of a text, by llama-perplexity's method (chunks, second half scored).
    Perplexity(tern::eval::cli::PerplexityArgs),
    /// KL divergence of a candidate from a reference: --save-base, then --base (a gate).
    Kld(tern::eval::cli::KldArgs),
}

#[derive(Copy, Clone, Debug, ValueEnum, PartialEq)]
enum SpecType {
    None,
    DraftMtp,
}

/// Slots, pool and drafting, with llama-server's flag names.
#[derive(clap::Args, Debug)]
struct EngineArgs {
    /// Concurrent streams (slots); generate runs the prompt once per slot.
    #[arg(long, short = 'P', default_value_t = 1)]
    parallel: usize,
    /// The KV pool in tokens, shared evenly by the slots (default 4096 per slot, capped at the
    /// trained context).
    #[arg(long = "ctx-size", short = 'c')]
    ctx_size: Option<usize>,
    #[arg(long = "ubatch-size", default_value_t = 512)]
    ubatch_size: usize,
    #[arg(long = "cache-type-k", default_value = "f16")]
    cache_type_k: String,
    #[arg(long = "cache-type-v", default_value = "f16")]
    cache_type_v: String,
    #[arg(long = "spec-type", value_enum, default_value = "none")]
    spec_type: SpecType,
    #[arg(long = "spec-draft-n-max", default_value_t = 3)]
    spec_draft_n_max: usize,
    #[arg(long = "spec-draft-n-min", default_value_t = 0)]
    spec_draft_n_min: usize,
    #[arg(long = "spec-draft-p-min", default_value_t = 0.0)]
    spec_draft_p_min: f32,
    #[arg(long = "spec-draft-type-k", default_value = "f16")]
    spec_draft_type_k: String,
    #[arg(long = "spec-draft-type-v", default_value = "f16")]
    spec_draft_type_v: String,
}

impl EngineArgs {
    fn config(&self, trained: usize) -> Result<EngineConfig> {
        let parse = |flag: &str, v: &str| {
            GgmlType::parse_name(v).ok_or_else(|| {
                anyhow::anyhow!("--{flag} {v:?}: expected f32, f16, bf16, q8_0 or q4_0")
            })
        };
        let parallel = self.parallel.max(1);
        Ok(EngineConfig {
            ctx_size: self.ctx_size.unwrap_or(4096.min(trained) * parallel),
            parallel,
            ubatch: self.ubatch_size,
            kv_types: KvTypes {
                k: parse("cache-type-k", &self.cache_type_k)?,
                v: parse("cache-type-v", &self.cache_type_v)?,
            },
            spec: (self.spec_type == SpecType::DraftMtp).then_some(SpecConfig {
                n_max: self.spec_draft_n_max,
                n_min: self.spec_draft_n_min,
                p_min: self.spec_draft_p_min,
            }),
            draft_kv_types: KvTypes {
                k: parse("spec-draft-type-k", &self.spec_draft_type_k)?,
                v: parse("spec-draft-type-v", &self.spec_draft_type_v)?,
            },
        })
    }
}

fn open_file(model: Option<PathBuf>) -> Result<Arc<Gguf>> {
    Ok(Arc::new(match model {
        Some(p) => Gguf::open(&p)?,
        None => tern::bundled::default_model()?,
    }))
}

macro_rules! on_backend {
    ($picked:expr, |$be:ident| $body:expr) => {
        match $picked {
            Picked::Cpu($be) => $body,
            Picked::Wgpu($be) => $body,
            #[cfg(feature = "cuda")]
            Picked::Cuda($be) => $body,
        }
    };
}

fn pick_backend(name: BackendName) -> Result<Picked> {
    let name = match name {
        BackendName::Auto => "auto",
        BackendName::Cpu => "cpu",
        BackendName::Wgpu => "wgpu",
        BackendName::Cuda => "cuda",
    };
    Ok(tern::backend::pick::pick(name)?)
}

#[global_allocator]
static HEAP: tern::alloc::Counting = tern::alloc::Counting;

fn main() -> Result<()> {
    HEAP.mark_installed();
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Inspect { model, tensors } => inspect(open_file(model)?, tensors),
        Cmd::Fit(a) => tern::cli::fit::run(&a),
        Cmd::Config(a) => tern::cli::config::run(&a),
        Cmd::Verify(a) => tern::cli::verify::run(&a),
        Cmd::Serve(a) => tern::server::run(&a),
        Cmd::Perplexity(a) => tern::eval::cli::perplexity(&a),
        Cmd::Kld(a) => tern::eval::cli::kld(&a),
        Cmd::Logits {
            model,
            tokens,
            prompt,
            backend,
            mode,
            out,
        } => {
            let file = open_file(model)?;
            let tokens = match (tokens, prompt) {
                (Some(t), _) => t,
                (None, Some(p)) => Tokenizer::from_gguf(&file)?.encode(&p, true, true)?,
                (None, None) => bail!("give --tokens or --prompt"),
            };
            if tokens.is_empty() {
                bail!("no tokens to evaluate");
            }
            let (rows, n_vocab) = on_backend!(pick_backend(backend)?, |be| {
                let m = Model::load(&be, file)?;
                (logits_rows(&be, &m, &tokens, mode)?, m.cfg.n_vocab)
            });
            tern::npy::write(&out, &rows, &[tokens.len(), n_vocab])?;
            eprintln!("wrote {} [{} x {}]", out.display(), tokens.len(), n_vocab);
            Ok(())
        }
        Cmd::Generate {
            model,
            prompt,
            n_predict,
            temp,
            seed,
            top_k,
            top_p,
            min_p,
            presence_penalty,
            frequency_penalty,
            backend,
            engine,
        } => {
            let file = open_file(model)?;
            let d = SamplerConfig::from_gguf(&file);
            let sampler = SamplerConfig {
                temperature: temp.unwrap_or(d.temperature),
                top_k: top_k.unwrap_or(d.top_k),
                top_p: top_p.unwrap_or(d.top_p),
                min_p: min_p.unwrap_or(d.min_p),
                presence_penalty: presence_penalty.unwrap_or(d.presence_penalty),
                frequency_penalty: frequency_penalty.unwrap_or(d.frequency_penalty),
                penalty_last_n: d.penalty_last_n,
                seed,
                ..d
            };
            sampler.validate().map_err(anyhow::Error::msg)?;
            on_backend!(pick_backend(backend)?, |be| generate(
                be, file, &prompt, n_predict, sampler, &engine
            ))
        }
    }
}

fn logits_rows<B: Backend>(
    be: &B,
    m: &Model<B>,
    tokens: &[u32],
    mode: LogitsMode,
) -> Result<Vec<f32>> {
    let mut st = m.new_state(be);
    Ok(match mode {
        LogitsMode::Prefill => be.to_host(&m.forward(be, &mut st, tokens, true)?.logits),
        LogitsMode::Decode => {
            let mut rows = Vec::with_capacity(tokens.len() * m.cfg.n_vocab);
            for &t in tokens {
                rows.extend(be.to_host(&m.forward(be, &mut st, &[t], true)?.logits));
            }
            rows
        }
    })
}

fn generate<B: Backend + 'static>(
    be: B,
    file: Arc<Gguf>,
    prompt: &str,
    n: usize,
    sc: SamplerConfig,
    args: &EngineArgs,
) -> Result<()>
where
    B::W: 'static,
{
    let tok = Arc::new(Tokenizer::from_gguf(&file)?);
    let name = be.name();
    // The planner prices the shape before anything is allocated and refuses one that does not
    // fit; the boot ledger then sets what was allocated beside it.
    let mcfg = tern::model::Config::from_gguf(&file)?;
    let cfg = args.config(mcfg.context_length)?;
    let kind = match name {
        "cpu" => tern::plan::BackendKind::Cpu,
        "wgpu" => tern::plan::BackendKind::Wgpu,
        _ => tern::plan::BackendKind::Cuda,
    };
    let shape = tern::cli::boot::shape_of(&cfg, kind, args.ubatch_size as u64)?;
    let ledger = tern::cli::boot::plan(&file, &shape, None, "the model")?;
    let m = Model::load(&be, file)?;
    let ids = tok.encode(prompt, true, true)?;
    if ids.is_empty() {
        bail!("the prompt tokenizes to nothing");
    }
    let engine = Engine::start(m, be, tok, cfg.clone())?;
    tern::cli::boot::report(&ledger, &engine.allocated);
    let t0 = Instant::now();
    let handles: Vec<_> = (0..cfg.parallel)
        .map(|i| {
            engine.submit(Request {
                prompt: ids.clone(),
                max_tokens: n,
                sampler: SamplerConfig {
                    seed: sc.seed + i as u64,
                    ..sc.clone()
                },
                stop: Vec::new(),
                ignore_eos: false,
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
                Ok(Event::Token { text, .. }) | Ok(Event::Text(text)) => {
                    stdout.write_all(text.as_bytes())?;
                    stdout.flush()?;
                }
                Ok(Event::Started { .. }) => {}
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

fn inspect(file: Arc<Gguf>, all_tensors: bool) -> Result<()> {
    println!("file: {}", file.path().display());
    println!(
        "GGUF v{}, {} bytes, alignment {}, data at {}",
        file.version,
        file.file_len(),
        file.alignment,
        file.data_offset
    );
    println!("metadata ({} keys):", file.metadata().len());
    for (k, v) in file.metadata() {
        println!("  {k:<48} = {v}");
    }
    let ts = file.tensors();
    let total: u64 = ts.iter().map(|t| t.nbytes).sum();
    println!(
        "tensors: {} ({:.2} MiB)",
        ts.len(),
        total as f64 / (1 << 20) as f64
    );
    let mut by_type: std::collections::BTreeMap<String, (usize, u64, u64)> = Default::default();
    for t in ts {
        let e = by_type.entry(t.ty.name().to_string()).or_default();
        e.0 += 1;
        e.1 += t.n_elements();
        e.2 += t.nbytes;
    }
    for (ty, (n, el, b)) in &by_type {
        println!(
            "  {ty:<18} {n:>5} tensors {el:>14} elements {:>10.2} MiB",
            *b as f64 / (1 << 20) as f64
        );
    }
    if all_tensors {
        for t in ts {
            println!("  {:<48} {:<18} {:?}", t.name, t.ty.name(), t.dims);
        }
    }
    match tern::model::Config::from_gguf(&file) {
        Ok(c) => {
            let n_attn = (0..c.n_layer).filter(|&i| !c.is_recurrent(i)).count();
            println!(
                "qwen35: {} trunk layers ({} GDN + {} attention), MTP layers {}, n_embd {}, n_vocab {}, heads {}/{} x {}, rope {} dims, GDN n_k {} n_v {} d {}, {} output",
                c.n_layer, c.n_layer - n_attn, n_attn, c.n_nextn, c.n_embd, c.n_vocab, c.n_head, c.n_head_kv,
                c.head_dim, c.n_rot, c.ssm_n_k, c.ssm_n_v, c.ssm_state, if c.tied_output { "tied" } else { "untied" }
            );
        }
        Err(e) => println!("not a loadable qwen35 model: {e}"),
    }
    match tern::quant::hadamard::HadamardConfig::from_gguf(&file) {
        Ok(Some(h)) => println!(
            "prism.hadamard: block {}, {} folded weights, gdn_v_grouped {}",
            h.block_size,
            h.folded_names().count(),
            h.gdn_v_grouped
        ),
        Ok(None) => {}
        Err(e) => println!("prism.hadamard refused: {e}"),
    }
    Ok(())
}
