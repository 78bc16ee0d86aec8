//! Golden tokenization: tern's ids must equal stock llama.cpp's on the cases recorded in
//! `fixtures/golden/tokens.json`, and decoding them must give the text back.
//!
//! The file looks like
//! `{"model": "fixtures/<file>.gguf", "cases": [{"text": "...", "parse_special": true, "ids": [..]}]}`
//! with the model path relative to the crate root. A case may also carry `"add_special"`
//! (default false), the other flag of `llama_tokenize`. Until the fixture generator has
//! written the file, the test says so and passes.

use std::path::{Path, PathBuf};

use serde_json::Value;
use tern::gguf::Gguf;
use tern::tokenizer::Tokenizer;

const GOLDEN: &str = "fixtures/golden/tokens.json";

struct Case {
    text: String,
    parse_special: bool,
    add_special: bool,
    ids: Vec<u32>,
}

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Parses the golden file, panicking with the path and the field at fault: a malformed
/// fixture must fail the test, not skip it.
fn load(path: &Path) -> (PathBuf, Vec<Case>) {
    let raw = std::fs::read_to_string(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: Value =
        serde_json::from_str(&raw).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let model = json["model"]
        .as_str()
        .unwrap_or_else(|| panic!("{}: \"model\" must be a string", path.display()));
    let cases = json["cases"]
        .as_array()
        .unwrap_or_else(|| panic!("{}: \"cases\" must be an array", path.display()));
    let cases = cases
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let field = |name: &str| format!("{}: case {i}: \"{name}\"", path.display());
            let text = c["text"]
                .as_str()
                .unwrap_or_else(|| panic!("{} must be a string", field("text")));
            let flag = |name: &str, default: bool| match &c[name] {
                Value::Null => default,
                v => v
                    .as_bool()
                    .unwrap_or_else(|| panic!("{} must be a bool", field(name))),
            };
            let ids = c["ids"]
                .as_array()
                .unwrap_or_else(|| panic!("{} must be an array", field("ids")))
                .iter()
                .map(|v| {
                    v.as_u64()
                        .and_then(|id| u32::try_from(id).ok())
                        .unwrap_or_else(|| panic!("{} holds {v}, not a token id", field("ids")))
                })
                .collect();
            Case {
                text: text.to_string(),
                // Only true cases are expected in practice; default to llama.cpp's
                // `special=true`, the setting a chat-templated prompt is tokenized with.
                parse_special: flag("parse_special", true),
                add_special: flag("add_special", false),
                ids,
            }
        })
        .collect();
    (root().join(model), cases)
}

#[test]
fn golden_tokens_match_llama_cpp() {
    let golden = root().join(GOLDEN);
    if !golden.exists() {
        eprintln!(
            "skipped: {} does not exist yet (it is written by the fixture generator from stock \
             llama.cpp); this test checks tern's tokenizer against it once it is there",
            golden.display()
        );
        return;
    }
    let (model, cases) = load(&golden);
    assert!(!cases.is_empty(), "{}: no cases", golden.display());
    let gguf =
        Gguf::open(&model).unwrap_or_else(|e| panic!("{GOLDEN} names {}: {e}", model.display()));
    let tok = Tokenizer::from_gguf(&gguf).unwrap_or_else(|e| panic!("{}: {e}", model.display()));

    // Collect every mismatch so one run shows the whole picture.
    let mut failures = Vec::new();
    for (i, c) in cases.iter().enumerate() {
        match tok.encode(&c.text, c.add_special, c.parse_special) {
            Ok(ids) if ids == c.ids => {}
            Ok(ids) => failures.push(format!(
                "case {i} {:?} (parse_special={}, add_special={}):\n  llama.cpp {:?}\n  tern      {:?}\n  pieces    {:?}",
                c.text,
                c.parse_special,
                c.add_special,
                c.ids,
                ids,
                ids.iter().map(|&id| tok.token_piece(id).unwrap_or("?")).collect::<Vec<_>>()
            )),
            Err(e) => failures.push(format!("case {i} {:?}: encode failed: {e}", c.text)),
        }
        // Decoding llama.cpp's ids with specials shown must give the text back. With
        // add_special, the ids also hold the bos/eos the text did not have, so the round trip
        // is checked only without it.
        if !c.add_special {
            match tok.decode(&c.ids, false) {
                Ok(text) if text == c.text => {}
                Ok(text) => {
                    failures.push(format!("case {i}: decode gave {text:?}, want {:?}", c.text))
                }
                Err(e) => failures.push(format!("case {i} {:?}: decode failed: {e}", c.text)),
            }
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} golden cases differ from llama.cpp ({}):\n{}",
        failures.len(),
        cases.len(),
        model.display(),
        failures.join("\n")
    );
    eprintln!(
        "{} golden cases match llama.cpp ({})",
        cases.len(),
        model.display()
    );
}

/// The pre-tokenizer split against llama.cpp's own `unicode.cpp`: its code point classes over
/// the whole code space (a digest) and its cuts of random strings, both qwen35 and qwen2
/// (`fixtures/golden/split.json`, written by `cargo xtask tokcheck split --write`).
#[test]
fn split_and_classes_match_llama_cpp() {
    use sha2::{Digest, Sha256};
    use tern::tokenizer::split::{class_table, split, Flavor};
    let path = root().join("fixtures/golden/split.json");
    let raw = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: Value = serde_json::from_str(&raw).unwrap();
    let digest: String = Sha256::digest(class_table())
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    assert_eq!(
        json["classes_sha256"].as_str(),
        Some(digest.as_str()),
        "the code point classes differ from llama.cpp's"
    );
    let cases = json["cases"].as_array().expect("cases");
    assert!(cases.len() > 1000);
    let lens = |v: &Value| -> Vec<usize> {
        v.as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_u64().unwrap() as usize)
            .collect()
    };
    for c in cases {
        let text = c["text"].as_str().unwrap();
        for (flavor, key) in [(Flavor::Qwen35, "qwen35"), (Flavor::Qwen2, "qwen2")] {
            let got: Vec<usize> = split(text, flavor).into_iter().map(|r| r.len()).collect();
            assert_eq!(got, lens(&c[key]), "{key} split of {text:?}");
        }
    }
}

/// Hard texts (runs of 10^6 spaces and newlines, long digit and letter runs, mixed scripts,
/// contractions, combining marks) tokenized by stock llama.cpp on the fixture vocabulary
/// (`fixtures/golden/tokens_hard.json`, written by `cargo xtask tokcheck ids --write`): each
/// text is stored as its recipe and its ids as a count and a digest.
#[test]
fn hard_texts_match_llama_cpp() {
    use sha2::{Digest, Sha256};
    let path = root().join("fixtures/golden/tokens_hard.json");
    let raw = std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let json: Value = serde_json::from_str(&raw).unwrap();
    let vocabs = json["vocabularies"].as_array().expect("vocabularies");
    assert!(vocabs.len() >= 2);
    let mut failures = Vec::new();
    for v in vocabs {
        let model = root().join(v["model"].as_str().expect("model"));
        let tok = Tokenizer::from_gguf(&Gguf::open(&model).unwrap()).unwrap();
        let cases = v["cases"].as_array().expect("cases");
        assert!(cases.len() >= 20);
        for c in cases {
            let label = c["label"].as_str().unwrap();
            let text: String = c["parts"]
                .as_array()
                .unwrap()
                .iter()
                .map(|p| {
                    p[0].as_str()
                        .unwrap()
                        .repeat(p[1].as_u64().unwrap() as usize)
                })
                .collect();
            let ids = tok.encode(&text, false, true).unwrap();
            let mut h = Sha256::new();
            for i in &ids {
                h.update(i.to_le_bytes());
            }
            let digest: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
            if ids.len() as u64 != c["n_ids"].as_u64().unwrap()
                || c["ids_sha256"].as_str() != Some(&digest)
            {
                failures.push(format!(
                    "{} {label}: llama.cpp {} ids, tern {}",
                    model.display(),
                    c["n_ids"],
                    ids.len()
                ));
            }
        }
    }
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}
