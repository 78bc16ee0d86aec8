//! End to end: the `tern serve` binary on a free port with the fixture model and 2 slots, the
//! official `openai` Python client against it (tests/e2e/openai_client.py: a chat, a stream,
//! tools, an error, 5 concurrent requests), then /metrics, then SIGTERM. Also the boot
//! refusals: a shape that does not fit, a missing file, an unknown flag or config key.

mod scratch;
mod server_common;

use std::io::Read;
use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use server_common::{eventually, fixture, free_port, get};

const TERN: &str = env!("CARGO_BIN_EXE_tern");

/// Kills the server if a check fails before SIGTERM.
struct Server(Option<Child>);

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(c) = &mut self.0 {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn sigterm(pid: u32) {
    let ok = Command::new("kill")
        .args(["-TERM", &pid.to_string()])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "kill -TERM {pid}");
}

fn metric(text: &str, name: &str) -> f64 {
    text.lines()
        .find_map(|l| l.strip_prefix(&format!("llamacpp:{name} ")))
        .and_then(|v| v.parse().ok())
        .unwrap_or_else(|| panic!("no llamacpp:{name} in\n{text}"))
}

#[test]
fn openai_client_against_tern_serve() {
    let have_openai = Command::new("python3")
        .args(["-c", "import openai"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !have_openai {
        println!(
            "SKIPPED openai_client_against_tern_serve: `python3 -c \"import openai\"` fails \
             (pip install openai; .ci/run installs the pinned version)"
        );
        return;
    }
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let model = fixture("tiny-q8_0.gguf");
    let child = Command::new(TERN)
        .args(["serve", "--model"])
        .arg(&model)
        .args([
            "--port",
            &port.to_string(),
            "--parallel",
            "2",
            "--ctx-size",
            "4096",
            "--backend",
            "cpu",
            "--metrics",
            "--alias",
            "tern-e2e",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("tern serve starts");
    let mut server = Server(Some(child));
    let up = eventually(Duration::from_secs(60), || {
        std::net::TcpStream::connect(addr).is_ok() && get(addr, "/health").status == 200
    });
    assert!(up, "tern serve answers /health");

    let out = Command::new("python3")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tests/e2e/openai_client.py"
        ))
        .args(["--base-url", &format!("http://{addr}")])
        .output()
        .expect("python3 runs");
    let transcript = String::from_utf8_lossy(&out.stdout);
    println!("--- openai client transcript ---\n{transcript}");
    eprintln!("{}", String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success(), "the openai client checks pass");
    assert!(transcript.contains("all checks passed"));

    let m = get(addr, "/metrics");
    assert_eq!(m.status, 200);
    let text = m.text();
    println!("--- /metrics ---\n{text}");
    assert!(metric(&text, "prompt_tokens_total") > 0.0);
    // 16 + 24 + 16 + 8 + 5 × 24 at most; each request generates at least one token.
    assert!(metric(&text, "tokens_predicted_total") >= 9.0);
    assert!(metric(&text, "n_decode_total") > 0.0);
    assert!(metric(&text, "prompt_seconds_total") > 0.0);
    assert!(metric(&text, "n_busy_slots_per_decode") >= 1.0);
    assert_eq!(metric(&text, "requests_processing"), 0.0);

    // SIGTERM: exits 0 within 5 s.
    let mut child = server.0.take().unwrap();
    let t0 = Instant::now();
    sigterm(child.id());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "exits within 5 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    let mut log = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut log);
    }
    println!("--- tern serve log ---\n{log}");
    assert!(status.success(), "exit status {status:?}");
    assert!(
        log.contains("fits: needs"),
        "the boot summary says it fits and by how much"
    );
    assert!(
        !log.contains("boot ledger"),
        "the full ledger is at debug only: {log}"
    );
}

/// SIGTERM with a generation in flight that outlasts `--drain-timeout`: the stream is cut off
/// at the limit and the process exits 0 within a few seconds of it.
#[test]
fn sigterm_with_a_stream_in_flight() {
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let child = Command::new(TERN)
        .args(["serve", "--model"])
        .arg(fixture("tiny-q8_0.gguf"))
        .args([
            "--port",
            &port.to_string(),
            "--backend",
            "cpu",
            "--ctx-size",
            "4096",
            "--drain-timeout",
            "1",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut server = Server(Some(child));
    assert!(eventually(Duration::from_secs(60), || {
        std::net::TcpStream::connect(addr).is_ok() && get(addr, "/health").status == 200
    }));
    let body = serde_json::json!({
        "messages": [{"role": "user", "content": "Tell me a long story."}],
        "stream": true, "max_tokens": 100000, "ignore_eos": true
    });
    let _conn = server_common::open_stream(addr, "/v1/chat/completions", &body);
    let mut child = server.0.take().unwrap();
    let t0 = Instant::now();
    sigterm(child.id());
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        assert!(
            t0.elapsed() < Duration::from_secs(5),
            "exits within 5 s of SIGTERM"
        );
        std::thread::sleep(Duration::from_millis(20));
    };
    assert!(status.success(), "{status:?}");
}

fn serve_fails(args: &[&str]) -> String {
    let out = Command::new(TERN)
        .arg("serve")
        .args(args)
        .output()
        .expect("tern runs");
    assert!(
        !out.status.success(),
        "tern serve {args:?} must refuse to start"
    );
    String::from_utf8_lossy(&out.stderr).into_owned()
}

#[test]
fn boot_refusals_name_the_cause() {
    let model = fixture("tiny-q8_0.gguf");
    let model = model.to_str().unwrap();
    let port = free_port().to_string();
    let base = [
        "--model",
        model,
        "--backend",
        "cpu",
        "--port",
        port.as_str(),
    ];

    // A shape that does not fit: the ledger is printed and the boot refused before any load.
    let mut a = base.to_vec();
    a.extend(["--device-mib", "512"]);
    let err = serve_fails(&a);
    assert!(
        err.contains("term") && err.contains("kv") && err.contains("does not fit"),
        "{err}"
    );

    let err = serve_fails(&["--model", "/nonexistent/model.gguf", "--backend", "cpu"]);
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");

    let mut a = base.to_vec();
    a.extend(["--mmproj", "/nonexistent/mmproj.gguf"]);
    let err = serve_fails(&a);
    assert!(err.contains("/nonexistent/mmproj.gguf"), "{err}");

    let mut a = base.to_vec();
    a.extend(["--chat-template-file", "/nonexistent/t.jinja"]);
    let err = serve_fails(&a);
    assert!(err.contains("/nonexistent/t.jinja"), "{err}");

    let mut a = base.to_vec();
    a.push("--kv-cache-type");
    let err = serve_fails(&a);
    assert!(err.contains("--kv-cache-type"), "{err}");

    let dir = scratch::dir("serve-boot");
    let cfg = dir.join("tern.yaml");
    std::fs::write(&cfg, "parallel: 2\nkv-cache-type: f16\n").unwrap();
    let mut a = base.to_vec();
    a.extend(["--config", cfg.to_str().unwrap()]);
    let err = serve_fails(&a);
    assert!(err.contains("kv-cache-type"), "{err}");

    // A window past the trained context.
    let mut a = base.to_vec();
    a.extend(["--ctx-size", "16384"]);
    let err = serve_fails(&a);
    assert!(err.contains("4096") || err.contains("4,096"), "{err}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// The YAML config and the flags merge (file, then flags) into the served shape.
#[test]
fn config_file_then_flags() {
    let dir = scratch::dir("serve-cfg");
    let cfg = dir.join("tern.yaml");
    let port = free_port();
    std::fs::write(
        &cfg,
        format!(
            "model: {}\nalias: from-file\nparallel: 2\nctx-size: 1024\nbackend: cpu\nport: {port}\npresence-penalty: 1.0\n",
            fixture("tiny-q8_0.gguf").display()
        ),
    )
    .unwrap();
    let child = Command::new(TERN)
        .args(["serve", "--config"])
        .arg(&cfg)
        .args(["--alias", "from-flag"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut server = Server(Some(child));
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert!(eventually(Duration::from_secs(60), || {
        std::net::TcpStream::connect(addr).is_ok() && get(addr, "/health").status == 200
    }));
    let props = get(addr, "/props").json();
    assert_eq!(props["model_alias"], "from-flag");
    assert_eq!(props["total_slots"], 2);
    assert_eq!(props["default_generation_settings"]["n_ctx"], 512);
    assert_eq!(
        props["default_generation_settings"]["params"]["presence_penalty"],
        1.0
    );
    let mut child = server.0.take().unwrap();
    sigterm(child.id());
    assert!(child.wait().unwrap().success());
    let _ = std::fs::remove_dir_all(&dir);
}

/// llama-server's environment and flags, and the access log in JSON: one line per request with
/// time, method, path, status, latency, tokens and slot.
#[test]
fn access_log_in_json_from_llama_server_settings() {
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let dir = scratch::dir("serve-log");
    let log = dir.join("access.jsonl");
    let _ = std::fs::remove_file(&log);
    let child = Command::new(TERN)
        .args(["serve", "-m"])
        .arg(fixture("tiny-q8_0.gguf"))
        .args([
            "-np",
            "2",
            "-c",
            "2048",
            "-ngl",
            "99",
            "-cb",
            "--backend",
            "cpu",
        ])
        .args(["--log-format", "json", "--log-file"])
        .arg(&log)
        .env("LLAMA_ARG_PORT", port.to_string())
        .env("LLAMA_API_KEY", "k1,k2")
        .env("LLAMA_ARG_ENDPOINT_METRICS", "1")
        .env("RUST_BACKTRACE", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut server = Server(Some(child));
    assert!(eventually(Duration::from_secs(60), || {
        std::net::TcpStream::connect(addr).is_ok() && get(addr, "/health").status == 200
    }));
    let key = [("Authorization", "Bearer k2")];
    let chat = serde_json::json!({
        "messages": [{"role": "user", "content": "Hi"}], "max_tokens": 4, "ignore_eos": true
    })
    .to_string();
    let r = server_common::request(
        addr,
        "POST",
        "/v1/chat/completions",
        &key,
        Some(chat.as_bytes()),
    );
    assert_eq!(r.status, 200);
    let stream =
        serde_json::json!({"prompt": "Once", "max_tokens": 3, "stream": true, "ignore_eos": true})
            .to_string();
    let r = server_common::request(
        addr,
        "POST",
        "/v1/completions",
        &key,
        Some(stream.as_bytes()),
    );
    assert_eq!(r.status, 200);
    let r = server_common::request(
        addr,
        "POST",
        "/tokenize",
        &key,
        Some(br#"{"content":"Hi"}"#),
    );
    assert_eq!(r.status, 200);
    assert_eq!(
        server_common::request(addr, "GET", "/slots", &key, None).status,
        200
    );
    assert_eq!(get(addr, "/slots").status, 401, "LLAMA_API_KEY is read");
    assert_eq!(
        server_common::request(addr, "GET", "/metrics", &key, None).status,
        200
    );

    let mut child = server.0.take().unwrap();
    sigterm(child.id());
    assert!(child.wait().unwrap().success());
    let mut stderr = String::new();
    if let Some(mut e) = child.stderr.take() {
        let _ = e.read_to_string(&mut stderr);
    }
    let text = std::fs::read_to_string(&log).unwrap();
    let lines: Vec<serde_json::Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap_or_else(|e| panic!("not JSON ({e}): {l}")))
        .collect();
    let access: Vec<&serde_json::Value> = lines
        .iter()
        .filter(|l| l["target"] == "tern::access")
        .collect();
    println!("--- access log (JSON) ---");
    for l in &access {
        println!("{l}");
    }
    assert_eq!(
        access.len(),
        5,
        "one line per request; the polling routes (/health, /metrics) at debug: {text}"
    );
    for l in &access {
        for f in [
            "timestamp",
            "level",
            "method",
            "path",
            "status",
            "latency_ms",
            "remote",
        ] {
            assert!(!l[f].is_null(), "{f} in {l}");
        }
    }
    let chat_line = access
        .iter()
        .find(|l| l["path"] == "/v1/chat/completions")
        .unwrap();
    assert_eq!(chat_line["status"], 200);
    assert_eq!(chat_line["generated_tokens"], 4);
    assert!(chat_line["prompt_tokens"].as_u64().unwrap() > 0);
    assert!(chat_line["slot"].as_i64().unwrap() >= 0);
    let stream_line = access
        .iter()
        .find(|l| l["path"] == "/v1/completions")
        .unwrap();
    assert_eq!(
        stream_line["generated_tokens"], 3,
        "a stream is logged when it ends"
    );
    assert!(access.iter().any(|l| l["status"] == 401));
    // The warnings for -ngl and -cb, once each, in the same format.
    let warns: Vec<&serde_json::Value> = lines.iter().filter(|l| l["level"] == "WARN").collect();
    assert!(
        warns.iter().any(|l| l["message"]
            .as_str()
            .unwrap()
            .starts_with("-ngl 99: ignored")),
        "{text}"
    );
    assert!(
        warns
            .iter()
            .any(|l| l["message"].as_str().unwrap().starts_with("-cb: ignored")),
        "{text}"
    );
    assert!(!stderr.contains("stack backtrace"), "{stderr}");
    let _ = std::fs::remove_dir_all(&dir);
}
