//! Loading a qwen35 file: the config is validated with errors that name the key or tensor, the
//! layer rule is llama.cpp's, and a Hadamard-folded weight cannot be consumed without its
//! transform.

use std::path::Path;
use std::sync::Arc;

use tern::backend::cpu::CpuBackend;
use tern::gguf::{Gguf, GgufWriter, Value};
use tern::model::{Config, Model, ModelError};

fn fixture(name: &str) -> Gguf {
    Gguf::open(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("fixtures")
            .join(name),
    )
    .unwrap()
}

/// Rewrites a fixture with `edit` applied to its metadata and tensor list.
fn rewrite(
    src: &Gguf,
    edit_meta: impl Fn(&str, &Value) -> Option<Value>,
    extra: impl FnOnce(&mut GgufWriter),
) -> Gguf {
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        if let Some(v) = edit_meta(k, v) {
            w.set(k, v);
        }
    }
    for t in src.tensors() {
        w.add_tensor(&t.name, &t.dims, t.ty, src.tensor_data(t).to_vec());
    }
    extra(&mut w);
    Gguf::from_bytes("edited.gguf", w.to_bytes()).unwrap()
}

fn load_err(g: Gguf) -> String {
    match Model::load(&CpuBackend::new(), Arc::new(g)) {
        Ok(_) => panic!("expected the load to fail"),
        Err(e) => e.to_string(),
    }
}

#[test]
fn config_reads_the_fixture_geometry() {
    let c = Config::from_gguf(&fixture("tiny-f32.gguf")).unwrap();
    assert_eq!((c.n_layer_all, c.n_layer, c.n_nextn), (9, 8, 1));
    let attn: Vec<usize> = (0..c.n_layer).filter(|&i| !c.is_recurrent(i)).collect();
    assert_eq!(attn, vec![3, 7], "is_recr(i) = (i+1) % interval != 0");
    assert!(
        !c.is_recurrent(8),
        "the MTP block is never a trunk GDN layer"
    );
    assert_eq!((c.n_head, c.n_head_kv, c.head_dim, c.n_rot), (4, 2, 32, 16));
    assert_eq!((c.ssm_n_k, c.ssm_n_v, c.ssm_state), (2, 4, 32));
    assert!(!c.tied_output);
    let t = Config::from_gguf(&fixture("tiny-tied-f32.gguf")).unwrap();
    assert!(t.tied_output && !t.has_mtp());
    assert_eq!(
        (0..t.n_layer)
            .filter(|&i| !t.is_recurrent(i))
            .collect::<Vec<_>>(),
        vec![1, 3]
    );
}

#[test]
fn missing_and_inconsistent_keys_are_named() {
    let f = fixture("tiny-f32.gguf");
    let drop = |key: &'static str| rewrite(&f, move |k, v| (k != key).then(|| v.clone()), |_| {});
    let set = |key: &'static str, nv: Value| {
        rewrite(
            &f,
            move |k, v| Some(if k == key { nv.clone() } else { v.clone() }),
            |_| {},
        )
    };

    let e = load_err(drop("qwen35.ssm.state_size"));
    assert!(
        e.contains("missing metadata key \"qwen35.ssm.state_size\""),
        "{e}"
    );
    let e = load_err(drop("qwen35.rope.dimension_sections"));
    assert!(e.contains("qwen35.rope.dimension_sections"), "{e}");
    let e = load_err(set("qwen35.ssm.inner_size", Value::U32(100)));
    assert!(
        e.contains("qwen35.ssm.inner_size") && e.contains("100"),
        "{e}"
    );
    let e = load_err(set("qwen35.attention.head_count_kv", Value::U32(3)));
    assert!(
        e.contains("head_count_kv") && e.contains("does not divide"),
        "{e}"
    );
    let e = load_err(set("qwen35.attention.value_length", Value::U32(16)));
    assert!(e.contains("value_length"), "{e}");
    let e = load_err(set("qwen35.nextn_predict_layers", Value::U32(9)));
    assert!(e.contains("nextn_predict_layers"), "{e}");
    let e = load_err(set("qwen35.rope.dimension_count", Value::U32(15)));
    assert!(e.contains("rope.dimension_count"), "{e}");
    let e = load_err(set("qwen35.embedding_length", Value::String("wide".into())));
    assert!(
        e.contains("qwen35.embedding_length") && e.contains("string"),
        "{e}"
    );
    let e = load_err(set("general.architecture", Value::String("llama".into())));
    assert!(e.contains("llama"), "{e}");
    // A shape that disagrees with the metadata names the tensor.
    let e = load_err(set("qwen35.feed_forward_length", Value::U32(128)));
    assert!(e.contains("ffn_gate.weight") && e.contains("shape"), "{e}");
}

#[test]
fn missing_tensor_is_named() {
    let f = fixture("tiny-q8_0.gguf");
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        w.set(k, v.clone());
    }
    for t in f.tensors().iter().filter(|t| t.name != "blk.2.ssm_a") {
        w.add_tensor(&t.name, &t.dims, t.ty, f.tensor_data(t).to_vec());
    }
    let e = load_err(Gguf::from_bytes("m.gguf", w.to_bytes()).unwrap());
    assert!(e.contains("missing tensor \"blk.2.ssm_a\""), "{e}");
}

#[test]
fn a_folded_weight_the_model_does_not_consume_is_refused() {
    let f = fixture("tiny-pq2_0.gguf");
    // A foldable-kind tensor that qwen35 never reads (layer 20 does not exist): listing it as
    // folded must fail the coverage check rather than load and be silently ignored.
    let g = rewrite(
        &f,
        |k, v| {
            Some(if k == "prism.hadamard.weight_names" {
                let mut names = v.as_array().unwrap().to_vec();
                names.push(Value::String("blk.20.ffn_up.weight".into()));
                Value::Array(tern::gguf::ValueType::String, names)
            } else {
                v.clone()
            })
        },
        |w| {
            let src = f.tensor("blk.0.ffn_up.weight").unwrap();
            w.add_tensor(
                "blk.20.ffn_up.weight",
                &src.dims,
                src.ty,
                f.tensor_data(src).to_vec(),
            );
        },
    );
    let e = load_err(g);
    assert!(
        e.contains("blk.20.ffn_up.weight") && e.contains("without its activation transform"),
        "{e}"
    );
}

#[test]
fn the_transform_is_what_makes_pq2_0_right() {
    // The same bytes with the fold metadata stripped load (as llama.cpp would), but the
    // logits are garbage next to the folded run: proof that `matmul` applied the transform.
    let f = fixture("tiny-pq2_0.gguf");
    let be = CpuBackend::new();
    let plain = rewrite(
        &f,
        |k, v| (!k.starts_with("prism.")).then(|| v.clone()),
        |_| {},
    );
    let folded = Model::load(&be, Arc::new(f)).unwrap();
    let unfolded = Model::load(&be, Arc::new(plain)).unwrap();
    assert!(folded.hadamard.is_some() && unfolded.hadamard.is_none());
    let toks = [5u32, 17, 200, 33];
    let a = folded
        .forward(&be, &mut folded.new_state(&be), &toks, true)
        .unwrap()
        .logits;
    let b = unfolded
        .forward(&be, &mut unfolded.new_state(&be), &toks, true)
        .unwrap()
        .logits;
    assert!(tern::backend::nmse(&b.data, &a.data) > 0.1);
}

#[test]
fn bad_token_ids_are_errors() {
    let be = CpuBackend::new();
    let m = Model::load(&be, Arc::new(fixture("tiny-q8_0.gguf"))).unwrap();
    match m.forward(&be, &mut m.new_state(&be), &[1, 100_000], true) {
        Err(ModelError::BadToken { id: 100_000, .. }) => {}
        Err(e) => panic!("wrong error {e}"),
        Ok(_) => panic!("out-of-vocabulary id accepted"),
    }
}
