//! `tern perplexity` against stock llama-perplexity, and `tern kld` as a backend check.
//!
//! The golden (`fixtures/golden/perplexity.json`) is llama-perplexity's own figure on the F16
//! demo model over the held-out plays (`fixtures/demo/heldout.txt`), recorded by
//! `cargo xtask goldens` (tern never writes it), with llama.cpp's tokenization of the text.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde_json::Value;
use sha2::{Digest, Sha256};
use tern::backend::cpu::CpuBackend;
use tern::backend::{Backend, KvTypes};
use tern::eval::base::{self, BaseFile, Header};
use tern::eval::cli::{compare, perplexity_of, read_text, save_base, tokenize};
use tern::eval::score::Chunking;
use tern::gguf::Gguf;
use tern::model::Model;
use tern::tensor::GgmlType;

fn demo(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/demo")
        .join(name)
}

fn golden() -> Value {
    let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/golden/perplexity.json");
    let s = std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e} (run `cargo xtask goldens`)", p.display()));
    serde_json::from_str(&s).unwrap()
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

const F16_KV: KvTypes = KvTypes {
    k: GgmlType::F16,
    v: GgmlType::F16,
};

/// tern's figure for one recorded llama-perplexity run, after checking that the golden is
/// about these very files and that tern reads the text into llama.cpp's tokens.
fn check_run(name: &str) {
    let g = golden();
    let model = demo("demo-f16.gguf");
    let file = Arc::new(Gguf::open(&model).unwrap());
    assert_eq!(
        base::sha256_hex(file.bytes()),
        g["model"]["sha256"].as_str().unwrap(),
        "demo-f16.gguf is not the file the golden was recorded on"
    );
    let (text_id, text) = read_text(&demo("heldout.txt")).unwrap();
    assert_eq!(text_id.sha256, g["text"]["sha256"].as_str().unwrap());
    let (tokens, bos) = tokenize(&file, &text).unwrap();
    let bytes: Vec<u8> = tokens.iter().flat_map(|t| t.to_le_bytes()).collect();
    assert_eq!(
        tokens.len() as u64,
        g["tokens"]["count"].as_u64().unwrap(),
        "token count differs from llama.cpp's"
    );
    assert_eq!(
        hex(&Sha256::digest(&bytes)),
        g["tokens"]["sha256_u32le"].as_str().unwrap(),
        "tern's tokens differ from llama.cpp's"
    );
    let run = g["runs"]
        .as_array()
        .unwrap()
        .iter()
        .find(|r| r["name"] == name)
        .unwrap();
    let c = Chunking::new(
        tokens.len(),
        run["ctx"].as_u64().unwrap() as usize,
        run["batch"].as_u64().unwrap() as usize,
        run["chunks"].as_u64().map(|n| n as usize),
        bos,
    )
    .unwrap();
    assert_eq!(c.n_chunk as u64, run["n_chunk"].as_u64().unwrap());
    assert_eq!(c.n_seq as u64, run["n_seq"].as_u64().unwrap());
    let be = CpuBackend::new();
    let m = Model::load(&be, file).unwrap();
    let r = perplexity_of(&be, &m, &tokens, &c, F16_KV, |_, _| {}).unwrap();
    let (want, want_err) = (
        run["ppl"].as_f64().unwrap(),
        run["ppl_err"].as_f64().unwrap(),
    );
    let rel = (r.ppl - want).abs() / want;
    println!(
        "{name}: tern PPL = {:.4} +/- {:.5}, llama-perplexity {want:.4} +/- {want_err:.5} ({} chunks of {}): relative difference {rel:.2e} in {:.2} s",
        r.ppl,
        r.err.unwrap(),
        c.n_chunk,
        c.n_ctx,
        r.seconds
    );
    // The bound: the same number as llama-perplexity within 0.1%. (llama.cpp rounds
    // activations to F16 for F16 matmuls, tern keeps them f32; the figures still agree far
    // closer than this.)
    assert!(rel <= 1e-3, "tern {} vs llama-perplexity {want}", r.ppl);
    let err_rel = (r.err.unwrap() - want_err).abs() / want_err;
    assert!(err_rel <= 1e-2, "± {} vs {want_err}", r.err.unwrap());
    // The running estimate after every chunk, as printed.
    let running: Vec<f64> = run["running"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_f64().unwrap())
        .collect();
    assert_eq!(running.len(), r.running.len());
    for (i, (a, b)) in r.running.iter().zip(&running).enumerate() {
        assert!((a - b).abs() / b <= 2e-3, "[{}] tern {a} vs {b}", i + 1);
    }
}

#[test]
fn perplexity_equals_llama_perplexity() {
    check_run("ci");
}

/// The whole held-out text (297 chunks; about 25 s on two cores).
#[test]
fn perplexity_equals_llama_perplexity_on_the_whole_text() {
    check_run("full");
}

/// The committed held-out text is the training script's: its first tokens are the held-out
/// slice that `cargo xtask train-demo` recorded from the script's own validation ids.
#[test]
fn heldout_text_is_the_training_heldout() {
    let eval: Value =
        serde_json::from_str(&std::fs::read_to_string(demo("eval.json")).unwrap()).unwrap();
    let slice: Vec<u32> = eval["heldout_slice"]["tokens"]
        .as_array()
        .unwrap()
        .iter()
        .map(|v| v.as_u64().unwrap() as u32)
        .collect();
    let file = Gguf::open(demo("demo-f16.gguf")).unwrap();
    let (_, text) = read_text(&demo("heldout.txt")).unwrap();
    let (tokens, _) = tokenize(&file, &text).unwrap();
    assert_eq!(&tokens[..slice.len()], &slice[..]);
    // train_demo.py's count of held-out tokens (the file's trailing newline included).
    let (tokens, _) = tokenize(&file, &(text + "\n")).unwrap();
    assert_eq!(tokens.len(), 76_073);
}

/// A short base file of the demo F16 model on the CPU: 4 chunks of 64.
fn cpu_base(model: &str) -> BaseFile {
    let file = Arc::new(Gguf::open(demo(model)).unwrap());
    let (text_id, text) = read_text(&demo("heldout.txt")).unwrap();
    let (tokens, bos) = tokenize(&file, &text).unwrap();
    let c = Chunking::new(tokens.len(), 64, 256, Some(4), bos).unwrap();
    let be = CpuBackend::new();
    let m = Model::load(&be, file.clone()).unwrap();
    let header = Header {
        model: base::model_id(&file),
        tokenizer: base::tokenizer_id(&file, m.cfg.n_vocab),
        text: text_id,
        n_ctx: c.n_ctx,
        n_chunk: c.n_chunk,
        bos: c.bos,
        top_k: 32,
        backend: "cpu".into(),
        cache_type_k: "f16".into(),
        cache_type_v: "f16".into(),
        ppl: f64::NAN,
        ppl_err: None,
        tern_version: "test".into(),
    };
    save_base(&be, &m, &tokens, &c, F16_KV, header, &mut std::io::sink()).unwrap()
}

/// The backend check users run on their own GPU: the same file on a backend against the CPU
/// reference. A backend computes the same model, so the distributions nearly coincide.
fn backend_matches_the_cpu_reference<B: Backend>(be: &B) {
    let b = cpu_base("demo-f16.gguf");
    let h = &b.header;
    let c = Chunking {
        n_ctx: h.n_ctx,
        n_seq: 4,
        n_chunk: h.n_chunk,
        bos: h.bos,
    };
    let m = Model::load(be, Arc::new(Gguf::open(demo("demo-f16.gguf")).unwrap())).unwrap();
    let r = compare(be, &m, &b, &c, F16_KV, 0.95, &mut std::io::sink()).unwrap();
    println!(
        "{}: mean KL {:.3e}, max {:.3e}, top-1 {:.4}, PPL {:.4} vs {:.4}",
        be.name(),
        r.kld_mean.value,
        r.kld.max,
        r.top1.value,
        r.ppl.value,
        r.ppl_base.value
    );
    assert_eq!(r.positions, 4 * 31);
    // Reading its own file on the CPU, the candidate is the reference: only the base file's
    // f16 log-probs separate them.
    let (max_mean, min_top1) = if be.name() == "cpu" {
        (1e-6, 1.0)
    } else {
        (1e-4, 0.98)
    };
    assert!(r.kld_mean.value <= max_mean, "mean KL {}", r.kld_mean.value);
    assert!(r.top1.value >= min_top1, "top-1 {}", r.top1.value);
    assert!((r.ppl_ratio.value - 1.0).abs() < 1e-3);
}

per_backend!(backend_matches_the_cpu_reference);

/// A quantized candidate is measurably further from the reference than the reference itself,
/// and in the right order (Q8_0 close, the post-training ternary files far).
#[test]
fn quantized_candidates_order_by_distance() {
    let b = cpu_base("demo-f16.gguf");
    let be = CpuBackend::new();
    let h = &b.header;
    let c = Chunking {
        n_ctx: h.n_ctx,
        n_seq: 4,
        n_chunk: h.n_chunk,
        bos: h.bos,
    };
    let kl = |f: &str| {
        let m = Model::load(&be, Arc::new(Gguf::open(demo(f)).unwrap())).unwrap();
        compare(&be, &m, &b, &c, F16_KV, 0.95, &mut std::io::sink())
            .unwrap()
            .kld_mean
            .value
    };
    let (q8, pq2, ptq1) = (
        kl("demo-q8_0.gguf"),
        kl("demo-pq2_0.gguf"),
        kl("demo-ptq1_0.gguf"),
    );
    println!("mean KL from F16: Q8_0 {q8:.2e}, PQ2_0 {pq2:.4}, PTQ1_0 {ptq1:.4}");
    assert!(q8 > 1e-7 && q8 < 1e-3, "Q8_0 {q8}");
    assert!(pq2 > 0.1 && ptq1 > 0.1);
    // PTQ1_0 packs the PQ2_0 file's ternary codes (from the F16 rather than the F32 weights).
    assert!(
        (pq2 - ptq1).abs() < 0.05 * pq2,
        "PQ2_0 {pq2} vs PTQ1_0 {ptq1}"
    );
}
