//! `tern serve`'s llama-server flags over real HTTP: API keys as a list and a file, /slots,
//! POST /props, the web UI setting, `--api-prefix`, CORS, `--n-predict`, `--reasoning-budget`,
//! `--cache-prompt`, `--timeout`, and /v1/models' extra fields.

mod scratch;
mod server_common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::TcpStream;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use server_common::*;

fn chat(extra: Value) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": "Say hi."}],
        "max_tokens": 6,
        "seed": 7,
        "ignore_eos": true,
    });
    if let (Some(b), Some(e)) = (b.as_object_mut(), extra.as_object()) {
        for (k, v) in e {
            b.insert(k.clone(), v.clone());
        }
    }
    b
}

fn tmp(name: &str) -> std::path::PathBuf {
    scratch::dir("server-flags").join(name)
}

#[test]
fn api_keys_slots_props_and_the_ui_setting() {
    let keys = tmp("keys.txt");
    std::fs::write(&keys, "# ops\nfrom-file\n").unwrap();
    let mut s = settings();
    s.api_key = Some("k1,k2".into());
    s.api_key_file = Some(keys);
    s.slots = Some(false);
    s.props = Some(true);
    s.webui = Some(false);
    let h = start_with(s, options());
    let auth = |key: &str, path: &str| {
        request(
            h.addr,
            "GET",
            path,
            &[("Authorization", &format!("Bearer {key}"))],
            None,
        )
        .status
    };
    assert_eq!(auth("k1", "/v1/models"), 200);
    assert_eq!(auth("k2", "/v1/models"), 200, "any key of the comma list");
    assert_eq!(auth("from-file", "/v1/models"), 200, "a key of the file");
    assert_eq!(auth("k1,k2", "/v1/models"), 401, "not one literal key");
    assert_eq!(auth("nope", "/v1/models"), 401);
    // --no-slots: 501 as llama-server.
    let r = request(
        h.addr,
        "GET",
        "/slots",
        &[("Authorization", "Bearer k1")],
        None,
    );
    assert_eq!(r.status, 501);
    assert_eq!(r.json()["error"]["type"], "not_supported_error");
    assert!(r.text().contains("--slots"));
    // --props: POST /props is accepted.
    let r = request(
        h.addr,
        "POST",
        "/props",
        &[("Authorization", "Bearer k2")],
        Some(b"{}"),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!({"success": true}));
    let p = request(
        h.addr,
        "GET",
        "/props",
        &[("Authorization", "Bearer k2")],
        None,
    )
    .json();
    assert_eq!(p["endpoint_slots"], false);
    assert_eq!(p["endpoint_props"], true);
    assert_eq!(p["ui"], false);
    // --no-webui: / is 404 (public, no key needed), /sw.js removes a cached UI worker.
    assert_eq!(get(h.addr, "/").status, 404);
    let r = get(h.addr, "/sw.js");
    assert_eq!(r.status, 200);
    assert!(r.text().contains("unregister"));
    h.stop().unwrap();

    // The defaults: /slots on, POST /props refused, the UI on (tests/webui.rs checks the page).
    let h = start();
    assert_eq!(get(h.addr, "/slots").status, 200);
    let r = post(h.addr, "/props", &json!({}));
    assert_eq!(r.status, 501);
    assert!(r.text().contains("--props"));
    let r = get(h.addr, "/");
    assert_eq!(r.status, 200);
    assert!(r.header("content-type").unwrap().starts_with("text/html"));
    assert_eq!(get(h.addr, "/sw.js").status, 404);
    h.stop().unwrap();
}

#[test]
fn models_lists_aliases_tags_and_the_ollama_shape() {
    let mut s = settings();
    s.alias = Some("zeta, alpha".into());
    s.tags = Some("prod,small".into());
    let h = start_with(s, options());
    let v = get(h.addr, "/v1/models").json();
    assert_eq!(v["object"], "list");
    // llama-server keeps the aliases as a sorted set and serves the first.
    assert_eq!(v["data"][0]["id"], "alpha");
    assert_eq!(v["data"][0]["aliases"], json!(["alpha", "zeta"]));
    assert_eq!(v["data"][0]["tags"], json!(["prod", "small"]));
    assert_eq!(v["models"][0]["name"], "alpha");
    assert_eq!(v["models"][0]["details"]["format"], "gguf");
    let c = post(h.addr, "/v1/chat/completions", &chat(json!({}))).json();
    assert_eq!(c["model"], "alpha");
    h.stop().unwrap();
}

#[test]
fn api_prefix_and_cors() {
    let mut s = settings();
    s.api_prefix = Some("/llm".into());
    s.cors_origins = Some("localhost".into());
    let h = start_with(s, options());
    assert_eq!(get(h.addr, "/llm/health").status, 200);
    assert_eq!(get(h.addr, "/llm/v1/models").status, 200);
    assert_eq!(get(h.addr, "/health").status, 404);
    let origin = |o: &str| {
        let r = request(h.addr, "GET", "/llm/health", &[("Origin", o)], None);
        r.header("access-control-allow-origin").map(str::to_string)
    };
    assert_eq!(
        origin("http://localhost:3000").as_deref(),
        Some("http://localhost:3000")
    );
    assert_eq!(
        origin("http://evil.example"),
        None,
        "only localhost origins"
    );
    let r = request(
        h.addr,
        "OPTIONS",
        "/llm/v1/chat/completions",
        &[("Origin", "http://127.0.0.1:8000")],
        None,
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.header("access-control-allow-methods"),
        Some("GET, POST, DELETE, OPTIONS")
    );
    assert_eq!(r.header("access-control-allow-credentials"), Some("true"));
    h.stop().unwrap();
    // The default (*, with credentials) echoes the Origin, as llama-server.
    let h = start();
    let r = request(
        h.addr,
        "GET",
        "/health",
        &[("Origin", "http://a.example")],
        None,
    );
    assert_eq!(
        r.header("access-control-allow-origin"),
        Some("http://a.example")
    );
    h.stop().unwrap();
}

#[test]
fn n_predict_reverse_prompt_and_cache_prompt() {
    let mut s = settings();
    s.n_predict = Some(0);
    let h = start_with(s, options());
    // -n 0: the prompt is evaluated, nothing is generated.
    let b = json!({"messages": [{"role": "user", "content": "Hi"}], "ignore_eos": true});
    let v = post(h.addr, "/v1/chat/completions", &b).json();
    assert_eq!(v["usage"]["completion_tokens"], 0, "{v}");
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    assert_eq!(v["choices"][0]["message"]["content"], "");
    // A request's own limit wins; max_tokens 0 is llama-server's n_predict 0.
    let v = post(
        h.addr,
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 3})),
    )
    .json();
    assert_eq!(v["usage"]["completion_tokens"], 3);
    let v = post(
        h.addr,
        "/completion",
        &json!({"prompt": "Hello", "n_predict": 0}),
    )
    .json();
    assert_eq!(v["tokens_predicted"], 0, "{v}");
    h.stop().unwrap();

    let mut s = settings();
    s.n_predict = Some(4);
    s.cache_prompt = Some(false);
    let h = start_with(s, options());
    let b = json!({"prompt": (10..40).collect::<Vec<u32>>(), "ignore_eos": true});
    let v = post(h.addr, "/v1/completions", &b).json();
    assert_eq!(
        v["usage"]["completion_tokens"], 4,
        "--n-predict is the default limit"
    );
    // --no-cache-prompt: the same prompt again reuses nothing; a request can turn it back on.
    let v = post(h.addr, "/v1/completions", &b).json();
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let longer = json!({"prompt": (10..50).collect::<Vec<u32>>(), "ignore_eos": true});
    let v = post(h.addr, "/v1/completions", &longer).json();
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 0);
    let mut b2 = longer.clone();
    b2["prompt"] = json!((10..60).collect::<Vec<u32>>());
    b2["cache_prompt"] = json!(true);
    let v = post(h.addr, "/v1/completions", &b2).json();
    assert!(
        v["usage"]["prompt_tokens_details"]["cached_tokens"]
            .as_u64()
            .unwrap()
            > 0,
        "a request's cache_prompt wins: {v}"
    );
    h.stop().unwrap();
}

#[test]
fn reasoning_budget_closes_the_thinking_block() {
    let h = start();
    let ask = |extra: Value| {
        let mut body = chat(json!({"max_tokens": 8, "reasoning_format": "none"}));
        for (k, x) in extra.as_object().unwrap() {
            body[k] = x.clone();
        }
        let v = post(h.addr, "/v1/chat/completions", &body).json();
        v["choices"][0]["message"]["content"]
            .as_str()
            .unwrap_or_default()
            .to_string()
    };
    let free = ask(json!({}));
    assert!(
        !free.contains("</think>"),
        "the random model does not close it itself: {free:?}"
    );
    // The prompt opens thinking with "<think>\n"; the "\n" counts, as in llama.cpp, so a
    // budget of 2 leaves one free token before the end tag is forced.
    let closed = ask(json!({"reasoning_budget_tokens": 2}));
    let at = closed
        .find("</think>")
        .unwrap_or_else(|| panic!("{closed:?}"));
    // One free token, or a few more when it ends inside a UTF-8 character (the end tag waits
    // for the character to complete, as in llama.cpp).
    assert!(at > 0 && at <= 12, "{closed:?}");
    let msg = ask(json!({"reasoning_budget_tokens": 1, "reasoning_budget_message": "Enough."}));
    assert!(msg.starts_with("Enough.</think>"), "{msg:?}");
    h.stop().unwrap();

    // --reasoning-budget 1 is every request's default: the end tag comes first.
    let mut s = settings();
    s.reasoning_budget = Some(1);
    let h = start_with(s, options());
    let v = post(
        h.addr,
        "/v1/chat/completions",
        &chat(json!({"max_tokens": 4})),
    )
    .json();
    let m = &v["choices"][0]["message"];
    assert_eq!(m["reasoning_content"], Value::Null, "{v}");
    h.stop().unwrap();
}

#[test]
fn timeout_bounds_the_request_head_and_body() {
    let mut s = settings();
    s.timeout = Some(1);
    let h = start_with(s, options());
    // A head that never ends: the connection is closed after the timeout.
    let mut c = TcpStream::connect(h.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n").unwrap();
    let t0 = Instant::now();
    let mut buf = Vec::new();
    let _ = c.read_to_end(&mut buf);
    let waited = t0.elapsed();
    assert!(
        waited >= Duration::from_millis(900) && waited < Duration::from_secs(8),
        "{waited:?}"
    );
    // A body shorter than its Content-Length: a 400 once the timeout passes.
    let mut c = TcpStream::connect(h.addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    c.write_all(b"POST /tokenize HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"con")
        .unwrap();
    let mut r = BufReader::new(c);
    let mut status = String::new();
    r.read_line(&mut status).unwrap();
    assert!(status.contains(" 400 "), "{status}");
    let mut rest = String::new();
    let _ = r.read_to_string(&mut rest);
    assert!(rest.contains("--timeout"), "{rest}");
    // A complete request is answered as usual.
    assert_eq!(get(h.addr, "/health").status, 200);
    h.stop().unwrap();
}
