//! `cargo xtask fixtures [--bench]`: small random-weight qwen35 GGUFs (and their F32 twins) for
//! golden tests, and large bench-geometry files. Everything is drawn from fixed seeds, so a
//! re-run writes byte-identical files.

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use half::{bf16, f16};
use sha2::{Digest, Sha256};
use tern::gguf::{Gguf, GgufWriter, Value};
use tern::tensor::GgmlType;

use crate::fold;
use crate::rng::Rng;
use crate::vocab::{self, Vocab};

/// The master seed of every fixture.
pub const SEED: u64 = 0x7465_726E_2D66_6978; // "tern-fix"
/// Learned BPE merges in every fixture vocabulary.
pub const N_MERGES: usize = 200;
/// Tokens per golden sequence: one full GDN chunk (64) plus one.
const N_TOKENS: usize = 65;
const CHAT_TEMPLATE: &str = include_str!("chat_template.jinja");

// ---------------------------------------------------------------------------------------------
// Geometry and tensor list

#[derive(Clone, Debug)]
pub struct Geometry {
    /// Seed label prefix: files of one geometry share master weights.
    pub label: &'static str,
    pub n_embd: usize,
    /// Trunk layers (the MTP block, if any, is layer `n_layer`).
    pub n_layer: usize,
    pub interval: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub sections: [i32; 4],
    pub d_state: usize,
    pub n_k: usize,
    pub n_v: usize,
    pub d_conv: usize,
    pub n_ff: usize,
    pub ctx: u32,
    pub freq_base: f32,
    pub eps: f32,
    pub tied: bool,
    pub mtp: bool,
}

impl Geometry {
    /// Geometry A: n_k < n_v, GQA, partial RoPE, untied, MTP block.
    pub fn tiny() -> Geometry {
        Geometry {
            label: "tiny",
            n_embd: 128,
            n_layer: 8,
            interval: 4,
            n_head: 4,
            n_head_kv: 2,
            head_dim: 32,
            n_rot: 16,
            // IMROPE sectors (i % 8) must all fall in t/h/w so text RoPE is plain NEOX.
            sections: [3, 3, 2, 0],
            d_state: 32,
            n_k: 2,
            n_v: 4,
            d_conv: 4,
            n_ff: 256,
            ctx: 4096,
            freq_base: 10000.0,
            eps: 1e-6,
            tied: false,
            mtp: true,
        }
    }

    /// Geometry B: n_k = n_v, MQA, full-width RoPE, tied output, no MTP.
    pub fn tiny_tied() -> Geometry {
        Geometry {
            label: "tiny-tied",
            n_layer: 4,
            interval: 2,
            n_head_kv: 1,
            n_rot: 32,
            // 16 pairs: [6,5,5,0] puts every sector in t/h/w ([6,6,4,0] would leave sector 14 on
            // the 4th stream, position 0).
            sections: [6, 5, 5, 0],
            n_v: 2,
            tied: true,
            mtp: false,
            ..Geometry::tiny()
        }
    }

    /// Qwen3.5-0.8B (bench.md).
    pub fn bench_0_8b() -> Geometry {
        Geometry {
            label: "bench-0.8b",
            n_embd: 1024,
            n_layer: 24,
            interval: 4,
            n_head: 8,
            n_head_kv: 2,
            head_dim: 256,
            n_rot: 64,
            sections: [11, 11, 10, 0],
            d_state: 128,
            n_k: 16,
            n_v: 16,
            d_conv: 4,
            n_ff: 3584,
            ctx: 262_144,
            freq_base: 1e7,
            eps: 1e-6,
            tied: true,
            mtp: true,
        }
    }

    pub fn is_attn(&self, il: usize) -> bool {
        il >= self.n_layer || (il + 1).is_multiple_of(self.interval)
    }
    fn inner(&self) -> usize {
        self.n_v * self.d_state
    }
    fn conv_dim(&self) -> usize {
        2 * self.n_k * self.d_state + self.inner()
    }
    fn block_count(&self) -> usize {
        self.n_layer + self.mtp as usize
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Kind {
    Embed,
    Output,
    /// A 2-D matmul weight (attention, GDN projections, FFN, eh_proj).
    Matmul,
    /// ssm_alpha / ssm_beta: 2-D, but BF16 and never folded in PQ2_0 files.
    AlphaBeta,
    Norm,
    Conv,
    SsmA,
    DtBias,
}

#[derive(Clone, Debug)]
pub struct Spec {
    pub name: String,
    /// ggml order {ne0, ne1}.
    pub dims: Vec<u64>,
    pub kind: Kind,
    /// Part of the MTP block.
    pub mtp: bool,
}

impl Spec {
    fn ne0(&self) -> usize {
        self.dims[0] as usize
    }
    fn n(&self) -> usize {
        self.dims.iter().product::<u64>() as usize
    }
    fn is_ssm_out(&self) -> bool {
        self.name.ends_with(".ssm_out.weight")
    }
}

pub fn tensor_specs(g: &Geometry, n_vocab: usize) -> Vec<Spec> {
    let (e, v) = (g.n_embd as u64, n_vocab as u64);
    let mut out = Vec::new();
    let mut add = |name: String, dims: &[u64], kind: Kind, mtp: bool| {
        out.push(Spec {
            name,
            dims: dims.to_vec(),
            kind,
            mtp,
        })
    };
    add("token_embd.weight".into(), &[e, v], Kind::Embed, false);
    let hd = g.head_dim as u64;
    let (nh, nkv) = (g.n_head as u64, g.n_head_kv as u64);
    let ff = g.n_ff as u64;
    for il in 0..g.block_count() {
        let mtp = il >= g.n_layer;
        let p = |s: &str| format!("blk.{il}.{s}");
        add(p("attn_norm.weight"), &[e], Kind::Norm, mtp);
        if g.is_attn(il) {
            // attn_q rows are laid out per head as [q_h | gate_h].
            add(p("attn_q.weight"), &[e, 2 * nh * hd], Kind::Matmul, mtp);
            add(p("attn_k.weight"), &[e, nkv * hd], Kind::Matmul, mtp);
            add(p("attn_v.weight"), &[e, nkv * hd], Kind::Matmul, mtp);
            add(p("attn_output.weight"), &[nh * hd, e], Kind::Matmul, mtp);
            add(p("attn_q_norm.weight"), &[hd], Kind::Norm, mtp);
            add(p("attn_k_norm.weight"), &[hd], Kind::Norm, mtp);
        } else {
            let inner = g.inner() as u64;
            let nv = g.n_v as u64;
            add(
                p("attn_qkv.weight"),
                &[e, g.conv_dim() as u64],
                Kind::Matmul,
                mtp,
            );
            add(p("attn_gate.weight"), &[e, inner], Kind::Matmul, mtp);
            add(
                p("ssm_conv1d.weight"),
                &[g.d_conv as u64, g.conv_dim() as u64],
                Kind::Conv,
                mtp,
            );
            add(p("ssm_dt.bias"), &[nv], Kind::DtBias, mtp);
            add(p("ssm_a"), &[nv], Kind::SsmA, mtp);
            add(p("ssm_beta.weight"), &[e, nv], Kind::AlphaBeta, mtp);
            add(p("ssm_alpha.weight"), &[e, nv], Kind::AlphaBeta, mtp);
            add(p("ssm_norm.weight"), &[g.d_state as u64], Kind::Norm, mtp);
            add(p("ssm_out.weight"), &[inner, e], Kind::Matmul, mtp);
        }
        add(p("post_attention_norm.weight"), &[e], Kind::Norm, mtp);
        add(p("ffn_gate.weight"), &[e, ff], Kind::Matmul, mtp);
        add(p("ffn_up.weight"), &[e, ff], Kind::Matmul, mtp);
        add(p("ffn_down.weight"), &[ff, e], Kind::Matmul, mtp);
        if mtp {
            add(p("nextn.eh_proj.weight"), &[2 * e, e], Kind::Matmul, true);
            add(p("nextn.enorm.weight"), &[e], Kind::Norm, true);
            add(p("nextn.hnorm.weight"), &[e], Kind::Norm, true);
            add(p("nextn.shared_head_norm.weight"), &[e], Kind::Norm, true);
        }
    }
    add("output_norm.weight".into(), &[e], Kind::Norm, false);
    if !g.tied {
        add("output.weight".into(), &[e, v], Kind::Output, false);
    }
    out
}

/// The master f32 weights of one tensor, from its own seeded stream.
pub fn master(label: &str, s: &Spec) -> Vec<f32> {
    let mut rng = Rng::for_label(SEED, &format!("{label}/master/{}", s.name));
    let mut w = vec![0f32; s.n()];
    match s.kind {
        Kind::Embed => rng.fill_uniform(&mut w, -1.0, 1.0),
        Kind::Output | Kind::Matmul | Kind::AlphaBeta => {
            // std 1/sqrt(ne0): keeps every projection's output at the input's scale.
            let a = (3.0 / s.ne0() as f32).sqrt();
            rng.fill_uniform(&mut w, -a, a)
        }
        // Never all ones: that would hide a missing/extra +1.
        Kind::Norm => w.iter_mut().for_each(|x| *x = 1.0 + rng.uniform(-0.2, 0.2)),
        Kind::Conv => rng.fill_uniform(&mut w, -0.5, 0.5),
        Kind::SsmA => w
            .iter_mut()
            .for_each(|x| *x = -rng.uniform(-1.0, 0.5).exp()),
        Kind::DtBias => rng.fill_uniform(&mut w, -0.5, 0.5),
    }
    w
}

// ---------------------------------------------------------------------------------------------
// Encoding

fn f32_bytes(w: &[f32]) -> Vec<u8> {
    w.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Encodes a tensor in `ty`, row by row, with tern's quantizers (F32 is raw bytes).
pub fn encode(ty: GgmlType, ne0: usize, w: &[f32]) -> Result<Vec<u8>> {
    if ty == GgmlType::F32 {
        return Ok(f32_bytes(w));
    }
    let mut out = Vec::new();
    for row in w.chunks(ne0) {
        let b = tern::quant::quantize_row(ty, row)
            .map_err(|e| anyhow::anyhow!("quantize {ty:?}: {e:?}"))?;
        out.extend_from_slice(&b);
    }
    Ok(out)
}

fn f16_bytes(w: &[f32]) -> Vec<u8> {
    w.iter()
        .flat_map(|&x| f16::from_f32(x).to_bits().to_le_bytes())
        .collect()
}
fn bf16_bytes(w: &[f32]) -> Vec<u8> {
    w.iter()
        .flat_map(|&x| bf16::from_f32(x).to_bits().to_le_bytes())
        .collect()
}
fn f16_decode(b: &[u8]) -> Vec<f32> {
    b.chunks(2)
        .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
        .collect()
}
fn bf16_decode(b: &[u8]) -> Vec<f32> {
    b.chunks(2)
        .map(|c| bf16::from_bits(u16::from_le_bytes([c[0], c[1]])).to_f32())
        .collect()
}

/// Runs `f(i)` for i in 0..n on the available cores; results come back in index order.
fn par_map<T: Send>(n: usize, f: impl Fn(usize) -> T + Sync) -> Vec<T> {
    use std::sync::atomic::{AtomicUsize, Ordering};
    use std::sync::Mutex;
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
        .min(n.max(1));
    let next = AtomicUsize::new(0);
    let slots: Vec<Mutex<Option<T>>> = (0..n).map(|_| Mutex::new(None)).collect();
    std::thread::scope(|sc| {
        for _ in 0..threads {
            sc.spawn(|| loop {
                let i = next.fetch_add(1, Ordering::Relaxed);
                if i >= n {
                    break;
                }
                let r = f(i);
                *slots[i].lock().unwrap() = Some(r);
            });
        }
    });
    slots
        .into_iter()
        .map(|m| m.into_inner().unwrap().unwrap())
        .collect()
}

// ---------------------------------------------------------------------------------------------
// Metadata

pub fn file_type_of(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::Q4_0 => 2,
        GgmlType::Q8_0 => 7,
        GgmlType::BF16 => 32,
        GgmlType::PQ2_0 => 141,
        _ => unreachable!("no fixture of type {ty:?}"),
    }
}

pub fn type_name(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => "F32",
        GgmlType::F16 => "F16",
        GgmlType::BF16 => "BF16",
        GgmlType::Q8_0 => "Q8_0",
        GgmlType::Q4_0 => "Q4_0",
        GgmlType::PQ2_0 => "PQ2_0",
        _ => "?",
    }
}

pub fn set_metadata(w: &mut GgufWriter, g: &Geometry, vocab: &Vocab, name: &str, file_type: u32) {
    let u = |x: usize| Value::U32(x as u32);
    w.set("general.architecture", Value::String("qwen35".into()));
    w.set("general.name", Value::String(name.into()));
    w.set("general.file_type", Value::U32(file_type));
    w.set("general.quantization_version", Value::U32(2));
    let a = "qwen35";
    w.set(&format!("{a}.context_length"), Value::U32(g.ctx));
    w.set(&format!("{a}.embedding_length"), u(g.n_embd));
    w.set(&format!("{a}.block_count"), u(g.block_count()));
    w.set(&format!("{a}.feed_forward_length"), u(g.n_ff));
    w.set(&format!("{a}.attention.head_count"), u(g.n_head));
    w.set(&format!("{a}.attention.head_count_kv"), u(g.n_head_kv));
    w.set(&format!("{a}.attention.key_length"), u(g.head_dim));
    w.set(&format!("{a}.attention.value_length"), u(g.head_dim));
    w.set(
        &format!("{a}.attention.layer_norm_rms_epsilon"),
        Value::F32(g.eps),
    );
    w.set(&format!("{a}.rope.freq_base"), Value::F32(g.freq_base));
    w.set(&format!("{a}.rope.dimension_count"), u(g.n_rot));
    w.set(
        &format!("{a}.rope.dimension_sections"),
        Value::i32_array(&g.sections),
    );
    w.set(&format!("{a}.full_attention_interval"), u(g.interval));
    w.set(&format!("{a}.ssm.conv_kernel"), u(g.d_conv));
    w.set(&format!("{a}.ssm.state_size"), u(g.d_state));
    w.set(&format!("{a}.ssm.group_count"), u(g.n_k));
    w.set(&format!("{a}.ssm.time_step_rank"), u(g.n_v));
    w.set(&format!("{a}.ssm.inner_size"), u(g.inner()));
    if g.mtp {
        w.set(&format!("{a}.nextn_predict_layers"), Value::U32(1));
    }
    w.set("tokenizer.ggml.model", Value::String("gpt2".into()));
    w.set("tokenizer.ggml.pre", Value::String("qwen35".into()));
    w.set("tokenizer.ggml.tokens", Value::str_array(&vocab.tokens));
    w.set("tokenizer.ggml.token_type", Value::i32_array(&vocab.types));
    w.set("tokenizer.ggml.merges", Value::str_array(&vocab.merges));
    // As Qwen's own GGUFs do: bos = eos = <|endoftext|> (never added: add_bos_token false).
    w.set("tokenizer.ggml.bos_token_id", Value::U32(vocab.eos));
    w.set("tokenizer.ggml.eos_token_id", Value::U32(vocab.eos));
    w.set("tokenizer.ggml.padding_token_id", Value::U32(vocab.eos));
    w.set("tokenizer.ggml.add_bos_token", Value::Bool(false));
    w.set(
        "tokenizer.chat_template",
        Value::String(CHAT_TEMPLATE.into()),
    );
}

// ---------------------------------------------------------------------------------------------
// Plain files (one weight type for every matmul weight)

/// A file of geometry `g` with every 2-D weight in `ty` and everything else F32.
pub fn plain_file(g: &Geometry, vocab: &Vocab, ty: GgmlType, name: &str) -> Result<GgufWriter> {
    let specs = tensor_specs(g, vocab.tokens.len());
    let data = par_map(specs.len(), |i| {
        let s = &specs[i];
        let w = master(g.label, s);
        let t = match s.kind {
            Kind::Embed | Kind::Output | Kind::Matmul | Kind::AlphaBeta => ty,
            _ => GgmlType::F32,
        };
        encode(t, s.ne0(), &w).map(|b| (t, b))
    });
    let mut w = GgufWriter::new();
    set_metadata(&mut w, g, vocab, name, file_type_of(ty));
    for (s, d) in specs.iter().zip(data) {
        let (t, b) = d.with_context(|| s.name.clone())?;
        w.add_tensor(&s.name, &s.dims, t, b);
    }
    Ok(w)
}

// ---------------------------------------------------------------------------------------------
// PQ2_0 with a PrismML-style Hadamard fold

/// What a PQ2_0 file folds, and how.
pub struct FoldPlan {
    pub block: usize,
    /// `prism.hadamard.version` (2 = tied output, the embedding doubles as the folded LM head).
    pub version: u32,
    /// Store the unfoldable 2-D trunk weights in this type (Q8_0 for bench ffn_down).
    pub fallback: GgmlType,
    /// Type of the (unrotated) MTP block's 2-D weights.
    pub mtp_type: GgmlType,
}

impl FoldPlan {
    fn folds(&self, s: &Spec) -> bool {
        match s.kind {
            Kind::Output => s.ne0().is_multiple_of(self.block),
            Kind::Matmul => !s.mtp && s.ne0().is_multiple_of(self.block),
            _ => false,
        }
    }
}

/// Draws a PQ2_0 tensor directly: per 128-block a positive f16 scale around `target_std/0.84`
/// and codes mostly in {0,1,2} with about 1% code 3 (so all four levels occur).
fn draw_pq2_0(rng: &mut Rng, n: usize, target_std: f32) -> Vec<u8> {
    let mut out = Vec::with_capacity(n / fold::PQ2_0_BLOCK * fold::PQ2_0_BYTES);
    let mut codes = [0u8; fold::PQ2_0_BLOCK];
    for _ in 0..n / fold::PQ2_0_BLOCK {
        // E[(code-1)^2] ≈ 0.7, so d ≈ std / 0.84.
        let d = f16::from_f32(target_std / 0.84 * rng.uniform(0.7, 1.3));
        for c in codes.iter_mut() {
            let r = rng.below(300);
            *c = if r < 3 { 3 } else { (r % 3) as u8 };
        }
        out.extend_from_slice(&fold::encode_pq2_0_block(d, &codes));
    }
    out
}

pub struct Pq2File {
    pub file: GgufWriter,
    /// The F32 twin in plain llama.cpp semantics (None when not asked for).
    pub twin: Option<GgufWriter>,
    pub folded: Vec<String>,
    pub sign_widths: Vec<usize>,
}

pub fn pq2_0_file(
    g: &Geometry,
    vocab: &Vocab,
    plan: &FoldPlan,
    name: &str,
    with_twin: bool,
) -> Result<Pq2File> {
    let specs = tensor_specs(g, vocab.tokens.len());
    let folded: Vec<String> = specs
        .iter()
        .filter(|s| plan.folds(s))
        .map(|s| s.name.clone())
        .collect();
    let mut sign_widths: Vec<usize> = specs
        .iter()
        .filter(|s| plan.folds(s) || s.kind == Kind::Embed)
        .map(|s| s.ne0())
        .collect();
    sign_widths.sort_unstable();
    sign_widths.dedup();
    if !g.n_embd.is_multiple_of(plan.block) {
        bail!(
            "n_embd {} is not a multiple of the Hadamard block {}",
            g.n_embd,
            plan.block
        );
    }
    let signs: Vec<Vec<i32>> = sign_widths
        .iter()
        .map(|&wd| {
            let mut rng = Rng::for_label(SEED, &format!("{}/pq2_0/signs/{wd}", g.label));
            (0..wd)
                .map(|_| if rng.below(2) == 0 { 1 } else { -1 })
                .collect()
        })
        .collect();
    let sign_of = |wd: usize| &signs[sign_widths.iter().position(|&x| x == wd).unwrap()];
    let h = fold::dense_h(plan.block);

    // (type, stored bytes, twin f32)
    let data = par_map(
        specs.len(),
        |i| -> Result<(GgmlType, Vec<u8>, Option<Vec<f32>>)> {
            let s = &specs[i];
            let (ne0, n) = (s.ne0(), s.n());
            if plan.folds(s) || s.kind == Kind::Embed {
                let mut rng = Rng::for_label(SEED, &format!("{}/pq2_0/codes/{}", g.label, s.name));
                let std = if s.kind == Kind::Embed {
                    0.577
                } else {
                    1.0 / (ne0 as f32).sqrt()
                };
                let bytes = draw_pq2_0(&mut rng, n, std);
                let twin = with_twin.then(|| {
                    let row_bytes = ne0 / fold::PQ2_0_BLOCK * fold::PQ2_0_BYTES;
                    let mut t = Vec::with_capacity(n);
                    for rb in bytes.chunks(row_bytes) {
                        let latent = fold::decode_pq2_0_row(rb);
                        let mut w = fold::unfold_row(&h, plan.block, sign_of(ne0), &latent);
                        if s.is_ssm_out() {
                            // gdn_v_grouped: the stored columns are in grouped V-head order.
                            w = fold::grouped_to_tiled(&w, ne0 / g.n_v, g.n_k, g.n_v / g.n_k);
                        }
                        t.extend_from_slice(&w);
                    }
                    t
                });
                return Ok((GgmlType::PQ2_0, bytes, twin));
            }
            let w = master(g.label, s);
            let (ty, bytes, twin) = match s.kind {
                Kind::AlphaBeta => {
                    let b = bf16_bytes(&w);
                    let t = with_twin.then(|| bf16_decode(&b));
                    (GgmlType::BF16, b, t)
                }
                Kind::Matmul | Kind::Output => {
                    let ty = if s.mtp { plan.mtp_type } else { plan.fallback };
                    let b = match ty {
                        GgmlType::F16 => f16_bytes(&w),
                        _ => encode(ty, ne0, &w)?,
                    };
                    let t = match ty {
                        GgmlType::F16 => with_twin.then(|| f16_decode(&b)),
                        _ if with_twin => {
                            bail!("no independent decoder for twin of {} in {ty:?}", s.name)
                        }
                        _ => None,
                    };
                    (ty, b, t)
                }
                _ => {
                    let b = f32_bytes(&w);
                    (GgmlType::F32, b, with_twin.then_some(w))
                }
            };
            Ok((ty, bytes, twin))
        },
    );

    let mut file = GgufWriter::new();
    set_metadata(&mut file, g, vocab, name, file_type_of(GgmlType::PQ2_0));
    let p = "prism.hadamard";
    file.set(&format!("{p}.version"), Value::U32(plan.version));
    if plan.version >= 2 {
        file.set(&format!("{p}.tied_output"), Value::Bool(true));
    }
    file.set(&format!("{p}.block_size"), Value::U32(plan.block as u32));
    file.set(
        &format!("{p}.transform"),
        Value::String("normalized-sylvester-walsh-hadamard".into()),
    );
    file.set(
        &format!("{p}.axis"),
        Value::String("input-last-dimension".into()),
    );
    file.set(&format!("{p}.sign_mode"), Value::String("explicit".into()));
    let widths: Vec<i32> = sign_widths.iter().map(|&x| x as i32).collect();
    file.set(&format!("{p}.sign_widths"), Value::i32_array(&widths));
    let all_signs: Vec<i32> = signs.concat();
    file.set(&format!("{p}.sign_values"), Value::i32_array(&all_signs));
    file.set(&format!("{p}.weight_names"), Value::str_array(&folded));
    file.set(
        &format!("{p}.inverse_weight_names"),
        Value::str_array(&["token_embd.weight"]),
    );
    file.set(&format!("{p}.gdn_v_grouped"), Value::Bool(true));

    let mut twin = with_twin.then(|| {
        let mut t = GgufWriter::new();
        set_metadata(&mut t, g, vocab, &format!("{name} (F32 twin)"), 0);
        t
    });
    for (s, d) in specs.iter().zip(data) {
        let (ty, bytes, tw) = d.with_context(|| s.name.clone())?;
        file.add_tensor(&s.name, &s.dims, ty, bytes);
        if let (Some(t), Some(tw)) = (twin.as_mut(), tw) {
            t.add_f32(&s.name, &s.dims, &tw);
        }
    }
    Ok(Pq2File {
        file,
        twin,
        folded,
        sign_widths,
    })
}

// ---------------------------------------------------------------------------------------------
// The tiny set

pub struct Fixture {
    pub file: String,
    pub writer: GgufWriter,
    pub twin: Option<(String, GgufWriter)>,
    pub tokens: Vec<u32>,
    pub has_mtp: bool,
    pub tied: bool,
    pub weight_type: GgmlType,
    pub geometry: &'static str,
}

fn tokens_for(g: &Geometry, vocab: &Vocab) -> Vec<u32> {
    let mut rng = Rng::for_label(SEED, &format!("{}/tokens", g.label));
    (0..N_TOKENS)
        .map(|_| rng.below(vocab.n_learned as u64) as u32)
        .collect()
}

/// The vocabulary size of the tiny fixtures.
pub fn tiny_vocab_size() -> usize {
    vocab::build(N_MERGES, 0).tokens.len()
}

/// Builds every tiny fixture in memory (no I/O), in manifest order.
pub fn tiny_set() -> Result<(Vec<Fixture>, Vec<String>)> {
    let vocab = vocab::build(N_MERGES, 0);
    let mut out = Vec::new();
    let geoms = [
        (
            Geometry::tiny(),
            vec![
                GgmlType::F32,
                GgmlType::F16,
                GgmlType::BF16,
                GgmlType::Q8_0,
                GgmlType::Q4_0,
            ],
        ),
        (Geometry::tiny_tied(), vec![GgmlType::F32, GgmlType::Q8_0]),
    ];
    for (g, types) in &geoms {
        let tokens = tokens_for(g, &vocab);
        for &ty in types {
            let file = format!("{}-{}.gguf", g.label, type_name(ty).to_lowercase());
            let name = format!(
                "tern {} fixture ({}, random weights)",
                g.label,
                type_name(ty)
            );
            out.push(Fixture {
                writer: plain_file(g, &vocab, ty, &name)?,
                file,
                twin: None,
                tokens: tokens.clone(),
                has_mtp: g.mtp,
                tied: g.tied,
                weight_type: ty,
                geometry: g.label,
            });
        }
    }
    let g = Geometry::tiny();
    let plan = FoldPlan {
        block: 64,
        version: 1,
        fallback: GgmlType::F16,
        mtp_type: GgmlType::F16,
    };
    let pq = pq2_0_file(
        &g,
        &vocab,
        &plan,
        "tern tiny fixture (PQ2_0, Hadamard-folded, random codes)",
        true,
    )?;
    out.push(Fixture {
        file: "tiny-pq2_0.gguf".into(),
        writer: pq.file,
        twin: Some(("tiny-pq2_0.twin-f32.gguf".into(), pq.twin.unwrap())),
        tokens: tokens_for(&g, &vocab),
        has_mtp: g.mtp,
        tied: g.tied,
        weight_type: GgmlType::PQ2_0,
        geometry: g.label,
    });
    Ok((out, pq.folded))
}

// ---------------------------------------------------------------------------------------------
// Writing

pub fn sha256_file(path: &Path) -> Result<String> {
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        h.update(&buf[..n]);
    }
    Ok(h.finalize().iter().map(|b| format!("{b:02x}")).collect())
}

/// Writes, re-opens with tern's reader, and returns (bytes, sha256).
pub fn write_checked(w: &GgufWriter, path: &Path) -> Result<(u64, String)> {
    w.write(path)
        .with_context(|| format!("writing {}", path.display()))?;
    let g = Gguf::open(path).with_context(|| format!("re-opening {}", path.display()))?;
    if g.architecture() != Some("qwen35") {
        bail!("{}: architecture did not round-trip", path.display());
    }
    let bytes = g.file_len();
    drop(g);
    let sha = sha256_file(path)?;
    println!(
        "{:<34} {:>12} bytes  sha256 {sha}",
        path.file_name().unwrap().to_string_lossy(),
        bytes
    );
    Ok((bytes, sha))
}

pub fn write_tiny(dir: &Path) -> Result<()> {
    std::fs::create_dir_all(dir)?;
    let (set, folded) = tiny_set()?;
    let mut entries = Vec::new();
    for fx in &set {
        let (bytes, sha) = write_checked(&fx.writer, &dir.join(&fx.file))?;
        let twin_sha = match &fx.twin {
            Some((tn, tw)) => Some(write_checked(tw, &dir.join(tn))?.1),
            None => None,
        };
        entries.push(serde_json::json!({
            "file": fx.file,
            "twin": fx.twin.as_ref().map(|t| t.0.clone()),
            "twin_sha256": twin_sha,
            "tokens": fx.tokens,
            "sha256": sha,
            "bytes": bytes,
            "has_mtp": fx.has_mtp,
            "tied": fx.tied,
            "weight_type": type_name(fx.weight_type),
            "geometry": fx.geometry,
        }));
    }
    let manifest = serde_json::json!({
        "generator": "cargo xtask fixtures",
        "seed": format!("{SEED:#018x}"),
        "fixtures": entries,
    });
    let path = dir.join("manifest.json");
    std::fs::write(&path, serde_json::to_string_pretty(&manifest)? + "\n")?;
    println!("{:<34} (manifest)", "manifest.json");
    println!(
        "tiny-pq2_0 folded ({}): {}",
        folded.len(),
        folded.join(", ")
    );
    Ok(())
}

pub fn write_bench(dir: &Path) -> Result<()> {
    let dir: PathBuf = dir.join("bench");
    std::fs::create_dir_all(&dir)?;
    let g = Geometry::bench_0_8b();
    let t0 = std::time::Instant::now();
    let vocab = vocab::build_exact(N_MERGES, 248_320);
    let mut entries = Vec::new();
    {
        let w = plain_file(
            &g,
            &vocab,
            GgmlType::Q8_0,
            "tern bench-0.8b (Q8_0, random weights)",
        )?;
        let path = dir.join("bench-0.8b-q8_0.gguf");
        let (bytes, sha) = write_checked(&w, &path)?;
        entries.push(serde_json::json!({"file": "bench-0.8b-q8_0.gguf", "bytes": bytes, "sha256": sha, "weight_type": "Q8_0"}));
    }
    let plan = FoldPlan {
        block: 1024,
        version: 2,
        fallback: GgmlType::Q8_0,
        mtp_type: GgmlType::Q8_0,
    };
    let pq = pq2_0_file(
        &g,
        &vocab,
        &plan,
        "tern bench-0.8b (PQ2_0, Hadamard-folded, random codes)",
        false,
    )?;
    let path = dir.join("bench-0.8b-pq2_0.gguf");
    let (bytes, sha) = write_checked(&pq.file, &path)?;
    entries.push(serde_json::json!({
        "file": "bench-0.8b-pq2_0.gguf", "bytes": bytes, "sha256": sha, "weight_type": "PQ2_0",
        "sign_widths": pq.sign_widths, "folded": pq.folded,
    }));
    // The same model as PTQ1_0 (1.75 bits a weight), for the PTQ1_0 kernels' rows of the
    // table: every PQ2_0 tensor re-packed block by block, its scale kept and its codes with
    // the fourth level (+2, which PTQ1_0 cannot hold) clamped to +1. Random codes either way;
    // only the shapes and the bytes read matter to a timing.
    let src = Gguf::open(&path).with_context(|| format!("re-opening {}", path.display()))?;
    let tq = ptq1_0_of_pq2_0(
        &src,
        "tern bench-0.8b (PTQ1_0, Hadamard-folded, random codes)",
    )?;
    drop(src);
    let path = dir.join("bench-0.8b-ptq1_0.gguf");
    let (bytes, sha) = write_checked(&tq, &path)?;
    entries.push(serde_json::json!({
        "file": "bench-0.8b-ptq1_0.gguf", "bytes": bytes, "sha256": sha, "weight_type": "PTQ1_0",
        "from": "bench-0.8b-pq2_0.gguf",
    }));
    let manifest = serde_json::json!({"seed": format!("{SEED:#018x}"), "fixtures": entries});
    std::fs::write(
        dir.join("manifest.json"),
        serde_json::to_string_pretty(&manifest)? + "\n",
    )?;
    let unfolded: Vec<&str> = [
        "ffn_down (ne0 3584 is not a multiple of 1024: Q8_0)",
        "blk.24.* MTP (Q8_0)",
        "ssm_alpha/ssm_beta (BF16)",
    ]
    .to_vec();
    println!(
        "bench-0.8b-pq2_0: {} folded tensors (+ token_embd inverse), sign widths {:?}; unfolded: {}",
        pq.folded.len(),
        pq.sign_widths,
        unfolded.join("; ")
    );
    println!("bench files written in {:.1}s", t0.elapsed().as_secs_f64());
    Ok(())
}

/// `src` (a PQ2_0 file) with its PQ2_0 tensors stored as PTQ1_0: per block the same scale and
/// the codes 0..3 (element j at bits 2(j % 4) of byte j / 4) with 3 taken as 2.
fn ptq1_0_of_pq2_0(src: &Gguf, name: &str) -> Result<GgufWriter> {
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        let v = match k.as_str() {
            // As train_demo's PTQ1_0 file: loaders read the tensor types, not this.
            "general.file_type" => Value::U32(142),
            "general.name" => Value::String(name.into()),
            _ => v.clone(),
        };
        w.set(k, v);
    }
    for t in src.tensors() {
        let data = src.tensor_data(t);
        if t.ty != GgmlType::PQ2_0 {
            w.add_tensor(&t.name, &t.dims, t.ty, data.to_vec());
            continue;
        }
        let mut out = Vec::with_capacity(data.len() / fold::PQ2_0_BYTES * fold::PTQ1_0_BYTES);
        let mut codes = [0u8; 128];
        for b in data.chunks_exact(fold::PQ2_0_BYTES) {
            for (j, c) in codes.iter_mut().enumerate() {
                *c = ((b[2 + j / 4] >> (2 * (j % 4))) & 3).min(2);
            }
            let d = f16::from_le_bytes([b[0], b[1]]);
            out.extend_from_slice(&fold::encode_ptq1_0_block(d, &codes));
        }
        w.add_tensor(&t.name, &t.dims, GgmlType::PTQ1_0, out);
    }
    Ok(w)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiny_set_is_deterministic() {
        let (a, _) = tiny_set().unwrap();
        let (b, _) = tiny_set().unwrap();
        assert_eq!(a.len(), b.len());
        for (x, y) in a.iter().zip(&b) {
            assert!(
                x.writer.to_bytes() == y.writer.to_bytes(),
                "{} differs between runs",
                x.file
            );
            if let (Some(tx), Some(ty)) = (&x.twin, &y.twin) {
                assert!(
                    tx.1.to_bytes() == ty.1.to_bytes(),
                    "{} differs between runs",
                    tx.0
                );
            }
            assert_eq!(x.tokens, y.tokens);
        }
    }

    #[test]
    fn layer_pattern_and_shapes() {
        let g = Geometry::tiny();
        let attn: Vec<usize> = (0..g.n_layer).filter(|&i| g.is_attn(i)).collect();
        assert_eq!(attn, [3, 7]);
        let specs = tensor_specs(&g, 500);
        let find = |n: &str| specs.iter().find(|s| s.name == n).unwrap().dims.clone();
        assert_eq!(find("blk.3.attn_q.weight"), [128, 256]);
        assert_eq!(find("blk.0.attn_qkv.weight"), [128, 256]);
        assert_eq!(find("blk.0.ssm_conv1d.weight"), [4, 256]);
        assert_eq!(find("blk.0.ssm_out.weight"), [128, 128]);
        assert_eq!(find("blk.8.nextn.eh_proj.weight"), [256, 128]);
        assert!(specs.iter().any(|s| s.name == "output.weight"));
        let gt = Geometry::tiny_tied();
        let specs = tensor_specs(&gt, 500);
        assert!(!specs
            .iter()
            .any(|s| s.name == "output.weight" || s.name.starts_with("blk.4.")));
        assert_eq!(
            specs
                .iter()
                .find(|s| s.name == "blk.1.attn_k.weight")
                .unwrap()
                .dims,
            [128, 32]
        );
    }
}
