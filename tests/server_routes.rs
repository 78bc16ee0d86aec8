//! `tern serve`'s routes over real HTTP on 127.0.0.1 (ephemeral ports), against the fixture
//! model. Response shapes are insta JSON snapshots with the volatile fields (ids, created,
//! timings, the random model's text, paths) redacted.

mod server_common;

use std::future::IntoFuture;
use std::io::BufRead;
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use server_common::*;

fn chat_body(extra: Value) -> Value {
    let mut b = json!({
        "model": "anything",
        "messages": [
            {"role": "system", "content": "You are terse."},
            {"role": "user", "content": "Say hi."}
        ],
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

#[test]
fn health_models_props_slots() {
    let h = start();
    let r = get(h.addr, "/health");
    assert_eq!(r.status, 200);
    assert_eq!(r.json(), json!({"status": "ok"}));

    let r = get(h.addr, "/v1/models");
    assert_eq!(r.status, 200);
    insta::assert_json_snapshot!("models", r.json(), {".data[].created" => "[created]"});

    let r = get(h.addr, "/props");
    assert_eq!(r.status, 200);
    let props = r.json();
    let tmpl = std::fs::read_to_string(concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../shared/data/qwen3.5-chat-template.jinja"
    ))
    .unwrap();
    assert_eq!(
        props["chat_template"],
        json!(tmpl),
        "the GGUF's own template"
    );
    assert!(props["model_path"]
        .as_str()
        .unwrap()
        .ends_with("fixtures/tiny-q8_0.gguf"));
    insta::assert_json_snapshot!("props", props, {
        ".chat_template" => "[template]",
        ".model_path" => "[path]",
        ".default_generation_settings.params.seed" => "[seed]",
        ".build_info" => "[build]",
    });

    let r = get(h.addr, "/slots");
    assert_eq!(r.status, 200);
    insta::assert_json_snapshot!("slots_idle", r.json());
    h.stop().unwrap();
}

#[test]
fn chat_completion() {
    let h = start();
    let r = post(h.addr, "/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["id"].as_str().unwrap().starts_with("chatcmpl-"));
    assert_eq!(
        v["model"], "tern-test",
        "the alias, whatever the request named"
    );
    let t = &v["timings"];
    assert_eq!(t["predicted_n"], 6);
    assert_eq!(t["prompt_n"], v["usage"]["prompt_tokens"]);
    for k in [
        "prompt_ms",
        "prompt_per_second",
        "predicted_ms",
        "predicted_per_second",
        "draft_n",
        "draft_n_accepted",
    ] {
        assert!(t[k].is_number(), "timings.{k}");
    }
    // The generation prompt opens <think>: a random model never closes it within 6 tokens, so
    // the budget ends inside thinking.
    assert_eq!(v["choices"][0]["finish_reason"], "length");
    insta::assert_json_snapshot!("chat_completion", v, {
        ".system_fingerprint" => "[build]",
        ".id" => "[id]",
        ".created" => "[created]",
        ".timings" => "[timings]",
        ".choices[].message.content" => "[text]",
        ".choices[].message.reasoning_content" => "[text]",
    });

    // With thinking off the same request answers in content.
    let r = post(
        h.addr,
        "/v1/chat/completions",
        &chat_body(json!({"chat_template_kwargs": {"enable_thinking": false}})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["choices"][0]["message"]
        .get("reasoning_content")
        .is_none());
    assert!(!v["choices"][0]["message"]["content"]
        .as_str()
        .unwrap()
        .is_empty());
    // The prompt grew by the closed think block.
    assert!(v["usage"]["prompt_tokens"].as_u64().unwrap() > 20);

    // reasoning_effort at any level renders (mapped, never a 500); "none" turns thinking off.
    for e in ["low", "high", "minimal", "none", "bogus"] {
        let r = post(
            h.addr,
            "/v1/chat/completions",
            &chat_body(json!({"reasoning_effort": e})),
        );
        assert_eq!(r.status, 200, "{e}: {}", r.text());
    }
    h.stop().unwrap();
}

#[test]
fn chat_stream() {
    let h = start();
    let r = post(
        h.addr,
        "/v1/chat/completions",
        &chat_body(json!({"stream": true})),
    );
    assert_eq!(r.status, 200);
    assert_eq!(r.header("content-type"), Some("text/event-stream"));
    let events = r.sse();
    assert_eq!(events.last().map(String::as_str), Some("[DONE]"));
    let chunks: Vec<Value> = events[..events.len() - 1]
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    assert!(chunks.len() >= 2);
    let id = &chunks[0]["id"];
    assert!(chunks
        .iter()
        .all(|c| &c["id"] == id && c["object"] == "chat.completion.chunk"));
    assert_eq!(
        chunks[0]["choices"][0]["delta"],
        json!({"role": "assistant", "content": null})
    );
    let last = chunks.last().unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 6);
    assert_eq!(last["timings"]["predicted_n"], 6);
    // Only reasoning deltas in between (the budget ends inside thinking).
    for c in &chunks[1..chunks.len() - 1] {
        let d = c["choices"][0]["delta"].as_object().unwrap();
        assert!(d.keys().all(|k| k == "reasoning_content"), "{c}");
        assert!(c["choices"][0]["finish_reason"].is_null());
    }
    insta::assert_json_snapshot!("chat_stream_first_last", json!([chunks[0], last]), {
        "[].id" => "[id]",
        "[].created" => "[created]",
        "[].timings" => "[timings]",
        "[].system_fingerprint" => "[build]",
    });

    // stream_options.include_usage: the usage comes in a last chunk with no choices.
    let r = post(
        h.addr,
        "/v1/chat/completions",
        &chat_body(json!({"stream": true, "stream_options": {"include_usage": true}})),
    );
    let events = r.sse();
    let n = events.len();
    assert_eq!(events[n - 1], "[DONE]");
    let usage: Value = serde_json::from_str(&events[n - 2]).unwrap();
    assert_eq!(usage["choices"], json!([]));
    assert_eq!(
        usage["usage"]["total_tokens"],
        usage["usage"]["prompt_tokens"].as_u64().unwrap() + 6
    );
    let fin: Value = serde_json::from_str(&events[n - 3]).unwrap();
    assert_eq!(fin["choices"][0]["finish_reason"], "length");
    assert!(fin.get("usage").is_none());
    h.stop().unwrap();
}

#[test]
fn chat_with_tools_answers_in_the_openai_shape() {
    let h = start();
    let body = chat_body(json!({
        "tools": [{"type": "function", "function": {
            "name": "get_weather",
            "description": "Weather for a city",
            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
        }}],
        "tool_choice": "auto",
    }));
    let r = post(h.addr, "/apply-template", &body);
    assert_eq!(r.status, 200);
    let prompt = r.json()["prompt"].as_str().unwrap().to_string();
    assert!(prompt
        .contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"get_weather\""));
    let r = post(h.addr, "/v1/chat/completions", &body);
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    // A random model does not call the tool; the shape is still a chat completion.
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["choices"][0]["message"]["role"], "assistant");
    h.stop().unwrap();
}

#[test]
fn completions_openai_and_native() {
    let h = start();
    let r = post(
        h.addr,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 5, "seed": 1, "ignore_eos": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    insta::assert_json_snapshot!("v1_completions", r.json(), {
        ".id" => "[id]", ".created" => "[created]", ".timings" => "[timings]", ".choices[].text" => "[text]",
        ".system_fingerprint" => "[build]",
    });

    let r = post(
        h.addr,
        "/v1/completions",
        &json!({"prompt": "Once upon a time", "max_tokens": 5, "stream": true, "ignore_eos": true}),
    );
    let ev = r.sse();
    assert_eq!(ev.last().unwrap(), "[DONE]");
    let last: Value = serde_json::from_str(&ev[ev.len() - 2]).unwrap();
    assert_eq!(last["choices"][0]["finish_reason"], "length");
    assert_eq!(last["usage"]["completion_tokens"], 5);

    let r = post(
        h.addr,
        "/completion",
        &json!({"prompt": "Once upon a time", "n_predict": 4, "seed": 3, "ignore_eos": true, "return_tokens": true}),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert_eq!(v["tokens"].as_array().unwrap().len(), 4);
    assert_eq!(v["stop_type"], "limit");
    insta::assert_json_snapshot!("completion_native", v, {
        ".timings" => "[timings]", ".content" => "[text]", ".tokens" => "[tokens]", ".has_new_line" => "[bool]",
    });

    // llama-server's native stream: one object per token, the final one with stop: true, no [DONE].
    let r = post(
        h.addr,
        "/completion",
        &json!({"prompt": [1, 2, 3], "n_predict": 3, "stream": true, "ignore_eos": true}),
    );
    let ev: Vec<Value> = r
        .sse()
        .iter()
        .map(|e| serde_json::from_str(e).unwrap())
        .collect();
    let (last, partial) = ev.split_last().unwrap();
    assert!(partial.iter().all(|e| e["stop"] == false));
    // One object per token (plus, at the end, any text held back for an incomplete character).
    let per_token = partial
        .iter()
        .filter(|e| e["tokens"].as_array().unwrap().len() == 1)
        .count();
    assert_eq!(per_token, 3);
    assert_eq!(last["stop"], true);
    assert_eq!(last["tokens_predicted"], 3);
    assert_eq!(last["tokens_evaluated"], 3);
    h.stop().unwrap();
}

#[test]
fn tokenize_detokenize_apply_template() {
    let h = start();
    let r = post(h.addr, "/tokenize", &json!({"content": "Hello world"}));
    assert_eq!(r.status, 200);
    let tokens = r.json()["tokens"].clone();
    assert!(!tokens.as_array().unwrap().is_empty());
    let r = post(h.addr, "/detokenize", &json!({"tokens": tokens}));
    assert_eq!(r.json(), json!({"content": "Hello world"}));
    let r = post(
        h.addr,
        "/tokenize",
        &json!({"content": "Hi<|im_end|>", "with_pieces": true}),
    );
    let pieces = r.json()["tokens"].clone();
    assert_eq!(
        pieces.as_array().unwrap().last().unwrap()["piece"],
        "<|im_end|>"
    );

    let r = post(
        h.addr,
        "/apply-template",
        &json!({"messages": [{"role": "developer", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Hi"}]}]}),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        r.json(),
        json!({"prompt": "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n<think>\n"})
    );
    h.stop().unwrap();
}

/// Every malformed request is a 400 (or 404/405) in OpenAI's error shape; none is a 500 and
/// none takes the server down.
#[test]
fn bad_requests() {
    let h = start();
    let chat = "/v1/chat/completions";
    let user = json!([{"role": "user", "content": "hi"}]);
    let long = "word ".repeat(1500);
    let cases: Vec<(&str, &str, Vec<u8>)> = vec![
        ("bad json", chat, b"{\"messages\": [".to_vec()),
        ("not an object", chat, b"[1, 2]".to_vec()),
        ("empty body", chat, Vec::new()),
        ("no messages", chat, b"{}".to_vec()),
        ("empty messages", chat, json!({"messages": []}).to_string().into_bytes()),
        ("messages not an array", chat, json!({"messages": "hi"}).to_string().into_bytes()),
        ("unknown role", chat, json!({"messages": [{"role": "wizard", "content": "hi"}]}).to_string().into_bytes()),
        ("role not a string", chat, json!({"messages": [{"role": 3, "content": "hi"}]}).to_string().into_bytes()),
        ("no content", chat, json!({"messages": [{"role": "user"}]}).to_string().into_bytes()),
        ("content a number", chat, json!({"messages": [{"role": "user", "content": 5}]}).to_string().into_bytes()),
        ("no user message", chat, json!({"messages": [{"role": "system", "content": "x"}]}).to_string().into_bytes()),
        ("image part", chat, json!({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}]}]}).to_string().into_bytes()),
        ("negative max_tokens", chat, json!({"messages": user, "max_tokens": -5}).to_string().into_bytes()),
        ("huge max_tokens", chat, json!({"messages": user, "max_tokens": 1e20}).to_string().into_bytes()),
        ("max_tokens a string", chat, json!({"messages": user, "max_tokens": "10"}).to_string().into_bytes()),
        ("fractional max_tokens", chat, json!({"messages": user, "max_tokens": 1.5}).to_string().into_bytes()),
        ("temperature a string", chat, json!({"messages": user, "temperature": "hot"}).to_string().into_bytes()),
        ("negative temperature", chat, json!({"messages": user, "temperature": -1}).to_string().into_bytes()),
        ("top_p above 1", chat, json!({"messages": user, "top_p": 1.5}).to_string().into_bytes()),
        ("stop a number", chat, json!({"messages": user, "stop": 3}).to_string().into_bytes()),
        ("n of 0", chat, json!({"messages": user, "n": 0}).to_string().into_bytes()),
        ("n over the slots", chat, json!({"messages": user, "n": 3}).to_string().into_bytes()),
        ("top_logprobs without logprobs", chat, json!({"messages": user, "top_logprobs": 2}).to_string().into_bytes()),
        ("unimplemented samplers", chat, json!({"messages": user, "samplers": ["top_k"]}).to_string().into_bytes()),
        ("logit_bias key not a token", chat, json!({"messages": user, "logit_bias": {"abc": 1}}).to_string().into_bytes()),
        ("logit_bias token out of vocab", chat, json!({"messages": user, "logit_bias": [[99999, 1]]}).to_string().into_bytes()),
        ("schema the library rejects", chat, json!({"messages": user, "response_format": {"type": "json_schema", "json_schema": {"schema": {"type": "object", "minProperties": "two"}}}}).to_string().into_bytes()),
        ("json_schema and grammar", "/completion", json!({"prompt": "x", "json_schema": {}, "grammar": "root ::= \"a\""}).to_string().into_bytes()),
        ("bad gbnf", "/completion", json!({"prompt": "x", "grammar": "root ::= \"a"}).to_string().into_bytes()),
        ("forced call without tools", chat, json!({"messages": user, "tool_choice": "required"}).to_string().into_bytes()),
        ("stream a string", chat, json!({"messages": user, "stream": "yes"}).to_string().into_bytes()),
        ("tools not an array", chat, json!({"messages": user, "tools": {}}).to_string().into_bytes()),
        ("tool without a name", chat, json!({"messages": user, "tools": [{"type": "function", "function": {}}]}).to_string().into_bytes()),
        ("bad tool_choice", chat, json!({"messages": user, "tool_choice": "sometimes"}).to_string().into_bytes()),
        ("bad tool-call arguments", chat, json!({"messages": [{"role": "user", "content": "x"}, {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{not json"}}]}]}).to_string().into_bytes()),
        ("enable_thinking a string", chat, json!({"messages": user, "chat_template_kwargs": {"enable_thinking": "yes"}}).to_string().into_bytes()),
        ("bad response_format", chat, json!({"messages": user, "response_format": {"type": "yaml"}}).to_string().into_bytes()),
        ("bad reasoning_format", chat, json!({"messages": user, "reasoning_format": "xml"}).to_string().into_bytes()),
        ("prompt over the slot window", chat, json!({"messages": [{"role": "user", "content": long}]}).to_string().into_bytes()),
        ("completion without prompt", "/completion", b"{}".to_vec()),
        ("completion token out of vocab", "/completion", json!({"prompt": [1, 99999]}).to_string().into_bytes()),
        ("completion negative token", "/v1/completions", json!({"prompt": [1, -2]}).to_string().into_bytes()),
        ("completion n_predict -7", "/completion", json!({"prompt": "x", "n_predict": -7}).to_string().into_bytes()),
        ("detokenize bad ids", "/detokenize", json!({"tokens": [1, "a"]}).to_string().into_bytes()),
        ("tokenize content a number", "/tokenize", json!({"content": 3}).to_string().into_bytes()),
    ];
    let mut seen = Vec::new();
    for (name, path, body) in &cases {
        let r = post_raw(h.addr, path, body);
        let v = r.json();
        assert_eq!(r.status, 400, "{name}: {v}");
        assert_eq!(v["error"]["code"], 400, "{name}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty()),
            "{name}"
        );
        seen.push(json!({"case": name, "status": r.status, "body": v}));
    }
    let r = get(h.addr, "/no/such/route");
    seen.push(json!({"case": "unknown route", "status": r.status, "body": r.json()}));
    assert_eq!(r.status, 404);
    let r = get(h.addr, "/v1/chat/completions");
    seen.push(json!({"case": "wrong method", "status": r.status, "body": r.json()}));
    assert_eq!(r.status, 405);
    insta::assert_json_snapshot!("bad_requests", seen);

    let over = seen
        .iter()
        .find(|c| c["case"] == "prompt over the slot window")
        .unwrap();
    assert_eq!(over["body"]["error"]["type"], "exceed_context_size_error");
    assert_eq!(over["body"]["error"]["n_ctx"], 1024);
    assert!(over["body"]["error"]["n_prompt_tokens"].as_u64().unwrap() > 1024);

    // Still serving.
    let r = post(h.addr, "/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(r.status, 200);
    h.stop().unwrap();
}

#[test]
fn api_key_protects_everything_but_health() {
    let mut s = settings();
    s.api_key = Some("sekrit".into());
    let h = start_with(s, options());
    assert_eq!(get(h.addr, "/health").status, 200);
    for path in ["/v1/models", "/props", "/slots", "/metrics"] {
        let r = get(h.addr, path);
        assert_eq!(r.status, 401, "{path}");
        assert_eq!(
            r.json(),
            json!({"error": {"code": 401, "message": "Invalid API Key", "type": "authentication_error"}})
        );
    }
    let r = request(
        h.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer wrong")],
        None,
    );
    assert_eq!(r.status, 401);
    let r = request(
        h.addr,
        "GET",
        "/v1/models",
        &[("Authorization", "Bearer sekrit")],
        None,
    );
    assert_eq!(r.status, 200);
    let r = request(
        h.addr,
        "GET",
        "/v1/models",
        &[("X-Api-Key", "sekrit")],
        None,
    );
    assert_eq!(r.status, 200);
    let body = chat_body(json!({})).to_string();
    let r = request(
        h.addr,
        "POST",
        "/v1/chat/completions",
        &[],
        Some(body.as_bytes()),
    );
    assert_eq!(r.status, 401);
    let r = request(
        h.addr,
        "POST",
        "/v1/chat/completions",
        &[("Authorization", "Bearer sekrit")],
        Some(body.as_bytes()),
    );
    assert_eq!(r.status, 200);
    h.stop().unwrap();
}

#[test]
fn metrics_without_the_flag_is_501() {
    let mut s = settings();
    s.metrics = None;
    let h = start_with(s, options());
    let r = get(h.addr, "/metrics");
    assert_eq!(r.status, 501);
    assert_eq!(r.json()["error"]["type"], "not_supported_error");
    assert_eq!(get(h.addr, "/health").status, 200);
    h.stop().unwrap();
}

#[test]
fn metrics_families_and_counters() {
    let h = start();
    let before = get(h.addr, "/metrics");
    assert_eq!(before.status, 200);
    assert!(before
        .header("content-type")
        .unwrap()
        .starts_with("text/plain"));
    let text = before.text();
    let families: Vec<&str> = text
        .lines()
        .filter_map(|l| l.strip_prefix("# TYPE llamacpp:"))
        .map(|l| l.split_whitespace().next().unwrap())
        .collect();
    insta::assert_json_snapshot!("metrics_families", families);
    assert_eq!(families.len(), 16, "15 families + the per-position counter");
    let r = post(h.addr, "/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(r.status, 200);
    let after = get(h.addr, "/metrics").text();
    let value = |t: &str, name: &str| -> f64 {
        t.lines()
            .find_map(|l| l.strip_prefix(&format!("llamacpp:{name} ")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{name} in {t}"))
    };
    assert!(value(&after, "prompt_tokens_total") > value(&text, "prompt_tokens_total"));
    assert_eq!(
        value(&after, "tokens_predicted_total") - value(&text, "tokens_predicted_total"),
        6.0
    );
    assert!(value(&after, "n_decode_total") >= 6.0);
    assert!(after.contains("tern:memory_ledger_bytes{term=\"kv\"}"));
    // The boot ledger: the KV the engine allocated is the KV the planner projected.
    let gauge = |family: &str| -> f64 {
        after
            .lines()
            .find_map(|l| l.strip_prefix(&format!("{family}{{term=\"kv\"}} ")))
            .and_then(|v| v.parse().ok())
            .unwrap_or_else(|| panic!("{family} kv in {after}"))
    };
    assert!(gauge("tern:memory_allocated_bytes") > 0.0);
    assert_eq!(
        gauge("tern:memory_allocated_bytes"),
        gauge("tern:memory_ledger_bytes")
    );
    h.stop().unwrap();
}

/// A later request that extends an earlier prompt reuses the slot's cache.
#[test]
fn prefix_cache_is_reported_in_cached_tokens() {
    let h = start();
    let first: Vec<u32> = (10..60).collect();
    let r = post(
        h.addr,
        "/v1/completions",
        &json!({"prompt": first, "max_tokens": 2, "ignore_eos": true}),
    );
    assert_eq!(
        r.json()["usage"]["prompt_tokens_details"]["cached_tokens"],
        0
    );
    let mut second = first.clone();
    second.extend(200..220);
    let r = post(
        h.addr,
        "/v1/completions",
        &json!({"prompt": second, "max_tokens": 2, "ignore_eos": true}),
    );
    let v = r.json();
    assert_eq!(v["usage"]["prompt_tokens"], 70);
    assert_eq!(v["usage"]["prompt_tokens_details"]["cached_tokens"], 50);
    assert_eq!(v["timings"]["prompt_n"], 20);
    assert_eq!(v["timings"]["cache_n"], 50);
    h.stop().unwrap();
}

/// Five requests over two slots: the extra ones wait for a slot; all succeed.
#[test]
fn more_requests_than_slots_wait_and_succeed() {
    let h = start();
    let addr = h.addr;
    let threads: Vec<_> = (0..5)
        .map(|i| {
            std::thread::spawn(move || {
                let b =
                    json!({"prompt": format!("request {i}"), "max_tokens": 24, "ignore_eos": true});
                post(addr, "/v1/completions", &b)
            })
        })
        .collect();
    for t in threads {
        let r = t.join().unwrap();
        assert_eq!(r.status, 200, "{}", r.text());
        assert_eq!(r.json()["usage"]["completion_tokens"], 24);
    }
    h.stop().unwrap();
}

/// A client that disconnects mid-stream frees its slot.
#[test]
fn a_client_that_disconnects_frees_its_slot() {
    let h = start_with(long_settings(), options());
    let body = chat_body(json!({"stream": true, "max_tokens": 100000}));
    let mut conn = open_stream(h.addr, "/v1/chat/completions", &body);
    let mut line = String::new();
    conn.read_line(&mut line).unwrap();
    let busy = |addr| {
        get(addr, "/slots")
            .json()
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["is_processing"] == true)
            .count()
    };
    assert!(
        eventually(Duration::from_secs(5), || busy(h.addr) == 1),
        "the stream holds a slot"
    );
    drop(conn);
    assert!(
        eventually(Duration::from_secs(5), || busy(h.addr) == 0),
        "the slot is freed"
    );
    let m = get(h.addr, "/metrics").text();
    assert!(m.contains("llamacpp:requests_processing 0"), "{m}");
    // Both slots serve again.
    let r = post(h.addr, "/v1/chat/completions", &chat_body(json!({})));
    assert_eq!(r.status, 200);
    h.stop().unwrap();
}

/// Shutdown with a stream in flight: it is cancelled after the drain window and the server
/// stops well within 5 s.
#[test]
fn shutdown_cancels_in_flight_work_within_seconds() {
    let mut o = options();
    o.drain = Duration::from_millis(300);
    let h = start_with(long_settings(), o);
    let body = chat_body(json!({"stream": true, "max_tokens": 100000}));
    let mut conn = open_stream(h.addr, "/v1/chat/completions", &body);
    let reader = std::thread::spawn(move || {
        let mut all = String::new();
        let mut line = String::new();
        while conn.read_line(&mut line).map(|n| n > 0).unwrap_or(false) {
            all.push_str(&line);
            line.clear();
        }
        all
    });
    let t0 = Instant::now();
    h.stop().unwrap();
    assert!(t0.elapsed() < Duration::from_secs(5), "{:?}", t0.elapsed());
    let all = reader.join().unwrap();
    assert!(
        all.contains("the server is shutting down"),
        "{}",
        &all[all.len().saturating_sub(400)..]
    );
}

/// /health is 503 until the model is loaded (every route is, as in llama-server).
#[test]
fn health_is_503_while_loading() {
    let p = tern::server::prepare(settings()).unwrap();
    let app = tern::server::routes::router(p.state().clone(), 1 << 20);
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .unwrap();
    let listener = rt
        .block_on(tokio::net::TcpListener::bind("127.0.0.1:0"))
        .unwrap();
    let addr = listener.local_addr().unwrap();
    let server = std::thread::spawn(move || {
        rt.block_on(async move {
            let _ = tokio::time::timeout(
                Duration::from_secs(5),
                axum::serve(listener, app).into_future(),
            )
            .await;
        })
    });
    let r = get(addr, "/health");
    assert_eq!(r.status, 503);
    assert_eq!(
        r.json(),
        json!({"error": {"code": 503, "message": "Loading model", "type": "unavailable_error"}})
    );
    assert_eq!(get(addr, "/v1/models").status, 503);
    drop(server);
}

/// `--spec-type draft-mtp` (the fixture has an MTP head): drafts show in the timings, the
/// counters and the per-position series; `--reasoning off` renders the closed think block.
#[test]
fn drafting_and_reasoning_off() {
    let mut s = settings();
    s.spec_type = Some(tern::plan::SpecType::DraftMtp);
    s.spec_draft_n_max = Some(2);
    s.reasoning = Some(tern::config::Reasoning::Off);
    let h = start_with(s, options());
    let props = get(h.addr, "/props").json();
    let p = &props["default_generation_settings"]["params"];
    assert_eq!(p["speculative.type"], "draft-mtp");
    assert_eq!(p["speculative.n_max"], 2);
    let r = post(
        h.addr,
        "/v1/chat/completions",
        &chat_body(json!({"max_tokens": 24, "temperature": 0})),
    );
    assert_eq!(r.status, 200, "{}", r.text());
    let v = r.json();
    assert!(v["timings"]["draft_n"].as_u64().unwrap() > 0, "{v}");
    assert!(v["timings"]["draft_n_accepted"].is_u64());
    // Thinking is off: the answer is content, not reasoning.
    assert!(
        v["choices"][0]["message"]
            .get("reasoning_content")
            .is_none(),
        "{v}"
    );
    let m = get(h.addr, "/metrics").text();
    let drafted: f64 = m
        .lines()
        .find_map(|l| l.strip_prefix("llamacpp:spec_decode_num_draft_tokens_total "))
        .unwrap()
        .parse()
        .unwrap();
    assert!(drafted > 0.0);
    for pos in 0..2 {
        assert!(
            m.contains(&format!(
                "llamacpp:spec_decode_num_accepted_tokens_per_pos_total{{position=\"{pos}\"}} "
            )),
            "{m}"
        );
    }
    // The adaptive depth's inputs, measured by the engine: a draft step, and decode steps
    // by their rows (a verify of up to n_max + 1 rows).
    let value = |prefix: &str| -> Vec<f64> {
        m.lines()
            .filter_map(|l| l.strip_prefix(prefix))
            .map(|v| v.rsplit(' ').next().unwrap().parse().unwrap())
            .collect()
    };
    let draft = value("tern:draft_step_seconds ");
    assert!(draft.len() == 1 && draft[0] > 0.0, "{m}");
    let steps = value("tern:decode_step_seconds{rows=");
    assert!(
        !steps.is_empty() && steps.len() <= 3 && steps.iter().all(|&s| s > 0.0),
        "{m}"
    );
    h.stop().unwrap();
}

/// `reasoning_format: none` per request leaves the think block in the content.
#[test]
fn reasoning_format_none_per_request() {
    let h = start();
    let r = post(
        h.addr,
        "/v1/chat/completions",
        &chat_body(json!({"reasoning_format": "none"})),
    );
    assert_eq!(r.status, 200);
    let v = r.json();
    let msg = &v["choices"][0]["message"];
    assert!(msg.get("reasoning_content").is_none(), "{v}");
    assert!(!msg["content"].as_str().unwrap().is_empty());
    h.stop().unwrap();
}
