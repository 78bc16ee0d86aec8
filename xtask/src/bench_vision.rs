//! `cargo xtask bench --vision`: image tokens per second of encoding one image on the CPU, tern
//! against stock llama.cpp (`llama_cpp.mtmd_cpp`, xtask/py/bench_vision.py) on the same
//! projector and image in the same run. Both time the encode alone (the tower and the merger),
//! after one warm-up encode (llama.cpp's init runs one too), median of the runs.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use crate::bench::median;
use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tern::backend::cpu::CpuBackend;
use tern::backend::Backend;
use tern::model::vision::Projector;

pub struct Options {
    pub model: PathBuf,
    pub mmproj: PathBuf,
    pub image: PathBuf,
    pub runs: usize,
    pub llama: bool,
    pub python: String,
}

impl Options {
    /// The fixtures: the tiny-vl text model, the Q8_0 projector (the deployment's type) and the
    /// fleet probe's 512 px solid red PNG.
    pub fn fixtures(root: &Path, python: String) -> Options {
        let d = root.join("fixtures/vision");
        Options {
            model: d.join("tiny-vl-f32.gguf"),
            mmproj: d.join("mmproj-q8_0.gguf"),
            image: d.join("red-512.png"),
            runs: 5,
            llama: true,
            python,
        }
    }
}

fn tern(o: &Options) -> Result<Value> {
    let be = CpuBackend::new();
    let text = tern::gguf::Gguf::open(&o.model)
        .with_context(|| format!("opening {}", o.model.display()))?;
    let n_embd = tern::model::Config::from_gguf(&text)?.n_embd;
    let p = Projector::open(&be, &o.mmproj, n_embd)?;
    let bytes =
        std::fs::read(&o.image).with_context(|| format!("reading {}", o.image.display()))?;
    let t0 = Instant::now();
    let img = p.cfg.prepare(&bytes)?;
    let prepare_ms = t0.elapsed().as_secs_f64() * 1e3;
    let (rows, cols) = img.grid(&p.cfg);
    let n_tok = rows * cols;
    let encode = || {
        let t = Instant::now();
        let out = p.encode(&be, &img);
        let n = be.to_host(&out).len();
        std::hint::black_box(n);
        t.elapsed().as_secs_f64()
    };
    encode();
    let secs: Vec<f64> = (0..o.runs).map(|_| encode()).collect();
    let med = median(secs.clone());
    Ok(json!({
        "engine": "tern",
        "backend": be.name(),
        "threads": rayon::current_num_threads(),
        "image_tokens": n_tok,
        "grid": [rows, cols],
        "prepare_ms": prepare_ms,
        "encode_ms": secs.iter().map(|s| s * 1e3).collect::<Vec<_>>(),
        "encode_ms_median": med * 1e3,
        "image_tokens_per_s": n_tok as f64 / med,
    }))
}

fn llama(o: &Options, script: &Path, threads: usize) -> Result<Value> {
    let out = Command::new(&o.python)
        .arg(script)
        .args([&o.model, &o.mmproj, &o.image])
        .args(["--runs", &o.runs.to_string()])
        .args(["--threads", &threads.to_string()])
        .output()
        .with_context(|| {
            format!(
                "running {} (set TERN_PYTHON to a venv with llama-cpp-python)",
                o.python
            )
        })?;
    if !out.status.success() {
        bail!(
            "llama.cpp vision bench failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    eprintln!(
        "tern cpu: {} on {} ...",
        o.mmproj.display(),
        o.image.display()
    );
    let t = tern(o)?;
    let threads = t["threads"].as_u64().unwrap_or(2) as usize;
    let l = if o.llama {
        eprintln!("llama.cpp (mtmd) ...");
        Some(llama(o, &root.join("xtask/py/bench_vision.py"), threads)?)
    } else {
        None
    };
    println!(
        "{:<10} {:>8} {:>8} {:>14} {:>16} {:>8}",
        "engine", "threads", "tokens", "encode ms", "image tokens/s", "ratio"
    );
    let anchor = l.as_ref().and_then(|l| l["image_tokens_per_s"].as_f64());
    for v in std::iter::once(&t).chain(l.as_ref()) {
        let tps = v["image_tokens_per_s"].as_f64().unwrap_or(f64::NAN);
        println!(
            "{:<10} {:>8} {:>8} {:>14.2} {:>16.1} {:>8.3}",
            v["engine"].as_str().unwrap_or("?"),
            v["threads"].as_u64().unwrap_or(0),
            v["image_tokens"].as_u64().unwrap_or(0),
            v["encode_ms_median"].as_f64().unwrap_or(f64::NAN),
            tps,
            anchor.map_or(f64::NAN, |a| tps / a)
        );
    }
    if let (Some(a), Some(l)) = (anchor, &l) {
        if l["image_tokens"] != t["image_tokens"] {
            bail!(
                "the engines disagree on the image's token count ({} vs {})",
                t["image_tokens"],
                l["image_tokens"]
            );
        }
        println!(
            "tern / llama.cpp: {:.3} (image tokens per second, same projector, image and run)",
            t["image_tokens_per_s"].as_f64().unwrap_or(0.0) / a
        );
    }
    let dir = root.join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let report = json!({
        "model": o.model, "mmproj": o.mmproj, "image": o.image, "runs": o.runs,
        "tern": t, "llama": l,
    });
    let path = dir.join("vision.json");
    std::fs::write(&path, serde_json::to_string_pretty(&report)?)?;
    eprintln!("wrote {}", path.display());
    Ok(())
}
