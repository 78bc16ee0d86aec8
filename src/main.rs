use std::path::PathBuf;
use std::process::ExitCode;
use std::sync::Arc;

use anyhow::{bail, Context, Result};
use clap::{CommandFactory, Parser, Subcommand, ValueEnum};

use tern::backend::pick::Picked;
use tern::backend::Backend;
use tern::gguf::Gguf;
use tern::model::Model;
use tern::tokenizer::Tokenizer;

#[derive(Parser)]
#[command(
    name = "tern",
    version,
    long_version = tern::LONG_VERSION,
    propagate_version = true,
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

/// The subcommands that take the settings, and with them llama-server's whole flag table
/// (its short forms, aliases, warnings and refusals: `tern::config::flags`).
const SETTINGS_COMMANDS: &[&str] = &["serve", "generate", "fit", "config"];

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
        /// The CPU backend's f32 reference matmuls (default true; false runs the serving
        /// path's int8 activations, as `generate` and `serve` do).
        #[arg(long, default_value_t = true, num_args = 0..=1, default_missing_value = "true", action = clap::ArgAction::Set, value_name = "BOOL")]
        cpu_exact: bool,
        #[arg(long, short = 'o')]
        out: PathBuf,
        /// LoRA adapter at scale 1 (repeatable or comma-separated).
        #[arg(long, value_delimiter = ',')]
        lora: Vec<PathBuf>,
        /// LoRA adapter with its scale, FILE:SCALE (repeatable or comma-separated); the
        /// adapters' ids follow the order of --lora, then --lora-scaled.
        #[arg(long, value_delimiter = ',', value_name = "FILE:SCALE")]
        lora_scaled: Vec<tern::config::LoraScaled>,
        /// Qwen3-VL projector (llama.cpp's mmproj GGUF) for --image.
        #[arg(long, requires = "image")]
        mmproj: Option<PathBuf>,
        /// Image file (PNG, JPEG, WebP, GIF), in place of the prompt's next <__media__>
        /// marker (repeatable); its tokens get one logits row each, as text does.
        #[arg(long, requires = "mmproj", requires = "prompt")]
        image: Vec<PathBuf>,
        /// Also write the projector's output, float32 [n_image_tokens, n_embd].
        #[arg(long, requires = "image")]
        embd_out: Option<PathBuf>,
    },
    /// Generate text from a prompt with the serving engine (the settings of `serve`).
    #[command(args_override_self = true)]
    Generate(tern::cli::generate::GenerateArgs),
    /// Price a shape (KV, draft KV, recurrent state, weights, buffers) against the device budget.
    #[command(args_override_self = true)]
    Fit(tern::cli::fit::FitArgs),
    /// Show the merged settings (config file, environment, flags) as YAML.
    #[command(args_override_self = true)]
    Config(tern::cli::config::ConfigArgs),
    /// Check files' byte counts and sha256 (streamed; progress bar on a terminal).
    Verify(tern::cli::verify::VerifyArgs),
    /// Serve the model over llama-server's HTTP API (OpenAI-compatible).
    #[command(args_override_self = true)]
    Serve(tern::cli::ServeArgs),
    /// Perplexity of a text, by llama-perplexity's method (chunks, second half scored).
    Perplexity(tern::eval::cli::PerplexityArgs),
    /// KL divergence of a candidate from a reference: --save-base, then --base (a gate).
    Kld(tern::eval::cli::KldArgs),
    /// Print a shell completion script (bash, zsh, fish, elvish, powershell).
    Completions {
        #[arg(value_enum)]
        shell: clap_complete::Shell,
    },
}

fn open_file(model: Option<PathBuf>) -> Result<Arc<Gguf>> {
    Ok(match model {
        Some(p) if p.is_dir() => {
            // The same refusal as the model loaders', naming the GGUF files inside.
            return Err(tern::plan::boot::open_model(Some(&p))
                .err()
                .map(anyhow::Error::new)
                .unwrap_or_else(|| anyhow::anyhow!("{} is a directory", p.display())));
        }
        Some(p) => Arc::new(Gguf::open(&p)?),
        None => Arc::new(tern::bundled::default_model()?),
    })
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

fn pick_backend(name: BackendName, cpu_exact: bool) -> Result<Picked> {
    let name = match name {
        BackendName::Auto => "auto",
        BackendName::Cpu => "cpu",
        BackendName::Wgpu => "wgpu",
        BackendName::Cuda => "cuda",
    };
    Ok(tern::backend::pick::pick_serving(name, cpu_exact, true)?)
}

#[global_allocator]
static HEAP: tern::alloc::Counting = tern::alloc::Counting;

fn main() -> ExitCode {
    HEAP.mark_installed();
    tern::alloc::keep_freed_heap();
    match run() {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            tern::cli::print_error(&e);
            ExitCode::FAILURE
        }
    }
}

fn run() -> Result<()> {
    let (args, given) = tern::cli::prepare_args(std::env::args_os(), SETTINGS_COMMANDS)?;
    let cli = Cli::try_parse_from(args).unwrap_or_else(|e| e.exit());
    if matches!(
        cli.cmd,
        Cmd::Inspect { .. } | Cmd::Logits { .. } | Cmd::Perplexity(_) | Cmd::Kld(_)
    ) {
        // The commands without settings log at the default level (the backend's choice).
        tern::cli::logging::init(&tern::config::Settings::default())?;
    }
    match cli.cmd {
        Cmd::Inspect { model, tensors } => inspect(open_file(model)?, tensors),
        Cmd::Fit(a) => tern::cli::fit::run(&a, given),
        Cmd::Config(a) => tern::cli::config::run(&a, given),
        Cmd::Verify(a) => tern::cli::verify::run(&a),
        Cmd::Serve(a) => tern::cli::serve(&a, given),
        Cmd::Generate(a) => tern::cli::generate::run(&a, given),
        Cmd::Completions { shell } => tern::cli::completions(shell, &mut Cli::command()),
        Cmd::Perplexity(a) => tern::eval::cli::perplexity(&a),
        Cmd::Kld(a) => tern::eval::cli::kld(&a),
        Cmd::Logits {
            model,
            tokens,
            prompt,
            backend,
            mode,
            cpu_exact,
            out,
            lora,
            lora_scaled,
            mmproj,
            image,
            embd_out,
        } => {
            let adapters: Vec<tern::config::LoraScaled> = lora
                .into_iter()
                .map(|path| tern::config::LoraScaled { path, scale: 1.0 })
                .chain(lora_scaled)
                .collect();
            let paths: Vec<PathBuf> = adapters.iter().map(|l| l.path.clone()).collect();
            let scales: Vec<f32> = adapters.iter().map(|l| l.scale).collect();
            let file = open_file(model)?;
            if let (Some(mmproj), Some(prompt)) = (mmproj, &prompt) {
                if mode == LogitsMode::Decode {
                    bail!("--mode decode does not apply with --image: text and image rows run as llama.cpp's chunks");
                }
                let tok = Tokenizer::from_gguf(&file)?;
                let pieces = tern::model::vision::tokenize_with_media(&tok, prompt, image.len())?;
                let bytes = image
                    .iter()
                    .map(|p| std::fs::read(p).with_context(|| format!("reading {}", p.display())))
                    .collect::<Result<Vec<_>>>()?;
                let (rows, embd, n_vocab, n_embd) =
                    on_backend!(pick_backend(backend, cpu_exact)?, |be| {
                        let m = tern::plan::boot::load_model(&be, file, &paths, false)?;
                        let proj =
                            tern::model::vision::Projector::open(&be, &mmproj, m.cfg.n_embd)?;
                        let (rows, embd) = media_logits(&be, &m, &proj, &pieces, &bytes, &scales)?;
                        (rows, embd, m.cfg.n_vocab, m.cfg.n_embd)
                    });
                let n = rows.len() / n_vocab;
                tern::npy::write(&out, &rows, &[n, n_vocab])?;
                eprintln!("wrote {} [{n} x {n_vocab}]", out.display());
                if let Some(e) = embd_out {
                    tern::npy::write(&e, &embd, &[embd.len() / n_embd, n_embd])?;
                    eprintln!("wrote {} [{} x {n_embd}]", e.display(), embd.len() / n_embd);
                }
                return Ok(());
            }
            let tokens = match (tokens, prompt) {
                (Some(t), _) => t,
                (None, Some(p)) => Tokenizer::from_gguf(&file)?.encode(&p, true, true)?,
                (None, None) => bail!("give --tokens or --prompt"),
            };
            if tokens.is_empty() {
                bail!("no tokens to evaluate");
            }
            let (rows, n_vocab) = on_backend!(pick_backend(backend, cpu_exact)?, |be| {
                let m = tern::plan::boot::load_model(&be, file, &paths, false)?;
                (logits_rows(&be, &m, &tokens, mode, &scales)?, m.cfg.n_vocab)
            });
            tern::npy::write(&out, &rows, &[tokens.len(), n_vocab])?;
            eprintln!("wrote {} [{} x {}]", out.display(), tokens.len(), n_vocab);
            Ok(())
        }
    }
}

fn logits_rows<B: Backend>(
    be: &B,
    m: &Model<B>,
    tokens: &[u32],
    mode: LogitsMode,
    lora: &[f32],
) -> Result<Vec<f32>> {
    let mut st = m.new_state(be);
    st.lora = lora.to_vec();
    let rows = match mode {
        LogitsMode::Prefill => be.to_host(&m.forward(be, &mut st, tokens, true)?.logits),
        LogitsMode::Decode => {
            let mut rows = Vec::with_capacity(tokens.len() * m.cfg.n_vocab);
            for &t in tokens {
                rows.extend(be.to_host(&m.forward(be, &mut st, &[t], true)?.logits));
            }
            rows
        }
    };
    // Non-finite logits are a broken model, not output.
    tern::runtime::sampler::check_logits(&rows, m.cfg.n_vocab)?;
    Ok(rows)
}

/// Logits at every position of a prompt with images (text rows and image rows alike, in order)
/// and the projector's output rows of every image.
fn media_logits<B: Backend>(
    be: &B,
    m: &Model<B>,
    proj: &tern::model::vision::Projector<B>,
    pieces: &[tern::model::vision::Piece],
    images: &[Vec<u8>],
    lora: &[f32],
) -> Result<(Vec<f32>, Vec<f32>)> {
    use tern::model::vision::Piece;
    let mut st = m.new_state(be);
    st.lora = lora.to_vec();
    let (mut rows, mut embd) = (Vec::new(), Vec::new());
    for p in pieces {
        let out = match p {
            Piece::Text(t) => m.forward(be, &mut st, t, true)?,
            Piece::Image(i) => {
                let img = proj.cfg.prepare(&images[*i])?;
                let (r, c) = img.grid(&proj.cfg);
                let t0 = std::time::Instant::now();
                let e = proj.encode(be, &img);
                embd.extend(be.to_host(&e));
                let s = t0.elapsed().as_secs_f64();
                // As llama-mtmd-cli reports its encode, for the side-by-side figure.
                eprintln!(
                    "image {i}: {}x{} px, {r}x{c} tokens, encoded in {:.1} ms ({:.1} tokens/s)",
                    img.width,
                    img.height,
                    s * 1e3,
                    (r * c) as f64 / s
                );
                m.forward_image(be, &mut st, &e, r, c, true)?
            }
        };
        rows.extend(be.to_host(&out.logits));
    }
    tern::runtime::sampler::check_logits(&rows, m.cfg.n_vocab)?;
    Ok((rows, embd))
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
