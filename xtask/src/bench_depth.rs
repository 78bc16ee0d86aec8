//! `cargo xtask bench --depth 0,4096,16384`: decode tokens/s with that many positions already
//! in the cache, tern beside stock llama.cpp's `llama-bench -d` in the same run (issue 21
//! point 5). Only the 6 attention layers' caches grow with depth; the GDN state is constant.
//!
//! One round per depth: a 16k prefill alone takes minutes per engine on a 2-core machine.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::json;
use tern::backend::cpu::CpuBackend;
use tern::backend::Backend;
use tern::model::Model;
use tern::tensor::GgmlType;

use crate::bench::{llama_bench_tests, load_average, prompt};

/// Prompt rows per forward while filling the cache (the engine's default ubatch).
const UBATCH: usize = 512;

pub struct Options {
    pub files: Vec<PathBuf>,
    pub depths: Vec<usize>,
    pub decode_tokens: usize,
}

/// Parses `--depth`'s comma-separated list.
pub fn parse_depths(list: &str) -> Result<Vec<usize>> {
    let depths = list
        .split(',')
        .map(|d| {
            d.trim()
                .parse::<usize>()
                .with_context(|| format!("--depth: {d:?} is not a number of positions"))
        })
        .collect::<Result<Vec<_>>>()?;
    if depths.is_empty() {
        bail!("--depth needs a list of positions, e.g. 0,4096,16384");
    }
    Ok(depths)
}

/// tern's serving path on `m`: the cache filled to `depth` (f16 K and V, llama-bench's
/// default), then `decode` greedy steps timed. Returns (fill t/s, NaN at depth 0; decode t/s).
fn tern_at(
    m: &Model<CpuBackend>,
    be: &CpuBackend,
    depth: usize,
    decode: usize,
) -> Result<(f64, f64)> {
    let kv = crate::bench::F16_KV;
    let mut st = m.new_state_with(be, kv)?;
    st.reserve(be, depth + decode + 1)?;
    let p = prompt(depth);
    let t0 = Instant::now();
    let mut next = 256;
    for chunk in p.chunks(UBATCH) {
        next = be.argmax_rows(&m.forward(be, &mut st, chunk, false)?.logits)[0];
    }
    let fill_tps = p.len() as f64 / t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    for _ in 0..decode {
        let out = m.forward(be, &mut st, &[next], false)?;
        next = be.argmax_rows(&out.logits)[0];
    }
    let decode_s = t1.elapsed().as_secs_f64();
    Ok((fill_tps, decode as f64 / decode_s))
}

/// `llama-bench -d depth -p 0 -n decode -r 1 -t 2`: its tg rate at that depth.
fn llama_at(exe: &Path, file: &Path, depth: usize, decode: usize) -> Result<f64> {
    let (d, n) = (depth.to_string(), decode.to_string());
    let tests = llama_bench_tests(exe, file, &["-p", "0", "-n", &n, "-d", &d, "-r", "1"])?;
    tests
        .iter()
        .find(|t| t["n_gen"].as_u64().is_some_and(|n| n > 0))
        .and_then(|t| t["avg_ts"].as_f64())
        .with_context(|| {
            format!(
                "llama-bench -d {depth} on {} reported no tg test",
                file.display()
            )
        })
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    let llama_bench = std::env::var_os("TERN_LLAMA_BENCH").map(PathBuf::from);
    if llama_bench.is_none() {
        eprintln!("TERN_LLAMA_BENCH is not set: tern's rows only");
    }
    let be = CpuBackend::int8();
    let mut rows = Vec::new();
    println!(
        "{:<24} {:>7} {:>10} {:>12} {:>12} {:>10} {:>10}",
        "file", "depth", "engine", "fill t/s", "decode t/s", "vs d0", "vs llama"
    );
    for f in &o.files {
        if !f.exists() {
            bail!(
                "{} is missing: run `cargo xtask fixtures --bench`",
                f.display()
            );
        }
        let m = Model::open(&be, f).with_context(|| format!("loading {}", f.display()))?;
        let need = o.depths.iter().max().copied().unwrap_or(0) + o.decode_tokens + 1;
        if need > m.cfg.context_length {
            bail!(
                "--depth: {} holds {} positions, the deepest run needs {need}",
                f.display(),
                m.cfg.context_length
            );
        }
        let llama_can = !m
            .file
            .tensors()
            .iter()
            .any(|t| matches!(t.ty, GgmlType::PQ2_0 | GgmlType::PTQ1_0));
        let name = f
            .file_name()
            .unwrap_or_default()
            .to_string_lossy()
            .to_string();
        let (mut tern_d0, mut llama_d0) = (None, None);
        for &depth in &o.depths {
            eprintln!("depth {depth} on {}, {}", f.display(), load_average());
            let (fill, dec) = tern_at(&m, &be, depth, o.decode_tokens)?;
            let llama = match (&llama_bench, llama_can) {
                (Some(exe), true) => Some(llama_at(exe, f, depth, o.decode_tokens)?),
                _ => None,
            };
            if depth == 0 {
                tern_d0 = Some(dec);
                llama_d0 = llama;
            }
            let vs =
                |x: f64, base: Option<f64>| base.map_or("-".into(), |b| format!("{:.3}", x / b));
            let fill_col = if depth == 0 {
                "-".to_string()
            } else {
                format!("{fill:.2}")
            };
            println!(
                "{:<24} {:>7} {:>10} {:>12} {:>12.2} {:>10} {:>10}",
                name,
                depth,
                "tern-cpu",
                fill_col,
                dec,
                vs(dec, tern_d0),
                vs(dec, llama)
            );
            if let Some(l) = llama {
                println!(
                    "{:<24} {:>7} {:>10} {:>12} {:>12.2} {:>10} {:>10}",
                    name,
                    depth,
                    "llama",
                    "-",
                    l,
                    vs(l, llama_d0),
                    "1.000"
                );
            }
            rows.push(
                json!({"file": name, "depth": depth, "tern_fill_tps": (depth > 0).then_some(fill),
                "tern_decode_tps": dec, "llama_bench_decode_tps": llama,
                "load_average": load_average()}),
            );
        }
    }
    let dir = root.join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let report = json!({"decode_tokens": o.decode_tokens, "rounds": 1, "kv": "f16/f16",
        "threads": rayon::current_num_threads(), "results": rows});
    std::fs::write(
        dir.join("depth.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    eprintln!("wrote {}", dir.join("depth.json").display());
    Ok(())
}
