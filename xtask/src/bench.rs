//! `cargo xtask bench`: tern against stock llama.cpp on the same files in the same run
//! (../shared/docs/bench.md). Speed is reported as a ratio; absolute figures from a shared
//! 2-core machine mean little on their own.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use tern::backend::cpu::CpuBackend;
use tern::backend::gpu::Device as _;
use tern::backend::{Backend, KvTypes};
use tern::model::Model;
use tern::tensor::GgmlType;

/// K and V cached in f16: llama-bench's default (-ctk/-ctv f16) and the engine's, so every
/// serving-path figure beside llama.cpp's reads the cache it reads.
pub(crate) const F16_KV: KvTypes = KvTypes {
    k: GgmlType::F16,
    v: GgmlType::F16,
};

pub struct Options {
    pub files: Vec<PathBuf>,
    pub prompt_tokens: usize,
    pub decode_tokens: usize,
    pub runs: usize,
    pub llama: bool,
    pub python: String,
    /// Backends to measure: "cpu" (the serving path, int8 activations), "cpu-exact" (the f32
    /// reference), "wgpu", "cuda".
    pub backends: Vec<String>,
    /// Rounds of every measurement, tern and llama.cpp taking turns in each; the table gives
    /// the median over rounds (a shared machine's load comes and goes).
    pub rounds: usize,
}

/// Bytes of weights one decoded token reads: every matrix of the trunk once (the embedding
/// table only for one row, unless it is also the output head), not the MTP block.
pub(crate) fn streamed_bytes(g: &tern::gguf::Gguf) -> u64 {
    let tied = !g.tensors().iter().any(|t| t.name == "output.weight");
    g.tensors()
        .iter()
        .filter(|t| !t.name.contains(".nextn."))
        .filter(|t| t.name != "token_embd.weight" || tied)
        .map(|t| t.nbytes)
        .sum()
}

/// The token ids the llama.cpp side uses too (bench_llama.py), so both evaluate the same text.
pub(crate) fn prompt(n: usize) -> Vec<u32> {
    (0..n)
        .map(|i| ((i * 7919 + 13) % 200 + 256) as u32)
        .collect()
}

/// CPU time all of this process's threads have run, in ns (`/proc/self/task/*/schedstat`):
/// on a shared box wall time measures the neighbours too, CPU time mostly the work.
fn cpu_ns() -> u64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0;
    };
    tasks
        .flatten()
        .filter_map(|t| std::fs::read_to_string(t.path().join("schedstat")).ok())
        .filter_map(|s| s.split_whitespace().next()?.parse::<u64>().ok())
        .sum()
}

/// The median; of an even count, the mean of the two middle values (the upper one alone, as
/// this took before, read 4 rounds of 2.184 / 2.401 / 2.669 / 2.689 as 2.669, not 2.535).
pub(crate) fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    match v.len() {
        0 => f64::NAN,
        n if n % 2 == 1 => v[n / 2],
        n => (v[n / 2 - 1] + v[n / 2]) / 2.0,
    }
}

fn bench_tern<B: Backend>(be: &B, label: &str, path: &Path, o: &Options) -> Result<Value> {
    let m = Model::open(be, path).with_context(|| format!("loading {}", path.display()))?;
    let p = prompt(o.prompt_tokens);
    // K and V cached in f16 for the serving paths, as llama-bench (its default -ctk/-ctv) and
    // the engine cache them, and the whole context allocated before the clock starts, as
    // llama-bench's is: `new_state`'s f32 cache read twice the bytes a decoded token at
    // depth (bench-0.8b PQ2_0 after 2,048 tokens: 57.4 t/s here against the engine's 67.9).
    // The f32 reference keeps the f32 cache.
    let kv = match label {
        "cpu-exact" => KvTypes::default(),
        _ => F16_KV,
    };
    let fresh = || -> Result<_> {
        let mut st = m.new_state_with(be, kv)?;
        st.reserve(be, o.prompt_tokens + o.decode_tokens + 1)?;
        Ok(st)
    };
    // A prefill left out of the figures first, as llama-bench does (its warm-up prompt run):
    // the first pass pages the mapped weights in and grows the allocator's arenas.
    {
        let mut st = fresh()?;
        let out = m.forward(be, &mut st, &p, false)?;
        let _ = be.argmax_rows(&out.logits);
    }
    let (mut pre, mut pre_cpu, mut dec) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..o.runs {
        let mut st = fresh()?;
        let (t0, c0) = (Instant::now(), cpu_ns());
        let out = m.forward(be, &mut st, &p, false)?;
        let _ = be.argmax_rows(&out.logits);
        let t1 = Instant::now();
        pre_cpu.push(cpu_ns().saturating_sub(c0) as f64 / 1e9);
        let last = p[p.len() - 1];
        for i in 0..o.decode_tokens {
            let out = m.forward(be, &mut st, &[(last + i as u32) % 200 + 256], false)?;
            let _ = be.argmax_rows(&out.logits);
        }
        let t2 = Instant::now();
        pre.push(o.prompt_tokens as f64 / (t1 - t0).as_secs_f64());
        dec.push(o.decode_tokens as f64 / (t2 - t1).as_secs_f64());
    }
    let weight_bytes: u64 = m.file.tensors().iter().map(|t| t.nbytes).sum();
    let streamed = streamed_bytes(&m.file);
    let decode_tps = median(dec);
    Ok(json!({
        "engine": "tern",
        "backend": label,
        "threads": rayon::current_num_threads(),
        "prefill_tokens": o.prompt_tokens,
        "prefill_tps": median(pre.clone()),
        "prefill_tps_runs": pre,
        // CPU seconds of every thread per prefill: on a shared machine, the work without
        // the waits for a core.
        "prefill_cpu_s_runs": pre_cpu,
        "decode_tokens": o.decode_tokens,
        "decode_tps": decode_tps,
        "weight_bytes": weight_bytes,
        "streamed_bytes_per_token": streamed,
        // Weights read per second while decoding (KV and activations not counted).
        "decode_weight_gbps": streamed as f64 * decode_tps / 1e9,
    }))
}

/// The backends `cargo xtask bench` measures, opened once.
struct Backends {
    cpu: Option<CpuBackend>,
    cpu_exact: Option<CpuBackend>,
    gpu: Option<tern::backend::wgpu::WgpuBackend>,
    #[cfg(feature = "cuda")]
    cuda: Option<(tern::backend::cuda::CudaBackend, f64)>,
}

/// One round of tern on `f`, every backend asked for.
fn bench_tern_backends(b: &Backends, f: &Path, o: &Options) -> Result<Vec<Value>> {
    let mut t = Vec::new();
    if let Some(cpu) = &b.cpu {
        eprintln!("tern cpu on {} ...", f.display());
        t.push(bench_tern(cpu, "cpu", f, o)?);
    }
    if let Some(cpu) = &b.cpu_exact {
        eprintln!("tern cpu-exact on {} ...", f.display());
        t.push(bench_tern(cpu, "cpu-exact", f, o)?);
    }
    if let Some(g) = &b.gpu {
        eprintln!("tern wgpu on {} ...", f.display());
        let mut r = bench_tern(g, "wgpu", f, o)?;
        r["adapter"] = json!(g.dev.info.name);
        t.push(r);
    }
    #[cfg(feature = "cuda")]
    if let Some((c, copy_gbps)) = &b.cuda {
        eprintln!("tern cuda on {} ...", f.display());
        let mut r = bench_tern(c, "cuda", f, o)?;
        r["device"] = json!(c.dev.name);
        r["copy_gbps"] = json!(copy_gbps);
        r["decode_fraction_of_copy"] =
            json!(r["decode_weight_gbps"].as_f64().unwrap_or(0.0) / copy_gbps);
        t.push(r);
    }
    Ok(t)
}

/// One result of several rounds: the first round's fields with the median rates, and every
/// round's rates beside them.
fn median_rounds(rounds: Vec<Value>) -> Value {
    let mut out = rounds[0].clone();
    for key in [
        "prefill_tps",
        "decode_tps",
        "decode_weight_gbps",
        "over_one_stream",
    ] {
        let v: Vec<f64> = rounds.iter().filter_map(|r| r[key].as_f64()).collect();
        if v.len() == rounds.len() {
            out[key] = json!(median(v.clone()));
            out[format!("{key}_rounds")] = json!(v);
        }
    }
    out
}

/// `/proc/loadavg`'s three figures, for the log of a shared machine.
pub(crate) fn load_average() -> String {
    let l = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    let f: Vec<&str> = l.split_whitespace().take(3).collect();
    format!("load average {}", f.join(" "))
}

/// Stock llama.cpp's own `llama-bench` (`exe`) on `path`: pp of the prompt, and tg of the decoded
/// tokens at the prompt's depth (`-d`: tern's decode follows its prompt, and llama-bench's tg
/// alone starts from an empty cache, which after a 2,048-token prompt made llama.cpp's decode
/// the cheaper one to compare), `o.runs` repetitions each, 2 threads (its median-free report
/// gives the mean).
fn bench_llama_bench(exe: &Path, path: &Path, o: &Options) -> Result<Value> {
    let (p, n, r) = (
        o.prompt_tokens.to_string(),
        o.decode_tokens.to_string(),
        o.runs.to_string(),
    );
    let mut tests = llama_bench_tests(exe, path, &["-p", &p, "-n", "0", "-r", &r])?;
    tests.extend(llama_bench_tests(
        exe,
        path,
        &["-p", "0", "-n", &n, "-d", &p, "-r", &r],
    )?);
    let rate = |prompt: bool| -> Result<f64> {
        tests
            .iter()
            .find(|t| (t["n_gen"].as_u64() == Some(0)) == prompt)
            .and_then(|t| t["avg_ts"].as_f64())
            .with_context(|| {
                format!(
                    "llama-bench on {} reported no {} test",
                    path.display(),
                    if prompt { "pp" } else { "tg" }
                )
            })
    };
    let decode_tps = rate(false)?;
    let g = tern::gguf::Gguf::open(path)?;
    let streamed = streamed_bytes(&g);
    Ok(json!({
        "engine": "llama-bench",
        "build": tests.first().map(|t| t["build_commit"].clone()),
        "threads": 2,
        "prefill_tokens": o.prompt_tokens,
        "prefill_tps": rate(true)?,
        "decode_tokens": o.decode_tokens,
        "decode_depth": o.prompt_tokens,
        "decode_tps": decode_tps,
        "decode_weight_gbps": streamed as f64 * decode_tps / 1e9,
    }))
}

/// `llama-bench` (`exe`) on `file` with `args`, 2 threads: its JSON list of tests.
pub(crate) fn llama_bench_tests(exe: &Path, file: &Path, args: &[&str]) -> Result<Vec<Value>> {
    let out = Command::new(exe)
        .arg("-m")
        .arg(file)
        .args(args)
        .args(["-t", "2", "-o", "json"])
        .output()
        .with_context(|| format!("running {} (TERN_LLAMA_BENCH)", exe.display()))?;
    if !out.status.success() {
        bail!(
            "llama-bench {} failed on {}: {}",
            args.join(" "),
            file.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    serde_json::from_slice(&out.stdout)
        .with_context(|| format!("llama-bench's JSON on {}", file.display()))
}

fn bench_llama(path: &Path, o: &Options, script: &Path) -> Result<Value> {
    let out = Command::new(&o.python)
        .arg(script)
        .arg(path)
        .args(["--prompt-tokens", &o.prompt_tokens.to_string()])
        .args(["--decode", &o.decode_tokens.to_string()])
        .args(["--runs", &o.runs.to_string(), "--threads", "2"])
        .output()
        .with_context(|| {
            format!(
                "running {} (set TERN_PYTHON to a venv with llama-cpp-python)",
                o.python
            )
        })?;
    if !out.status.success() {
        bail!(
            "llama.cpp bench failed on {}: {}",
            path.display(),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    Ok(serde_json::from_slice(&out.stdout)?)
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    if o.files.is_empty() {
        bail!("no bench files: run `cargo xtask fixtures --bench` first");
    }
    let want = |b: &str| o.backends.iter().any(|x| x == b);
    let backends = Backends {
        cpu: want("cpu").then(CpuBackend::int8),
        cpu_exact: want("cpu-exact").then(CpuBackend::new),
        gpu: if want("wgpu") {
            let g = tern::backend::wgpu::WgpuBackend::new()?;
            eprintln!("{}", g.dev.describe());
            Some(g)
        } else {
            None
        },
        #[cfg(feature = "cuda")]
        cuda: if want("cuda") {
            let c = tern::backend::cuda::CudaBackend::new()?;
            eprintln!("{}", c.dev.describe());
            // The roofline of a decode step: what the device copies per second, read plus
            // write, measured now (1 GiB moved per repetition).
            let copy_gbps = c.dev.copy_bandwidth(512 << 20, 20);
            eprintln!("cuda device-to-device copy: {copy_gbps:.1} GB/s");
            Some((c, copy_gbps))
        } else {
            None
        },
    };
    #[cfg(not(feature = "cuda"))]
    if want("cuda") {
        bail!(
            "this xtask was built without CUDA: run `cargo run --release -p xtask --features cuda -- bench --backend cuda ...`"
        );
    }
    let script = root.join("xtask/py/bench_llama.py");
    let llama_bench = std::env::var_os("TERN_LLAMA_BENCH").map(PathBuf::from);
    let mut rows = Vec::new();
    for f in &o.files {
        if !f.exists() {
            bail!(
                "{} is missing: run `cargo xtask fixtures --bench`",
                f.display()
            );
        }
        // Stock llama.cpp has no PQ2_0/PTQ1_0 kernels: it can only run the other files.
        let g = tern::gguf::Gguf::open(f)?;
        let llama_can = !g.tensors().iter().any(|t| {
            matches!(
                t.ty,
                tern::tensor::GgmlType::PQ2_0 | tern::tensor::GgmlType::PTQ1_0
            )
        });
        let (mut t, mut l, mut lb) = (Vec::new(), Vec::new(), Vec::new());
        for round in 0..o.rounds {
            eprintln!(
                "round {}/{} on {}, {}",
                round + 1,
                o.rounds,
                f.display(),
                load_average()
            );
            let mut tr = bench_tern_backends(&backends, f, o)?;
            if want("cpu") {
                tr.extend(crate::bench_draft::llama_table_rows(
                    f,
                    o.prompt_tokens,
                    o.decode_tokens,
                )?);
            }
            t.push(tr);
            if o.llama && llama_can {
                eprintln!("llama.cpp (Python binding) on {} ...", f.display());
                l.push(bench_llama(f, o, &script)?);
            }
            if let (Some(exe), true) = (&llama_bench, llama_can) {
                eprintln!("llama-bench on {} ...", f.display());
                lb.push(bench_llama_bench(exe, f, o)?);
            }
        }
        let t: Vec<Value> = (0..t[0].len())
            .map(|i| median_rounds(t.iter().map(|r| r[i].clone()).collect()))
            .collect();
        let l = (!l.is_empty()).then(|| median_rounds(l));
        let lb = (!lb.is_empty()).then(|| median_rounds(lb));
        rows.push(json!({"file": f.file_name().unwrap().to_string_lossy(), "tern": t, "llama": l, "llama_bench": lb}));
    }
    // Ratios are taken against llama.cpp on the Q8_0 file, the anchor of bench.md: its own
    // llama-bench where TERN_LLAMA_BENCH names one, else the Python binding.
    let anchor = rows
        .iter()
        .find_map(|r| r["llama_bench"].as_object().cloned())
        .or_else(|| rows.iter().find_map(|r| r["llama"].as_object().cloned()));
    println!(
        "{:<28} {:>10} {:>14} {:>14} {:>10} {:>10} {:>12} {:>10}",
        "file",
        "engine",
        "prefill t/s",
        "decode t/s",
        "pre ratio",
        "dec ratio",
        "decode GB/s",
        "of copy"
    );
    for r in &rows {
        let mut runs: Vec<(String, &Value)> = r["tern"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| (format!("tern-{}", v["backend"].as_str().unwrap()), v))
            .collect();
        if !r["llama"].is_null() {
            runs.push(("llama.cpp".to_string(), &r["llama"]));
        }
        if !r["llama_bench"].is_null() {
            runs.push(("llama-bench".to_string(), &r["llama_bench"]));
        }
        for (eng, v) in runs {
            let (pr, dr) = match &anchor {
                Some(a) => (
                    v["prefill_tps"].as_f64().unwrap() / a["prefill_tps"].as_f64().unwrap(),
                    v["decode_tps"].as_f64().unwrap() / a["decode_tps"].as_f64().unwrap(),
                ),
                None => (f64::NAN, f64::NAN),
            };
            let gbps = v["decode_weight_gbps"]
                .as_f64()
                .map_or("-".to_string(), |g| format!("{g:.2}"));
            let of_copy = v["decode_fraction_of_copy"]
                .as_f64()
                .map_or("-".to_string(), |x| format!("{:.1}%", 100.0 * x));
            println!(
                "{:<28} {:>10} {:>14.2} {:>14.2} {:>10.3} {:>10.3} {:>12} {:>10}",
                r["file"].as_str().unwrap(),
                eng,
                v["prefill_tps"].as_f64().unwrap(),
                v["decode_tps"].as_f64().unwrap(),
                pr,
                dr,
                gbps,
                of_copy
            );
        }
    }
    println!(
        "tern-eng*: the serving engine (as serve runs it); -mtp drafts (adaptive depth <= 3) and \
         -x3 is 3 streams' aggregate: llama-bench has neither, so their ratios are to its plain \
         one-stream decode"
    );
    for r in &rows {
        let x3 = r["tern"].as_array().unwrap().iter().find_map(|v| {
            Some((
                v["over_one_stream"].as_f64()?,
                v.get("over_one_stream_rounds").cloned(),
            ))
        });
        if let Some((ratio, rounds)) = x3 {
            println!(
                "{:<28} 3 streams / 1 stream, turn by turn: median {ratio:.3}{}",
                r["file"].as_str().unwrap(),
                rounds.map_or(String::new(), |v| format!(" (rounds' medians {v})"))
            );
        }
    }
    let dir = root.join("target/bench");
    std::fs::create_dir_all(&dir)?;
    let report = json!({
        "prompt_tokens": o.prompt_tokens,
        "decode_tokens": o.decode_tokens,
        "runs": o.runs,
        "rounds": o.rounds,
        "load_average_after": load_average(),
        "ratio_anchor": "llama.cpp on the first file it can run (bench-0.8b Q8_0): llama-bench if TERN_LLAMA_BENCH, else the Python binding",
        "results": rows,
    });
    std::fs::write(
        dir.join("bench.json"),
        serde_json::to_string_pretty(&report)?,
    )?;
    eprintln!("wrote {}", dir.join("bench.json").display());
    Ok(())
}

/// `--prompt`'s value: one prompt length or several, comma-separated.
pub fn prompt_lengths(v: Option<&String>) -> Result<Vec<usize>> {
    let v = v.context("--prompt needs a number of tokens, or several comma-separated")?;
    v.split(',')
        .map(|n| match n.trim().parse::<usize>() {
            Ok(n) if n > 0 => Ok(n),
            _ => bail!("--prompt: {n:?} is not a positive number of tokens"),
        })
        .collect()
}

/// `cargo xtask bench` once per prompt length (llama-bench's `-p` follows it), each length's
/// report copied to target/bench/bench-p{N}.json beside bench.json (the last length's). The
/// decode column of a long prompt is tern decoding after it, llama-bench's `tg` at depth 0.
pub fn run_prompt_lengths(root: &Path, o: &mut Options, lengths: &[usize]) -> Result<()> {
    for &n in lengths {
        o.prompt_tokens = n;
        if lengths.len() > 1 {
            println!("\nprompt of {n} tokens");
        }
        run(root, o)?;
        let dir = root.join("target/bench");
        std::fs::copy(dir.join("bench.json"), dir.join(format!("bench-p{n}.json")))?;
    }
    Ok(())
}

/// The kernel tables' activations: `n` fixed values in [-1, 1), the same in every table and run.
pub fn bench_acts(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 7919) % 1000) as f32 / 500.0 - 1.0)
        .collect()
}

/// The kernel tables' weight row before quantization: `n` fixed values in [-1, 1).
fn bench_weights(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| ((i * 104729) % 2000) as f32 / 1000.0 - 1.0)
        .collect()
}

/// `cargo xtask bench --kernels`: `quant::dot_row` throughput per weight type, in GB/s of
/// weight bytes, over a matrix larger than the caches (what decode streams).
pub fn kernels() -> Result<()> {
    use tern::tensor::GgmlType::*;
    let (rows, cols) = (16384usize, 4096usize);
    let x: Vec<f32> = bench_acts(cols);
    let src: Vec<f32> = bench_weights(cols);
    println!("{:<8} {:>12} {:>16}", "type", "GB/s", "G elements/s");
    for ty in [F32, F16, BF16, Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        let row = tern::quant::quantize_row(ty, &src)?;
        let m: Vec<u8> = row.iter().copied().cycle().take(row.len() * rows).collect();
        let mut best = f64::MAX;
        let mut sink = 0f32;
        for _ in 0..3 {
            let t = Instant::now();
            for r in 0..rows {
                sink += tern::quant::dot_row(ty, &m[r * row.len()..(r + 1) * row.len()], &x);
            }
            best = best.min(t.elapsed().as_secs_f64());
        }
        std::hint::black_box(sink);
        println!(
            "{:<8} {:>12.2} {:>16.2}",
            ty.name(),
            m.len() as f64 / best / 1e9,
            (rows * cols) as f64 / best / 1e9
        );
    }
    int8_kernels(&x, &src, rows)
}

/// Seconds this thread has been on a CPU (`CLOCK_THREAD_CPUTIME_ID`): the kernel tables time
/// single-threaded loops by it, so that on a shared machine the time the thread waited for a
/// core does not count (cache and memory contention still do).
fn thread_cpu_s() -> f64 {
    let mut ts = libc::timespec {
        tv_sec: 0,
        tv_nsec: 0,
    };
    // SAFETY: `ts` is a valid timespec for the call to fill.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) } != 0 {
        return f64::NAN;
    }
    ts.tv_sec as f64 + ts.tv_nsec as f64 / 1e9
}

/// The least of three runs of `f`, in this thread's CPU seconds.
fn best_cpu_s(mut f: impl FnMut()) -> f64 {
    (0..3)
        .map(|_| {
            let t = thread_cpu_s();
            f();
            thread_cpu_s() - t
        })
        .fold(f64::MAX, f64::min)
}

/// The serving path's integer kernels (`quant::int8`) on the same matrices, for 1 to 4
/// activation rows per weight row and every instruction set the CPU has: GB/s of weight bytes
/// per second of this thread's CPU time.
fn int8_kernels(x: &[f32], src: &[f32], rows: usize) -> Result<()> {
    use tern::quant::int8::{self, QActs};
    use tern::tensor::GgmlType::*;
    let cols = x.len();
    let xs: Vec<f32> = x.iter().cycle().take(4 * cols).copied().collect();
    println!("\nint8 activations");
    println!("{:<8} {:>12} {:>6} {:>12}", "type", "isa", "rows", "GB/s");
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        let row = tern::quant::quantize_row(ty, src)?;
        let m: Vec<u8> = row.iter().copied().cycle().take(row.len() * rows).collect();
        let acts = QActs::quantize(ty, &xs, cols);
        for isa in int8::isas() {
            for n in 1..=4usize {
                let mut out = [0f32; 4];
                let best = best_cpu_s(|| {
                    for r in 0..rows {
                        let w = &m[r * row.len()..(r + 1) * row.len()];
                        int8::dot_rows_isa(w, &acts, 0, &mut out[..n], isa);
                        std::hint::black_box(&out);
                    }
                });
                println!(
                    "{:<8} {:>12} {:>6} {:>12.2}",
                    ty.name(),
                    format!("{isa:?}"),
                    n,
                    m.len() as f64 / best / 1e9
                );
            }
        }
    }
    head_kernels()?;
    span_kernels()?;
    tiled_kernels(src)
}

/// A decode step's products at bench-0.8b's shapes (row width and weight type), one activation
/// row, single-threaded on a slice of about 1 MiB of rows that stays in L2 across the passes:
/// the kernels' arithmetic ceiling in GB/s of weights, which a step's memory stream (9.3 GB/s
/// on one thread of the bench machine, `bench --step`) must stay below for the product to be
/// memory-bound. `dot_rows` row by row (a kernel choice and shape checks per row) beside
/// `dot_span` over the slice (once per slice), and the same for 2 to 4 activation rows.
pub fn span_kernels() -> Result<()> {
    use tern::quant::int8::{self, QActs};
    use tern::tensor::GgmlType::*;
    println!(
        "
bench-0.8b decode shapes, 1 to 4 activation rows, ~1 MiB of rows in L2, GB/s"
    );
    println!(
        "{:<8} {:>6} {:>12} {:>10} {:>10} {:>7} {:>10} {:>8} {:>8} {:>8}",
        "type",
        "cols",
        "isa",
        "dot_rows",
        "dot_span",
        "ratio",
        "dot_rows3",
        "span2",
        "span3",
        "span4"
    );
    for (ty, cols) in [
        (Q8_0, 1024usize),
        (Q8_0, 2048),
        (Q8_0, 3584),
        (PQ2_0, 1024),
        (PQ2_0, 2048),
        (PTQ1_0, 1024),
    ] {
        let x: Vec<f32> = bench_acts(cols);
        let src: Vec<f32> = bench_weights(cols);
        let row = tern::quant::quantize_row(ty, &src)?;
        let rows = (1usize << 20) / row.len();
        let m: Vec<u8> = row.iter().copied().cycle().take(row.len() * rows).collect();
        let acts = QActs::quantize(ty, &x, cols);
        let x4: Vec<f32> = bench_acts(4 * cols);
        let acts4 = QActs::quantize(ty, &x4, cols);
        let mut out = vec![0f32; rows];
        for isa in int8::isas() {
            // Ten passes per timing, so that a pass over 1 MiB is not lost in the clock's grain.
            let each = best_cpu_s(|| {
                for _ in 0..10 {
                    for (w, o) in m.chunks_exact(row.len()).zip(out.chunks_exact_mut(1)) {
                        int8::dot_rows_isa(w, &acts, 0, o, isa);
                    }
                    std::hint::black_box(&out);
                }
            });
            let span = best_cpu_s(|| {
                for _ in 0..10 {
                    int8::dot_span_isa(&m, &acts, 0, &mut out, isa);
                    std::hint::black_box(&out);
                }
            });
            // A few token rows (three streams, a verify batch): `dot_rows` row by row for 3,
            // and the multi-row span kernel for 2 to 4.
            let rows3 = best_cpu_s(|| {
                for _ in 0..10 {
                    let mut o = [0f32; 3];
                    for w in m.chunks_exact(row.len()) {
                        int8::dot_rows_isa(w, &acts4, 0, &mut o, isa);
                        std::hint::black_box(&o);
                    }
                }
            });
            let spans: Vec<f64> = (2..=4)
                .map(|n| {
                    let mut out = vec![0f32; rows * n];
                    best_cpu_s(|| {
                        for _ in 0..10 {
                            int8::dot_span_rows_isa(&m, &acts4, 0, n, &mut out, isa);
                            std::hint::black_box(&out);
                        }
                    })
                })
                .collect();
            let gb = 10.0 * m.len() as f64 / 1e9;
            println!(
                "{:<8} {:>6} {:>12} {:>10.2} {:>10.2} {:>7.2} {:>10.2} {:>8.2} {:>8.2} {:>8.2}",
                ty.name(),
                cols,
                format!("{isa:?}"),
                gb / each,
                gb / span,
                each / span,
                gb / rows3,
                gb / spans[0],
                gb / spans[1],
                gb / spans[2]
            );
        }
        // The serving path's copy of a Q8_0 or PQ2_0 matrix, repacked at load (`quant::packed`): its
        // span kernels for 1 to 4 activation rows (it has no per-row entry point).
        // A PTQ1_0 matrix packs as PQ2_0 blocks (34 bytes a block for 28): its row is read with
        // PQ2_0's activations, and its GB/s are of the packed bytes, the bytes it streams.
        if tern::quant::packed::packs(ty, cols) {
            use tern::quant::packed;
            let mut p = vec![0u8; packed::packed_len(ty, cols, m.len())];
            packed::pack_rows(ty, &m, cols, &mut p);
            let pty = packed::packed_type(ty);
            let (acts, acts4) = (
                QActs::quantize(pty, &x, cols),
                QActs::quantize(pty, &x4, cols),
            );
            let spans: Vec<f64> = (1..=4)
                .map(|n| {
                    let mut out = vec![0f32; rows * n];
                    let a = if n == 1 { &acts } else { &acts4 };
                    best_cpu_s(|| {
                        for _ in 0..10 {
                            packed::dot_span(&p, a, 0, n, &mut out);
                            std::hint::black_box(&out);
                        }
                    })
                })
                .collect();
            let gb = 10.0 * p.len() as f64 / 1e9;
            println!(
                "{:<8} {:>6} {:>12} {:>10} {:>10.2} {:>7} {:>10} {:>8.2} {:>8.2} {:>8.2}",
                ty.name(),
                cols,
                "packed",
                "-",
                gb / spans[0],
                "-",
                "-",
                gb / spans[1],
                gb / spans[2],
                gb / spans[3]
            );
        }
    }
    Ok(())
}

/// `cargo xtask bench --kernels --span-mem`: the serving path's packed span kernels
/// (`quant::packed`) streaming a 256 MiB matrix from memory on every rayon thread, in tasks of
/// `INT8_TASK_BYTES` as a decode step's row tasks, for 1 to 4 token rows, beside a plain read
/// of as many bytes on as many threads (`bench --step`'s). `--span` runs the kernels on one
/// thread in L2, where their arithmetic alone sets the pace; here a token row more costs only
/// what its arithmetic adds beyond the memory stream. Medians of 7 passes, the row counts
/// taken in turn within each.
pub fn span_mem() -> Result<()> {
    use rayon::prelude::*;
    use tern::quant::int8::QActs;
    use tern::quant::packed;
    use tern::tensor::GgmlType::*;
    const PASSES: usize = 7;
    let threads = rayon::current_num_threads();
    println!(
        "\npacked span kernels from memory, 256 MiB matrix, {threads} threads, GB/s of weights (medians of {PASSES} passes; the read the best of 3 in each); {}",
        load_average()
    );
    println!(
        "{:<8} {:>6} {:>8} {:>8} {:>8} {:>8} {:>8} {:>9}",
        "type", "cols", "read", "1 row", "2 rows", "3 rows", "4 rows", "3 ÷ 1 ms"
    );
    for (ty, cols) in [
        (PQ2_0, 1024usize),
        (PQ2_0, 2048),
        (PQ2_0, 3584),
        (Q8_0, 1024),
        (Q8_0, 3584),
    ] {
        if !packed::packs(ty, cols) {
            println!("{:<8} {cols:>6}: no packed kernel on this CPU", ty.name());
            continue;
        }
        let row = tern::quant::quantize_row(ty, &bench_weights(cols))?;
        let rows = (256usize << 20) / row.len();
        let m: Vec<u8> = row.iter().copied().cycle().take(row.len() * rows).collect();
        let mut p = vec![0u8; packed::packed_len(ty, cols, m.len())];
        packed::pack_rows(ty, &m, cols, &mut p);
        drop(m);
        let rb = p.len() / rows;
        // As many bytes as the packed matrix, touched once so that the reads reach memory.
        let plain: Vec<u64> = (0..(p.len() / 8) as u64).collect();
        let per_task = (tern::backend::cpu::INT8_TASK_BYTES / rb).max(1);
        let acts = QActs::quantize(packed::packed_type(ty), &bench_acts(4 * cols), cols);
        let mut outs: Vec<Vec<f32>> = (1..=4).map(|n| vec![0f32; rows * n]).collect();
        let (mut read, mut t) = (Vec::new(), vec![Vec::new(); 4]);
        for pass in 0..PASSES {
            read.push(crate::bench_step::read_bandwidth(&plain, threads));
            for k in 0..4 {
                // A different row count first in each pass, so no count always follows the read.
                let n = 1 + (k + pass) % 4;
                let out = &mut outs[n - 1];
                let s = Instant::now();
                out.par_chunks_mut(per_task * n)
                    .zip(p.par_chunks(per_task * rb))
                    .for_each(|(o, r)| packed::dot_span(r, &acts, 0, n, o));
                t[n - 1].push(s.elapsed().as_secs_f64());
                std::hint::black_box(&out);
            }
        }
        let gb = p.len() as f64 / 1e9;
        let t: Vec<f64> = t.into_iter().map(median).collect();
        println!(
            "{:<8} {:>6} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>9.2}",
            ty.name(),
            cols,
            median(read),
            gb / t[0],
            gb / t[1],
            gb / t[2],
            gb / t[3],
            t[2] / t[0]
        );
    }
    Ok(())
}

/// The row kernels for one activation row at the shape of bench-0.8b's tied output head
/// (248,320 rows of 1,024, the largest matrix of a decode step), single-threaded: rows this
/// short pay each row's setup and reduction more often than the 4,096-wide rows above.
fn head_kernels() -> Result<()> {
    use tern::quant::int8::{self, QActs};
    use tern::tensor::GgmlType::*;
    let (rows, cols) = (248_320usize, 1024usize);
    let x: Vec<f32> = bench_acts(cols);
    let src: Vec<f32> = bench_weights(cols);
    println!("\noutput head shape ({rows} x {cols}), 1 activation row");
    println!("{:<8} {:>12} {:>12}", "type", "isa", "GB/s");
    for ty in [Q8_0, PQ2_0] {
        let row = tern::quant::quantize_row(ty, &src)?;
        let m: Vec<u8> = row.iter().copied().cycle().take(row.len() * rows).collect();
        let acts = QActs::quantize(ty, &x, cols);
        for isa in int8::isas() {
            let mut out = [0f32; 1];
            let best = best_cpu_s(|| {
                for w in m.chunks_exact(row.len()) {
                    int8::dot_rows_isa(w, &acts, 0, &mut out, isa);
                    std::hint::black_box(&out);
                }
            });
            println!(
                "{:<8} {:>12} {:>12.2}",
                ty.name(),
                format!("{isa:?}"),
                m.len() as f64 / best / 1e9
            );
        }
    }
    Ok(())
}

/// The product's shapes from a decode step to prefill, single-threaded: 1 to 64 token rows
/// against 512 weight rows of 4096 (in L2/L3, as a task's slice of a matrix is), the row
/// kernels in groups of up to `MAX_ROWS` (what `product_int8` runs for up to `MAX_ROWS`
/// tokens) against the tiled product on a decoded panel (its decoding and the activations'
/// layout included), in G multiply-adds per second of CPU time: where the tiled kernel starts
/// to pay.
fn tiled_kernels(src: &[f32]) -> Result<()> {
    use tern::quant::int8::{self, Isa, Panel, QActs, TiledActs, MAX_ROWS};
    use tern::tensor::GgmlType::*;
    let (rows, cols) = (512usize, src.len());
    println!("\nproduct of T tokens x {rows} rows x {cols}, G MAC/s");
    println!(
        "{:<8} {:>4} {:>12} {:>12} {:>8}",
        "type", "T", "row kernels", "tiled", "ratio"
    );
    for ty in [Q8_0, Q4_0, PQ2_0, PTQ1_0] {
        let row = tern::quant::quantize_row(ty, src)?;
        let m: Vec<u8> = row.iter().copied().cycle().take(row.len() * rows).collect();
        for toks in [1usize, 2, 3, 4, 8, 16, 24, 32, 64] {
            let xs: Vec<f32> = bench_acts(toks * cols);
            let acts = QActs::quantize(ty, &xs, cols);
            let mut out = vec![0f32; toks * rows];
            let grouped = best_cpu_s(|| {
                for t0 in (0..toks).step_by(MAX_ROWS) {
                    let n = MAX_ROWS.min(toks - t0);
                    for (r, w) in m.chunks_exact(row.len()).enumerate() {
                        let o = &mut out[r * toks + t0..r * toks + t0 + n];
                        int8::dot_rows(w, &acts, t0, o);
                    }
                }
                std::hint::black_box(&out);
            });
            let mut panel = Panel::default();
            let tiled = best_cpu_s(|| {
                let acts = TiledActs::new(&acts);
                panel.decode(ty, &m, rows, cols);
                int8::gemm_isa(&panel, &acts, 0, toks, &mut out, Isa::Avx512Vnni);
                std::hint::black_box(&out);
            });
            let macs = (toks * rows * cols) as f64 / 1e9;
            println!(
                "{:<8} {:>4} {:>12.2} {:>12.2} {:>8.2}",
                ty.name(),
                toks,
                macs / grouped,
                macs / tiled,
                grouped / tiled
            );
        }
    }
    Ok(())
}

/// `cargo xtask bench --engine`: the serving engine on one file: decode tokens/s for 1 and 3
/// concurrent streams (aggregate), f16 and q8_0 V, MTP drafting off and on, with the
/// acceptance rate; and with f16 V, the same again under a JSON schema (constrained decoding:
/// the grammar's mask computed while the forward runs) beside its unconstrained twin, the two
/// measured in alternation on one engine, with the ratio. Greedy, the same prompt per stream.
/// `schema_only`: only the rows that measure constrained decoding (f16 V, with and without the
/// schema), for a file too slow to run every row.
/// One engine bench run: aggregate decode t/s, CPU ms per generated token (the whole request's,
/// prompt included), this run's acceptance, prompt t/s and the boot ledger's bytes.
#[derive(Clone, Copy)]
struct Run {
    tps: f64,
    cpu_ms: f64,
    /// Grammar masks per token, and the part of it steps waited for after their forward.
    mask_us: f64,
    wait_us: f64,
    /// Mean wall time of the steps that carried no prompt rows.
    step_ms: f64,
    acceptance: f64,
    prompt_tps: f64,
    kv: u64,
    state: u64,
    compute: u64,
}

pub fn engine(
    file: &Path,
    backend: &str,
    decode: usize,
    schema_only: bool,
    rounds: usize,
) -> Result<()> {
    use std::sync::Arc;
    use tern::backend::KvTypes;
    use tern::runtime::engine::{Engine, EngineConfig, Request};
    use tern::runtime::sampler::SamplerConfig;
    use tern::runtime::speculative::SpecConfig;
    use tern::tensor::GgmlType;

    let g = Arc::new(tern::gguf::Gguf::open(file)?);
    let tok = Arc::new(tern::tokenizer::Tokenizer::from_gguf(&g)?);
    let has_mtp = tern::model::Config::from_gguf(&g)?.has_mtp();
    let prompt = prompt(64);
    // A schema whose output is long enough for every decoded token to be constrained.
    let schema = json!({"type": "object", "properties": {"lines": {"type": "array",
        "items": {"type": "string"}, "minItems": 64}}, "required": ["lines"]});
    let grammars = tern::runtime::constraint::Grammars::new(tok.clone())
        .map_err(|e| anyhow::anyhow!("{e}"))?;
    let json_spec = tern::runtime::constraint::GrammarSpec::JsonSchema(schema);
    let mut rows = Vec::new();
    println!(
        "{:<8} {:>7} {:>6} {:>8} {:>8} {:>14} {:>9} {:>12} {:>9} {:>10} {:>9} {:>10} {:>10} {:>12} {:>10} {:>10} {:>12} {:>12}",
        "backend",
        "streams",
        "V",
        "schema",
        "drafting",
        "decode t/s",
        "vs plain",
        "cpu ms/tok",
        "vs plain",
        "step ms",
        "vs plain",
        "mask us/t",
        "wait us/t",
        "accept",
        "prompt t/s",
        "KV MiB",
        "state MiB",
        "compute MiB"
    );
    for parallel in [1usize, 3] {
        for v in [GgmlType::F16, GgmlType::Q8_0] {
            if schema_only && v != GgmlType::F16 {
                continue;
            }
            // With f16 V the schema's runs alternate with their unconstrained twins on one
            // engine: the box is shared, and rows measured minutes apart compare the
            // neighbours' load rather than the grammar's cost.
            let variants: &[bool] = if v == GgmlType::F16 {
                &[false, true]
            } else {
                &[false]
            };
            for spec in [false, true] {
                if spec && !has_mtp {
                    continue;
                }
                let cfg = EngineConfig {
                    ctx_size: 1024 * parallel,
                    parallel,
                    ubatch: 512,
                    kv_types: KvTypes {
                        k: GgmlType::F16,
                        v,
                    },
                    spec: spec.then(SpecConfig::default),
                    draft_kv_types: F16_KV,
                };
                // Memory: what boot allocated (the boot ledger): KV = trunk + draft caches,
                // state = recurrent copies + prompt checkpoints, compute = the warm-up's peak.
                let run = |e: &Engine, constrained: bool| -> Result<Run> {
                    let m0 = e.metrics();
                    let before = m0.spec;
                    let hs: Vec<_> = (0..parallel)
                        .map(|_| {
                            let constraint = if constrained {
                                Some(grammars.compile(&json_spec, false)?)
                            } else {
                                None
                            };
                            Ok(e.submit(Request {
                                prompt: prompt.clone(),
                                max_tokens: decode,
                                sampler: SamplerConfig::greedy(),
                                stop: vec![],
                                ignore_eos: true,
                                constraint,
                                ..Default::default()
                            }))
                        })
                        .collect::<Result<_, tern::runtime::constraint::ConstraintError>>()
                        .map_err(|e| anyhow::anyhow!("{e}"))?;
                    let cpu0 = cpu_ns();
                    let (tps, prompt_tps, finishes) = crate::bench_draft::collect_streams(hs)?;
                    let n: usize = finishes.iter().map(|f| f.completion_tokens).sum();
                    let cpu_ms = cpu_ns().saturating_sub(cpu0) as f64 / 1e6 / n.max(1) as f64;
                    // The worker publishes its counters right after the step that finished.
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    // This run's acceptance: the counters are the engine's, across runs.
                    let m1 = e.metrics();
                    let spec = m1.spec;
                    let per_token_us = |a: f64, b: f64| (b - a) * 1e6 / n.max(1) as f64;
                    let drafted = spec.drafted - before.drafted;
                    let a = &e.allocated;
                    Ok(Run {
                        tps,
                        cpu_ms,
                        mask_us: per_token_us(
                            m0.grammar_mask_seconds_total,
                            m1.grammar_mask_seconds_total,
                        ),
                        wait_us: per_token_us(
                            m0.grammar_wait_seconds_total,
                            m1.grammar_wait_seconds_total,
                        ),
                        step_ms: (m1.decode_only_seconds_total - m0.decode_only_seconds_total)
                            * 1e3
                            / (m1.decode_only_steps_total - m0.decode_only_steps_total).max(1)
                                as f64,
                        acceptance: (spec.accepted - before.accepted) as f64
                            / drafted.max(1) as f64,
                        prompt_tps,
                        kv: a.kv + a.draft_kv,
                        state: a.recurrent + a.checkpoint,
                        compute: a.compute.unwrap_or(0),
                    })
                };
                // `rounds` rounds, the variants taking turns in each. Each variant's row is
                // its median run, and the schema's cost is the median of its ratio to the
                // unconstrained run of the same round: the box is shared (and its VM loses CPU
                // to steal), so only runs seconds apart compare the grammar rather than the load.
                let best = |e: &Engine| -> Result<Vec<(Run, f64, f64, f64)>> {
                    let mut runs: Vec<Vec<Run>> = vec![Vec::new(); variants.len()];
                    for _ in 0..rounds.max(1) {
                        for (k, &constrained) in variants.iter().enumerate() {
                            runs[k].push(run(e, constrained)?);
                        }
                    }
                    let med =
                        |f: &dyn Fn(&Run) -> f64, k: usize| median(runs[k].iter().map(f).collect());
                    Ok((0..variants.len())
                        .map(|k| {
                            let mid = |f: &dyn Fn(&Run) -> f64| med(f, k);
                            let paired = |f: &dyn Fn(&Run) -> f64| {
                                median(
                                    runs[k]
                                        .iter()
                                        .zip(&runs[0])
                                        .map(|(r, p)| f(r) / f(p))
                                        .collect(),
                                )
                            };
                            let r = Run {
                                tps: mid(&|r| r.tps),
                                cpu_ms: mid(&|r| r.cpu_ms),
                                mask_us: mid(&|r| r.mask_us),
                                wait_us: mid(&|r| r.wait_us),
                                step_ms: mid(&|r| r.step_ms),
                                acceptance: mid(&|r| r.acceptance),
                                prompt_tps: mid(&|r| r.prompt_tps),
                                ..runs[k][0]
                            };
                            (
                                r,
                                paired(&|r| r.tps),
                                paired(&|r| r.cpu_ms),
                                paired(&|r| r.step_ms),
                            )
                        })
                        .collect())
                };
                let results = match backend {
                    "wgpu" => {
                        let be = tern::backend::wgpu::WgpuBackend::new()?;
                        let m = tern::plan::boot::load_model(&be, g.clone(), &[], spec)?;
                        best(&Engine::start(m, be, tok.clone(), cfg.clone())?)?
                    }
                    _ => {
                        let be = CpuBackend::int8();
                        let m = tern::plan::boot::load_model(&be, g.clone(), &[], spec)?;
                        best(&Engine::start(m, be, tok.clone(), cfg.clone())?)?
                    }
                };
                let mib = |b: u64| b as f64 / (1 << 20) as f64;
                for (&constrained, &(r, tps_ratio, cpu_ratio, step_ratio)) in
                    variants.iter().zip(&results)
                {
                    let Run {
                        tps,
                        cpu_ms,
                        mask_us,
                        wait_us,
                        step_ms,
                        acceptance: acc,
                        prompt_tps: ptps,
                        kv: kvb,
                        state: rcb,
                        compute: cb,
                    } = r;
                    println!(
                        "{:<8} {:>7} {:>6} {:>8} {:>8} {:>14.2} {:>9} {:>12.3} {:>9} {:>10.3} {:>9} {:>10.1} {:>10.1} {:>12} {:>10.1} {:>10.2} {:>12.2} {:>12.2}",
                        backend,
                        parallel,
                        v.name(),
                        if constrained { "json" } else { "-" },
                        if spec { "adapt-3" } else { "off" },
                        tps,
                        if constrained {
                            format!("{tps_ratio:.3}")
                        } else {
                            "-".into()
                        },
                        cpu_ms,
                        if constrained {
                            format!("{cpu_ratio:.3}")
                        } else {
                            "-".into()
                        },
                        step_ms,
                        if constrained {
                            format!("{step_ratio:.3}")
                        } else {
                            "-".into()
                        },
                        mask_us,
                        wait_us,
                        if spec {
                            format!("{:.1}%", 100.0 * acc)
                        } else {
                            "-".into()
                        },
                        ptps,
                        mib(kvb),
                        mib(rcb),
                        mib(cb)
                    );
                    rows.push(json!({"backend": backend, "streams": parallel, "cache_v": v.name(), "json_schema": constrained, "drafting": spec,
                        "decode_tps_aggregate": tps, "vs_unconstrained": if constrained { json!(tps_ratio) } else { json!(null) },
                        "cpu_ms_per_token": cpu_ms, "cpu_vs_unconstrained": if constrained { json!(cpu_ratio) } else { json!(null) },
                        "grammar_mask_us_per_token": mask_us, "grammar_wait_us_per_token": wait_us, "rounds": rounds,
                        "decode_step_ms": step_ms, "decode_step_vs_unconstrained": if constrained { json!(step_ratio) } else { json!(null) },
                        "acceptance": acc, "prompt_tps": ptps,
                        "kv_bytes_allocated": kvb, "state_bytes_allocated": rcb, "compute_bytes_allocated": cb}));
                }
            }
        }
    }
    let dir = file
        .parent()
        .unwrap_or(Path::new("."))
        .join("../../target/bench");
    let _ = std::fs::create_dir_all(&dir);
    let draft_rounds = if has_mtp && !schema_only {
        Some(crate::bench_draft::round_costs(
            file, backend, decode, rounds,
        )?)
    } else {
        None
    };
    let out = json!({"file": file.display().to_string(), "decode_tokens": decode, "prompt_tokens": 64, "results": rows, "draft_rounds": draft_rounds});
    std::fs::write(dir.join("engine.json"), serde_json::to_string_pretty(&out)?)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::median;

    #[test]
    fn median_of_odd_and_even_counts() {
        assert_eq!(median(vec![3.0, 1.0, 2.0]), 2.0);
        assert_eq!(
            median(vec![2.689, 2.184, 2.669, 2.401]),
            (2.401 + 2.669) / 2.0
        );
        assert_eq!(median(vec![5.0]), 5.0);
        assert!(median(Vec::new()).is_nan());
    }
}
