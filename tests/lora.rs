//! LoRA adapters against stock llama.cpp (fixtures/golden/lora, `cargo xtask goldens`): the
//! logits of every position with each adapter at scales 0, 0.5, 1 and 2 and with two adapters
//! at once, on tiny-f32.gguf and on the Hadamard-folded tiny-pq2_0.gguf (whose golden is
//! llama.cpp on its F32 twin: the adapter sees the true input, not the folded one), and the
//! MTP block with an adapter against llama.cpp's own MTP graph. Scale 0 is the base model to
//! the bit. Rows of one batch at different scales each get their own. And the refusals: an
//! adapter for another architecture, one with a shape that does not match, a half-pair.

mod common;
mod scratch;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use tern::backend::{nmse, Backend};
use tern::gguf::{Gguf, GgufWriter, Value};
use tern::model::{BatchItem, Model};
use tern::tensor::GgmlType;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn manifest() -> serde_json::Value {
    let p = fixtures().join("golden/lora/manifest.json");
    let text = std::fs::read_to_string(&p)
        .unwrap_or_else(|e| panic!("{}: {e} (run `cargo xtask goldens`)", p.display()));
    serde_json::from_str(&text).unwrap()
}

fn golden(name: &str) -> Vec<f32> {
    tern::npy::read(fixtures().join("golden/lora").join(name))
        .unwrap_or_else(|e| panic!("{name}: {e}"))
        .0
}

fn adapter_path(file: &str) -> PathBuf {
    fixtures().join("lora").join(file)
}

/// The trunk (like the MTP head) with every weight and adapter in f32 arithmetic is the exact
/// f32 math of the file, as llama.cpp on the F32 model (and F32 adapter twin) is: only the order
/// of f32 sums differs (goldens.md: NMSE <= 1e-6 against an exact golden). Measured on cpu and
/// wgpu: 4e-8 to 1.3e-7 for the trunk (the base model alone is 7e-8), 7e-14 to 3e-13 for MTP.
const TOL: f64 = 1e-6;

fn argmax(r: &[f32]) -> usize {
    (0..r.len()).fold(0, |b, i| if r[i] > r[b] { i } else { b })
}

/// Top-1 equal wherever the golden's top-2 margin exceeds 1e-3.
fn check_close(what: &str, ours: &[f32], gold: &[f32], n_vocab: usize) {
    let e = nmse(ours, gold);
    let mut bad = Vec::new();
    for (p, (a, g)) in ours.chunks(n_vocab).zip(gold.chunks(n_vocab)).enumerate() {
        let mut s = g.to_vec();
        s.sort_by(|x, y| y.total_cmp(x));
        if s[0] - s[1] > 1e-3 && argmax(a) != argmax(g) {
            bad.push(p);
        }
    }
    println!("{what}: NMSE {e:.3e}, top-1 mismatches {}", bad.len());
    assert!(e <= TOL, "{what}: NMSE {e:e} > {TOL:e}");
    assert!(bad.is_empty(), "{what}: top-1 differs at {bad:?}");
}

/// Every position's logits for `tokens` with adapter scales `scales`.
fn logits<B: Backend>(be: &B, m: &Model<B>, tokens: &[u32], scales: &[f32]) -> Vec<f32> {
    let mut st = m.new_state(be);
    st.lora = scales.to_vec();
    be.to_host(&m.forward(be, &mut st, tokens, true).unwrap().logits)
}

fn goldens<B: Backend>(be: &B) {
    let man = manifest();
    for base in man["bases"].as_object().unwrap().values() {
        let file = base["file"].as_str().unwrap();
        let tokens: Vec<u32> = base["tokens"]
            .as_array()
            .unwrap()
            .iter()
            .map(|t| t.as_u64().unwrap() as u32)
            .collect();
        let mut m = Model::open(be, fixtures().join(file)).unwrap();
        let plain = logits(be, &m, &tokens, &[]);
        let files: Vec<String> = man["adapters"]
            .as_object()
            .unwrap()
            .keys()
            .cloned()
            .collect();
        for f in &files {
            m.add_adapter(be, adapter_path(f)).unwrap();
        }
        let nv = m.cfg.n_vocab;
        let idx = |f: &str| files.iter().position(|x| x == f).unwrap();
        for r in man["results"].as_array().unwrap() {
            if r["base"] != file {
                continue;
            }
            let mut scales = vec![0f32; files.len()];
            let what;
            if let Some(list) = r["adapters"].as_array() {
                for pair in list {
                    scales[idx(pair[0].as_str().unwrap())] = pair[1].as_f64().unwrap() as f32;
                }
                what = format!("{file} combo {list:?} [{}]", be.name());
            } else {
                let f = r["adapter"].as_str().unwrap();
                let s = r["scale"].as_f64().unwrap() as f32;
                scales[idx(f)] = s;
                what = format!("{file} + {f} at {s} [{}]", be.name());
            }
            let ours = logits(be, &m, &tokens, &scales);
            check_close(&what, &ours, &golden(r["golden"].as_str().unwrap()), nv);
            if scales.iter().all(|&s| s == 0.0) {
                assert_eq!(
                    ours, plain,
                    "{what}: scale 0 must be the base model exactly"
                );
            }
            if let Some(mtp) = r["mtp_golden"].as_str() {
                let hin = golden(r["mtp_h_in"].as_str().unwrap());
                let mut ms = m.new_mtp_state(be).unwrap();
                ms.lora = scales.clone();
                let h = be.from_host(&hin, tokens.len(), m.cfg.n_embd);
                let mo = be.to_host(&m.mtp_forward(be, &mut ms, &tokens, &h).unwrap().logits);
                check_close(&format!("{what} MTP head"), &mo, &golden(mtp), nv);
            }
        }
    }
}

/// Two sequences in one batch at different scales: each row gets its own, so the batch equals
/// the two runs apart.
fn per_row_scales<B: Backend>(be: &B) {
    let mut m = Model::open(be, fixtures().join("tiny-pq2_0.gguf")).unwrap();
    m.add_adapter(be, adapter_path("tiny-lora-r4-f32.gguf"))
        .unwrap();
    m.add_adapter(be, adapter_path("tiny-lora-r8-q8_0.gguf"))
        .unwrap();
    let (ta, tb): (Vec<u32>, Vec<u32>) = ((1..12).collect(), (40..47).collect());
    let (sa, sb) = (vec![1.0f32, 0.0], vec![0.5f32, 2.0]);
    let want_a = logits(be, &m, &ta, &sa);
    let want_b = logits(be, &m, &tb, &sb);
    let (mut a, mut b) = (m.new_state(be), m.new_state(be));
    a.lora = sa;
    b.lora = sb;
    let mut items = [
        BatchItem {
            seq: &mut a,
            tokens: &ta,
            image: None,
            all_rows: true,
            hidden_rows: false,
            snapshot: false,
        },
        BatchItem {
            seq: &mut b,
            tokens: &tb,
            image: None,
            all_rows: true,
            hidden_rows: false,
            snapshot: false,
        },
    ];
    let outs = m.forward_batch(be, &mut items).unwrap();
    let nv = m.cfg.n_vocab;
    for (o, (want, what)) in outs.iter().zip([(&want_a, "a"), (&want_b, "b")]) {
        let got = be.to_host(&o.logits);
        let e = nmse(&got, want);
        println!(
            "batched sequence {what} [{}]: NMSE {e:.3e} vs alone",
            be.name()
        );
        assert!(e <= 1e-10, "sequence {what}: NMSE {e:e}");
        assert_eq!(got.len(), want.len());
        let _ = nv;
    }
}

per_backend!(goldens, per_row_scales);

/// An adapter GGUF built in memory from pieces of a real one, to check the refusals.
fn doctored(edit: impl Fn(&Gguf, &mut GgufWriter)) -> Arc<Gguf> {
    let src = Gguf::open(adapter_path("tiny-lora-r4-f32.gguf")).unwrap();
    let mut w = GgufWriter::new();
    edit(&src, &mut w);
    Arc::new(Gguf::from_bytes("doctored.gguf", w.to_bytes()).unwrap())
}

fn copy_meta(src: &Gguf, w: &mut GgufWriter, skip: &str) {
    for (k, v) in src.metadata() {
        if k != skip {
            w.set(k, v.clone());
        }
    }
}

fn copy_tensors(src: &Gguf, w: &mut GgufWriter, keep: impl Fn(&str) -> bool) {
    for t in src.tensors() {
        if keep(&t.name) {
            w.add_tensor(&t.name, &t.dims, t.ty, src.tensor_data(t).to_vec());
        }
    }
}

#[test]
fn refusals_name_the_file_and_tensor() {
    let be = common::cpu();
    let base = Gguf::open(fixtures().join("tiny-f32.gguf")).unwrap();
    let n_layer = 8;
    let load = |g: Arc<Gguf>| {
        tern::model::lora::load_from(&be, g, &base, n_layer)
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default()
    };
    // Another architecture.
    let e = load(doctored(|s, w| {
        copy_meta(s, w, "general.architecture");
        w.set("general.architecture", Value::String("llama".into()));
        copy_tensors(s, w, |_| true);
    }));
    assert!(
        e.contains("doctored.gguf") && e.contains("llama") && e.contains("qwen35"),
        "{e}"
    );
    // Not an adapter.
    let e = load(doctored(|s, w| {
        copy_meta(s, w, "general.type");
        copy_tensors(s, w, |_| true);
    }));
    assert!(e.contains("general.type"), "{e}");
    // A half pair.
    let e = load(doctored(|s, w| {
        copy_meta(s, w, "");
        copy_tensors(s, w, |n| n != "blk.3.attn_q.weight.lora_b");
    }));
    assert!(
        e.contains("blk.3.attn_q.weight") && e.contains("missing one half"),
        "{e}"
    );
    // A shape that does not match the base: attn_k's pair under attn_q's name.
    let e = load(doctored(|s, w| {
        copy_meta(s, w, "");
        for t in s.tensors() {
            let name = if t.name.starts_with("blk.3.attn_q.weight") {
                continue;
            } else if t.name.starts_with("blk.3.attn_k.weight") {
                t.name.replace("attn_k", "attn_q")
            } else {
                t.name.clone()
            };
            w.add_tensor(&name, &t.dims, t.ty, s.tensor_data(t).to_vec());
        }
    }));
    assert!(
        e.contains("blk.3.attn_q.weight") && e.contains("shape mismatch"),
        "{e}"
    );
    // A tensor the base does not have.
    let e = load(doctored(|s, w| {
        copy_meta(s, w, "");
        copy_tensors(s, w, |_| true);
        w.add_tensor(
            "blk.99.attn_q.weight.lora_a",
            &[128, 4],
            GgmlType::F32,
            vec![0; 128 * 4 * 4],
        );
        w.add_tensor(
            "blk.99.attn_q.weight.lora_b",
            &[4, 256],
            GgmlType::F32,
            vec![0; 256 * 4 * 4],
        );
    }));
    assert!(
        e.contains("blk.99.attn_q.weight") && e.contains("does not exist"),
        "{e}"
    );
    // A file that is not a GGUF at all.
    let bad = scratch::dir("lora").join("bad.gguf");
    std::fs::write(&bad, b"not a gguf").unwrap();
    let e = tern::model::lora::load(&be, &bad, &base, n_layer)
        .err()
        .map(|e| e.to_string())
        .unwrap();
    let _ = std::fs::remove_file(&bad);
    assert!(e.contains(&*bad.to_string_lossy()), "{e}");
}
