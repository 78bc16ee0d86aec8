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

// ---------------------------------------------------------------------------------------------
// The reproducers of issue #17: each was accepted (or took the process down) before the one
// validation pass; each is now refused, before anything is allocated for the model, with an
// error that names the key or tensor.
// ---------------------------------------------------------------------------------------------

/// The fixture with `key` set (replaced in place, or added).
fn set_key(f: &Gguf, key: &'static str, nv: Value) -> Gguf {
    rewrite(
        f,
        |_, v| Some(v.clone()),
        move |w| {
            w.set(key, nv);
        },
    )
}

/// The config and the planner (which prices before loading) both refuse, and so does loading.
fn refused_everywhere(g: Gguf) -> String {
    let g = Arc::new(g);
    let e = Config::from_gguf(&g)
        .expect_err("config accepted")
        .to_string();
    let p = tern::plan::Ledger::price(&g, &tern::plan::Shape::default())
        .expect_err("planner accepted")
        .to_string();
    assert!(p.contains(&e) || !p.is_empty(), "planner: {p}");
    let l = match Model::load(&CpuBackend::new(), g) {
        Ok(_) => panic!("load accepted"),
        Err(e) => e.to_string(),
    };
    assert_eq!(l, e);
    e
}

#[test]
fn huge_block_count_is_refused_before_allocation() {
    let f = fixture("tiny-f32.gguf");
    for v in [
        Value::U32(1 << 31),
        Value::U32(u32::MAX),
        Value::U64(1 << 40),
        Value::U64(u64::MAX),
        Value::I64(-1),
        Value::U32(513),
    ] {
        let e = refused_everywhere(set_key(&f, "qwen35.block_count", v.clone()));
        assert!(e.contains("qwen35.block_count"), "{v:?}: {e}");
    }
    // Within llama.cpp's 512 but more layers than the table has tensors for.
    let e = refused_everywhere(set_key(&f, "qwen35.block_count", Value::U32(500)));
    assert!(
        e.contains("qwen35.block_count") && e.contains("tensors"),
        "{e}"
    );
}

#[test]
fn non_finite_or_non_positive_floats_are_refused() {
    let f = fixture("tiny-f32.gguf");
    let eps = "qwen35.attention.layer_norm_rms_epsilon";
    for v in [f32::NAN, -1e-6, 0.0, f32::INFINITY, 2.0] {
        let e = refused_everywhere(set_key(&f, eps, Value::F32(v)));
        assert!(e.contains(eps), "eps {v}: {e}");
    }
    for v in [0.0, -10000.0, f32::NAN, f32::NEG_INFINITY] {
        let e = refused_everywhere(set_key(&f, "qwen35.rope.freq_base", Value::F32(v)));
        assert!(e.contains("qwen35.rope.freq_base"), "rope base {v}: {e}");
    }
    // A f64 that overflows f32 is infinite once narrowed, as it is used.
    let e = refused_everywhere(set_key(&f, "qwen35.rope.freq_base", Value::F64(1e300)));
    assert!(e.contains("rope.freq_base"), "{e}");
}

#[test]
fn counts_and_products_are_range_checked() {
    let f = fixture("tiny-f32.gguf");
    for (key, v, want) in [
        ("qwen35.context_length", Value::U32(0), "at least 1"),
        ("qwen35.attention.head_count", Value::U32(0), "at least 1"),
        (
            "qwen35.attention.head_count_kv",
            Value::U64(1 << 33),
            "out of range",
        ),
        ("qwen35.attention.key_length", Value::U32(0), "at least 1"),
        ("qwen35.ssm.state_size", Value::U32(1 << 31), "overflows"),
        ("qwen35.embedding_length", Value::I32(-4), "negative"),
        (
            "qwen35.full_attention_interval",
            Value::U32(0),
            "at least 1",
        ),
        ("qwen35.ssm.conv_kernel", Value::U32(1), "at least 2"),
    ] {
        let e = refused_everywhere(set_key(&f, key, v.clone()));
        let short = key.rsplit('.').next().unwrap();
        assert!(e.contains(short) && e.contains(want), "{key} = {v:?}: {e}");
    }
    for (v, want) in [
        (Value::i32_array(&[8, 8]), "2 entries, expected 4"),
        (Value::i32_array(&[8, -1, 0, 0]), "entry 1 = -1"),
        (
            Value::Array(tern::gguf::ValueType::String, vec![]),
            "0 entries",
        ),
    ] {
        let e = refused_everywhere(set_key(&f, "qwen35.rope.dimension_sections", v));
        assert!(
            e.contains("rope.dimension_sections") && e.contains(want),
            "{e}"
        );
    }
    // llama.cpp's get_key_or_arr: one entry per block, or a scalar for all.
    let e = refused_everywhere(set_key(
        &f,
        "qwen35.attention.recurrent_layers",
        Value::Array(tern::gguf::ValueType::Bool, vec![Value::Bool(true); 3]),
    ));
    assert!(
        e.contains("recurrent_layers") && e.contains("3 entries"),
        "{e}"
    );
}

#[test]
fn a_table_larger_than_the_header_is_refused() {
    // block_count 5 of the file's 9 (8 trunk + MTP): the extra layers used to be ignored.
    let f = fixture("tiny-f32.gguf");
    let e = refused_everywhere(set_key(&f, "qwen35.block_count", Value::U32(5)));
    assert!(e.contains("tensor \"blk.4."), "{e}");
    let g = rewrite(
        &f,
        |k, v| {
            Some(match k {
                "qwen35.block_count" => Value::U32(8),
                "qwen35.nextn_predict_layers" => Value::U32(0),
                _ => v.clone(),
            })
        },
        |_| {},
    );
    let e = refused_everywhere(g);
    assert!(
        e.contains("tensor \"blk.8.") && e.contains("block_count = 8"),
        "{e}"
    );
}

#[test]
fn an_extra_unknown_tensor_is_refused() {
    let f = fixture("tiny-q8_0.gguf");
    let g = rewrite(
        &f,
        |_, v| Some(v.clone()),
        |w| {
            w.add_f32("rope_freqs.weight", &[16], &[1.0; 16]);
        },
    );
    let e = refused_everywhere(g);
    assert!(
        e.contains("tensor \"rope_freqs.weight\"") && e.contains("not a tensor of the qwen35"),
        "{e}"
    );
    let g = rewrite(
        &f,
        |_, v| Some(v.clone()),
        |w| {
            w.add_f32("blk.2.attn_q_norm.weight", &[32], &[1.0; 32]);
        },
    );
    let e = refused_everywhere(g);
    assert!(
        e.contains("blk.2.attn_q_norm.weight") && e.contains("Gated DeltaNet"),
        "{e}"
    );
}

#[test]
fn a_tensor_type_without_kernels_is_refused_at_validation() {
    let f = fixture("tiny-q8_0.gguf");
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        w.set(k, v.clone());
    }
    for t in f.tensors() {
        if t.name == "blk.0.ffn_up.weight" {
            // The same bytes count under Q8_1's 36-byte blocks as a different table; use a
            // type of Q8_0's own size that tern has no kernel for: IQ4_NL (32 per 18 B) needs
            // different bytes, so write zeros of the right size.
            let rows = t.n_rows();
            let bytes = tern::tensor::GgmlType::Q4_1.row_bytes(t.ne0()).unwrap() * rows;
            w.add_tensor(
                &t.name,
                &t.dims,
                tern::tensor::GgmlType::Q4_1,
                vec![0; bytes as usize],
            );
        } else {
            w.add_tensor(&t.name, &t.dims, t.ty, f.tensor_data(t).to_vec());
        }
    }
    let e = refused_everywhere(Gguf::from_bytes("m.gguf", w.to_bytes()).unwrap());
    assert!(
        e.contains("blk.0.ffn_up.weight") && e.contains("Q4_1"),
        "{e}"
    );
}

#[test]
fn an_empty_fold_beside_ternary_tensors_is_refused() {
    let f = fixture("tiny-pq2_0.gguf");
    let e = refused_everywhere(set_key(
        &f,
        "prism.hadamard.weight_names",
        Value::Array(tern::gguf::ValueType::String, vec![]),
    ));
    assert!(
        e.contains("prism.hadamard.weight_names") && e.contains("PQ2_0"),
        "{e}"
    );
    // A fold that claims the output is tied while the file has its own output.weight.
    let e = refused_everywhere(set_key(&f, "prism.hadamard.tied_output", Value::Bool(true)));
    assert!(e.contains("tied_output"), "{e}");
}

#[test]
fn overlapping_tensor_data_is_refused() {
    // The second tensor of the table pointed at the first one's bytes.
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-q8_0.gguf");
    let mut bytes = std::fs::read(path).unwrap();
    let g = Gguf::from_bytes("f", bytes.clone()).unwrap();
    let (a, b) = (&g.tensors()[0], &g.tensors()[1]);
    let l = tern::fuzz::gguf::layout(&bytes).unwrap();
    let at = l.find(tern::fuzz::gguf::Kind::Offset, &b.name).unwrap().at;
    bytes[at..at + 8].copy_from_slice(&a.offset.to_le_bytes());
    let e = match Gguf::from_bytes("overlap.gguf", bytes) {
        Ok(_) => panic!("overlapping data parsed"),
        Err(e) => e.to_string(),
    };
    assert!(
        e.contains(&format!("tensor {:?}", b.name))
            && e.contains(&format!("overlaps the data of tensor {:?}", a.name)),
        "{e}"
    );
}

/// A weight poisoned with NaN used to give all-NaN logits (and `generate` printed token 0 over
/// and over); the sampling step refuses a non-finite row instead.
#[test]
fn non_finite_logits_are_an_error_not_output() {
    use tern::runtime::sampler::{Sampler, SamplerConfig};
    use tern::runtime::speculative::Generator;
    let f = fixture("tiny-f32.gguf");
    let mut w = GgufWriter::new();
    for (k, v) in f.metadata() {
        w.set(k, v.clone());
    }
    for t in f.tensors() {
        let mut data = f.tensor_data(t).to_vec();
        if t.name == "output_norm.weight" {
            data[..4].copy_from_slice(&f32::NAN.to_le_bytes());
        }
        w.add_tensor(&t.name, &t.dims, t.ty, data);
    }
    let g = Arc::new(Gguf::from_bytes("nan.gguf", w.to_bytes()).unwrap());
    let be = CpuBackend::new();
    let m = Model::load(&be, g).unwrap();
    for sampler in [SamplerConfig::greedy(), SamplerConfig::default()] {
        let mut gen =
            Generator::new(&m, &be, m.new_state(&be), Sampler::new(sampler), None).unwrap();
        match gen.prefill(&[5, 17, 200]) {
            Err(ModelError::NonFiniteLogits { row: 0, .. }) => {}
            Err(e) => panic!("wrong error {e}"),
            Ok(id) => panic!("sampled {id} from non-finite logits"),
        }
    }
    assert!(tern::runtime::sampler::check_logits(&[0.0, f32::NAN], 2).is_err());
    assert!(tern::runtime::sampler::check_logits(&[0.0, -1.0, 3.0, 1e30], 2).is_ok());
}
