//! `cargo xtask bench --lora [--rank R] [--wgpu] [FILE]`: what a LoRA adapter on every matrix
//! costs the serving engine's decode, against the share of the work the adapter adds.
//!
//! Writes a random rank-R adapter for FILE (every matrix an adapter may modify, F16), then
//! decodes with one stream three ways: no adapter, the adapter loaded at scale 0 (skipped: the
//! base model exactly), and the adapter at scale 1. Decode is bound by the bytes each token
//! reads, so the expected cost is the adapter's bytes over the model's; its FLOP share is
//! printed beside it.

use std::path::Path;
use std::sync::Arc;

use anyhow::{anyhow, Result};
use serde_json::json;
use tern::backend::{cpu::CpuBackend, Backend};
use tern::gguf::Gguf;
use tern::model::lora::Site;
use tern::model::{Config, Model};
use tern::runtime::engine::{Engine, EngineConfig, Request};
use tern::runtime::sampler::SamplerConfig;

pub fn lora_cost(file: &Path, backend: &str, rank: usize, decode: usize) -> Result<()> {
    let g = Arc::new(Gguf::open(file)?);
    let cfg = Config::from_gguf(&g)?;
    let tok = Arc::new(tern::tokenizer::Tokenizer::from_gguf(&g)?);
    let stem = file
        .file_stem()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("../target/bench");
    std::fs::create_dir_all(&dir)?;
    let adapter = dir.join(format!("{stem}-lora-r{rank}.gguf"));
    let (adapter_bytes, _) = crate::fixtures::write_checked(
        &crate::lora_fixtures::adapter_for(&g, rank, &stem)?,
        &adapter,
    )?;

    // The work per decoded token: every matmul weight once (the MTP block is not run without
    // drafting), and rank·(n_in + n_out) per adapted matrix.
    let (mut base_flops, mut base_bytes, mut lora_flops, mut pairs) = (0u64, 0u64, 0u64, 0);
    for t in g.tensors() {
        let mtp = t.name.starts_with(&format!("blk.{}.", cfg.n_layer));
        if t.dims.len() != 2 || t.name == "token_embd.weight" || mtp {
            continue;
        }
        base_flops += 2 * t.ne0() * t.n_rows();
        base_bytes += t.nbytes;
        if Site::of(&t.name, cfg.n_layer).is_some() {
            lora_flops += 2 * rank as u64 * (t.ne0() + t.n_rows());
            pairs += 1;
        }
    }
    // F16 pairs: 2 bytes per element, rank·(n_in + n_out) elements = lora_flops / 2.
    let lora_read = lora_flops;

    let prompt: Vec<u32> = (0..64u32).map(|i| 1 + (i * 7919) % 1000).collect();
    let ecfg = EngineConfig {
        ctx_size: 1024,
        parallel: 1,
        ubatch: 512,
        kv_types: crate::bench::F16_KV,
        spec: None,
        draft_kv_types: crate::bench::F16_KV,
    };
    let run = |with_adapter: bool, scale: f32| -> Result<f64> {
        fn go<B: Backend + 'static>(
            be: B,
            g: Arc<Gguf>,
            tok: Arc<tern::tokenizer::Tokenizer>,
            ecfg: EngineConfig,
            adapter: Option<&Path>,
            req: Request,
        ) -> Result<f64> {
            let mut m = Model::load(&be, g)?;
            if let Some(a) = adapter {
                m.add_adapter(&be, a)?;
            }
            let e = Engine::start(m, be, tok, ecfg)?;
            let mut best = 0f64;
            for _ in 0..2 {
                let (_, _, f) = e
                    .submit(req.clone())
                    .collect()
                    .map_err(|e| anyhow!("{e}"))?;
                best =
                    best.max(f.completion_tokens as f64 / (f.timings.predicted_ms / 1e3).max(1e-9));
            }
            Ok(best)
        }
        let req = Request {
            prompt: prompt.clone(),
            max_tokens: decode,
            sampler: SamplerConfig::greedy(),
            stop: vec![],
            ignore_eos: true,
            lora: if with_adapter { vec![scale] } else { vec![] },
            ..Default::default()
        };
        let a = with_adapter.then_some(adapter.as_path());
        match backend {
            "wgpu" => go(
                tern::backend::wgpu::WgpuBackend::new()?,
                g.clone(),
                tok.clone(),
                ecfg.clone(),
                a,
                req,
            ),
            _ => go(
                CpuBackend::new(),
                g.clone(),
                tok.clone(),
                ecfg.clone(),
                a,
                req,
            ),
        }
    };
    let none = run(false, 0.0)?;
    let zero = run(true, 0.0)?;
    let one = run(true, 1.0)?;
    let share_bytes = lora_read as f64 / base_bytes as f64;
    let share_flops = lora_flops as f64 / base_flops as f64;
    println!(
        "{} on {backend}: rank-{rank} adapter on {pairs} matrices ({adapter_bytes} B file)",
        file.display()
    );
    println!("  decode t/s, 1 stream, {decode} tokens (best of 2):");
    println!("    no adapter            {none:>8.2}");
    println!(
        "    adapter at scale 0    {zero:>8.2}  ({:.3}x)",
        zero / none
    );
    println!("    adapter at scale 1    {one:>8.2}  ({:.3}x)", one / none);
    println!(
        "  the adapter's share: {:.2}% of the bytes read per token, {:.2}% of the FLOPs \
         (expected decode ratio ~{:.3}x)",
        100.0 * share_bytes,
        100.0 * share_flops,
        1.0 / (1.0 + share_bytes)
    );
    let out = dir.join(format!("lora-{stem}-{backend}.json"));
    std::fs::write(
        &out,
        serde_json::to_string_pretty(&json!({
            "file": file.display().to_string(), "backend": backend, "rank": rank,
            "pairs": pairs, "decode_tokens": decode,
            "tps_no_adapter": none, "tps_scale0": zero, "tps_scale1": one,
            "ratio_scale1": one / none, "share_bytes": share_bytes, "share_flops": share_flops,
        }))?,
    )?;
    println!("  written {}", out.display());
    Ok(())
}
