//! Random LoRA adapters for the tiny geometry (`cargo xtask fixtures` writes them to
//! `fixtures/lora/`): one pair for every matrix llama.cpp's `build_lora_mm` covers in qwen35
//! (attention q/k/v/output, the GDN projections and `ssm_out`, the FFN, the output head, the
//! MTP block's `eh_proj` and its layer), in llama.cpp's adapter format. The same files apply
//! to tiny-f32.gguf and to tiny-pq2_0.gguf, whose F32 twin is the model they were made for:
//! an adapter knows nothing of the fold.

use std::path::Path;

use anyhow::{Context, Result};
use tern::gguf::{GgufWriter, Value};
use tern::tensor::GgmlType;

use crate::fixtures::{tensor_specs, Geometry, Kind, SEED};
use crate::rng::Rng;

/// One adapter fixture: rank, alpha, and the storage type of `lora_a` (`lora_b`, whose rows
/// are `rank` long, is F32 where the type needs blocks of 32).
pub struct AdapterSpec {
    pub file: &'static str,
    pub rank: usize,
    pub alpha: f32,
    pub ty: GgmlType,
}

pub const ADAPTERS: [AdapterSpec; 3] = [
    AdapterSpec {
        file: "tiny-lora-r4-f32.gguf",
        rank: 4,
        alpha: 8.0,
        ty: GgmlType::F32,
    },
    AdapterSpec {
        file: "tiny-lora-r8-f16.gguf",
        rank: 8,
        alpha: 0.0,
        ty: GgmlType::F16,
    },
    AdapterSpec {
        file: "tiny-lora-r8-q8_0.gguf",
        rank: 8,
        alpha: 16.0,
        ty: GgmlType::Q8_0,
    },
];

fn encode(ty: GgmlType, ne0: usize, w: &[f32]) -> Result<Vec<u8>> {
    let mut out = Vec::new();
    for row in w.chunks(ne0) {
        out.extend(tern::quant::quantize_row(ty, row).context("quantizing an adapter row")?);
    }
    Ok(out)
}

/// The adapter as a GGUF writer. A's entries are ~N(0, 1/n_in) and B's are scaled so that each
/// pair moves its matrix's output by a few percent: the adapted logits differ clearly from the
/// base model's without leaving its range.
pub fn adapter(spec: &AdapterSpec) -> Result<GgufWriter> {
    let g = Geometry::tiny();
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("qwen35".into()));
    w.set("general.type", Value::String("adapter".into()));
    w.set(
        "general.name",
        Value::String(format!("tern tiny LoRA rank {} (random)", spec.rank)),
    );
    w.set("adapter.type", Value::String("lora".into()));
    w.set("adapter.lora.alpha", Value::F32(spec.alpha));
    // The vocabulary size does not matter for the matrices an adapter touches but output's.
    let n_vocab = crate::fixtures::tiny_vocab_size();
    for s in tensor_specs(&g, n_vocab) {
        if !matches!(s.kind, Kind::Matmul | Kind::AlphaBeta | Kind::Output) {
            continue;
        }
        let (n_in, n_out) = (s.dims[0] as usize, s.dims[1] as usize);
        let r = spec.rank;
        let mut rng = Rng::for_label(SEED, &format!("lora/{}/{}", spec.file, s.name));
        let sa = (3.0 / n_in as f32).sqrt();
        let a: Vec<f32> = (0..r * n_in).map(|_| rng.uniform(-sa, sa)).collect();
        let sb = 0.05 / (r as f32).sqrt();
        let b: Vec<f32> = (0..n_out * r).map(|_| rng.uniform(-sb, sb)).collect();
        let a_ty = spec.ty;
        let b_ty = if r.is_multiple_of(a_ty.block_size()) {
            a_ty
        } else {
            GgmlType::F32
        };
        w.add_tensor(
            &format!("{}.lora_a", s.name),
            &[n_in as u64, r as u64],
            a_ty,
            encode(a_ty, n_in, &a)?,
        );
        w.add_tensor(
            &format!("{}.lora_b", s.name),
            &[r as u64, n_out as u64],
            b_ty,
            encode(b_ty, r, &b)?,
        );
    }
    Ok(w)
}

/// Writes every adapter fixture into `dir/lora/` with a manifest (sha256 of each).
pub fn write(dir: &Path) -> Result<()> {
    let dir = dir.join("lora");
    std::fs::create_dir_all(&dir)?;
    let mut entries = Vec::new();
    for spec in &ADAPTERS {
        let (bytes, sha) = crate::fixtures::write_checked(&adapter(spec)?, &dir.join(spec.file))?;
        entries.push(serde_json::json!({
            "file": spec.file,
            "rank": spec.rank,
            "alpha": spec.alpha,
            "lora_a_type": crate::fixtures::type_name(spec.ty),
            "sha256": sha,
            "bytes": bytes,
            "base": ["tiny-f32.gguf", "tiny-pq2_0.gguf"],
        }));
    }
    let manifest = serde_json::json!({
        "generator": "cargo xtask fixtures",
        "adapters": entries,
    });
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(&manifest)? + "\n",
    )?;
    Ok(())
}

/// A random rank-`rank` adapter for any qwen35 file, with a pair for every matrix an adapter
/// may modify there (read off the file's own tensor table), for the bench's cost figure.
pub fn adapter_for(base: &tern::gguf::Gguf, rank: usize, label: &str) -> Result<GgufWriter> {
    let cfg = tern::model::Config::from_gguf(base)?;
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("qwen35".into()));
    w.set("general.type", Value::String("adapter".into()));
    w.set(
        "general.name",
        Value::String(format!("{label} LoRA rank {rank} (random)")),
    );
    w.set("adapter.type", Value::String("lora".into()));
    w.set("adapter.lora.alpha", Value::F32(rank as f32));
    for t in base.tensors() {
        if tern::model::lora::Site::of(&t.name, cfg.n_layer).is_none() {
            continue;
        }
        let (n_in, n_out) = (t.ne0() as usize, t.n_rows() as usize);
        let mut rng = Rng::for_label(SEED, &format!("lora/{label}/{}", t.name));
        let sa = (3.0 / n_in as f32).sqrt();
        let a: Vec<f32> = (0..rank * n_in).map(|_| rng.uniform(-sa, sa)).collect();
        let sb = 0.05 / (rank as f32).sqrt();
        let b: Vec<f32> = (0..n_out * rank).map(|_| rng.uniform(-sb, sb)).collect();
        w.add_tensor(
            &format!("{}.lora_a", t.name),
            &[n_in as u64, rank as u64],
            GgmlType::F16,
            encode(GgmlType::F16, n_in, &a)?,
        );
        w.add_tensor(
            &format!("{}.lora_b", t.name),
            &[rank as u64, n_out as u64],
            GgmlType::F16,
            encode(GgmlType::F16, rank, &b)?,
        );
    }
    Ok(w)
}
