//! Project tasks: `cargo xtask <task>`.

mod bench;
mod bench_depth;
mod bench_draft;
mod bench_lora;
mod bench_step;
mod bench_vision;
mod fixtures;
mod fold;
mod fuzz;
mod gpu_kit;
mod llama_flags;
mod lora_fixtures;
mod quality;
mod rng;
mod tokcheck;
mod train_demo;
mod vision_fixtures;
mod vocab;

use std::path::PathBuf;

use anyhow::{bail, Result};

const USAGE: &str = "usage: cargo xtask <task>
  fixtures [--out DIR] [--vision-only]
                        write the tiny golden-test GGUFs, their twins and manifest.json to fixtures/,
                        the LoRA adapters (fixtures/lora/) and the vision set (fixtures/vision/: a
                        tiny-vl text model, Qwen3-VL projectors in F32/F16/Q8_0, test images)
  fixtures --bench      write fixtures/bench/bench-0.8b-{q8_0,pq2_0,ptq1_0}.gguf (large, not committed)
  goldens [--perplexity-only | --lora-only | --vision-only]
                        run stock llama.cpp (llama-cpp-python) and the NumPy reference on the
                        fixtures, writing fixtures/golden/ (needs TERN_PYTHON or python3 with
                        llama-cpp-python==0.3.36, gguf, numpy), and llama-perplexity
                        (TERN_LLAMA_BIN: the directory with it) on the F16 demo model over
                        fixtures/demo/heldout.txt (fixtures/golden/perplexity.json); the
                        LoRA goldens (xtask/py/lora_goldens.py, fixtures/golden/lora); the vision
                        goldens (xtask/py/vision_goldens.py, fixtures/golden/vision: mtmd's image
                        embeddings and logits at every position, flash attention off)
  bench [--backend cpu,cpu-exact,wgpu,cuda] [--no-llama] [--prompt N[,N...]] [--decode N]
        [--runs N] [--rounds N] [FILE...]
                        tern vs stock llama.cpp on the bench files (default: fixtures/bench/*);
                        cpu is the serving path (int8 activations, f16 K/V as llama-bench
                        caches them), cpu-exact the f32 reference (f32 K/V);
                        llama.cpp through its Python binding and, with TERN_LLAMA_BENCH=path,
                        its own llama-bench (then the ratios' anchor; its tg at the prompt's
                        depth, -d N, as tern decodes after the prompt); --rounds N alternates
                        tern and llama.cpp N times and reports medians; --prompt 128,2048
                        gives the table once per prompt length (target/bench/bench-pN.json);
                        GB/s of weights streamed per decoded token, and on cuda against the
                        device's copy bandwidth measured in the same run (cuda needs
                        `cargo run --release -p xtask --features cuda -- bench ...`)
  bench --depth D,D,... [--decode N] [FILE...]
                        decode t/s with D positions already cached (f16 K/V), tern's serving
                        path beside `llama-bench -d D` (TERN_LLAMA_BENCH) in the same run, one
                        round per depth (a 16k fill takes minutes); default files as bench
  bench --kernels       single-thread dot_row throughput per weight type; the int8 row
                        kernels for 1 to 4 rows and the tiled int8 product (G MAC/s)
  bench --kernels --span
                        only the decode-shape table: one activation row at bench-0.8b's row
                        widths, in L2, per row (dot_rows) and per span (dot_span), GB/s;
                        Q8_0 also as the serving path packs it (the packed row)
  bench --kernels --span-mem
                        the packed span kernels for 1 to 4 token rows streaming a 256 MiB
                        matrix from memory on every thread, beside a plain read of as many bytes
  bench --step [--decode N] [--rows R] [--copies native|transcoded|stored] [FILE...]
                        a one-row decode step's wall time split on the CPU serving path: matmul
                        ms per class of matrix (GDN/attention in and out, FFN, output head), the
                        rest, the GDN cores (ms, GB/s of state, in cache and from memory;
                        from memory also as a depth-2 verify with its rollback), argmax,
                        context switches per step, against the read bandwidth of 1 and all
                        threads and the bytes a token reads; default files as bench
                        (--rows R: the matmul classes with R token rows, as R streams' step;
                        --copies: the matrices as serve holds them on this CPU, as a CPU
                        without the packed kernels does (PTQ1_0 transcoded to PQ2_0), or as
                        stored)
  bench --vision [--no-llama] [--runs N] [--model F] [--mmproj F] [--image F]
                        image tokens/s of one encode on the CPU, tern vs llama.cpp (mtmd, the
                        Python binding) on the same projector and image (default: the fixtures'
                        tiny-vl model, its Q8_0 projector and the 512 px solid red PNG)
  bench --engine [--wgpu] [--schema-only] [--draft-rounds|--phases [--prompt P]] [--decode N]
         [--rounds N] [FILE]
                        the serving engine: 1 and 3 streams, f16/q8_0 V, drafting off/on
                        (adaptive depth), f16 V under a JSON schema (--schema-only: only f16 V,
                        with and without); each row the median of N rounds (3), the schema's
                        cost the median of its ratio to the unconstrained run of the same round;
                        then a draft round's cost per depth 1-3 against a plain step from the
                        engine's timers, with the break-even acceptance, medians of N rounds
                        (--draft-rounds: only that table, to target/bench/draft_rounds.json)
                        (--phases: where a 1-stream step, a 3-stream step and a depth-2
                        round spend their time, by the engine's phase timers, medians over
                        every step of N rounds after a P-token prompt (64), to
                        target/bench/phases.json)
  gpu-kit [--out DIR]   build, without a GPU, the kit that checks the cuda and wgpu backends on an
                        NVIDIA machine with no Rust toolchain (default target/gpu-kit; cuda/README.md)
  llama-flags [--arg-cpp FILE]
                        the options stock llama-server accepts, read from llama.cpp's
                        common/arg.cpp (default: $TERN_LLAMA_CPP/common/arg.cpp), written to
                        fixtures/llama-server-flags.json for tests/flags.rs
  fuzz [--seconds N | --cases N] [--target gguf|request|all] [--seed S] [--jobs J]
       [--start I] [--mem-mib M] [--hang-s S] [--case I]
                        the structure-aware fuzz suite (GGUF headers and tables; request JSON,
                        chat-template inputs, tool-call text): cases per outcome (clean error,
                        accepted-valid, panic, abort, hang, silent NaN), the time split over the
                        targets; workers run under an address-space limit (default 4096 MiB)
                        and a hang limit (default 20 s); --case I replays one case; failing
                        inputs go to target/fuzz/
  tokcheck split [--cases N] [--seed S] [--write]
                        the pre-tokenizer split and code point classes against llama.cpp's
                        unicode.cpp (TERN_LLAMA_SRC: a llama.cpp source tree; needs c++);
                        --write records fixtures/golden/split.json
  tokcheck ids [--random N] [--seed S] [--inp F.inp] [--write] [VOCAB.gguf...]
                        token ids against llama-cpp-python (TERN_PYTHON) on hard texts and
                        random strings (default vocabularies: the fixture and demo models);
                        --write records fixtures/golden/tokens_hard.json
  bench --lora [--rank R] [--wgpu] [FILE]
                        decode cost of a random rank-R (default 16) LoRA adapter on every
                        matrix of FILE (default bench-0.8b Q8_0), against its share of the work
  train-demo [--no-train] [--steps N] [--no-llama] [--work DIR]
                        train the bundled demo model (PyTorch: TERN_TRAIN_PYTHON, default
                        python3, with torch, tokenizers, gguf, matplotlib), write
                        fixtures/demo/demo-{f16,q8_0,pq2_0}.gguf, evaluate them with tern and
                        record llama.cpp's greedy continuations (TERN_PYTHON); --no-train
                        re-exports and re-evaluates the last run in --work
                        (default target/demo-train); also writes demo-ptq1_0.gguf from the F16
                        file and the held-out text fixtures/demo/heldout.txt
  quality [--bench [--chunks N]]
                        the quantization tables by tern's kld: the demo files against the F16
                        file on the held-out plays, and F16 on wgpu against the CPU
                        (fixtures/demo/quality.json), or with --bench bench-0.8b PQ2_0 against
                        Q8_0 on the CPU over N chunks of 512 (default 4;
                        fixtures/bench/quality.json)
  train-demo --ptq1_0-only
                        only write fixtures/demo/demo-ptq1_0.gguf from the committed
                        demo-f16.gguf (no PyTorch, no retraining)";

/// The Python that has llama-cpp-python: $TERN_PYTHON, else python3 on the PATH.
fn python() -> String {
    std::env::var("TERN_PYTHON").unwrap_or_else(|_| "python3".to_string())
}

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .unwrap()
        .to_path_buf()
}

// The engine's boot ledger measures the CPU backend's compute on the heap.
#[global_allocator]
static HEAP: tern::alloc::Counting = tern::alloc::Counting;

fn main() -> Result<()> {
    HEAP.mark_installed();
    tern::alloc::keep_freed_heap();
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("fixtures") => {
            let mut bench = false;
            let mut vision_only = false;
            let mut out = workspace_root().join("fixtures");
            let mut it = args[1..].iter();
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--bench" => bench = true,
                    "--vision-only" => vision_only = true,
                    "--out" => match it.next() {
                        Some(d) => out = PathBuf::from(d),
                        None => bail!("--out needs a directory\n{USAGE}"),
                    },
                    other => bail!("unknown option {other}\n{USAGE}"),
                }
            }
            if bench {
                fixtures::write_bench(&out)
            } else if vision_only {
                vision_fixtures::write(&out)
            } else {
                fixtures::write_tiny(&out)?;
                lora_fixtures::write(&out)?;
                vision_fixtures::write(&out)
            }
        }
        Some("goldens") => {
            let root = workspace_root();
            let only_ppl = args[1..].iter().any(|a| a == "--perplexity-only");
            let only_lora = args[1..].iter().any(|a| a == "--lora-only");
            let only_vision = args[1..].iter().any(|a| a == "--vision-only");
            if !only_ppl && !only_lora {
                // The vision goldens (fixtures/golden/vision): mtmd's embeddings and logits.
                let st = std::process::Command::new(python())
                    .arg(root.join("xtask/py/vision_goldens.py"))
                    .args(["--fixtures", "fixtures", "--out", "fixtures/golden/vision"])
                    .current_dir(&root)
                    .status()?;
                if !st.success() {
                    bail!("vision_goldens.py failed ({st})");
                }
            }
            if only_vision {
                return Ok(());
            }
            if !only_ppl && !only_lora {
                let st = std::process::Command::new(python())
                    .arg(root.join("xtask/py/goldens.py"))
                    .args(["--fixtures", "fixtures", "--out", "fixtures/golden"])
                    .args(&args[1..])
                    .current_dir(&root)
                    .status()?;
                if !st.success() {
                    bail!("goldens.py failed ({st})");
                }
            }
            if !only_ppl {
                // LoRA adapters on the tiny fixtures, and the server test's greedy runs.
                let st = std::process::Command::new(python())
                    .arg(root.join("xtask/py/lora_goldens.py"))
                    .args(["--fixtures", "fixtures", "--out", "fixtures/golden/lora"])
                    .current_dir(&root)
                    .status()?;
                if !st.success() {
                    bail!("lora_goldens.py failed ({st})");
                }
            }
            if only_lora {
                return Ok(());
            }
            // llama-perplexity's figure on the F16 demo model over the held-out plays.
            let Ok(bin) = std::env::var("TERN_LLAMA_BIN") else {
                bail!("the perplexity golden runs stock llama-perplexity: set TERN_LLAMA_BIN to the directory that holds it (llama.cpp's build/bin)");
            };
            let st = std::process::Command::new(python())
                .arg(root.join("xtask/py/perplexity_golden.py"))
                .args(["--llama-bin", &bin])
                .current_dir(&root)
                .status()?;
            if !st.success() {
                bail!("perplexity_golden.py failed ({st})");
            }
            Ok(())
        }
        Some("bench") => {
            let root = workspace_root();
            let mut o = bench::Options {
                files: Vec::new(),
                prompt_tokens: 128,
                decode_tokens: 32,
                runs: 3,
                llama: true,
                python: python(),
                backends: vec!["cpu".to_string()],
                rounds: 1,
            };
            if args[1..].iter().any(|a| a == "--kernels") {
                if args[1..].iter().any(|a| a == "--span-mem") {
                    return bench::span_mem();
                }
                if args[1..].iter().any(|a| a == "--span") {
                    return bench::span_kernels();
                }
                return bench::kernels();
            }
            if args[1..].iter().any(|a| a == "--step") {
                return bench_step_cli(&root, &args[1..]);
            }
            if let Some(i) = args[1..].iter().position(|a| a == "--depth") {
                return bench_depth_cli(&root, &args[1..], i);
            }
            if args[1..].iter().any(|a| a == "--lora") {
                let rest: Vec<&String> = args[1..].iter().filter(|a| *a != "--lora").collect();
                let mut rank = 16;
                let mut file = root.join("fixtures/bench/bench-0.8b-q8_0.gguf");
                let mut backend = "cpu";
                let mut it = rest.into_iter();
                while let Some(a) = it.next() {
                    match a.as_str() {
                        "--rank" => {
                            rank = match it.next().map(|s| s.parse::<usize>()) {
                                Some(Ok(n)) if n > 0 => n,
                                _ => bail!("--rank needs a positive number\n{USAGE}"),
                            }
                        }
                        "--wgpu" => backend = "wgpu",
                        f if !f.starts_with("--") => file = PathBuf::from(f),
                        other => bail!("bench --lora: unknown option {other}\n{USAGE}"),
                    }
                }
                return bench_lora::lora_cost(&file, backend, rank, 32);
            }
            if args[1..].iter().any(|a| a == "--vision") {
                let mut v = bench_vision::Options::fixtures(&root, python());
                let mut it = args[1..].iter().filter(|a| *a != "--vision");
                while let Some(a) = it.next() {
                    let mut path = |flag: &str| match it.next() {
                        Some(p) => Ok(PathBuf::from(p)),
                        None => bail!("{flag} needs a file\n{USAGE}"),
                    };
                    match a.as_str() {
                        "--no-llama" => v.llama = false,
                        "--model" => v.model = path("--model")?,
                        "--mmproj" => v.mmproj = path("--mmproj")?,
                        "--image" => v.image = path("--image")?,
                        "--runs" => {
                            v.runs = match it.next().map(|s| s.parse::<usize>()) {
                                Some(Ok(n)) if n > 0 => n,
                                _ => bail!("--runs needs a positive number\n{USAGE}"),
                            }
                        }
                        other => bail!("bench --vision: unknown option {other}\n{USAGE}"),
                    }
                }
                return bench_vision::run(&root, &v);
            }
            if args[1..].iter().any(|a| a == "--engine") {
                let mut rest: Vec<&String> =
                    args[1..].iter().filter(|a| *a != "--engine").collect();
                let mut count = |flag: &str, default: usize| -> Result<usize> {
                    match rest.iter().position(|a| a.as_str() == flag) {
                        Some(k) => match rest.get(k + 1).map(|v| v.parse::<usize>()) {
                            Some(Ok(n)) if n > 0 => {
                                rest.drain(k..k + 2);
                                Ok(n)
                            }
                            _ => bail!("{flag} needs a positive number\n{USAGE}"),
                        },
                        None => Ok(default),
                    }
                };
                let decode = count("--decode", 32)?;
                let rounds = count("--rounds", 3)?;
                let phase_prompt = count("--prompt", 64)?;
                let file = rest
                    .iter()
                    .find(|a| !a.starts_with("--"))
                    .map(|f| PathBuf::from(f.as_str()))
                    .unwrap_or_else(|| root.join("fixtures/bench/bench-0.8b-q8_0.gguf"));
                let backend = if rest.iter().any(|a| a.as_str() == "--wgpu") {
                    "wgpu"
                } else {
                    "cpu"
                };
                let schema_only = rest.iter().any(|a| a.as_str() == "--schema-only");
                let only = [
                    ("--draft-rounds", "draft_rounds.json"),
                    ("--phases", "phases.json"),
                ]
                .into_iter()
                .find(|(flag, _)| rest.iter().any(|a| a.as_str() == *flag));
                if let Some((flag, out)) = only {
                    let r = if flag == "--phases" {
                        bench_draft::phases(&file, backend, phase_prompt, decode, rounds)?
                    } else {
                        bench_draft::round_costs(&file, backend, decode, rounds)?
                    };
                    let dir = root.join("target/bench");
                    std::fs::create_dir_all(&dir)?;
                    std::fs::write(dir.join(out), serde_json::to_string_pretty(&r)?)?;
                    return Ok(());
                }
                return bench::engine(&file, backend, decode, schema_only, rounds);
            }
            let mut it = args[1..].iter();
            let mut prompts = vec![o.prompt_tokens];
            let num = |v: Option<&String>, flag: &str| -> Result<usize> {
                match v.map(|s| s.parse::<usize>()) {
                    Some(Ok(n)) if n > 0 => Ok(n),
                    _ => bail!("{flag} needs a positive number\n{USAGE}"),
                }
            };
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--no-llama" => o.llama = false,
                    "--prompt" => prompts = bench::prompt_lengths(it.next())?,
                    "--decode" => o.decode_tokens = num(it.next(), "--decode")?,
                    "--runs" => o.runs = num(it.next(), "--runs")?,
                    "--rounds" => o.rounds = num(it.next(), "--rounds")?,
                    "--backend" => match it.next() {
                        Some(list) => o.backends = list.split(',').map(str::to_string).collect(),
                        None => bail!("--backend needs a list of cpu, wgpu, cuda\n{USAGE}"),
                    },
                    f if !f.starts_with("--") => o.files.push(PathBuf::from(f)),
                    other => bail!("unknown option {other}\n{USAGE}"),
                }
            }
            if o.files.is_empty() {
                o.files = default_bench_files(&root);
            }
            bench::run_prompt_lengths(&root, &mut o, &prompts)
        }
        Some("fuzz-worker") => {
            let target = match args.get(1).map(String::as_str) {
                Some("gguf") => fuzz::Target::Gguf,
                Some("request") => fuzz::Target::Request,
                _ => bail!("fuzz-worker TARGET SEED FROM TO"),
            };
            let n = |i: usize| -> Result<u64> {
                args.get(i)
                    .and_then(|s| s.parse().ok())
                    .ok_or_else(|| anyhow::anyhow!("fuzz-worker TARGET SEED FROM TO"))
            };
            fuzz::worker(&workspace_root(), target, n(2)?, n(3)?, n(4)?)
        }
        Some("fuzz") => {
            let mut o = fuzz::Options {
                targets: vec![fuzz::Target::Gguf, fuzz::Target::Request],
                seconds: None,
                cases: None,
                seed: fuzz::DEFAULT_SEED,
                jobs: std::thread::available_parallelism().map_or(1, |n| n.get()),
                mem_mib: 4096,
                hang_s: 20,
                start: 0,
                one_case: None,
            };
            let mut it = args[1..].iter();
            while let Some(a) = it.next() {
                let mut num = |flag: &str| -> Result<u64> {
                    let v = it
                        .next()
                        .ok_or_else(|| anyhow::anyhow!("{flag} needs a number"))?;
                    let v = v.trim();
                    let parsed = match v.strip_prefix("0x") {
                        Some(h) => u64::from_str_radix(h, 16),
                        None => v.parse(),
                    };
                    parsed.map_err(|_| anyhow::anyhow!("{flag} needs a number, not {v:?}\n{USAGE}"))
                };
                match a.as_str() {
                    "--seconds" => o.seconds = Some(num(a)?),
                    "--cases" => o.cases = Some(num(a)?),
                    "--seed" => o.seed = num(a)?,
                    "--jobs" => o.jobs = num(a)?.max(1) as usize,
                    "--mem-mib" => o.mem_mib = num(a)?.max(16),
                    "--hang-s" => o.hang_s = num(a)?.max(1),
                    "--start" => o.start = num(a)?,
                    "--case" => o.one_case = Some(num(a)?),
                    "--target" => match it.next() {
                        Some(t) => o.targets = fuzz::Target::parse_list(t)?,
                        None => bail!("--target needs gguf, request or all"),
                    },
                    other => bail!("unknown option {other}\n{USAGE}"),
                }
            }
            if o.seconds.is_none() && o.cases.is_none() && o.one_case.is_none() {
                o.seconds = Some(60);
            }
            fuzz::run(&workspace_root(), &o)
        }
        Some("tokcheck") => {
            let root = workspace_root();
            let mut cases = 20_000usize;
            let mut seed = 0x746f_6b63_6865_636bu64;
            let mut write = false;
            let mut files = Vec::new();
            let mut extra = Vec::new();
            let mut it = args.iter().skip(2);
            while let Some(a) = it.next() {
                let mut num = |flag: &str| -> Result<u64> {
                    match it.next().map(|s| s.parse::<u64>()) {
                        Some(Ok(n)) => Ok(n),
                        _ => bail!("{flag} needs a number\n{USAGE}"),
                    }
                };
                match a.as_str() {
                    "--cases" | "--random" => cases = num(a)? as usize,
                    "--seed" => seed = num(a)?,
                    "--write" => write = true,
                    "--inp" => match it.next() {
                        Some(f) => extra.extend(tokcheck::inp_texts(std::path::Path::new(f))?),
                        None => bail!("--inp needs a llama.cpp vocab test input file"),
                    },
                    f if !f.starts_with("--") => files.push(PathBuf::from(f)),
                    other => bail!("unknown option {other}\n{USAGE}"),
                }
            }
            match args.get(1).map(String::as_str) {
                Some("split") => tokcheck::split_check(&root, cases, seed, write),
                Some("ids") => {
                    if files.is_empty() {
                        files = vec![
                            root.join("fixtures/tiny-f32.gguf"),
                            root.join("fixtures/demo/demo-q8_0.gguf"),
                        ];
                    }
                    tokcheck::ids_check(&root, &python(), &files, cases, seed, write, &extra)
                }
                _ => bail!("tokcheck needs split or ids\n{USAGE}"),
            }
        }
        Some("gpu-kit") => {
            let root = workspace_root();
            let mut out = root.join("target/gpu-kit");
            let mut it = args[1..].iter();
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--out" => match it.next() {
                        Some(d) => out = PathBuf::from(d),
                        None => bail!("--out needs a directory\n{USAGE}"),
                    },
                    other => bail!("unknown option {other}\n{USAGE}"),
                }
            }
            gpu_kit::run(&root, &out)
        }
        Some("quality") => {
            let root = workspace_root();
            let mut bench = false;
            let mut chunks = 4;
            let mut it = args[1..].iter();
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--bench" => bench = true,
                    "--chunks" => match it.next().map(|s| s.parse::<usize>()) {
                        Some(Ok(n)) if n > 0 => chunks = n,
                        _ => bail!("--chunks needs a positive number\n{USAGE}"),
                    },
                    other => bail!("unknown option {other}\n{USAGE}"),
                }
            }
            if bench {
                quality::bench(&root, chunks)
            } else {
                quality::demo(&root)
            }
        }
        Some("llama-flags") => {
            let root = workspace_root();
            let mut arg_cpp = std::env::var("TERN_LLAMA_CPP")
                .map(|d| PathBuf::from(d).join("common/arg.cpp"))
                .ok();
            let mut it = args[1..].iter();
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--arg-cpp" => match it.next() {
                        Some(f) => arg_cpp = Some(PathBuf::from(f)),
                        None => bail!("--arg-cpp needs a file\n{USAGE}"),
                    },
                    other => bail!("unknown option {other}\n{USAGE}"),
                }
            }
            let Some(arg_cpp) = arg_cpp else {
                bail!("give --arg-cpp llama.cpp/common/arg.cpp or set TERN_LLAMA_CPP\n{USAGE}");
            };
            llama_flags::run(&arg_cpp, &root.join("fixtures/llama-server-flags.json"))
        }
        Some("train-demo") => {
            let root = workspace_root();
            let mut o = train_demo::Options {
                train: true,
                steps: None,
                llama: true,
                work: root.join("target/demo-train"),
                train_python: std::env::var("TERN_TRAIN_PYTHON")
                    .unwrap_or_else(|_| "python3".to_string()),
                llama_python: python(),
            };
            if args[1..].iter().any(|a| a == "--ptq1_0-only") {
                return train_demo::export_ptq1_0(&root.join("fixtures/demo"));
            }
            let mut it = args[1..].iter();
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--no-train" => o.train = false,
                    "--no-llama" => o.llama = false,
                    "--steps" => match it.next().map(|s| s.parse::<usize>()) {
                        Some(Ok(n)) if n > 0 => o.steps = Some(n),
                        _ => bail!("--steps needs a positive number\n{USAGE}"),
                    },
                    "--work" => match it.next() {
                        Some(d) => o.work = PathBuf::from(d),
                        None => bail!("--work needs a directory\n{USAGE}"),
                    },
                    other => bail!("unknown option {other}\n{USAGE}"),
                }
            }
            train_demo::run(&root, &o)
        }
        _ => {
            eprintln!("{USAGE}");
            std::process::exit(2)
        }
    }
}

/// `bench --depth D,... [--decode N] [FILE...]` (`at` is the index of `--depth` in `args`).
fn bench_depth_cli(root: &std::path::Path, args: &[String], at: usize) -> Result<()> {
    let mut o = bench_depth::Options {
        files: Vec::new(),
        depths: Vec::new(),
        decode_tokens: 32,
    };
    let mut it = args.iter().enumerate();
    while let Some((i, a)) = it.next() {
        let mut value = |flag: &str| -> Result<String> {
            match it.next() {
                Some((_, v)) => Ok(v.clone()),
                None => bail!("{flag} needs a value\n{USAGE}"),
            }
        };
        match a.as_str() {
            "--depth" if i == at => o.depths = bench_depth::parse_depths(&value("--depth")?)?,
            "--decode" => {
                o.decode_tokens = match value("--decode")?.parse::<usize>() {
                    Ok(n) if n > 0 => n,
                    _ => bail!("--decode needs a positive number\n{USAGE}"),
                }
            }
            f if !f.starts_with("--") => o.files.push(PathBuf::from(f)),
            other => bail!("bench --depth: unknown option {other}\n{USAGE}"),
        }
    }
    if o.files.is_empty() {
        o.files = default_bench_files(root);
    }
    bench_depth::run(root, &o)
}

/// `bench --step [--decode N] [--rows R] [--copies native|transcoded|stored] [FILE...]`.
fn bench_step_cli(root: &std::path::Path, args: &[String]) -> Result<()> {
    let (mut files, mut decode, mut rows) = (Vec::new(), 32, 1);
    let mut copies = bench_step::Copies::Native;
    let mut it = args.iter().filter(|a| *a != "--step");
    while let Some(a) = it.next() {
        match a.as_str() {
            "--decode" => {
                decode = match it.next().map(|v| v.parse::<usize>()) {
                    Some(Ok(n)) if n > 0 => n,
                    _ => bail!("--decode needs a positive number\n{USAGE}"),
                }
            }
            "--rows" => {
                rows = match it.next().map(|v| v.parse::<usize>()) {
                    Some(Ok(n)) if (1..=4).contains(&n) => n,
                    _ => bail!("--rows needs 1 to 4\n{USAGE}"),
                }
            }
            "--copies" => {
                copies = match it.next().map(String::as_str) {
                    Some("native") => bench_step::Copies::Native,
                    Some("transcoded") => bench_step::Copies::Transcoded,
                    Some("stored") => bench_step::Copies::Stored,
                    _ => bail!("--copies needs native, transcoded or stored\n{USAGE}"),
                }
            }
            f if !f.starts_with("--") => files.push(PathBuf::from(f)),
            other => bail!("bench --step: unknown option {other}\n{USAGE}"),
        }
    }
    if files.is_empty() {
        files = default_bench_files(root);
    }
    if let Some(f) = files.iter().find(|f| !f.exists()) {
        bail!(
            "{} is missing: run `cargo xtask fixtures --bench`",
            f.display()
        );
    }
    bench_step::run(&files, decode, rows, copies)
}

/// The bench files `cargo xtask fixtures --bench` writes, when no file is named.
fn default_bench_files(root: &std::path::Path) -> Vec<PathBuf> {
    let d = root.join("fixtures/bench");
    [
        "bench-0.8b-q8_0.gguf",
        "bench-0.8b-pq2_0.gguf",
        "bench-0.8b-ptq1_0.gguf",
    ]
    .iter()
    .map(|f| d.join(f))
    .collect()
}
