//! `tern perplexity` and `tern kld`: flags, runs on any backend, and llama-perplexity's printed
//! format (running estimates and `Final estimate: PPL = x +/- e` on stdout, setup on stderr).

use std::io::{IsTerminal, Write};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use indicatif::{ProgressBar, ProgressDrawTarget, ProgressStyle};
use rayon::prelude::*;
use serde_json::json;

use super::base::{self, BaseFile, Header, TextId};
use super::score::{self, Chunking};
use super::stats::{self, KldReport, KldSums, NllSums};
use super::EvalError;
use crate::backend::pick::{pick, Picked};
use crate::backend::{Backend, KvTypes};
use crate::gguf::Gguf;
use crate::model::Model;
use crate::tensor::GgmlType;
use crate::tokenizer::Tokenizer;

/// What both commands share: the model, how the text is cut, and where it runs.
#[derive(clap::Args, Debug, Clone)]
pub struct EvalArgs {
    /// GGUF file (default: the bundled model).
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Tokens per chunk; the second half of each chunk is scored [default: 512; with --base,
    /// the base file's].
    #[arg(long = "ctx-size", short = 'c')]
    pub ctx_size: Option<usize>,
    /// Tokens per batch: max(1, batch-size / ctx-size) chunks are evaluated together.
    #[arg(long = "batch-size", short = 'b', default_value_t = 2048)]
    pub batch_size: usize,
    /// Evaluate only the first N chunks (default: every whole chunk of the text; with --base,
    /// the base file's).
    #[arg(long)]
    pub chunks: Option<usize>,
    /// cpu, wgpu, cuda or auto.
    #[arg(long, default_value = "auto")]
    pub backend: String,
    #[arg(long = "cache-type-k", default_value = "f16")]
    pub cache_type_k: String,
    #[arg(long = "cache-type-v", default_value = "f16")]
    pub cache_type_v: String,
}

/// `tern perplexity`: llama-perplexity's method and figure.
#[derive(clap::Args, Debug, Clone)]
pub struct PerplexityArgs {
    #[command(flatten)]
    pub eval: EvalArgs,
    /// The text (one trailing newline is dropped, as llama.cpp's -f does).
    #[arg(long, short = 'f')]
    pub file: PathBuf,
    /// Also write the result as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// `tern kld`: step 1 `--save-base` runs the reference and stores its top-K log-probabilities;
/// step 2 `--base` measures a candidate (another file, or the same file on another backend)
/// against them. Exit status 3 when a gate bound (--max-mean-kl, --min-top1, --max-ppl-ratio)
/// fails, 1 on an error.
#[derive(clap::Args, Debug, Clone)]
#[command(group(clap::ArgGroup::new("step").required(true).args(["save_base", "base"])))]
pub struct KldArgs {
    #[command(flatten)]
    pub eval: EvalArgs,
    /// The text: required with --save-base; with --base it is optional (the base file holds
    /// the token ids) and checked against the base file's hash when given.
    #[arg(long, short = 'f')]
    pub file: Option<PathBuf>,
    /// Step 1: run the model (the reference) and write the base file here.
    #[arg(long = "save-base")]
    pub save_base: Option<PathBuf>,
    /// Step 2: measure the model (the candidate) against this base file.
    #[arg(long)]
    pub base: Option<PathBuf>,
    /// Log-probabilities stored per position in the base file (6 bytes each). The KL counts
    /// the other tokens as one bin, a lower bound that nears the full-vocabulary KL as the
    /// top-K hold the mass: raise it for flat (small or weak) models.
    #[arg(long = "top-k", default_value_t = 32, requires = "save_base")]
    pub top_k: usize,
    /// The nucleus of the same-top-p rate.
    #[arg(long = "top-p", default_value_t = 0.95)]
    pub top_p: f64,
    /// Gate: fail when the mean KL divergence exceeds this.
    #[arg(long = "max-mean-kl", requires = "base")]
    pub max_mean_kl: Option<f64>,
    /// Gate: fail when the top-1 agreement (a fraction, 0.95 = 95%) is below this.
    #[arg(long = "min-top1", requires = "base")]
    pub min_top1: Option<f64>,
    /// Gate: fail when PPL(candidate) / PPL(base) exceeds this.
    #[arg(long = "max-ppl-ratio", requires = "base")]
    pub max_ppl_ratio: Option<f64>,
    /// Write everything measured (and the gate's verdict) as JSON.
    #[arg(long)]
    pub json: Option<PathBuf>,
}

/// Exit status of a failed gate.
pub const GATE_FAILED: i32 = 3;

impl EvalArgs {
    fn kv(&self) -> Result<KvTypes> {
        let parse = |flag: &str, v: &str| {
            GgmlType::parse_name(v)
                .filter(|t| {
                    matches!(
                        t,
                        GgmlType::F32
                            | GgmlType::F16
                            | GgmlType::BF16
                            | GgmlType::Q8_0
                            | GgmlType::Q4_0
                    )
                })
                .ok_or_else(|| {
                    anyhow::anyhow!("--{flag} {v:?}: expected f32, f16, bf16, q8_0 or q4_0")
                })
        };
        Ok(KvTypes {
            k: parse("cache-type-k", &self.cache_type_k)?,
            v: parse("cache-type-v", &self.cache_type_v)?,
        })
    }

    fn n_ctx(&self) -> usize {
        self.ctx_size.unwrap_or(512)
    }

    fn open(&self) -> Result<Arc<Gguf>> {
        Ok(Arc::new(match &self.model {
            Some(p) => Gguf::open(p)?,
            None => crate::bundled::default_model()?,
        }))
    }
}

/// A text file as llama.cpp's `-f` reads it: the bytes (hashed as they are) and the text with
/// one trailing newline dropped.
pub fn read_text(path: &Path) -> Result<(TextId, String)> {
    let bytes = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let id = base::text_id(path, &bytes);
    let mut text = String::from_utf8(bytes).map_err(|e| {
        anyhow::anyhow!(
            "{}: not UTF-8 text (invalid byte at offset {})",
            path.display(),
            e.utf8_error().valid_up_to()
        )
    })?;
    if text.ends_with('\n') {
        text.pop();
    }
    Ok((id, text))
}

/// The text's tokens as llama-perplexity takes them (`common_tokenize(ctx, text, true)`:
/// special tokens added per the vocabulary, special-token text not parsed), and the BOS that
/// replaces each chunk's first token when the vocabulary adds one.
pub fn tokenize(file: &Gguf, text: &str) -> Result<(Vec<u32>, Option<u32>)> {
    let tok = Tokenizer::from_gguf(file)?;
    let tokens = tok.encode(text, true, false)?;
    let add_bos = file
        .get("tokenizer.ggml.add_bos_token")
        .and_then(|v| v.as_bool())
        .unwrap_or(false);
    Ok((tokens, if add_bos { tok.bos() } else { None }))
}

/// A chunk counter on stderr when it is a terminal and stdout is not (the running estimates
/// are the progress on a terminal, as in llama-perplexity); hidden otherwise.
fn progress(n_chunk: usize) -> ProgressBar {
    if !std::io::stderr().is_terminal() || std::io::stdout().is_terminal() {
        return ProgressBar::hidden();
    }
    let pb = ProgressBar::with_draw_target(Some(n_chunk as u64), ProgressDrawTarget::stderr());
    if let Ok(s) = ProgressStyle::with_template("{msg} [{bar:32}] {pos}/{len} chunks eta {eta}") {
        pb.set_style(s.progress_chars("=> "));
    }
    pb
}

/// llama-perplexity's line after the first batch.
fn eta_line(what: &str, secs: f64, c: &Chunking) {
    let mut total = (secs * c.n_chunk as f64 / c.n_seq as f64) as i64;
    let mut line = format!("{what}: {secs:.2} seconds per pass - ETA ");
    if total >= 3600 {
        line += &format!("{} hours ", total / 3600);
        total %= 3600;
    }
    line += &format!("{:.2} minutes", total as f64 / 60.0);
    eprintln!("{line}");
}

/// The outcome of `perplexity_of`.
#[derive(Clone, Debug)]
pub struct Perplexity {
    pub ppl: f64,
    /// llama-perplexity's ± (None where it reports a negative variance).
    pub err: Option<f64>,
    /// The running estimate after each chunk (`[i]x` of the printed line).
    pub running: Vec<f64>,
    pub positions: usize,
    pub seconds: f64,
}

/// llama-perplexity's figure for `tokens` cut as `c`. `on_chunk(i, running)` after each chunk.
pub fn perplexity_of<B: Backend>(
    be: &B,
    m: &Model<B>,
    tokens: &[u32],
    c: &Chunking,
    kv: KvTypes,
    mut on_chunk: impl FnMut(usize, f64),
) -> Result<Perplexity, EvalError> {
    let nv = m.cfg.n_vocab;
    let t0 = Instant::now();
    let mut sums = NllSums::default();
    let mut running = Vec::with_capacity(c.n_chunk);
    score::run(be, m, tokens, c, kv, |ch| {
        let nll: Vec<f64> = ch
            .logits
            .par_chunks(nv)
            .zip(ch.targets.par_iter())
            .map(|(row, &t)| -stats::Softmax::of(row).log_prob(row, t as usize))
            .collect();
        for x in nll {
            sums.add(x);
        }
        running.push(sums.ppl());
        on_chunk(ch.index, sums.ppl());
        Ok(())
    })?;
    let (ppl, err) = sums.estimate();
    Ok(Perplexity {
        ppl,
        err,
        running,
        positions: sums.count,
        seconds: t0.elapsed().as_secs_f64(),
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

pub fn perplexity(a: &PerplexityArgs) -> Result<()> {
    let kv = a.eval.kv()?;
    let file = a.eval.open()?;
    let (text_id, text) = read_text(&a.file)?;
    let picked = pick(&a.eval.backend)?;
    let backend = picked.name();
    eprintln!("perplexity: tokenizing the input ..");
    let t0 = Instant::now();
    let (tokens, bos) = tokenize(&file, &text)?;
    eprintln!(
        "perplexity: tokenization took {:.3} ms",
        t0.elapsed().as_secs_f64() * 1e3
    );
    let c = Chunking::new(
        tokens.len(),
        a.eval.n_ctx(),
        a.eval.batch_size,
        a.eval.chunks,
        bos,
    )?;
    eprintln!(
        "perplexity: calculating perplexity over {} chunks, n_ctx={}, batch_size={}, n_seq={}",
        c.n_chunk,
        c.n_ctx,
        a.eval.batch_size.min(c.n_seq * c.n_ctx),
        c.n_seq
    );
    let r = on_backend!(picked, |be| {
        let m = Model::load(&be, file.clone())?;
        run_perplexity(&be, &m, &tokens, &c, kv)?
    });
    println!();
    match r.err {
        Some(e) => println!("Final estimate: PPL = {:.4} +/- {:.5}", r.ppl, e),
        None => eprintln!("Unexpected negative standard deviation of log(prob)"),
    }
    report_speed("perplexity", backend, &c, r.seconds);
    if let Some(path) = &a.json {
        let v = json!({
            "model": base::model_id(&file),
            "text": text_id,
            "tokens": tokens.len(),
            "n_ctx": c.n_ctx, "n_seq": c.n_seq, "n_chunk": c.n_chunk, "bos": c.bos,
            "backend": backend, "cache_type_k": a.eval.cache_type_k, "cache_type_v": a.eval.cache_type_v,
            "positions": r.positions, "ppl": r.ppl, "ppl_err": r.err, "running": r.running,
            "seconds": r.seconds, "seconds_per_1k_positions": 1e3 * r.seconds / r.positions as f64,
            "tern_version": env!("CARGO_PKG_VERSION"),
        });
        write_json(path, &v)?;
    }
    Ok(())
}

fn run_perplexity<B: Backend>(
    be: &B,
    m: &Model<B>,
    tokens: &[u32],
    c: &Chunking,
    kv: KvTypes,
) -> Result<Perplexity> {
    let bar = progress(c.n_chunk);
    let mut out = std::io::stdout().lock();
    let t0 = Instant::now();
    let mut first = true;
    let r = perplexity_of(be, m, tokens, c, kv, |i, ppl| {
        // The first batch has run when its first chunk is handed over.
        if first {
            eta_line("perplexity", t0.elapsed().as_secs_f64(), c);
            first = false;
        }
        let _ = write!(out, "[{}]{:.4},", i + 1, ppl);
        let _ = out.flush();
        bar.set_message(format!("PPL {ppl:.4}"));
        bar.inc(1);
    })?;
    bar.finish_and_clear();
    Ok(r)
}

fn report_speed(what: &str, backend: &str, c: &Chunking, secs: f64) {
    let pos = c.positions() as f64;
    let toks = (c.n_chunk * c.n_ctx) as f64;
    eprintln!(
        "{what}: {} chunks of {} on {backend}: {} scored positions ({} evaluated tokens) in {secs:.2} s = {:.3} s per 1k scored positions ({:.0} tokens/s)",
        c.n_chunk,
        c.n_ctx,
        c.positions(),
        c.n_chunk * c.n_ctx,
        1e3 * secs / pos,
        toks / secs
    );
}

fn write_json(path: &Path, v: &serde_json::Value) -> Result<()> {
    std::fs::write(path, serde_json::to_string_pretty(v)? + "\n")
        .with_context(|| format!("writing {}", path.display()))
}

pub fn kld(a: &KldArgs) -> Result<()> {
    let kv = a.eval.kv()?;
    if !(a.top_p > 0.0 && a.top_p < 1.0) {
        bail!("--top-p {}: must be in (0, 1)", a.top_p);
    }
    if let Some(t) = a.min_top1 {
        if !(0.0..=1.0).contains(&t) {
            bail!("--min-top1 {t}: a fraction in [0, 1] (0.95 for 95%)");
        }
    }
    let file = a.eval.open()?;
    match (&a.save_base, &a.base) {
        (Some(out), None) => {
            let Some(text_path) = &a.file else {
                bail!("--save-base needs the text: --file F");
            };
            if a.top_k == 0 {
                bail!("--top-k 0: must be > 0");
            }
            let (text_id, text) = read_text(text_path)?;
            let picked = pick(&a.eval.backend)?;
            let backend = picked.name();
            let (tokens, bos) = tokenize(&file, &text)?;
            let c = Chunking::new(
                tokens.len(),
                a.eval.n_ctx(),
                a.eval.batch_size,
                a.eval.chunks,
                bos,
            )?;
            eprintln!(
                "kld: reference {} on {backend}: {} chunks, n_ctx={}, n_seq={}, top-{} per position",
                file.path().display(),
                c.n_chunk,
                c.n_ctx,
                c.n_seq,
                a.top_k
            );
            let t0 = Instant::now();
            let b = on_backend!(picked, |be| {
                let m = Model::load(&be, file.clone())?;
                if a.top_k > m.cfg.n_vocab {
                    bail!(
                        "--top-k {}: the vocabulary has only {} tokens",
                        a.top_k,
                        m.cfg.n_vocab
                    );
                }
                let header = Header {
                    model: base::model_id(&file),
                    tokenizer: base::tokenizer_id(&file, m.cfg.n_vocab),
                    text: text_id,
                    n_ctx: c.n_ctx,
                    n_chunk: c.n_chunk,
                    bos: c.bos,
                    top_k: a.top_k,
                    backend: backend.to_string(),
                    cache_type_k: a.eval.cache_type_k.clone(),
                    cache_type_v: a.eval.cache_type_v.clone(),
                    ppl: f64::NAN,
                    ppl_err: None,
                    tern_version: env!("CARGO_PKG_VERSION").to_string(),
                };
                save_base(
                    &be,
                    &m,
                    &tokens,
                    &c,
                    kv,
                    header,
                    &mut std::io::stdout().lock(),
                )?
            });
            let secs = t0.elapsed().as_secs_f64();
            b.write(out)?;
            println!();
            if let Some(e) = b.header.ppl_err {
                println!("Final estimate: PPL = {:.4} +/- {:.5}", b.header.ppl, e);
            }
            report_speed("kld", backend, &c, secs);
            eprintln!(
                "kld: wrote {} ({} positions, {} bytes)",
                out.display(),
                b.len(),
                std::fs::metadata(out).map(|m| m.len()).unwrap_or(0)
            );
            if let Some(path) = &a.json {
                write_json(
                    path,
                    &json!({"base": out, "header": b.header, "seconds": secs}),
                )?;
            }
            Ok(())
        }
        (None, Some(base_path)) => {
            let b = BaseFile::read(base_path)?;
            let h = &b.header;
            if let Some(text_path) = &a.file {
                let bytes = std::fs::read(text_path)
                    .with_context(|| format!("reading {}", text_path.display()))?;
                let id = base::text_id(text_path, &bytes);
                if id.sha256 != h.text.sha256 {
                    return Err(EvalError::Mismatch(format!(
                        "{} (sha256 {}) is not the text {} was made from ({}, sha256 {})",
                        text_path.display(),
                        id.sha256,
                        base_path.display(),
                        h.text.file,
                        h.text.sha256
                    ))
                    .into());
                }
            }
            if let Some(n) = a.eval.ctx_size.filter(|&n| n != h.n_ctx) {
                bail!(
                    "--ctx-size {n}: {} was made with chunks of {}; a candidate is measured on the same chunks (drop --ctx-size)",
                    base_path.display(),
                    h.n_ctx
                );
            }
            if let Some(n) = a.eval.chunks.filter(|&n| n != h.n_chunk) {
                bail!(
                    "--chunks {n}: {} holds {} chunks; a candidate is measured on all of them (drop --chunks)",
                    base_path.display(),
                    h.n_chunk
                );
            }
            let picked = pick(&a.eval.backend)?;
            let backend = picked.name();
            let c = Chunking {
                n_ctx: h.n_ctx,
                n_seq: (a.eval.batch_size / h.n_ctx).max(1),
                n_chunk: h.n_chunk,
                bos: h.bos,
            };
            eprintln!(
                "kl_divergence: computing over {} chunks, n_ctx={}, batch_size={}, n_seq={}",
                c.n_chunk,
                c.n_ctx,
                a.eval.batch_size.min(c.n_seq * c.n_ctx),
                c.n_seq
            );
            let t0 = Instant::now();
            let report = on_backend!(picked, |be| {
                let m = Model::load(&be, file.clone())?;
                check_candidate(&file, m.cfg.n_vocab, &b, base_path)?;
                compare(&be, &m, &b, &c, kv, a.top_p, &mut std::io::stdout().lock())?
            });
            let secs = t0.elapsed().as_secs_f64();
            print_report(&report, h.top_k);
            report_speed("kld", backend, &c, secs);
            let gate = Gate::check(a, &report);
            gate.print();
            if let Some(path) = &a.json {
                let v = json!({
                    "base": {"file": base_path, "header": h},
                    "candidate": {"model": base::model_id(&file), "backend": backend,
                                  "cache_type_k": a.eval.cache_type_k, "cache_type_v": a.eval.cache_type_v},
                    "n_seq": c.n_seq,
                    "report": report,
                    "gate": gate.json(),
                    "seconds": secs,
                    "seconds_per_1k_positions": 1e3 * secs / report.positions as f64,
                    "tern_version": env!("CARGO_PKG_VERSION"),
                });
                write_json(path, &v)?;
            }
            if !gate.pass() {
                let _ = std::io::stdout().flush();
                std::process::exit(GATE_FAILED);
            }
            Ok(())
        }
        _ => bail!("give exactly one of --save-base F and --base F"),
    }
}

/// Refuses a candidate whose vocabulary or tokenizer is not the base file's.
pub fn check_candidate(
    file: &Gguf,
    n_vocab: usize,
    b: &BaseFile,
    base_path: &Path,
) -> Result<(), EvalError> {
    let h = &b.header;
    if n_vocab != h.tokenizer.n_vocab {
        return Err(EvalError::Mismatch(format!(
            "{} has a vocabulary of {n_vocab} tokens; {} was made with {} ({} tokens): another vocabulary cannot be compared",
            file.path().display(),
            base_path.display(),
            h.model.file,
            h.tokenizer.n_vocab
        )));
    }
    let t = base::tokenizer_id(file, n_vocab);
    if t.sha256 != h.tokenizer.sha256 {
        return Err(EvalError::Mismatch(format!(
            "{}'s tokenizer (sha256 {}) is not the one {} was made with ({}, tokenizer sha256 {}): the same ids would be other tokens",
            file.path().display(),
            t.sha256,
            base_path.display(),
            h.model.file,
            h.tokenizer.sha256
        )));
    }
    Ok(())
}

/// Runs the reference and fills a base file, writing the running perplexity to `out`.
pub fn save_base<B: Backend>(
    be: &B,
    m: &Model<B>,
    tokens: &[u32],
    c: &Chunking,
    kv: KvTypes,
    mut header: Header,
    out: &mut dyn Write,
) -> Result<BaseFile, EvalError> {
    let nv = m.cfg.n_vocab;
    let k = header.top_k;
    let mut b = BaseFile::new(header.clone(), tokens[..c.n_chunk * c.n_ctx].to_vec());
    let mut sums = NllSums::default();
    let bar = progress(c.n_chunk);
    score::run(be, m, tokens, c, kv, |ch| {
        let rows: Vec<stats::BaseRow> = ch
            .logits
            .par_chunks(nv)
            .zip(ch.targets.par_iter())
            .map(|(row, &t)| stats::base_row(row, t, k))
            .collect();
        for r in &rows {
            sums.add(-(r.target_logp as f64));
            b.push(r);
        }
        let _ = write!(out, "[{}]{:.4},", ch.index + 1, sums.ppl());
        let _ = out.flush();
        bar.set_message(format!("PPL {:.4}", sums.ppl()));
        bar.inc(1);
        Ok(())
    })?;
    bar.finish_and_clear();
    let (ppl, err) = sums.estimate();
    header.ppl = ppl;
    header.ppl_err = err;
    b.header = header;
    Ok(b)
}

/// Runs the candidate over the base file's tokens and measures it against the stored
/// distributions, writing llama-perplexity's per-chunk table to `out` as it goes.
pub fn compare<B: Backend>(
    be: &B,
    m: &Model<B>,
    b: &BaseFile,
    c: &Chunking,
    kv: KvTypes,
    top_p: f64,
    out: &mut dyn Write,
) -> Result<KldReport, EvalError> {
    let nv = m.cfg.n_vocab;
    let scored = c.scored();
    let mut sums = KldSums::default();
    let mut kl_values = Vec::with_capacity(b.len());
    let mut p_diff = Vec::with_capacity(b.len());
    let bar = progress(c.n_chunk);
    let _ = writeln!(
        out,
        "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p"
    );
    score::run(be, m, &b.tokens, c, kv, |ch| {
        let at = ch.index * scored;
        let rows: Vec<stats::RowCmp> = ch
            .logits
            .par_chunks(nv)
            .zip(ch.targets.par_iter())
            .enumerate()
            .map(|(i, (row, &t))| stats::compare_row(row, t, b.entry(at + i), top_p))
            .collect();
        for r in &rows {
            sums.add(r);
            kl_values.push(r.kld as f32);
            p_diff.push(r.p_diff as f32);
        }
        let [ppl, ratio, kl, rms, top] = sums.running();
        let _ = writeln!(
            out,
            "{:4}    {:9.4} ± {:9.4}    {:10.5} ± {:10.5}    {:10.5} ± {:10.5}    {:6.3} ± {:6.3} %    {:6.3} ± {:6.3} %",
            ch.index + 1,
            ppl.0,
            ppl.1,
            ratio.0,
            ratio.1,
            kl.0,
            kl.1,
            rms.0,
            rms.1,
            top.0,
            top.1
        );
        let _ = out.flush();
        bar.set_message(format!("KLD {:.5}", kl.0));
        bar.inc(1);
        Ok(())
    })?;
    bar.finish_and_clear();
    Ok(KldReport::new(&sums, kl_values, p_diff, top_p))
}

/// llama-perplexity's closing statistics, with tern's nucleus rate.
pub fn print_report(r: &KldReport, top_k: usize) {
    let pct = |x: f64| 100.0 * x;
    println!();
    println!("====== Perplexity statistics ======");
    println!(
        "Mean PPL(Q)                   : {:10.6} ± {:10.6}",
        r.ppl.value, r.ppl.err
    );
    println!(
        "Mean PPL(base)                : {:10.6} ± {:10.6}",
        r.ppl_base.value, r.ppl_base.err
    );
    println!(
        "Cor(ln(PPL(Q)), ln(PPL(base))): {:6.2}%",
        pct(r.ppl_correlation)
    );
    println!(
        "Mean ln(PPL(Q)/PPL(base))     : {:10.6} ± {:10.6}",
        r.ln_ppl_ratio.value, r.ln_ppl_ratio.err
    );
    println!(
        "Mean PPL(Q)/PPL(base)         : {:10.6} ± {:10.6}",
        r.ppl_ratio.value, r.ppl_ratio.err
    );
    println!(
        "Mean PPL(Q)-PPL(base)         : {:10.6} ± {:10.6}",
        r.ppl_diff.value, r.ppl_diff.err
    );
    println!();
    println!("====== KL divergence statistics (base top-{top_k} + rest) ======");
    let k = &r.kld;
    println!(
        "Mean    KLD: {} ± {}",
        small(r.kld_mean.value),
        small(r.kld_mean.err)
    );
    for (label, v) in [
        ("Maximum KLD", k.max),
        ("99.9%   KLD", k.p99_9),
        ("99.0%   KLD", k.p99),
        ("95.0%   KLD", k.p95),
        ("90.0%   KLD", k.p90),
        ("Median  KLD", k.median),
        ("10.0%   KLD", k.p10),
        (" 5.0%   KLD", k.p5),
        (" 1.0%   KLD", k.p1),
        (" 0.1%   KLD", k.p0_1),
        ("Minimum KLD", k.min),
    ] {
        println!("{label}: {}", small(v));
    }
    println!();
    println!("====== Token probability statistics ======");
    println!(
        "Mean    Δp: {:6.3} ± {:5.3} %",
        pct(r.delta_p_mean.value),
        pct(r.delta_p_mean.err)
    );
    let d = &r.delta_p;
    for (label, v) in [
        ("Maximum Δp", d.max),
        ("99.9%   Δp", d.p99_9),
        ("99.0%   Δp", d.p99),
        ("95.0%   Δp", d.p95),
        ("90.0%   Δp", d.p90),
        ("75.0%   Δp", d.p75),
        ("Median  Δp", d.median),
        ("25.0%   Δp", d.p25),
        ("10.0%   Δp", d.p10),
        (" 5.0%   Δp", d.p5),
        (" 1.0%   Δp", d.p1),
        (" 0.1%   Δp", d.p0_1),
        ("Minimum Δp", d.min),
    ] {
        println!("{label}: {:6.3}%", pct(v));
    }
    println!(
        "RMS Δp    : {:6.3} ± {:5.3} %",
        pct(r.delta_p_rms.value),
        pct(r.delta_p_rms.err)
    );
    println!(
        "Same top p: {:6.3} ± {:5.3} %",
        pct(r.top1.value),
        pct(r.top1.err)
    );
    println!(
        "Same nucleus (top-p {}): {:6.3} % of the {} positions whose base nucleus lies in its top-{top_k}",
        r.same_top_p.top_p,
        pct(r.same_top_p.rate),
        r.same_top_p.decided
    );
}

/// llama-perplexity's `%10.6f`, in scientific notation below 1e-4 where six decimals would
/// print a backend check's KL (1e-9 and less) as zero.
fn small(x: f64) -> String {
    if x != 0.0 && x.abs() < 1e-4 {
        format!("{x:10.3e}")
    } else {
        format!("{x:10.6}")
    }
}

/// The gate's bounds and verdicts.
struct Gate {
    checks: Vec<(String, f64, f64, bool)>,
}

impl Gate {
    fn check(a: &KldArgs, r: &KldReport) -> Gate {
        let mut checks = Vec::new();
        if let Some(max) = a.max_mean_kl {
            checks.push((
                "mean KL <= --max-mean-kl".to_string(),
                r.kld_mean.value,
                max,
                r.kld_mean.value <= max,
            ));
        }
        if let Some(min) = a.min_top1 {
            checks.push((
                "top-1 >= --min-top1".to_string(),
                r.top1.value,
                min,
                r.top1.value >= min,
            ));
        }
        if let Some(max) = a.max_ppl_ratio {
            checks.push((
                "PPL(Q)/PPL(base) <= --max-ppl-ratio".to_string(),
                r.ppl_ratio.value,
                max,
                r.ppl_ratio.value <= max,
            ));
        }
        Gate { checks }
    }

    fn pass(&self) -> bool {
        self.checks.iter().all(|c| c.3)
    }

    fn print(&self) {
        if self.checks.is_empty() {
            return;
        }
        println!();
        println!("====== Gate ======");
        for (what, v, bound, ok) in &self.checks {
            println!(
                "{}: {what}: {v:.6} vs {bound}",
                if *ok { "pass" } else { "FAIL" }
            );
        }
        println!("gate: {}", if self.pass() { "PASS" } else { "FAIL" });
    }

    fn json(&self) -> serde_json::Value {
        json!({
            "pass": self.pass(),
            "checks": self.checks.iter().map(|(what, v, bound, ok)| json!({
                "check": what, "value": v, "bound": bound, "pass": ok,
            })).collect::<Vec<_>>(),
        })
    }
}
