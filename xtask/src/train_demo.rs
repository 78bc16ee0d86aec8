//! `cargo xtask train-demo`: the bundled demo model. Trains a small qwen35 on Shakespeare with
//! PyTorch (`xtask/py/train_demo.py`, which writes the trained weights as an F32 GGUF in
//! llama.cpp's form), re-encodes it here as F16, Q8_0 and Hadamard-folded PQ2_0 under
//! `fixtures/demo/`, evaluates the three with tern (held-out perplexity, MTP top-1 accuracy, MTP
//! drafting acceptance), and records stock llama.cpp's greedy continuations of the F16 and Q8_0
//! files next to tern's. CI never runs this; it checks the committed results
//! (`tests/demo_model.rs`).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use serde_json::{json, Value as Json};
use tern::backend::cpu::CpuBackend;
use tern::backend::{Backend, KvTypes};
use tern::gguf::{Gguf, GgufWriter, Value};
use tern::model::Model;
use tern::runtime::engine::{Engine, EngineConfig, Request};
use tern::runtime::sampler::SamplerConfig;
use tern::runtime::speculative::SpecConfig;
use tern::tensor::GgmlType;
use tern::tokenizer::Tokenizer;

use crate::fold;
use crate::rng::Rng;

/// Seed of the PQ2_0 Hadamard sign vectors ("tern-dem").
const SEED: u64 = 0x7465_726E_2D64_656D;
/// The Hadamard block of the PQ2_0 fold: n_embd (128) and every other folded input width
/// (128, 384) are multiples of it.
const HADAMARD_BLOCK: usize = 128;
/// Greedy tokens compared against llama.cpp, per prompt.
pub const N_GREEDY: usize = 48;
/// Perplexity window: the training sequence length; every window starts from a fresh state.
const PPL_WINDOW: usize = 256;
/// Prompts of the greedy comparison: the opening of a held-out play, a famous line from a
/// trained one, and a chat turn rendered by the model's template (thinking on, the default).
pub const PROMPTS: [&str; 3] = [
    "Duke.\nIf music be the food of love, play on;\n",
    "Ham.\nTo be, or not to be,",
    "<|im_start|>user\nShall I compare thee to a summer's day?<|im_end|>\n<|im_start|>assistant\n<think>\n",
];
/// The three files written, by type.
pub const FILES: [(&str, GgmlType); 3] = [
    ("demo-f16.gguf", GgmlType::F16),
    ("demo-q8_0.gguf", GgmlType::Q8_0),
    ("demo-pq2_0.gguf", GgmlType::PQ2_0),
];

/// The PTQ1_0 file, derived from the committed F16 file (no retraining needed).
pub const PTQ1_0_FILE: &str = "demo-ptq1_0.gguf";
/// The held-out plays as text (the training script's validation text), the text of
/// `tern perplexity`/`tern kld` figures and of the perplexity golden.
pub const HELDOUT_TEXT: &str = "heldout.txt";

pub struct Options {
    /// Retrain (otherwise reuse `work/demo-f32.gguf`).
    pub train: bool,
    pub steps: Option<usize>,
    /// Run llama.cpp (TERN_PYTHON) for the greedy comparison.
    pub llama: bool,
    pub work: PathBuf,
    /// The Python with torch, tokenizers, gguf, matplotlib.
    pub train_python: String,
    /// The Python with llama-cpp-python 0.3.36.
    pub llama_python: String,
}

pub fn run(root: &Path, o: &Options) -> Result<()> {
    let out = root.join("fixtures/demo");
    std::fs::create_dir_all(&out)?;
    std::fs::create_dir_all(&o.work)?;
    if o.train {
        let mut cmd = std::process::Command::new(&o.train_python);
        cmd.arg(root.join("xtask/py/train_demo.py"))
            .arg("--cache")
            .arg(o.work.join("cache"))
            .arg("--out")
            .arg(&o.work);
        if let Some(s) = o.steps {
            cmd.args(["--steps", &s.to_string()]);
        }
        let st = cmd
            .status()
            .with_context(|| format!("running {}", o.train_python))?;
        if !st.success() {
            bail!("train_demo.py failed ({st})");
        }
    }
    let src_path = o.work.join("demo-f32.gguf");
    let src = Gguf::open(&src_path)
        .with_context(|| format!("{} (run with training first)", src_path.display()))?;
    for (file, ty) in FILES {
        let w = encode_file(&src, ty)?;
        let path = out.join(file);
        w.write(&path)?;
        let g = Gguf::open(&path)?;
        println!("{file:<18} {:>9} bytes", g.file_len());
    }
    export_ptq1_0(&out)?;
    std::fs::copy(o.work.join(HELDOUT_TEXT), out.join(HELDOUT_TEXT))
        .with_context(|| format!("{} (written by train_demo.py)", HELDOUT_TEXT))?;
    // Training record: the plot and the per-step losses.
    std::fs::copy(o.work.join("loss.png"), out.join("loss.png"))?;
    let log: Json = serde_json::from_str(&std::fs::read_to_string(o.work.join("train_log.json"))?)?;
    let steps: Vec<Json> = log["log"]
        .as_array()
        .context("train_log.json: no log")?
        .iter()
        .map(|r| {
            json!([
                r["step"],
                round4(r["loss"].as_f64().unwrap_or(f64::NAN)),
                round4(r["mtp_loss"].as_f64().unwrap_or(f64::NAN))
            ])
        })
        .collect();
    let training =
        json!({"summary": log["summary"], "columns": ["step", "loss", "mtp_loss"], "steps": steps});
    std::fs::write(
        out.join("training.json"),
        serde_json::to_string(&training)? + "\n",
    )?;

    let val = read_npy_i32(&o.work.join("val_ids.npy"))?;
    let report = evaluate(root, o, &out, &val)?;
    std::fs::write(
        out.join("eval.json"),
        serde_json::to_string_pretty(&report)? + "\n",
    )?;
    println!("wrote {}", out.join("eval.json").display());
    Ok(())
}

fn round4(x: f64) -> f64 {
    (x * 1e4).round() / 1e4
}

// ---------------------------------------------------------------------------------------------
// Encoding

fn is_matmul(name: &str, dims: &[u64]) -> bool {
    dims.len() == 2 && !name.ends_with("ssm_conv1d.weight")
}

fn is_mtp(name: &str, n_layer: usize) -> bool {
    name.starts_with(&format!("blk.{n_layer}."))
}

fn f16_bytes(w: &[f32]) -> Vec<u8> {
    w.iter()
        .flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes())
        .collect()
}

fn encode_rows(ty: GgmlType, ne0: usize, w: &[f32]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for row in w.chunks(ne0) {
        out.extend(
            tern::quant::quantize_row(ty, row)
                .map_err(|e| anyhow::anyhow!("quantize {ty:?}: {e:?}"))?,
        );
    }
    Ok(out)
}

/// The trained F32 file (or the F16 file made from it) re-encoded: every 2-D weight in `ty`
/// (norms, conv, ssm_a and dt bias stay F32). For PQ2_0 and PTQ1_0, the trunk's matmul weights,
/// `output` and `token_embd` are folded through a randomized Hadamard transform and ternarised;
/// ssm_alpha/beta are BF16 and the MTP block Q8_0, as in PrismML's files.
pub fn encode_file(src: &Gguf, ty: GgmlType) -> Result<GgufWriter> {
    let n_layer = (src.get_u64("qwen35.block_count").context("block_count")?
        - src.get_u64("qwen35.nextn_predict_layers").unwrap_or(0)) as usize;
    let mut w = GgufWriter::new();
    let (ft, tname) = match ty {
        GgmlType::F16 => (1u32, "F16"),
        GgmlType::Q8_0 => (7, "Q8_0"),
        GgmlType::PQ2_0 => (141, "PQ2_0"),
        // LLAMA_FTYPE_MOSTLY_PQ2_0 is 141 (format-pq2_0.md); the PrismML fork's PTQ1_0 ftype is
        // not in our sources, so this takes the next id. Loaders read the tensor types, not this.
        GgmlType::PTQ1_0 => (142, "PTQ1_0"),
        _ => bail!("no demo file of type {ty:?}"),
    };
    for (k, v) in src.metadata() {
        let v = match k.as_str() {
            "general.file_type" => Value::U32(ft),
            "general.name" => {
                // The F16 file's name carries its type; the derived file gets its own.
                let base = v.as_str().unwrap_or("tern demo");
                Value::String(format!("{} {tname}", base.trim_end_matches(" F16")))
            }
            _ => v.clone(),
        };
        w.set(k, v);
    }
    for t in src.tensors() {
        if !matches!(t.ty, GgmlType::F32 | GgmlType::F16) {
            bail!(
                "{}: {} is {}; the source must be the trained F32 file or the F16 file",
                src.path().display(),
                t.name,
                t.ty.name()
            );
        }
    }
    let tensors: Vec<(String, Vec<u64>, Vec<f32>)> = src
        .tensors()
        .iter()
        .map(|t| {
            let mut data = vec![0f32; t.n_elements() as usize];
            tern::quant::dequantize_row(t.ty, src.tensor_data(t), &mut data)
                .map_err(|e| anyhow::anyhow!("{}: {e}", t.name))?;
            Ok((t.name.clone(), t.dims.clone(), data))
        })
        .collect::<Result<_>>()?;
    if !matches!(ty, GgmlType::PQ2_0 | GgmlType::PTQ1_0) {
        for (name, dims, data) in &tensors {
            let (t, bytes) = if is_matmul(name, dims) {
                match ty {
                    GgmlType::F16 => (ty, f16_bytes(data)),
                    _ => (ty, encode_rows(ty, dims[0] as usize, data)?),
                }
            } else {
                (GgmlType::F32, f32_bytes(data))
            };
            w.add_tensor(name, dims, t, bytes);
        }
        return Ok(w);
    }

    // PQ2_0 / PTQ1_0: which tensors fold, their sign vectors (one per input width), the fold
    // and the ternarisation (the same codes and scale for both; only the packing differs).
    let folds = |name: &str, dims: &[u64]| {
        is_matmul(name, dims)
            && tern::quant::hadamard::is_foldable_name(name)
            && !is_mtp(name, n_layer)
            && (dims[0] as usize).is_multiple_of(HADAMARD_BLOCK)
    };
    let folded: Vec<String> = tensors
        .iter()
        .filter(|(n, d, _)| folds(n, d))
        .map(|(n, _, _)| n.clone())
        .collect();
    let mut widths: Vec<usize> = tensors
        .iter()
        .filter(|(n, d, _)| folds(n, d) || n == "token_embd.weight")
        .map(|(_, d, _)| d[0] as usize)
        .collect();
    widths.sort_unstable();
    widths.dedup();
    let signs: Vec<Vec<i32>> = widths
        .iter()
        .map(|&wd| {
            let mut rng = Rng::for_label(SEED, &format!("demo/pq2_0/signs/{wd}"));
            (0..wd)
                .map(|_| if rng.below(2) == 0 { 1 } else { -1 })
                .collect()
        })
        .collect();
    let sign_of = |wd: usize| &signs[widths.iter().position(|&x| x == wd).unwrap()];
    let h = fold::dense_h(HADAMARD_BLOCK);
    let p = "prism.hadamard";
    w.set(&format!("{p}.version"), Value::U32(1));
    w.set(
        &format!("{p}.block_size"),
        Value::U32(HADAMARD_BLOCK as u32),
    );
    w.set(
        &format!("{p}.transform"),
        Value::String("normalized-sylvester-walsh-hadamard".into()),
    );
    w.set(
        &format!("{p}.axis"),
        Value::String("input-last-dimension".into()),
    );
    w.set(&format!("{p}.sign_mode"), Value::String("explicit".into()));
    let wi: Vec<i32> = widths.iter().map(|&x| x as i32).collect();
    w.set(&format!("{p}.sign_widths"), Value::i32_array(&wi));
    w.set(
        &format!("{p}.sign_values"),
        Value::i32_array(&signs.concat()),
    );
    w.set(&format!("{p}.weight_names"), Value::str_array(&folded));
    w.set(
        &format!("{p}.inverse_weight_names"),
        Value::str_array(&["token_embd.weight"]),
    );
    // ssm_out is folded in the file's own (tiled) V order: no permutation at run time.
    w.set(&format!("{p}.gdn_v_grouped"), Value::Bool(false));
    for (name, dims, data) in &tensors {
        let ne0 = dims[0] as usize;
        let (t, bytes) = if folds(name, dims) || name == "token_embd.weight" {
            // Stored latent z with w = s ⊙ H_blk(z), i.e. z = H_blk(s ⊙ w) (H is symmetric and
            // its own inverse); the same rule gives the embedding's inverse fold e = s ⊙ H(z).
            let s = sign_of(ne0);
            let mut bytes = Vec::with_capacity(data.len() / 128 * 34);
            for row in data.chunks(ne0) {
                let sx: Vec<f64> = row
                    .iter()
                    .zip(s)
                    .map(|(&v, &g)| v as f64 * g as f64)
                    .collect();
                let z = fold::apply_h_blk(&h, HADAMARD_BLOCK, &sx);
                for blk in z.chunks(fold::PQ2_0_BLOCK) {
                    let (d, codes) = ternarise(blk);
                    match ty {
                        GgmlType::PQ2_0 => {
                            bytes.extend_from_slice(&fold::encode_pq2_0_block(d, &codes))
                        }
                        _ => bytes.extend_from_slice(&fold::encode_ptq1_0_block(d, &codes)),
                    }
                }
            }
            (ty, bytes)
        } else if name.ends_with("ssm_alpha.weight") || name.ends_with("ssm_beta.weight") {
            let b = data
                .iter()
                .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
                .collect();
            (GgmlType::BF16, b)
        } else if is_matmul(name, dims) {
            (GgmlType::Q8_0, encode_rows(GgmlType::Q8_0, ne0, data)?)
        } else {
            (GgmlType::F32, f32_bytes(data))
        };
        w.add_tensor(name, dims, t, bytes);
    }
    Ok(w)
}

/// Writes `demo-ptq1_0.gguf` from `demo-f16.gguf` in `dir`: the PQ2_0 file's fold and
/// least-squares ternarisation, packed as PTQ1_0 (1.75 bits a weight). It starts from the F16
/// file, not the trained F32 one, so that it can be made from a checkout without retraining.
pub fn export_ptq1_0(dir: &Path) -> Result<()> {
    let src_path = dir.join(FILES[0].0);
    let src = Gguf::open(&src_path).with_context(|| src_path.display().to_string())?;
    let w = encode_file(&src, GgmlType::PTQ1_0)?;
    let path = dir.join(PTQ1_0_FILE);
    w.write(&path)?;
    let g = Gguf::open(&path)?;
    println!(
        "{PTQ1_0_FILE:<18} {:>9} bytes (from {})",
        g.file_len(),
        FILES[0].0
    );
    Ok(())
}

fn f32_bytes(w: &[f32]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// The least-squares ternary code of one 128-block: codes in {-1, 0, +1} (stored +1) and a
/// scale d minimising `||z - d q||²`. With the k largest |z| set to sign(z) the best d is their
/// mean |z| and the error is `Σz² - (Σ_top-k |z|)² / k`, so k maximises `S_k² / k`.
pub fn ternarise(z: &[f64]) -> (f16, Vec<u8>) {
    let mut order: Vec<usize> = (0..z.len()).collect();
    order.sort_by(|&a, &b| z[b].abs().total_cmp(&z[a].abs()).then(a.cmp(&b)));
    let (mut best_k, mut best, mut s) = (0usize, 0f64, 0f64);
    for (i, &j) in order.iter().enumerate() {
        s += z[j].abs();
        let score = s * s / (i + 1) as f64;
        if score > best {
            best = score;
            best_k = i + 1;
        }
    }
    let mut codes = vec![1u8; z.len()];
    if best_k == 0 {
        return (f16::ZERO, codes);
    }
    let d = order[..best_k].iter().map(|&j| z[j].abs()).sum::<f64>() / best_k as f64;
    for &j in &order[..best_k] {
        codes[j] = if z[j] > 0.0 { 2 } else { 0 };
    }
    (f16::from_f64(d), codes)
}

// ---------------------------------------------------------------------------------------------
// Evaluation

fn read_npy_i32(path: &Path) -> Result<Vec<u32>> {
    let b = std::fs::read(path).with_context(|| path.display().to_string())?;
    if b.len() < 10 || &b[..6] != b"\x93NUMPY" {
        bail!("{}: not an .npy file", path.display());
    }
    let (hl, off) = if b[6] == 1 {
        (u16::from_le_bytes([b[8], b[9]]) as usize, 10)
    } else {
        (u32::from_le_bytes([b[8], b[9], b[10], b[11]]) as usize, 12)
    };
    let header = String::from_utf8_lossy(&b[off..off + hl]);
    if !header.contains("'<i4'") || header.contains("'fortran_order': True") {
        bail!(
            "{}: expected a C-order <i4 array, got {header}",
            path.display()
        );
    }
    Ok(b[off + hl..]
        .chunks(4)
        .map(|c| i32::from_le_bytes([c[0], c[1], c[2], c[3]]) as u32)
        .collect())
}

/// Held-out perplexity and MTP top-1 accuracy of one file, by tern's CPU backend, over
/// consecutive windows of `PPL_WINDOW` tokens (each from a fresh state). The MTP row p reads
/// token x_p and the trunk's h_{p-1} and is scored on x_{p+1} (rows p >= 1).
pub fn ppl_and_mtp(path: &Path, val: &[u32], max_windows: usize) -> Result<(f64, f64, usize)> {
    let be = CpuBackend::new();
    let m = Model::load(&be, Arc::new(Gguf::open(path)?))?;
    let nv = m.cfg.n_vocab;
    let (mut nll, mut n, mut hit, mut n_mtp) = (0f64, 0usize, 0usize, 0usize);
    for win in val.chunks_exact(PPL_WINDOW).take(max_windows) {
        let mut st = m.new_state(&be);
        let out = m.forward(&be, &mut st, win, true)?;
        let lg = be.to_host(&out.logits);
        for t in 0..win.len() - 1 {
            let row = &lg[t * nv..(t + 1) * nv];
            nll += logsumexp(row) - row[win[t + 1] as usize] as f64;
            n += 1;
        }
        let h = be.to_host(&out.h);
        let e = h.len() / win.len();
        let mut hp = vec![0f32; h.len()];
        hp[e..].copy_from_slice(&h[..h.len() - e]);
        let hp = be.from_host(&hp, win.len(), e);
        let mut ms = m.new_mtp_state(&be)?;
        let mo = be.to_host(&m.mtp_forward(&be, &mut ms, win, &hp)?.logits);
        for p in 1..win.len() - 1 {
            let row = &mo[p * nv..(p + 1) * nv];
            hit += (argmax(row) == win[p + 1] as usize) as usize;
            n_mtp += 1;
        }
    }
    Ok(((nll / n as f64).exp(), hit as f64 / n_mtp as f64, n))
}

fn logsumexp(row: &[f32]) -> f64 {
    let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max) as f64;
    mx + row.iter().map(|&x| (x as f64 - mx).exp()).sum::<f64>().ln()
}

fn argmax(row: &[f32]) -> usize {
    let mut best = 0;
    for (i, &x) in row.iter().enumerate() {
        if x > row[best] {
            best = i;
        }
    }
    best
}

/// tern's greedy continuation through the serving engine (as `tern generate --temp 0`), with
/// an F32 KV cache as in the llama.cpp run; `spec` turns MTP drafting on. Returns the ids and
/// (drafted, accepted).
pub fn tern_greedy(
    path: &Path,
    prompts: &[Vec<u32>],
    n: usize,
    spec: Option<SpecConfig>,
) -> Result<(Vec<Vec<u32>>, u64, u64)> {
    let be = CpuBackend::new();
    let g = Arc::new(Gguf::open(path)?);
    let tok = Arc::new(Tokenizer::from_gguf(&g)?);
    let m = Model::load(&be, g)?;
    let cfg = EngineConfig {
        ctx_size: 1024,
        parallel: 1,
        ubatch: 512,
        kv_types: KvTypes {
            k: GgmlType::F32,
            v: GgmlType::F32,
        },
        spec,
        draft_kv_types: KvTypes {
            k: GgmlType::F32,
            v: GgmlType::F32,
        },
    };
    let engine = Engine::start(m, be, tok, cfg).map_err(|e| anyhow::anyhow!("{e}"))?;
    let mut outs = Vec::new();
    for p in prompts {
        let h = engine.submit(Request {
            prompt: p.clone(),
            max_tokens: n,
            sampler: SamplerConfig::greedy(),
            stop: vec![],
            ignore_eos: true,
            ..Default::default()
        });
        let (ids, _, _) = h.collect().map_err(|e| anyhow::anyhow!("{e}"))?;
        outs.push(ids);
    }
    let s = engine.metrics().spec;
    Ok((outs, s.drafted, s.accepted))
}

fn evaluate(root: &Path, o: &Options, out: &Path, val: &[u32]) -> Result<Json> {
    let mut files = serde_json::Map::new();
    for (file, ty) in FILES {
        let path = out.join(file);
        let t0 = Instant::now();
        // TERN_DEMO_MAX_WINDOWS caps the windows for a quick check of this task itself.
        let max_windows = std::env::var("TERN_DEMO_MAX_WINDOWS")
            .ok()
            .and_then(|v| v.parse().ok())
            .unwrap_or(usize::MAX);
        let (ppl, mtp, n) = ppl_and_mtp(&path, val, max_windows)?;
        let bytes = std::fs::metadata(&path)?.len();
        println!(
            "{file:<18} val ppl {ppl:8.3}  MTP top-1 {:.4}  ({n} tokens, {:.1}s)",
            mtp,
            t0.elapsed().as_secs_f64()
        );
        files.insert(
            crate::fixtures::type_name(ty).into(),
            json!({"file": file, "bytes": bytes, "val_ppl": ppl, "mtp_top1": mtp, "tokens_scored": n}),
        );
    }
    // A held-out slice for the CI test's perplexity check, with tern's figures on it.
    let slice: Vec<u32> = val[..2 * PPL_WINDOW].to_vec();
    let mut slice_ppl = serde_json::Map::new();
    for (file, ty) in FILES {
        let (ppl, mtp, _) = ppl_and_mtp(&out.join(file), &slice, 2)?;
        slice_ppl.insert(
            crate::fixtures::type_name(ty).into(),
            json!({"ppl": ppl, "mtp_top1": mtp}),
        );
    }

    // MTP drafting: greedy continuations of 8 held-out windows with drafting on (n_max 3) and
    // off; the drafted run must reproduce the plain one token for token.
    let prompts: Vec<Vec<u32>> = (0..8)
        .map(|i| {
            let s = i * (val.len() / 8);
            val[s..s + 32].to_vec()
        })
        .collect();
    let mut accept = serde_json::Map::new();
    for (file, ty) in FILES {
        let path = out.join(file);
        let (plain, _, _) = tern_greedy(&path, &prompts, 64, None)?;
        let (drafted, d, a) = tern_greedy(&path, &prompts, 64, Some(SpecConfig::default()))?;
        let rate = a as f64 / d.max(1) as f64;
        println!(
            "{file:<18} draft-mtp acceptance {rate:.3} ({a} / {d}); same tokens as without drafting: {}",
            plain == drafted
        );
        accept.insert(
            crate::fixtures::type_name(ty).into(),
            json!({"drafted": d, "accepted": a, "rate": rate, "same_as_plain": plain == drafted}),
        );
    }

    // llama.cpp's greedy continuations (F16, Q8_0) and tern's on the same prompt ids.
    let greedy_path = out.join("llama_greedy.json");
    if o.llama {
        let job = json!({
            "models": {
                "F16": out.join("demo-f16.gguf"),
                "Q8_0": out.join("demo-q8_0.gguf"),
            },
            "prompts": PROMPTS,
            "n": N_GREEDY,
        });
        let job_path = o.work.join("llama_job.json");
        std::fs::write(&job_path, serde_json::to_string(&job)?)?;
        let st = std::process::Command::new(&o.llama_python)
            .arg(root.join("xtask/py/demo_llama.py"))
            .arg("--job")
            .arg(&job_path)
            .arg("--out")
            .arg(&greedy_path)
            .status()
            .with_context(|| format!("running {}", o.llama_python))?;
        if !st.success() {
            bail!("demo_llama.py failed ({st})");
        }
    }
    let mut greedy = Vec::new();
    if greedy_path.exists() {
        let lj: Json = serde_json::from_str(&std::fs::read_to_string(&greedy_path)?)?;
        for r in lj["runs"].as_array().context("llama_greedy.json: runs")? {
            let file = r["model"].as_str().unwrap_or_default();
            let ids = |v: &Json| -> Vec<u32> {
                v.as_array()
                    .map(|a| {
                        a.iter()
                            .filter_map(|x| x.as_u64())
                            .map(|x| x as u32)
                            .collect()
                    })
                    .unwrap_or_default()
            };
            let prompt_ids = ids(&r["prompt_ids"]);
            let want = ids(&r["ids"]);
            let path = out.join(file);
            let (got, _, _) =
                tern_greedy(&path, std::slice::from_ref(&prompt_ids), want.len(), None)?;
            let g = Gguf::open(&path)?;
            let tok = Tokenizer::from_gguf(&g)?;
            let tern_prompt = tok.encode(r["prompt"].as_str().unwrap_or_default(), true, true)?;
            let text = tok.decode(&got[0], false)?;
            let same = got[0] == want;
            println!(
                "{file:<18} greedy {} tokens: tern == llama.cpp: {same}; tokenizer agrees: {}",
                want.len(),
                tern_prompt == prompt_ids
            );
            greedy.push(json!({
                "file": file, "type": r["type"], "prompt": r["prompt"], "prompt_ids": prompt_ids,
                "llama_ids": want, "tern_ids": got[0], "equal": same,
                "tokenizer_agrees": tern_prompt == prompt_ids, "tern_text": text, "llama_text": r["text"],
            }));
        }
    }
    Ok(json!({
        "generator": "cargo xtask train-demo",
        "perplexity_window": PPL_WINDOW,
        "files": files,
        "heldout_slice": {"window": PPL_WINDOW, "tokens": slice, "by_type": slice_ppl},
        "draft_mtp": {"spec_draft_n_max": SpecConfig::default().n_max, "prompts": prompts.len(),
                      "prompt_tokens": 32, "generated_per_prompt": 64, "kv": "f32", "by_type": accept},
        "greedy": greedy,
    }))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ternarise_is_least_squares() {
        let z: Vec<f64> = (0..128)
            .map(|i| ((i * 37 % 101) as f64 - 50.0) / 25.0)
            .collect();
        let (d, codes) = ternarise(&z);
        let err = |d: f64, c: &[u8]| -> f64 {
            z.iter()
                .zip(c)
                .map(|(&v, &q)| (v - d * (q as f64 - 1.0)).powi(2))
                .sum()
        };
        let e = err(d.to_f64(), &codes);
        // No other scale with round-to-nearest ternary codes does better.
        for k in 1..200 {
            let dd = k as f64 * 0.02;
            let c: Vec<u8> = z
                .iter()
                .map(|&v| ((v / dd).round().clamp(-1.0, 1.0) + 1.0) as u8)
                .collect();
            assert!(e <= err(dd, &c) + 1e-6, "d {dd}");
        }
    }
}
