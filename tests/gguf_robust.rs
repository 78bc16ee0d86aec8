//! Bad bytes must give an error naming the problem, never a panic: every truncation of a file
//! that uses every metadata type, every header truncation of a real fixture, and thousands of
//! seeded corruptions, each parsed and (when it parses) loaded as a model.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use tern::backend::cpu::CpuBackend;
use tern::gguf::{FormatError, Gguf, GgufError, GgufWriter, Value, ValueType};
use tern::model::Model;
use tern::tensor::GgmlType;

fn every_type_file() -> Vec<u8> {
    let mut w = GgufWriter::new();
    w.set("general.architecture", Value::String("qwen35".into()))
        .set("t.u8", Value::U8(7))
        .set("t.i8", Value::I8(-7))
        .set("t.u16", Value::U16(65000))
        .set("t.i16", Value::I16(-3000))
        .set("t.u32", Value::U32(1 << 30))
        .set("t.i32", Value::I32(-5))
        .set("t.f32", Value::F32(1.5))
        .set("t.bool", Value::Bool(true))
        .set("t.str", Value::String("héllo ✓".into()))
        .set("t.u64", Value::U64(u64::MAX))
        .set("t.i64", Value::I64(i64::MIN))
        .set("t.f64", Value::F64(-2.25))
        .set("t.arr", Value::i32_array(&[1, -2, 3]))
        .set("t.strs", Value::str_array(&["a", "bc", ""]))
        .set(
            "t.nested",
            Value::Array(
                ValueType::Array,
                vec![
                    Value::f32_array(&[1.0, 2.0]),
                    Value::Array(ValueType::U8, vec![]),
                ],
            ),
        );
    w.add_f32("a", &[4, 2], &[0.5; 8]);
    w.add_tensor("b", &[32], GgmlType::Q8_0, vec![0u8; 34]);
    w.add_tensor("c", &[128, 2], GgmlType::PQ2_0, vec![1u8; 68]);
    w.to_bytes()
}

fn fixture_bytes() -> Option<Vec<u8>> {
    let p = concat!(env!("CARGO_MANIFEST_DIR"), "/fixtures/tiny-q8_0.gguf");
    std::fs::read(p).ok()
}

/// Parses and, when that succeeds, loads the model: both must return rather than panic.
fn must_not_panic(bytes: Vec<u8>, what: &str) -> bool {
    let r = catch_unwind(AssertUnwindSafe(|| {
        match Gguf::from_bytes("mem.gguf", bytes) {
            Ok(g) => {
                for t in g.tensors() {
                    let _ = g.tensor_data(t).len();
                }
                let _ = Model::load(&CpuBackend::new(), Arc::new(g)).is_ok();
                true
            }
            Err(e) => {
                assert!(!e.to_string().is_empty());
                false
            }
        }
    }));
    match r {
        Ok(parsed) => parsed,
        Err(_) => panic!("panic on {what}"),
    }
}

#[test]
fn round_trip_every_value_type() {
    let g = Gguf::from_bytes("mem.gguf", every_type_file()).unwrap();
    assert_eq!(g.get("t.u64"), Some(&Value::U64(u64::MAX)));
    assert_eq!(g.get("t.i64"), Some(&Value::I64(i64::MIN)));
    assert_eq!(g.get_str("t.str"), Some("héllo ✓"));
    assert_eq!(
        g.get("t.nested").unwrap().as_array().unwrap()[0],
        Value::f32_array(&[1.0, 2.0])
    );
    assert_eq!(
        g.get("t.nested").unwrap().as_array().unwrap()[1],
        Value::Array(ValueType::U8, vec![])
    );
    let c = g.tensor("c").unwrap();
    assert_eq!(
        (c.ty, c.nbytes, c.dims.clone()),
        (GgmlType::PQ2_0, 68, vec![128, 2])
    );
    assert_eq!(g.tensor_data(c), &[1u8; 68][..]);
    assert_eq!(g.tensor_data(g.tensor("a").unwrap()).len(), 32);
    assert_eq!(g.data_offset % 32, 0);
}

/// End of the last tensor's bytes: what follows is alignment padding, which may be missing.
fn content_end(bytes: &[u8]) -> usize {
    let g = Gguf::from_bytes("f", bytes.to_vec()).unwrap();
    let end = g
        .tensors()
        .iter()
        .map(|t| t.offset + t.nbytes)
        .max()
        .unwrap_or(0);
    (g.data_offset + end) as usize
}

#[test]
fn every_truncation_is_an_error() {
    let full = every_type_file();
    for n in 0..content_end(&full) {
        let r = catch_unwind(|| Gguf::from_bytes("mem.gguf", full[..n].to_vec()));
        match r {
            Ok(Err(_)) => {}
            Ok(Ok(_)) => panic!("truncation to {n} of {} bytes parsed", full.len()),
            Err(_) => panic!("panic on truncation to {n}"),
        }
    }
}

#[test]
fn fixture_truncations_and_corruptions() {
    let Some(full) = fixture_bytes() else {
        panic!("fixtures/tiny-q8_0.gguf is missing: run `cargo xtask fixtures`");
    };
    let data_offset = Gguf::from_bytes("f", full.clone()).unwrap().data_offset as usize;
    // Every cut inside the header and tensor table, then a stride through the data.
    let mut cuts: Vec<usize> = (0..=data_offset).collect();
    cuts.extend((data_offset..full.len()).step_by(509));
    let end = content_end(&full);
    for n in cuts {
        let parsed = must_not_panic(full[..n].to_vec(), &format!("truncation to {n}"));
        assert!(
            !parsed || n >= end,
            "truncation to {n} of {end} content bytes parsed"
        );
    }
    // Seeded corruptions, biased to the header where parsing decisions are made.
    let mut s = 0x5eed_u64;
    let mut next = || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    };
    let mut parsed = 0;
    for i in 0..4000 {
        let mut b = full.clone();
        let flips = 1 + next() % 4;
        for _ in 0..flips {
            let range = if next() % 8 == 0 {
                b.len()
            } else {
                data_offset
            };
            let at = (next() as usize) % range;
            b[at] = match next() % 3 {
                0 => b[at] ^ (1 << (next() % 8)),
                1 => 0xff,
                _ => next() as u8,
            };
        }
        if must_not_panic(b, &format!("corruption #{i}")) {
            parsed += 1;
        }
    }
    // Many corruptions land in string bytes and still parse: both outcomes must occur.
    assert!(parsed > 0 && parsed < 4000, "parsed {parsed} of 4000");
}

fn format_err(bytes: Vec<u8>) -> FormatError {
    match Gguf::from_bytes("bad.gguf", bytes) {
        Err(GgufError::Format { kind, path }) => {
            assert_eq!(path.to_str(), Some("bad.gguf"));
            kind
        }
        other => panic!("expected a format error, got {other:?}"),
    }
}

#[test]
fn named_errors() {
    let good = every_type_file();
    let mut b = good.clone();
    b[0] = b'X';
    assert!(matches!(format_err(b), FormatError::BadMagic(_)));
    let mut b = good.clone();
    b[4..8].copy_from_slice(&1u32.to_le_bytes());
    assert_eq!(format_err(b), FormatError::UnsupportedVersion(1));
    let end = content_end(&good);
    assert!(matches!(
        format_err(good[..end - 1].to_vec()),
        FormatError::TensorOutOfBounds { .. }
    ));
    assert!(Gguf::from_bytes("no-trailing-padding", good[..end].to_vec()).is_ok());

    let mut w = GgufWriter::new();
    w.add_tensor("x", &[32], GgmlType::Q8_0, vec![0u8; 34]);
    let b = w.to_bytes();
    // Header 24 bytes, then the entry: name (8 + 1), n_dims (4), ne0 (8) at 37, type id at 45.
    let p = 45;
    assert_eq!(
        b[p..p + 4],
        8u32.to_le_bytes(),
        "layout of the one-tensor file"
    );
    let mut bad = b.clone();
    bad[p..p + 4].copy_from_slice(&77u32.to_le_bytes());
    assert_eq!(
        format_err(bad),
        FormatError::UnknownTensorType {
            name: "x".into(),
            id: 77
        }
    );
    let mut bad = b.clone();
    bad[p - 8..p].copy_from_slice(&u64::MAX.to_le_bytes());
    assert!(matches!(
        format_err(bad),
        FormatError::DimensionOverflow { .. } | FormatError::BadRowLength { .. }
    ));
    let mut bad = b;
    bad[p - 8..p].copy_from_slice(&(1u64 << 40).to_le_bytes());
    assert!(matches!(
        format_err(bad),
        FormatError::TensorOutOfBounds { .. }
    ));
}

#[test]
fn legacy_type_42_is_detected_by_size() {
    // 34 bytes per 128 (legacy prism) vs 36 bytes per 128 (upstream Q2_0 at group 64).
    let mut w = GgufWriter::new();
    w.add_tensor(
        "legacy",
        &[1024, 4],
        GgmlType::Q2_0Legacy,
        vec![0u8; 8 * 34 * 4],
    );
    let g = Gguf::from_bytes("l", w.to_bytes()).unwrap();
    assert_eq!(g.tensor("legacy").unwrap().ty, GgmlType::Q2_0Legacy);
    let mut w = GgufWriter::new();
    w.add_tensor(
        "upstream",
        &[1024, 4],
        GgmlType::Q2_0,
        vec![0u8; 16 * 18 * 4],
    );
    let g = Gguf::from_bytes("u", w.to_bytes()).unwrap();
    assert_eq!(g.tensor("upstream").unwrap().ty, GgmlType::Q2_0);
}

/// Offsets follow ggml's layout: each tensor starts where the previous one ends, padded to the
/// alignment. Data shared by two tensors, or a gap, is refused naming both tensors.
#[test]
fn tensor_data_must_be_laid_out_in_table_order() {
    use tern::fuzz::gguf::{layout, Kind};
    let good = every_type_file();
    let g = Gguf::from_bytes("f", good.clone()).unwrap();
    let l = layout(&good).expect("the header maps");
    // The map finds every tensor's offset field where the reader read it.
    for t in g.tensors() {
        let f = l.find(Kind::Offset, &t.name).expect("offset field");
        let v = u64::from_le_bytes(good[f.at..f.at + 8].try_into().unwrap());
        assert_eq!(v, t.offset, "{}", t.name);
    }
    let set = |name: &str, off: u64| {
        let mut b = good.clone();
        let f = l.find(Kind::Offset, name).unwrap();
        b[f.at..f.at + 8].copy_from_slice(&off.to_le_bytes());
        b
    };
    let (a, b, c) = (
        g.tensor("a").unwrap(),
        g.tensor("b").unwrap(),
        g.tensor("c").unwrap(),
    );
    match format_err(set("b", a.offset)) {
        FormatError::UnexpectedOffset {
            name,
            offset,
            expected,
            previous,
        } => {
            assert_eq!((name.as_str(), offset, expected), ("b", 0, 32));
            assert_eq!(previous.as_deref(), Some("a"));
        }
        e => panic!("{e:?}"),
    }
    let e = format_err(set("b", b.offset + 32)).to_string();
    assert!(
        e.contains("\"b\"") && e.contains("gap") && e.contains("\"a\""),
        "{e}"
    );
    let e = format_err(set("c", b.offset)).to_string();
    assert!(
        e.contains("\"c\"") && e.contains("overlaps") && e.contains("\"b\""),
        "{e}"
    );
    let e = format_err(set("a", 32)).to_string();
    assert!(e.contains("\"a\"") && e.contains("does not start"), "{e}");
    assert_eq!((b.offset, c.offset), (32, 96));
}
