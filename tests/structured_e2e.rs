//! Structured output, probabilities, n > 1, logit bias and embeddings through the server: the
//! official `openai` Python client (tests/e2e/structured.py, validating with `jsonschema`)
//! against a server on the bundled demo model with 3 slots and `--embeddings`; and the same
//! routes' shapes and refusals over plain HTTP.

mod server_common;

use std::process::{Command, Stdio};

use serde_json::{json, Value};
use server_common::{fixture, options, post, settings, start_with};
use tern::config::Settings;

fn demo() -> Settings {
    Settings {
        model: Some(fixture("demo/demo-q8_0.gguf")),
        parallel: Some(3),
        ctx_size: Some(3 * 1024),
        embeddings: Some(true),
        ..settings()
    }
}

fn python_has(modules: &str) -> bool {
    Command::new("python3")
        .args(["-c", &format!("import {modules}")])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false)
}

#[test]
fn openai_client_structured_output_probs_choices_bias_embeddings() {
    if !python_has("openai, jsonschema") {
        println!(
            "SKIPPED: `python3 -c \"import openai, jsonschema\"` fails (.ci/run installs both)"
        );
        return;
    }
    let h = start_with(demo(), options());
    let out = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/e2e/structured.py"
        ))
        .args(["--base-url", &format!("http://{}", h.addr)])
        .output()
        .expect("python3 runs");
    let transcript = String::from_utf8_lossy(&out.stdout);
    println!("--- structured.py transcript ---\n{transcript}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the structured-output checks pass");
    assert!(transcript.contains("all checks passed"));
}

#[test]
fn embedding_routes_shapes_and_refusals() {
    let h = start_with(demo(), options());
    // llama-server's /embedding: [{index, embedding: [[...]]}], normalized.
    let r = post(
        h.addr,
        "/embedding",
        &json!({"content": "To be, or not to be"}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    let e = v[0]["embedding"][0].as_array().unwrap();
    let norm: f64 = e.iter().map(|x| x.as_f64().unwrap().powi(2)).sum();
    assert!((norm - 1.0).abs() < 1e-4, "L2-normalized: {norm}");
    // Token ids, base64, and embd_normalize -1 (raw).
    let r = post(
        h.addr,
        "/v1/embeddings",
        &json!({"input": [[419, 309, 44]], "encoding_format": "base64", "embd_normalize": -1}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["object"], "list");
    assert_eq!(v["usage"]["prompt_tokens"], 3);
    assert!(v["data"][0]["embedding"].is_string());
    // Refusals name the problem.
    let bad = |body: Value, needle: &str| {
        let r = post(h.addr, "/v1/embeddings", &body);
        assert_eq!(r.status, 400, "{body}: {}", r.text());
        assert!(r.text().contains(needle), "{body}: {}", r.text());
    };
    bad(json!({}), "\\\"input\\\" or \\\"content\\\"");
    bad(json!({"input": []}), "must not be empty");
    bad(
        json!({"input": "x", "encoding_format": "hex"}),
        "float or base64",
    );
    drop(h);
    // Without --embeddings the routes say how to turn them on.
    let h = start_with(
        Settings {
            embeddings: None,
            ..demo()
        },
        options(),
    );
    let r = post(h.addr, "/v1/embeddings", &json!({"input": "x"}));
    assert_eq!(r.status, 501);
    assert!(r.text().contains("--embeddings"));
}
