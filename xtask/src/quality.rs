//! `cargo xtask quality [--bench]`: the quantization tables, measured by tern's own `kld` (the
//! library behind `tern kld --save-base` / `--base`) on the files users serve.
//!
//! - demo: the F16 demo model on the CPU is the reference over the held-out plays
//!   (`fixtures/demo/heldout.txt`, 256-token chunks: the training window); Q8_0, PQ2_0 and
//!   PTQ1_0 are the candidates. Then the backend check: the F16 file on wgpu against the CPU
//!   over the first 8 chunks (lavapipe, where CI has no GPU, runs ~50 tokens/s). Writes
//!   `fixtures/demo/quality.json`.
//! - `--bench`: bench-0.8b Q8_0 on the CPU is the reference (random weights: the figures test
//!   the tool, not a model) and PQ2_0 the candidate, over the first chunks of the same text.
//!   Writes `fixtures/bench/quality.json` (not committed; the table is in `fixtures/bench.md`).
//!
//! Both print the markdown table.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result};
use serde_json::{json, Value as Json};
use tern::backend::pick::{pick, Picked};
use tern::backend::{Backend, KvTypes};
use tern::eval::base::{self, BaseFile, Header};
use tern::eval::cli::{check_candidate, compare, read_text, save_base, tokenize};
use tern::eval::score::Chunking;
use tern::eval::stats::KldReport;
use tern::gguf::Gguf;
use tern::model::Model;
use tern::tensor::GgmlType;

const TOP_K: usize = 32;
const TOP_P: f64 = 0.95;
const N_BATCH: usize = 2048;

struct Setup {
    reference: PathBuf,
    candidates: Vec<(PathBuf, &'static str)>,
    text: PathBuf,
    n_ctx: usize,
    chunks: Option<usize>,
}

fn kv() -> KvTypes {
    KvTypes {
        k: GgmlType::F16,
        v: GgmlType::F16,
    }
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

fn run_base<B: Backend>(be: &B, g: Arc<Gguf>, s: &Setup, backend: &str) -> Result<(BaseFile, f64)> {
    let (text_id, text) = read_text(&s.text)?;
    let (tokens, bos) = tokenize(&g, &text)?;
    let c = Chunking::new(tokens.len(), s.n_ctx, N_BATCH, s.chunks, bos)?;
    let m = Model::load(be, g.clone())?;
    let header = Header {
        model: base::model_id(&g),
        tokenizer: base::tokenizer_id(&g, m.cfg.n_vocab),
        text: text_id,
        n_ctx: c.n_ctx,
        n_chunk: c.n_chunk,
        bos: c.bos,
        top_k: TOP_K,
        backend: backend.to_string(),
        cache_type_k: "f16".into(),
        cache_type_v: "f16".into(),
        ppl: f64::NAN,
        ppl_err: None,
        tern_version: env!("CARGO_PKG_VERSION").to_string(),
    };
    let t0 = Instant::now();
    let b = save_base(be, &m, &tokens, &c, kv(), header, &mut std::io::sink())?;
    Ok((b, t0.elapsed().as_secs_f64()))
}

fn run_candidate<B: Backend>(be: &B, g: Arc<Gguf>, b: &BaseFile) -> Result<(KldReport, f64)> {
    let m = Model::load(be, g.clone())?;
    check_candidate(&g, m.cfg.n_vocab, b, Path::new("(base)"))?;
    let h = &b.header;
    let c = Chunking {
        n_ctx: h.n_ctx,
        n_seq: (N_BATCH / h.n_ctx).max(1),
        n_chunk: h.n_chunk,
        bos: h.bos,
    };
    let t0 = Instant::now();
    let r = compare(be, &m, b, &c, kv(), TOP_P, &mut std::io::sink())?;
    Ok((r, t0.elapsed().as_secs_f64()))
}

fn measure(s: &Setup) -> Result<Json> {
    let g = Arc::new(Gguf::open(&s.reference).with_context(|| s.reference.display().to_string())?);
    eprintln!("reference {} on cpu ...", s.reference.display());
    let (b, base_secs) = on_backend!(pick("cpu")?, |be| run_base(&be, g, s, "cpu")?);
    let h = b.header.clone();
    eprintln!(
        "  PPL {:.4} ± {:.4}, {} positions, {:.1} s",
        h.ppl,
        h.ppl_err.unwrap_or(f64::NAN),
        b.len(),
        base_secs
    );
    let mut rows = Vec::new();
    for (path, backend) in &s.candidates {
        let picked = match pick(backend) {
            Ok(p) => p,
            Err(e) => {
                eprintln!("  {} on {backend}: skipped ({e})", path.display());
                continue;
            }
        };
        eprintln!("candidate {} on {backend} ...", path.display());
        let g = Arc::new(Gguf::open(path).with_context(|| path.display().to_string())?);
        let bytes = g.file_len();
        let (r, secs) = on_backend!(picked, |be| run_candidate(&be, g, &b)?);
        eprintln!(
            "  mean KL {:.6}, top-1 {:.4}, PPL {:.4} ({:.1} s)",
            r.kld_mean.value, r.top1.value, r.ppl.value, secs
        );
        rows.push(json!({
            "file": path.file_name().map(|n| n.to_string_lossy().into_owned()),
            "bytes": bytes,
            "backend": backend,
            "seconds": secs,
            "seconds_per_1k_positions": 1e3 * secs / r.positions as f64,
            "report": r,
        }));
    }
    let v = json!({
        "generator": "cargo xtask quality",
        "text": h.text,
        "n_ctx": h.n_ctx, "n_chunk": h.n_chunk, "positions": b.len(), "top_k": TOP_K, "top_p": TOP_P,
        "kv": "f16", "n_batch": N_BATCH,
        "reference": {"file": h.model.file, "sha256": h.model.sha256, "bytes": h.model.bytes,
                      "backend": "cpu", "ppl": h.ppl, "ppl_err": h.ppl_err, "seconds": base_secs,
                      "seconds_per_1k_positions": 1e3 * base_secs / b.len() as f64},
        "candidates": rows,
    });
    print_table(&v);
    Ok(v)
}

fn write(out: &Path, v: &Json) -> Result<()> {
    std::fs::write(out, serde_json::to_string_pretty(v)? + "\n")?;
    eprintln!("wrote {}", out.display());
    Ok(())
}

/// A perplexity: fixed decimals, or scientific where random weights put it past 1e6.
fn ppl(x: f64, err: f64) -> String {
    if x.abs() < 1e6 {
        format!("{x:.3} ± {err:.3}")
    } else {
        format!("{x:.3e} ± {err:.3e}")
    }
}

fn print_table(v: &Json) {
    let f = |x: &Json| x.as_f64().unwrap_or(f64::NAN);
    println!(
        "| file | backend | bytes | PPL | PPL / PPL(reference) | mean KL | median KL | p99 KL | max KL | top-1 | same top-p {TOP_P} | s / 1k positions |"
    );
    println!("|---|---|---|---|---|---|---|---|---|---|---|---|");
    let r = &v["reference"];
    println!(
        "| {} (reference) | cpu | {} | {} | 1 | 0 | 0 | 0 | 0 | 100% | 100% | {:.3} |",
        r["file"].as_str().unwrap_or("?"),
        r["bytes"],
        ppl(f(&r["ppl"]), f(&r["ppl_err"])),
        f(&r["seconds_per_1k_positions"])
    );
    for c in v["candidates"].as_array().into_iter().flatten() {
        let rp = &c["report"];
        println!(
            "| {} | {} | {} | {} | {:.4} ± {:.4} | {:.3e} | {:.3e} | {:.3e} | {:.3e} | {:.2}% | {:.1}% of {} | {:.3} |",
            c["file"].as_str().unwrap_or("?"),
            c["backend"].as_str().unwrap_or("?"),
            c["bytes"],
            ppl(f(&rp["ppl"]["value"]), f(&rp["ppl"]["err"])),
            f(&rp["ppl_ratio"]["value"]),
            f(&rp["ppl_ratio"]["err"]),
            f(&rp["kld_mean"]["value"]),
            f(&rp["kld"]["median"]),
            f(&rp["kld"]["p99"]),
            f(&rp["kld"]["max"]),
            100.0 * f(&rp["top1"]["value"]),
            100.0 * f(&rp["same_top_p"]["rate"]),
            rp["same_top_p"]["decided"],
            f(&c["seconds_per_1k_positions"])
        );
    }
}

pub fn demo(root: &Path) -> Result<()> {
    let d = root.join("fixtures/demo");
    let file = |n: &str| d.join(n);
    let quantized = measure(&Setup {
        reference: file("demo-f16.gguf"),
        candidates: vec![
            (file("demo-q8_0.gguf"), "cpu"),
            (file("demo-pq2_0.gguf"), "cpu"),
            (file(crate::train_demo::PTQ1_0_FILE), "cpu"),
        ],
        text: file(crate::train_demo::HELDOUT_TEXT),
        n_ctx: 256,
        chunks: None,
    })?;
    let backend_check = measure(&Setup {
        reference: file("demo-f16.gguf"),
        candidates: vec![(file("demo-f16.gguf"), "wgpu")],
        text: file(crate::train_demo::HELDOUT_TEXT),
        n_ctx: 256,
        chunks: Some(8),
    })?;
    write(
        &file("quality.json"),
        &json!({"quantized": quantized, "backend_check": backend_check}),
    )
}

pub fn bench(root: &Path, chunks: usize) -> Result<()> {
    let d = root.join("fixtures/bench");
    let file = |n: &str| d.join(n);
    measure(&Setup {
        reference: file("bench-0.8b-q8_0.gguf"),
        candidates: vec![(file("bench-0.8b-pq2_0.gguf"), "cpu")],
        text: root
            .join("fixtures/demo")
            .join(crate::train_demo::HELDOUT_TEXT),
        n_ctx: 512,
        chunks: Some(chunks),
    })
    .and_then(|v| write(&file("quality.json"), &v))
}
