//! The planner against memory-ledger.md's test vectors, on header-only GGUFs of the real
//! Ternary-Bonsai-2 9B and 27B geometries (written sparse: the tensor data is a hole, so a
//! 7 GB file costs only its header on disk).

mod scratch;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use tern::cli::fit::{run_to, FitArgs};
use tern::config::Settings;
use tern::gguf::{Gguf, GgufWriter, Value};
use tern::plan::{
    self, fit, Budget, FlashAttn, KvType, Ledger, PlanError, Shape, SpecType, Term, MIB,
};
use tern::tensor::GgmlType;

/// The 3090's addressable memory (the driver's free figure).
const BUDGET_MIB: u64 = 24_123;
/// The 9B's projector as a header-only Qwen3-VL tower (its geometry: width 1152, 27 layers,
/// ff 4304, 16 heads, patch 16, a 48 × 48 position grid, a 4608-wide merger into n_embd
/// 4096), Q8_0 matrices (ffn_down F16, as its rows are not whole blocks) beside F16 patch
/// kernels and F32 norms, biases and positions: the
/// deployment's 624,229,664-byte file also carries deepstack mergers, which a qwen35 model
/// cannot use (and tern refuses), so this one is the part of it that runs.
struct Tower {
    width: u64,
    layers: usize,
    ff: u64,
    heads: u64,
    patch: u64,
    image_size: u64,
}

const TOWER_9B: Tower = Tower {
    width: 1152,
    layers: 27,
    ff: 4304,
    heads: 16,
    patch: 16,
    image_size: 768,
};

struct Geo {
    name: &'static str,
    n_layer: usize,
    mtp: bool,
    /// Declare nextn_predict_layers without writing the nextn tensors (a ghost drafter).
    mtp_ghost: bool,
    n_embd: u64,
    n_ff: u64,
    n_head: u64,
    n_kv: u64,
    hd: u64,
    n_k: u64,
    n_v: u64,
    d: u64,
    conv: u64,
    vocab: u64,
    ctx: u32,
    /// ssm_alpha / ssm_beta storage type.
    ab: GgmlType,
    /// Matmul type of the MTP block.
    mtp_ty: GgmlType,
    /// Type of the trunk's matrices, the embedding table and the output head.
    ty: GgmlType,
}

const B9: Geo = Geo {
    name: "Ternary-Bonsai-2-9B-PQ2_0-MTP",
    n_layer: 32,
    mtp: true,
    mtp_ghost: false,
    n_embd: 4096,
    n_ff: 12288,
    n_head: 16,
    n_kv: 4,
    hd: 256,
    n_k: 16,
    n_v: 32,
    d: 128,
    conv: 4,
    vocab: 248_320,
    ctx: 262_144,
    ab: GgmlType::F32,
    mtp_ty: GgmlType::Q8_0,
    ty: GgmlType::PQ2_0,
};

const B27: Geo = Geo {
    name: "Ternary-Bonsai-2-27B-PQ2_0",
    n_layer: 64,
    mtp: false,
    mtp_ghost: false,
    n_embd: 5120,
    n_ff: 17408,
    n_head: 24,
    n_kv: 4,
    hd: 256,
    n_k: 16,
    n_v: 48,
    d: 128,
    conv: 4,
    vocab: 248_320,
    ctx: 262_144,
    ab: GgmlType::F16,
    mtp_ty: GgmlType::Q8_0,
    ty: GgmlType::PQ2_0,
};

/// A small file whose metadata declares an MTP layer that has no tensors.
const GHOST: Geo = Geo {
    name: "ghost-mtp",
    n_layer: 4,
    mtp: true,
    mtp_ghost: true,
    n_embd: 256,
    n_ff: 512,
    n_head: 2,
    n_kv: 1,
    hd: 128,
    n_k: 2,
    n_v: 2,
    d: 64,
    conv: 4,
    vocab: 1024,
    ctx: 4096,
    ab: GgmlType::F32,
    mtp_ty: GgmlType::Q8_0,
    ty: GgmlType::PQ2_0,
};

fn dir() -> PathBuf {
    scratch::dir("plan")
}

/// Writes (once per process, atomically) the header-only GGUF of `g`.
fn write_model(g: &Geo) -> PathBuf {
    let a = "qwen35";
    let mut w = GgufWriter::new();
    let u = |x: u64| Value::U32(x as u32);
    let inner = g.n_v * g.d;
    let conv_dim = 2 * g.n_k * g.d + inner;
    let blocks = g.n_layer + g.mtp as usize;
    w.set("general.architecture", Value::String(a.into()));
    w.set("general.name", Value::String(g.name.into()));
    w.set("general.file_type", Value::U32(141));
    w.set(&format!("{a}.context_length"), Value::U32(g.ctx));
    w.set(&format!("{a}.embedding_length"), u(g.n_embd));
    w.set(&format!("{a}.block_count"), u(blocks as u64));
    w.set(&format!("{a}.feed_forward_length"), u(g.n_ff));
    w.set(&format!("{a}.attention.head_count"), u(g.n_head));
    w.set(&format!("{a}.attention.head_count_kv"), u(g.n_kv));
    w.set(&format!("{a}.attention.key_length"), u(g.hd));
    w.set(&format!("{a}.attention.value_length"), u(g.hd));
    w.set(
        &format!("{a}.attention.layer_norm_rms_epsilon"),
        Value::F32(1e-6),
    );
    w.set(&format!("{a}.rope.freq_base"), Value::F32(10_000_000.0));
    w.set(&format!("{a}.rope.dimension_count"), u(64));
    w.set(
        &format!("{a}.rope.dimension_sections"),
        Value::i32_array(&[11, 11, 10, 0]),
    );
    w.set(&format!("{a}.full_attention_interval"), u(4));
    w.set(&format!("{a}.ssm.conv_kernel"), u(g.conv));
    w.set(&format!("{a}.ssm.state_size"), u(g.d));
    w.set(&format!("{a}.ssm.group_count"), u(g.n_k));
    w.set(&format!("{a}.ssm.time_step_rank"), u(g.n_v));
    w.set(&format!("{a}.ssm.inner_size"), u(inner));
    if g.mtp {
        w.set(&format!("{a}.nextn_predict_layers"), Value::U32(1));
    }
    let (e, v, ff) = (g.n_embd, g.vocab, g.n_ff);
    let pq = g.ty;
    let f32 = GgmlType::F32;
    w.add_sparse("token_embd.weight", &[e, v], pq);
    for il in 0..blocks {
        let mtp = il >= g.n_layer;
        if mtp && g.mtp_ghost {
            break;
        }
        let mm = if mtp { g.mtp_ty } else { pq };
        let p = |s: &str| format!("blk.{il}.{s}");
        w.add_sparse(&p("attn_norm.weight"), &[e], f32);
        if mtp || (il + 1) % 4 == 0 {
            w.add_sparse(&p("attn_q.weight"), &[e, 2 * g.n_head * g.hd], mm);
            w.add_sparse(&p("attn_k.weight"), &[e, g.n_kv * g.hd], mm);
            w.add_sparse(&p("attn_v.weight"), &[e, g.n_kv * g.hd], mm);
            w.add_sparse(&p("attn_output.weight"), &[g.n_head * g.hd, e], mm);
            w.add_sparse(&p("attn_q_norm.weight"), &[g.hd], f32);
            w.add_sparse(&p("attn_k_norm.weight"), &[g.hd], f32);
        } else {
            w.add_sparse(&p("attn_qkv.weight"), &[e, conv_dim], mm);
            w.add_sparse(&p("attn_gate.weight"), &[e, inner], mm);
            w.add_sparse(&p("ssm_conv1d.weight"), &[g.conv, conv_dim], f32);
            w.add_sparse(&p("ssm_dt.bias"), &[g.n_v], f32);
            w.add_sparse(&p("ssm_a"), &[g.n_v], f32);
            w.add_sparse(&p("ssm_beta.weight"), &[e, g.n_v], g.ab);
            w.add_sparse(&p("ssm_alpha.weight"), &[e, g.n_v], g.ab);
            w.add_sparse(&p("ssm_norm.weight"), &[g.d], f32);
            w.add_sparse(&p("ssm_out.weight"), &[inner, e], mm);
        }
        w.add_sparse(&p("post_attention_norm.weight"), &[e], f32);
        w.add_sparse(&p("ffn_gate.weight"), &[e, ff], mm);
        w.add_sparse(&p("ffn_up.weight"), &[e, ff], mm);
        w.add_sparse(&p("ffn_down.weight"), &[ff, e], mm);
        if mtp {
            w.add_sparse(&p("nextn.eh_proj.weight"), &[2 * e, e], mm);
            w.add_sparse(&p("nextn.enorm.weight"), &[e], f32);
            w.add_sparse(&p("nextn.hnorm.weight"), &[e], f32);
            w.add_sparse(&p("nextn.shared_head_norm.weight"), &[e], f32);
        }
    }
    w.add_sparse("output_norm.weight", &[e], f32);
    w.add_sparse("output.weight", &[e, v], pq);
    let path = dir().join(format!("{}.gguf", g.name));
    let tmp = dir().join(format!("{}.gguf.{}", g.name, std::process::id()));
    w.write(&tmp).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    path
}

/// Writes (once per process, atomically) the header-only projector GGUF of `t` for a text
/// model of width `n_embd`.
fn write_mmproj(name: &str, t: &Tower, n_embd: u64) -> PathBuf {
    let mut w = GgufWriter::new();
    let u = |x: u64| Value::U32(x as u32);
    let v = |k: &str| format!("clip.vision.{k}");
    w.set("general.architecture", Value::String("clip".into()));
    w.set(
        "clip.projector_type",
        Value::String("qwen3vl_merger".into()),
    );
    w.set("clip.has_vision_encoder", Value::Bool(true));
    w.set("clip.use_gelu", Value::Bool(true));
    w.set(&v("embedding_length"), u(t.width));
    w.set(&v("feed_forward_length"), u(t.ff));
    w.set(&v("block_count"), u(t.layers as u64));
    w.set(&v("attention.head_count"), u(t.heads));
    w.set(&v("attention.layer_norm_epsilon"), Value::F32(1e-6));
    w.set(&v("patch_size"), u(t.patch));
    w.set(&v("image_size"), u(t.image_size));
    w.set(&v("projection_dim"), u(n_embd));
    w.set(&v("spatial_merge_size"), u(2));
    w.set(&v("image_mean"), Value::f32_array(&[0.5; 3]));
    w.set(&v("image_std"), Value::f32_array(&[0.5; 3]));
    let (e, p, q8, f16, f32) = (
        t.width,
        t.patch,
        GgmlType::Q8_0,
        GgmlType::F16,
        GgmlType::F32,
    );
    let side = t.image_size / p;
    w.add_sparse("v.patch_embd.weight", &[p, p, 3, e], f16);
    w.add_sparse("v.patch_embd.weight.1", &[p, p, 3, e], f16);
    w.add_sparse("v.patch_embd.bias", &[e], f32);
    w.add_sparse("v.position_embd.weight", &[e, side * side], f32);
    let mut wb = |name: &str, dims: &[u64], bias: u64, ty: GgmlType| {
        w.add_sparse(&format!("{name}.weight"), dims, ty);
        w.add_sparse(&format!("{name}.bias"), &[bias], f32);
    };
    for il in 0..t.layers {
        let b = |s: &str| format!("v.blk.{il}.{s}");
        wb(&b("ln1"), &[e], e, f32);
        wb(&b("ln2"), &[e], e, f32);
        wb(&b("attn_qkv"), &[e, 3 * e], 3 * e, q8);
        wb(&b("attn_out"), &[e, e], e, q8);
        wb(&b("ffn_up"), &[e, t.ff], t.ff, q8);
        // 4304 is not a whole number of Q8_0 blocks: converters keep ffn_down in F16.
        let down = if t.ff.is_multiple_of(32) { q8 } else { f16 };
        wb(&b("ffn_down"), &[t.ff, e], e, down);
    }
    wb("v.post_ln", &[e], e, f32);
    wb("mm.0", &[4 * e, 4 * e], 4 * e, q8);
    wb("mm.2", &[4 * e, n_embd], n_embd, q8);
    let path = dir().join(name);
    let tmp = dir().join(format!("{name}.{}", std::process::id()));
    w.write(&tmp).unwrap();
    std::fs::rename(&tmp, &path).unwrap();
    path
}

fn model_9b() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| write_model(&B9))
}
/// The 9B geometry with PTQ1_0 matrices (a file name seen in the wild; its layout assumed).
fn model_9b_ptq1_0() -> &'static Path {
    const B9T: Geo = Geo {
        name: "Ternary-Bonsai-2-9B-PTQ1_0-MTP",
        ty: GgmlType::PTQ1_0,
        ..B9
    };
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| write_model(&B9T))
}
fn model_27b() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| write_model(&B27))
}
fn mmproj_9b() -> &'static Path {
    static P: OnceLock<PathBuf> = OnceLock::new();
    P.get_or_init(|| write_mmproj("Ternary-Bonsai-2-9B-mmproj-Q8_0.gguf", &TOWER_9B, B9.n_embd))
}
fn open(p: &Path) -> std::sync::Arc<Gguf> {
    std::sync::Arc::new(Gguf::open(p).unwrap())
}

/// MiB with the doc's two decimals: compared exactly in hundredths.
fn hundredths(bytes: u64) -> u64 {
    (bytes * 100 + MIB / 2) / MIB
}
fn assert_mib(bytes: u64, mib: f64, what: &str) {
    assert_eq!(
        hundredths(bytes),
        (mib * 100.0).round() as u64,
        "{what}: {bytes} B = {} MiB, expected {mib}",
        plan::mib(bytes)
    );
}

fn shape(parallel: u64, slot: u64, k: KvType, v: KvType) -> Shape {
    Shape {
        ctx_size: parallel * slot,
        parallel,
        cache_type_k: k,
        cache_type_v: v,
        flash_attn: FlashAttn::On,
        ..Shape::default()
    }
}

/// Images of at most 768 tokens (examples/zealot.yaml): at llama.cpp's default 4,096 the
/// encoder's worst case does not fit beside the rest of the seed's shape, and at 1,024 it does
/// not with the adapter too.
const SEED_IMAGE_MAX_TOKENS: u64 = 768;

/// The seed's current shape: 3 × 200,704, f16 K + q8_0 V, MTP depth 2, batch 6144 / ubatch
/// 1024, flash attention on, the Q8_0 projector with images of at most 768 tokens.
fn seed_shape() -> Shape {
    Shape {
        spec: SpecType::DraftMtp,
        draft_n_max: 2,
        ubatch_size: 1024,
        batch_size: 6144,
        mmproj: Some(mmproj_9b().to_path_buf()),
        image_max_tokens: Some(SEED_IMAGE_MAX_TOKENS),
        backend: plan::BackendKind::Cuda,
        ..shape(3, 200_704, KvType::F16, KvType::Q8_0)
    }
}

fn price(p: &Path, s: &Shape) -> Ledger {
    Ledger::price(&open(p), s).unwrap_or_else(|e| panic!("{e}"))
}

// ---------------------------------------------------------------------------------------------
// Geometry and the KV rate

#[test]
fn geometry_9b_and_27b() {
    let l = price(model_9b(), &shape(1, 4096, KvType::F16, KvType::F16));
    let g = &l.geometry;
    assert_eq!(
        (g.n_layer, g.n_full_attn, g.n_gdn, g.n_nextn),
        (32, 8, 24, 1)
    );
    assert_eq!(g.kv_elems_per_token, 8192);
    assert_eq!(g.context_length, 262_144);
    let l = price(model_27b(), &shape(1, 4096, KvType::F16, KvType::F16));
    let g = &l.geometry;
    assert_eq!(
        (g.n_layer, g.n_full_attn, g.n_gdn, g.n_nextn),
        (64, 16, 48, 0)
    );
    assert_eq!(g.kv_elems_per_token, 16_384);
}

#[test]
fn kv_vectors_9b() {
    let m = model_9b();
    // f16 K + q8_0 V: 16,384 + 8,704 = 25,088 B/token; pool 602,112 -> 14,406.00 MiB.
    let l = price(m, &shape(3, 200_704, KvType::F16, KvType::Q8_0));
    assert_eq!(l.bytes(Term::Kv), 602_112 * 25_088);
    assert_mib(l.bytes(Term::Kv), 14_406.00, "kv f16/q8_0");
    assert_mib(l.part(Term::Kv, "K").unwrap(), 9_408.00, "K f16");
    assert_mib(l.part(Term::Kv, "V").unwrap(), 4_998.00, "V q8_0");
    // f16 pair: 32,768 B/token.
    let l = price(m, &shape(3, 200_704, KvType::F16, KvType::F16));
    assert_eq!(l.bytes(Term::Kv), 602_112 * 32_768);
    assert_mib(l.bytes(Term::Kv), 18_816.00, "kv f16/f16 @602,112");
    let l = price(m, &shape(2, 262_144, KvType::F16, KvType::F16));
    assert_mib(l.bytes(Term::Kv), 16_384.00, "kv f16/f16 @524,288");
    let l = price(m, &shape(3, 262_144, KvType::F16, KvType::F16));
    assert_mib(l.bytes(Term::Kv), 24_576.00, "kv f16/f16 @786,432");
    // q8_0 pair: 17,408 B/token.
    let l = price(m, &shape(3, 262_144, KvType::Q8_0, KvType::Q8_0));
    assert_eq!(l.bytes(Term::Kv), 786_432 * 17_408);
    assert_mib(l.bytes(Term::Kv), 13_056.00, "kv q8_0/q8_0 @786,432");
    // Only full-attention layers bill: no drafting, no draft KV line.
    assert!(l.line(Term::DraftKv).is_none());
}

#[test]
fn draft_kv_and_recurrent_vectors_9b() {
    let m = model_9b();
    let mut s = shape(3, 200_704, KvType::F16, KvType::Q8_0);
    s.spec = SpecType::DraftMtp;
    s.draft_n_max = 2;
    let l = price(m, &s);
    // One layer, 4 × 256 × 2 B × 2 caches = 4,096 B/position over the whole pool.
    assert_eq!(l.bytes(Term::DraftKv), 602_112 * 4_096);
    assert_mib(l.bytes(Term::DraftKv), 2_352.00, "draft kv @602,112");
    // 3 slots × (1 + 2) copies × 50.25 MiB.
    assert_eq!(l.geometry.recurrent_bytes_per_slot, 52_690_944);
    assert_mib(
        l.geometry.recurrent_bytes_per_slot,
        50.25,
        "recurrent per slot",
    );
    assert_mib(
        l.bytes(Term::Recurrent),
        452.25,
        "recurrent 3 slots depth 2",
    );

    let mut s = shape(3, 262_144, KvType::Q8_0, KvType::Q8_0);
    s.spec = SpecType::DraftMtp;
    s.draft_n_max = 3;
    assert_mib(
        price(m, &s).bytes(Term::DraftKv),
        3_072.00,
        "draft kv @786,432",
    );
    // The draft cache at its own dtypes.
    s.spec_draft_type_k = KvType::Q8_0;
    s.spec_draft_type_v = KvType::Q8_0;
    assert_eq!(price(m, &s).bytes(Term::DraftKv), 786_432 * 2_176);

    let l = price(m, &shape(3, 200_704, KvType::F16, KvType::Q8_0));
    assert_mib(l.bytes(Term::Recurrent), 150.75, "recurrent 3 slots");
    let l = price(m, &shape(2, 262_144, KvType::F16, KvType::F16));
    assert_mib(l.bytes(Term::Recurrent), 100.50, "recurrent 2 slots");
}

#[test]
fn kv_and_recurrent_vectors_27b() {
    let m = model_27b();
    let l = price(m, &shape(2, 200_704, KvType::Q8_0, KvType::Q8_0));
    assert_eq!(l.bytes(Term::Kv), 401_408 * 34_816);
    assert_mib(l.bytes(Term::Kv), 13_328.00, "27B kv q8_0 pair @401,408");
    let l = price(m, &shape(2, 200_704, KvType::F16, KvType::F16));
    assert_mib(l.bytes(Term::Kv), 25_088.00, "27B kv f16 pair @401,408");
    let l = price(m, &shape(2, 200_704, KvType::Q4_0, KvType::Q4_0));
    assert_mib(l.bytes(Term::Kv), 7_056.00, "27B kv q4_0 pair @401,408");
    // 48 × (3 × 10,240 + 128 × 128 × 48) × 4 B ≈ 149.6 MiB per slot; 299 for two.
    assert_eq!(
        l.geometry.recurrent_bytes_per_slot,
        48 * (3 * 10_240 + 128 * 128 * 48) * 4
    );
    assert_mib(
        l.geometry.recurrent_bytes_per_slot,
        149.63,
        "27B recurrent per slot",
    );
    assert_mib(l.bytes(Term::Recurrent), 299.25, "27B recurrent 2 slots");
}

#[test]
fn weights_match_the_real_files() {
    // 9B: the boot showed weights 2,283.29 + 257.66 (host) MiB; the file is 2,675,410,720 B,
    // the difference being the header (a 248,320-token vocabulary and its merges).
    // The stored bytes (the CPU reads them in place) are llama.cpp's figure; tern's f32 copies
    // of the small weights are a part of their own.
    // The serving path holds its Q8_0 and PQ2_0 matrices (where the CPU packs them) as packed
    // copies of the same bytes instead of the mapping's; the reference path (`--cpu-exact`)
    // and the serving path without packing (`--no-repack`) map them all.
    let l = price(model_9b(), &shape(1, 4096, KvType::F16, KvType::F16));
    let packed = l.part(Term::Weights, "packed").unwrap_or(0);
    for in_place in [
        Shape {
            cpu_exact: true,
            ..shape(1, 4096, KvType::F16, KvType::F16)
        },
        Shape {
            repack: false,
            ..shape(1, 4096, KvType::F16, KvType::F16)
        },
    ] {
        let exact = price(model_9b(), &in_place);
        assert_eq!(exact.part(Term::Weights, "packed"), None);
        assert_eq!(
            exact.part(Term::Weights, "mapped"),
            Some(l.part(Term::Weights, "mapped").unwrap() + packed)
        );
        assert_eq!(exact.bytes(Term::Weights), l.bytes(Term::Weights));
    }
    let w = l.part(Term::Weights, "mapped").unwrap() + packed;
    let copies = l.part(Term::Weights, "allocated").unwrap();
    assert_eq!(l.bytes(Term::Weights), w + copies);
    assert!(copies < 16 * MIB, "small-weight copies {copies}");
    let boot = (2_283.29 + 257.66) * MIB as f64;
    assert!(
        (w as f64 - boot).abs() <= 0.02 * MIB as f64,
        "9B weights {} MiB vs the boot's 2,540.95",
        plan::mib(w)
    );
    let file = 2_675_410_720u64;
    assert!(
        w < file && file - w < 16 * MIB,
        "9B weights {w} vs file {file}"
    );
    let detail = &l.line(Term::Weights).unwrap().detail;
    assert!(detail.contains("PQ2_0 ×202"), "{detail}");

    // 27B: the projection said 6,539 MiB of model on the device (token_embd stays on the host).
    let g = open(model_27b());
    let l = Ledger::price(&g, &shape(1, 4096, KvType::F16, KvType::F16)).unwrap();
    let w = l.part(Term::Weights, "mapped").unwrap() + l.part(Term::Weights, "packed").unwrap_or(0);
    let embd = g.tensor("token_embd.weight").unwrap().nbytes;
    assert_eq!(
        (w - embd) / MIB,
        6_539,
        "27B device weights {}",
        plan::mib(w - embd)
    );
    let file = 7_206_168_928u64;
    assert!(
        w < file && file - w < 16 * MIB,
        "27B weights {w} vs file {file}"
    );
}

// ---------------------------------------------------------------------------------------------
// The projector: priced before the fit check (the seeds' ~1.4 GiB went unpriced)

#[test]
fn prices_the_projector_weights_and_its_worst_case_encode() {
    let pg = open(mmproj_9b());
    let pos = pg.tensor("v.position_embd.weight").unwrap().nbytes;
    let all: u64 = pg.tensors().iter().map(|t| t.nbytes).sum();
    let with = |backend, max: Option<u64>| Shape {
        mmproj: Some(mmproj_9b().to_path_buf()),
        image_max_tokens: max,
        backend,
        ..shape(1, 4096, KvType::F16, KvType::F16)
    };
    // cuda: every tensor the tower uploads as stored (its norms and biases are F32 already);
    // the position grid stays on the host, outside the device's budget.
    let l = price(model_9b(), &with(plan::BackendKind::Cuda, None));
    assert_eq!(l.bytes(Term::Projector), all - pos, "{}", l.table());
    // The encode of the largest image the default 4096 tokens allow: 16,384 patches, replayed
    // through the pool's power-of-two classes: im2col 48 MiB -> 64, the 72 MiB residual rows
    // -> 128 (six live at the widest point: x, a temporary, a, rotated q and k, d), qkv 216
    // -> 256, the MLP's two 269 MiB rows -> 512 each, the rotary table 4.5 -> 8, the GELU
    // table 0.25, and a second 64 MiB class for the merger's output beside the im2col.
    let vc = l.line(Term::VisionCompute).unwrap();
    assert!(vc.estimated);
    assert_mib(
        vc.bytes,
        64.0 + 6.0 * 128.0 + 256.0 + 2.0 * 512.0 + 8.0 + 0.25 + 64.0,
        "vision compute, cuda, 4096 tokens",
    );
    // A smaller limit shrinks the encoder, never the weights.
    let small = price(model_9b(), &with(plan::BackendKind::Cuda, Some(256)));
    assert_eq!(small.bytes(Term::Projector), all - pos);
    assert!(
        small.bytes(Term::VisionCompute) * 8 < vc.bytes,
        "{}",
        small.table()
    );
    // cpu: read in place from the mapping (or packed, the same bytes: the serving path's Q8_0
    // matrices), plus the decoded small weights and the grid.
    let l = price(model_9b(), &with(plan::BackendKind::Cpu, None));
    let packed = l.part(Term::Projector, "packed").unwrap_or(0);
    assert_eq!(
        l.part(Term::Projector, "mapped").map(|m| m + packed),
        Some(all - pos)
    );
    assert_eq!(l.part(Term::Projector, "position"), Some(pos));
    // The cpu heap's widest step: a layer's eight residual-wide rows and two MLP rows.
    let widest = 16_384 * (8 * 1152 + 2 * 4304) * 4;
    assert_eq!(l.part(Term::VisionCompute, "widest"), Some(widest));
    // An absurd limit prices as a huge (refused) figure, never a wrapped or panicking one.
    for backend in [plan::BackendKind::Cuda, plan::BackendKind::Cpu] {
        let huge = price(model_9b(), &with(backend, Some(u64::MAX)));
        assert!(
            huge.bytes(Term::VisionCompute) > 1 << 50,
            "{}",
            huge.table()
        );
    }
    // A maximum under the minimum is refused before anything is priced, naming both.
    let mut bad = with(plan::BackendKind::Cuda, Some(100));
    bad.image_min_tokens = Some(200);
    let e = Ledger::price(&open(model_9b()), &bad)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("projector") && e.contains("100") && e.contains("200"),
        "{e}"
    );
    // A projector for another text model is refused by the planner too.
    let other = write_mmproj("mmproj-for-4096-wide-text.gguf", &TOWER_9B, 5120);
    let e = Ledger::price(
        &open(model_9b()),
        &Shape {
            mmproj: Some(other),
            ..shape(1, 4096, KvType::F16, KvType::F16)
        },
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("projection_dim = 5120") && e.contains("4096"),
        "{e}"
    );
}

// ---------------------------------------------------------------------------------------------
// The verdicts of memory-ledger.md on the 3090's 24,123 MiB

#[test]
fn accepts_the_seed_shape() {
    let g = open(model_9b());
    let f = fit(&g, &seed_shape(), &Budget::mib(BUDGET_MIB)).unwrap();
    let l = &f.ledger;
    assert_mib(l.bytes(Term::Kv), 14_406.00, "kv");
    assert_mib(l.bytes(Term::DraftKv), 2_352.00, "draft kv");
    assert_mib(l.bytes(Term::Recurrent), 452.25, "recurrent");
    assert!(l.bytes(Term::Projector) > 400 * MIB, "{}", f.table());
    assert!(l.line(Term::VisionCompute).unwrap().estimated);
    assert!(l.line(Term::Compute).unwrap().estimated);
    assert!(l.line(Term::DraftCompute).unwrap().estimated);
    assert!(!l.line(Term::Kv).unwrap().estimated);
    assert!(f.verdict.fits, "{}", f.table());
    assert_eq!(f.verdict.margin, 1024 * MIB);
    assert!(f.suggestions.is_empty());
    // With a 4 MiB adapter too (the seeds' is 3 MB): rank-4 F16 pairs on every trunk layer's
    // ffn_down, priced as the pairs the backend (cuda here) holds, to the byte.
    let mut a = GgufWriter::new();
    a.set("general.architecture", Value::String("qwen35".into()));
    a.set("general.type", Value::String("adapter".into()));
    a.set("adapter.type", Value::String("lora".into()));
    a.set("adapter.lora.alpha", Value::F32(8.0));
    let (r, mut want) = (4u64, 0u64);
    for il in 0..B9.n_layer {
        let name = format!("blk.{il}.ffn_down.weight");
        a.add_sparse(&format!("{name}.lora_a"), &[B9.n_ff, r], GgmlType::F16);
        a.add_sparse(&format!("{name}.lora_b"), &[r, B9.n_embd], GgmlType::F16);
        // lora_b's rows are 4 wide: like a conv tap, it is decoded to f32 once at upload.
        want += r * B9.n_ff * 2 + r * B9.n_embd * 4;
    }
    let path = dir().join("adapter.gguf");
    a.write(&path).unwrap();
    let mut s = seed_shape();
    s.lora = vec![path];
    let f = fit(&g, &s, &Budget::mib(BUDGET_MIB)).unwrap();
    assert_eq!(f.ledger.bytes(Term::Lora), want, "{}", f.table());
    assert!(want > 4_000_000 && want < 6_000_000);
    println!("{}", f.table());
    assert!(f.verdict.fits, "{}", f.table());
}

/// The seeds' trap: the projector charged after the fit. Priced first, the seed's shape with
/// images of llama.cpp's default 4,096 tokens does not fit; the refusal offers a smaller
/// --image-max-tokens (the largest that fits) and dropping the projector.
#[test]
fn refuses_the_seed_shape_with_4096_token_images() {
    let g = open(model_9b());
    let mut s = seed_shape();
    s.image_max_tokens = None;
    let budget = Budget::mib(BUDGET_MIB);
    let f = fit(&g, &s, &budget).unwrap();
    println!("{}", f.table());
    assert!(!f.verdict.fits);
    let images = f
        .suggestions
        .iter()
        .find(|x| x.flags.starts_with("--image-max-tokens "))
        .unwrap_or_else(|| panic!("no --image-max-tokens in\n{}", f.table()));
    let n = images.shape.image_max_tokens.unwrap();
    assert!(
        images.fits && (SEED_IMAGE_MAX_TOKENS..4096).contains(&n),
        "{n}"
    );
    assert_eq!(images.flags, format!("--image-max-tokens {n}"));
    // The largest that fits: one more token would not.
    let mut bigger = images.shape.clone();
    bigger.image_max_tokens = Some(n + 1);
    assert!(!fit(&g, &bigger, &budget).unwrap().verdict.fits);
    let drop = f
        .suggestions
        .iter()
        .find(|x| x.flags == "drop --mmproj")
        .unwrap();
    assert!(drop.fits && drop.saving > images.saving);
    // Without a projector the same shape fits with room to spare: the projector is the cost.
    assert!(drop.shape.mmproj.is_none());
}

#[test]
fn refuses_f16_v_with_the_drafter_at_602112() {
    let g = open(model_9b());
    let mut s = seed_shape();
    s.cache_type_v = KvType::F16;
    let f = fit(&g, &s, &Budget::mib(BUDGET_MIB)).unwrap();
    assert!(!f.verdict.fits, "{}", f.table());
    // Refused on its own terms: without the projector and with no margin at all.
    s.mmproj = None;
    s.margin_mib = 0;
    let f = fit(&g, &s, &Budget::mib(BUDGET_MIB)).unwrap();
    assert!(!f.verdict.fits, "{}", f.table());
}

#[test]
fn refuses_f16_pair_at_786432() {
    let g = open(model_9b());
    let s = Shape {
        margin_mib: 0,
        ..shape(3, 262_144, KvType::F16, KvType::F16)
    };
    let f = fit(&g, &s, &Budget::mib(BUDGET_MIB)).unwrap();
    assert!(!f.verdict.fits);
    // The KV alone exceeds the budget before any weight.
    assert!(f.ledger.bytes(Term::Kv) > BUDGET_MIB * MIB);
    // The retired shape that replaced it (q8_0 pair at the same pool) fits.
    let s = shape(3, 262_144, KvType::Q8_0, KvType::Q8_0);
    assert!(fit(&g, &s, &Budget::mib(BUDGET_MIB)).unwrap().verdict.fits);
}

#[test]
fn refusal_lists_the_cheapest_changes_repriced() {
    let g = open(model_9b());
    let mut s = seed_shape();
    s.cache_type_v = KvType::F16;
    let budget = Budget::mib(BUDGET_MIB);
    let f = fit(&g, &s, &budget).unwrap();
    assert!(!f.suggestions.is_empty());
    let find = |c: &str| {
        f.suggestions
            .iter()
            .find(|x| x.change.starts_with(c))
            .unwrap_or_else(|| panic!("no {c:?} in {}", f.table()))
    };
    // q8_0 V hands back exactly 4,410 MiB at this pool, and fits.
    let q = find("q8_0 V");
    assert_mib(q.saving, 4_410.00, "q8_0 V saving");
    assert!(q.fits);
    assert_eq!(q.flags, "--cache-type-v q8_0");
    // Drafting off: the draft cache, two of three recurrent copies, the draft buffers.
    let d = find("drafting off");
    assert!(d.saving > (2_352 + 301) * MIB, "{}", plan::mib(d.saving));
    // One slot fewer keeps the 200,704 window.
    let o = find("one slot fewer");
    assert_eq!(o.shape.parallel, 2);
    assert_eq!(o.shape.ctx_size, 401_408);
    assert!(o.fits);
    // The smaller pool is the largest that fits: one more grain would not.
    let p = find("a smaller pool");
    assert!(p.fits && p.shape.ctx_size < s.ctx_size);
    let mut bigger = p.shape.clone();
    bigger.ctx_size += 256 * bigger.parallel;
    assert!(!fit(&g, &bigger, &budget).unwrap().verdict.fits);
    find("no projector");
    find("a smaller ubatch");
    // Every suggestion is a re-pricing of its shape.
    for x in &f.suggestions {
        let v = fit(&g, &x.shape, &budget).unwrap().verdict;
        assert_eq!(v.needed, x.needed, "{}", x.change);
        assert_eq!(v.fits, x.fits, "{}", x.change);
        assert_eq!(f.verdict.needed - x.needed, x.saving, "{}", x.change);
    }
    // Those that fit come first, least given up first.
    let fits: Vec<_> = f.suggestions.iter().take_while(|x| x.fits).collect();
    assert!(fits.windows(2).all(|w| w[0].saving <= w[1].saving));
    assert!(f.suggestions[fits.len()..].iter().all(|x| !x.fits));
}

/// Where the CPU packs (AVX-512 VNNI), a PTQ1_0 file's matrices are held as PQ2_0 blocks, 34
/// bytes for each 28 of the file; `--no-repack` prices them in place, and a refusal that only
/// the packed copies cause names it, re-priced.
#[test]
fn packed_ptq1_0_is_priced_and_no_repack_is_offered() {
    let g = open(model_9b_ptq1_0());
    let s = shape(1, 4096, KvType::F16, KvType::F16);
    let packed = price(model_9b_ptq1_0(), &s);
    let in_place_shape = Shape {
        repack: false,
        ..s.clone()
    };
    let in_place = price(model_9b_ptq1_0(), &in_place_shape);
    assert_eq!(in_place.part(Term::Weights, "packed"), None);
    if packed.part(Term::Weights, "packed").is_none() {
        eprintln!("this CPU does not pack: nothing more to compare");
        return;
    }
    let ternary: u64 = g
        .tensors()
        .iter()
        .filter(|t| t.ty == GgmlType::PTQ1_0)
        .map(|t| t.nbytes)
        .sum();
    assert!(ternary > 0);
    assert_eq!(
        packed.bytes(Term::Weights) - in_place.bytes(Term::Weights),
        ternary / 28 * 6
    );
    let roomy = Budget::mib(1 << 30);
    let need = fit(&g, &in_place_shape, &roomy).unwrap().verdict.needed;
    let budget = Budget::mib(need.div_ceil(MIB));
    let f = fit(&g, &s, &budget).unwrap();
    assert!(!f.verdict.fits, "{}", f.table());
    let x = f
        .suggestions
        .iter()
        .find(|x| x.flags == "--no-repack")
        .unwrap_or_else(|| panic!("no --no-repack in {}", f.table()));
    assert!(x.fits && !x.shape.repack);
    assert_eq!(x.saving, ternary / 28 * 6);
    // A PQ2_0 file packs into its own bytes: nothing to offer.
    let g9 = open(model_9b());
    let need = fit(&g9, &s, &roomy).unwrap().verdict.needed;
    let f = fit(&g9, &s, &Budget::mib(need / MIB - 1)).unwrap();
    assert!(f.suggestions.iter().all(|x| x.flags != "--no-repack"));
}

// ---------------------------------------------------------------------------------------------
// Validation

#[test]
fn ctx_must_divide_evenly() {
    let mut s = shape(3, 200_704, KvType::F16, KvType::Q8_0);
    s.ctx_size += 1;
    let e = Ledger::price(&open(model_9b()), &s).unwrap_err();
    assert!(matches!(e, PlanError::CtxNotDivisible { .. }));
    let m = e.to_string();
    assert!(m.contains("602113") && m.contains("parallel 3"), "{m}");
}

#[test]
fn slot_must_not_exceed_the_trained_window() {
    let s = shape(3, 262_145, KvType::Q8_0, KvType::Q8_0);
    let e = Ledger::price(&open(model_9b()), &s).unwrap_err();
    let m = e.to_string();
    assert!(matches!(e, PlanError::SlotTooLong { .. }), "{m}");
    assert!(m.contains("262145") && m.contains("262144"), "{m}");
}

#[test]
fn quantized_v_needs_flash_attention() {
    let g = open(model_9b());
    let mut s = shape(3, 200_704, KvType::F16, KvType::Q8_0);
    s.flash_attn = FlashAttn::Off;
    let m = Ledger::price(&g, &s).unwrap_err().to_string();
    assert!(m.contains("flash-attn off") && m.contains("q8_0"), "{m}");
    // f16 V is fine without it; auto takes the flash path.
    s.cache_type_v = KvType::F16;
    Ledger::price(&g, &s).unwrap();
    s.cache_type_v = KvType::Q4_0;
    s.flash_attn = FlashAttn::Auto;
    Ledger::price(&g, &s).unwrap();
    // The draft cache's V obeys the same rule.
    let mut s = seed_shape();
    s.flash_attn = FlashAttn::Off;
    s.cache_type_v = KvType::F16;
    s.spec_draft_type_v = KvType::Q4_0;
    let m = Ledger::price(&g, &s).unwrap_err().to_string();
    assert!(m.contains("spec-draft-type-v"), "{m}");
}

#[test]
fn drafting_needs_an_mtp_block() {
    let mut s = shape(2, 200_704, KvType::Q8_0, KvType::Q8_0);
    s.spec = SpecType::DraftMtp;
    let e = Ledger::price(&open(model_27b()), &s).unwrap_err();
    assert!(matches!(e, PlanError::DraftWithoutMtp { .. }), "{e}");
    assert!(e.to_string().contains("MTP"), "{e}");
    // Declared but absent: a ghost drafter is refused too.
    let ghost = write_model(&GHOST);
    let mut s = shape(1, 4096, KvType::F16, KvType::F16);
    s.spec = SpecType::DraftMtp;
    let e = Ledger::price(&open(&ghost), &s).unwrap_err();
    assert!(matches!(e, PlanError::MtpTensorsMissing { .. }), "{e}");
    s.spec = SpecType::None;
    Ledger::price(&open(&ghost), &s).unwrap();
}

#[test]
fn zero_sizes_and_missing_files_are_errors() {
    let g = open(model_9b());
    for f in [
        |s: &mut Shape| s.parallel = 0,
        |s: &mut Shape| s.ctx_size = 0,
        |s: &mut Shape| s.ubatch_size = 0,
        |s: &mut Shape| {
            s.spec = SpecType::DraftMtp;
            s.draft_n_max = 0
        },
    ] {
        let mut s = shape(1, 4096, KvType::F16, KvType::F16);
        f(&mut s);
        let e = Ledger::price(&g, &s).unwrap_err();
        assert!(matches!(e, PlanError::Zero { .. }), "{e}");
    }
    let mut s = shape(1, 4096, KvType::F16, KvType::F16);
    s.mmproj = Some(dir().join("no-such-mmproj.gguf"));
    let m = Ledger::price(&g, &s).unwrap_err().to_string();
    assert!(
        m.contains("projector") && m.contains("no-such-mmproj.gguf"),
        "{m}"
    );
    // Absurd sizes saturate instead of overflowing, and are refused.
    let s = Shape {
        parallel: 1 << 40,
        ctx_size: 1 << 58,
        ..shape(1, 1, KvType::F32, KvType::F32)
    };
    let f = fit(&g, &s, &Budget::mib(BUDGET_MIB)).unwrap();
    assert!(!f.verdict.fits);
}

#[test]
fn budget_sources() {
    assert_eq!(
        plan::Budget::mib(24_123).bytes,
        24_123 * MIB,
        "--device-mib is MiB"
    );
    for b in [
        plan::BackendKind::Wgpu,
        plan::BackendKind::Cuda,
        plan::BackendKind::Auto,
    ] {
        let m = Budget::resolve(b, None).unwrap_err().to_string();
        assert!(m.contains("--device-mib") && m.contains(b.name()), "{m}");
        assert_eq!(Budget::resolve(b, Some(100)).unwrap().bytes, 100 * MIB);
    }
    if Path::new("/proc/meminfo").exists() {
        let b = Budget::resolve(plan::BackendKind::Cpu, None).unwrap();
        assert!(b.bytes > 0 && b.source.contains("MemAvailable"));
    }
    let text = "MemTotal:       24000000 kB\nMemAvailable:   12345678 kB\n";
    assert_eq!(
        tern::plan::parse_mem_available(text),
        Some(12_345_678 * 1024)
    );
    assert_eq!(tern::plan::parse_mem_available("MemFree: 1 kB"), None);
}

// ---------------------------------------------------------------------------------------------
// The report: table, JSON, and the `tern fit` command body

fn fit_args(settings: Settings, json: bool) -> FitArgs {
    FitArgs {
        config: None,
        json,
        settings,
    }
}

fn seed_settings() -> Settings {
    Settings {
        model: Some(model_9b().to_path_buf()),
        mmproj: Some(mmproj_9b().to_path_buf()),
        image_max_tokens: Some(SEED_IMAGE_MAX_TOKENS as i64),
        ctx_size: Some(602_112),
        parallel: Some(3),
        cache_type_k: Some(KvType::F16),
        cache_type_v: Some(KvType::Q8_0),
        flash_attn: Some(FlashAttn::On),
        batch_size: Some(6144),
        ubatch_size: Some(1024),
        spec_type: Some(SpecType::DraftMtp),
        spec_draft_n_max: Some(2),
        backend: Some(plan::BackendKind::Cuda),
        device_mib: Some(BUDGET_MIB),
        ..Settings::default()
    }
}

#[test]
fn fit_command_prints_the_table_and_the_verdict() {
    let mut out = Vec::new();
    run_to(&fit_args(seed_settings(), false), &mut out).unwrap();
    let t = String::from_utf8(out).unwrap();
    println!("{t}");
    for want in [
        "14,406.00",
        "2,352.00",
        "452.25",
        "compute*",
        "581.79",
        "vision compute*",
        "24,123.00",
        "FITS",
        "estimated",
    ] {
        assert!(t.contains(want), "{want:?} missing in\n{t}");
    }

    let mut refused = seed_settings();
    refused.cache_type_v = Some(KvType::F16);
    let mut out = Vec::new();
    let e = run_to(&fit_args(refused, false), &mut out).unwrap_err();
    let t = String::from_utf8(out).unwrap();
    println!("{t}");
    assert!(e.to_string().contains("does not fit"), "{e}");
    for want in [
        "REFUSED",
        "cheapest changes",
        "--cache-type-v q8_0",
        "saves",
    ] {
        assert!(t.contains(want), "{want:?} missing in\n{t}");
    }
}

#[test]
fn fit_command_json() {
    let mut out = Vec::new();
    run_to(&fit_args(seed_settings(), true), &mut out).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["fits"], true);
    assert_eq!(v["budget_mib"], 24_123.0);
    assert_eq!(v["shape"]["n_ctx_slot"], 200_704);
    assert_eq!(v["shape"]["cache_type_v"], "q8_0");
    assert_eq!(v["shape"]["spec_type"], "draft-mtp");
    let lines = v["lines"].as_array().unwrap();
    let kv = lines.iter().find(|l| l["term"] == "kv").unwrap();
    assert_eq!(kv["mib"], 14_406.0);
    assert_eq!(kv["bytes"], 602_112u64 * 25_088);
    assert_eq!(kv["estimated"], false);
    let c = lines.iter().find(|l| l["term"] == "compute").unwrap();
    assert_eq!(c["estimated"], true);

    let mut refused = seed_settings();
    refused.cache_type_v = Some(KvType::F16);
    let mut out = Vec::new();
    assert!(run_to(&fit_args(refused, true), &mut out).is_err());
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["fits"], false);
    let s = v["suggestions"].as_array().unwrap();
    assert!(s
        .iter()
        .any(|x| x["flags"] == "--cache-type-v q8_0" && x["fits"] == true));
}

#[test]
fn fit_command_needs_a_budget_for_gpu_backends() {
    let mut s = seed_settings();
    s.device_mib = None;
    let e = run_to(&fit_args(s, false), &mut Vec::new()).unwrap_err();
    assert!(e.to_string().contains("--device-mib"), "{e}");
    let mut s = seed_settings();
    s.model = None;
    let e = run_to(&fit_args(s, false), &mut Vec::new()).unwrap_err();
    assert!(e.to_string().contains("--model"), "{e}");
}

#[test]
fn fit_from_the_shipped_config_with_flag_overrides() {
    // examples/zealot.yaml names the deployment's paths; flags point it at the test files.
    let cfg = Path::new(env!("CARGO_MANIFEST_DIR")).join("examples/zealot.yaml");
    let flags = Settings {
        model: Some(model_9b().to_path_buf()),
        mmproj: Some(mmproj_9b().to_path_buf()),
        ..Settings::default()
    };
    let args = FitArgs {
        config: Some(cfg.clone()),
        json: true,
        settings: flags.clone(),
    };
    let mut out = Vec::new();
    run_to(&args, &mut out).unwrap();
    let v: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(v["fits"], true);
    assert_eq!(v["shape"]["ctx_size"], 602_112);
    // A flag overrides the file: exact V is refused at this shape.
    let args = FitArgs {
        config: Some(cfg),
        json: false,
        settings: Settings {
            cache_type_v: Some(KvType::F16),
            ..flags
        },
    };
    assert!(run_to(&args, &mut Vec::new()).is_err());
}
