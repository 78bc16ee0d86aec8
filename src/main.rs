use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::{Parser, Subcommand, ValueEnum};

use tern::backend::cpu::CpuBackend;
use tern::backend::wgpu::WgpuBackend;
use tern::backend::Backend;
use tern::gguf::Gguf;
use tern::model::Model;
use tern::runtime::sampler::{Sampler, SamplerConfig};
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
    },
}

fn open_file(model: Option<PathBuf>) -> Result<Arc<Gguf>> {
    Ok(Arc::new(match model {
        Some(p) => Gguf::open(&p)?,
        None => tern::bundled::default_model()?,
    }))
}

/// The backend a command runs on.
enum Picked {
    Cpu(CpuBackend),
    Wgpu(WgpuBackend),
}

/// Runs a generic body on whichever backend was picked.
macro_rules! on_backend {
    ($picked:expr, |$be:ident| $body:expr) => {
        match $picked {
            Picked::Cpu($be) => $body,
            Picked::Wgpu($be) => $body,
        }
    };
}

/// `auto` takes wgpu when an adapter exists and says why it fell back to the CPU otherwise;
/// an explicit backend that cannot start is an error naming the reason.
fn pick_backend(name: BackendName) -> Result<Picked> {
    match name {
        BackendName::Cpu => Ok(Picked::Cpu(CpuBackend::new())),
        BackendName::Wgpu => {
            let be = WgpuBackend::new()?;
            eprintln!("{}", be.gpu.describe());
            Ok(Picked::Wgpu(be))
        }
        BackendName::Cuda => bail!("backend cuda is not available in this build (build with --features cuda once the CUDA backend lands)"),
        BackendName::Auto => match WgpuBackend::new() {
            // A software rasterizer (lavapipe, WARP) is slower than the CPU backend.
            Ok(be) if be.gpu.info.device_type == wgpu::DeviceType::Cpu => {
                eprintln!(
                    "backend: cpu (auto: the only wgpu adapter, {:?}, is a software renderer; --backend wgpu forces it)",
                    be.gpu.info.name
                );
                Ok(Picked::Cpu(CpuBackend::new()))
            }
            Ok(be) => {
                eprintln!("backend: wgpu (auto); {}", be.gpu.describe());
                Ok(Picked::Wgpu(be))
            }
            Err(e) => {
                eprintln!("backend: cpu (auto: {e})");
                Ok(Picked::Cpu(CpuBackend::new()))
            }
        },
    }
}

fn main() -> Result<()> {
    let cli = Cli::parse();
    match cli.cmd {
        Cmd::Inspect { model, tensors } => inspect(open_file(model)?, tensors),
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
            };
            sampler.validate().map_err(anyhow::Error::msg)?;
            on_backend!(pick_backend(backend)?, |be| generate(
                &be, file, &prompt, n_predict, sampler
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

fn generate<B: Backend>(
    be: &B,
    file: Arc<Gguf>,
    prompt: &str,
    n: usize,
    sc: SamplerConfig,
) -> Result<()> {
    let tok = Tokenizer::from_gguf(&file)?;
    let m = Model::load(be, file)?;
    let ids = tok.encode(prompt, true, true)?;
    if ids.is_empty() {
        bail!("the prompt tokenizes to nothing");
    }
    let mut sampler = Sampler::new(sc.clone());
    let mut st = m.new_state(be);
    let t0 = Instant::now();
    let out = m.forward(be, &mut st, &ids, false).context("prompt")?;
    let prefill_s = t0.elapsed().as_secs_f64();
    let greedy = sampler.is_greedy();
    let mut next = pick(be, &mut sampler, &out.logits, greedy);
    let mut stdout = std::io::stdout().lock();
    let mut pending: Vec<u8> = Vec::new();
    let t1 = Instant::now();
    let mut produced = 0usize;
    for i in 0..n {
        if tok.is_eog(next) {
            break;
        }
        produced += 1;
        pending.extend(tok.decode_bytes(&[next], true)?);
        // Hold back an incomplete UTF-8 sequence until its last byte arrives.
        let valid = match std::str::from_utf8(&pending) {
            Ok(s) => s.len(),
            Err(e) if e.error_len().is_none() => e.valid_up_to(),
            Err(_) => pending.len(),
        };
        stdout.write_all(&pending[..valid])?;
        stdout.flush()?;
        pending.drain(..valid);
        if i + 1 == n || st.pos >= m.cfg.context_length {
            break;
        }
        let out = m.forward(be, &mut st, &[next], false)?;
        next = pick(be, &mut sampler, &out.logits, greedy);
    }
    stdout.write_all(&pending)?;
    writeln!(stdout)?;
    let decode_s = t1.elapsed().as_secs_f64();
    eprintln!(
        "prompt: {} tokens in {:.3} s ({:.1} t/s); generated: {} tokens in {:.3} s ({:.1} t/s); backend {}",
        ids.len(),
        prefill_s,
        ids.len() as f64 / prefill_s.max(1e-9),
        produced,
        decode_s,
        produced as f64 / decode_s.max(1e-9),
        be.name()
    );
    Ok(())
}

/// Greedy decoding reads back only the chosen id; sampling needs the logits row.
fn pick<B: Backend>(be: &B, sampler: &mut Sampler, logits: &B::T, greedy: bool) -> u32 {
    let id = if greedy {
        be.argmax_rows(logits)[0]
    } else {
        sampler.sample(&be.to_host(logits))
    };
    sampler.accept(id);
    id
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
