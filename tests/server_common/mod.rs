//! Shared by the server tests: a tern server on an ephemeral 127.0.0.1 port over the fixture
//! model, and a small blocking HTTP/1.1 client (Content-Length and chunked bodies, SSE).

#![allow(dead_code)]

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::path::PathBuf;
use std::time::Duration;

use serde_json::Value;
use tern::config::Settings;
use tern::plan::BackendKind;
use tern::server::{Handle, Options};

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

/// The settings every test server starts from: the Q8_0 fixture on the CPU, 2 slots of 1024
/// tokens, metrics on, a fixed alias, quiet logs.
pub fn settings() -> Settings {
    Settings {
        model: Some(fixture("tiny-q8_0.gguf")),
        alias: Some("tern-test".into()),
        host: Some("127.0.0.1".into()),
        port: Some(0),
        ctx_size: Some(2048),
        parallel: Some(2),
        metrics: Some(true),
        backend: Some(BackendKind::Cpu),
        log_verbosity: Some(1),
        ..Default::default()
    }
}

/// Two slots at the fixture's whole trained window (4096 tokens): a generation long enough to
/// still be running while a test disconnects or shuts down.
pub fn long_settings() -> Settings {
    Settings {
        ctx_size: Some(8192),
        ..settings()
    }
}

/// 256 KiB bodies; a 2.5 s drain so that a test stopping with work in flight ends soon (the
/// drain's own tests set theirs).
pub fn options() -> Options {
    Options {
        body_limit: 256 << 10,
        drain: Duration::from_millis(2500),
        ..Default::default()
    }
}

pub fn start_with(s: Settings, o: Options) -> Handle {
    let h = tern::server::spawn(s, o).expect("the server starts");
    assert!(h.wait_ready(Duration::from_secs(60)), "the model loads");
    h
}

pub fn start() -> Handle {
    start_with(settings(), options())
}

#[derive(Debug)]
pub struct Resp {
    pub status: u16,
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl Resp {
    pub fn json(&self) -> Value {
        serde_json::from_slice(&self.body)
            .unwrap_or_else(|e| panic!("not JSON ({e}): {}", String::from_utf8_lossy(&self.body)))
    }

    pub fn text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    pub fn header(&self, name: &str) -> Option<&str> {
        self.headers
            .iter()
            .find(|(k, _)| k.eq_ignore_ascii_case(name))
            .map(|(_, v)| v.as_str())
    }

    /// The finish reason of the first choice: from the chunk that carries it in a stream,
    /// else from the body.
    pub fn finish_reason(&self) -> Option<String> {
        let reason = |v: &Value| {
            v["choices"][0]["finish_reason"]
                .as_str()
                .map(str::to_string)
        };
        if self.header("content-type") == Some("text/event-stream") {
            self.sse()
                .iter()
                .filter_map(|e| serde_json::from_str::<Value>(e).ok())
                .find_map(|e| reason(&e))
        } else {
            reason(&self.json())
        }
    }

    /// The `data:` payloads of an SSE body, in order.
    pub fn sse(&self) -> Vec<String> {
        self.text()
            .split("\n\n")
            .filter_map(|e| e.strip_prefix("data: "))
            .map(str::to_string)
            .collect()
    }
}

fn write_request(
    s: &mut TcpStream,
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) {
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    for (k, v) in headers {
        head.push_str(&format!("{k}: {v}\r\n"));
    }
    if let Some(b) = body {
        head.push_str(&format!(
            "Content-Type: application/json\r\nContent-Length: {}\r\n",
            b.len()
        ));
    }
    head.push_str("\r\n");
    s.write_all(head.as_bytes()).unwrap();
    if let Some(b) = body {
        // The server may answer (and close) before reading an oversize body.
        let _ = s.write_all(b);
    }
}

/// Reads the status line and headers.
fn read_head(r: &mut BufReader<TcpStream>) -> (u16, Vec<(String, String)>) {
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    let status: u16 = line
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or_else(|| panic!("bad status line {line:?}"));
    let mut headers = Vec::new();
    loop {
        let mut l = String::new();
        r.read_line(&mut l).unwrap();
        let l = l.trim_end();
        if l.is_empty() {
            break;
        }
        if let Some((k, v)) = l.split_once(':') {
            headers.push((k.trim().to_string(), v.trim().to_string()));
        }
    }
    (status, headers)
}

pub fn request(
    addr: SocketAddr,
    method: &str,
    path: &str,
    headers: &[(&str, &str)],
    body: Option<&[u8]>,
) -> Resp {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write_request(&mut s, addr, method, path, headers, body);
    let mut r = BufReader::new(s);
    let (status, headers) = read_head(&mut r);
    let chunked = headers.iter().any(|(k, v)| {
        k.eq_ignore_ascii_case("transfer-encoding") && v.eq_ignore_ascii_case("chunked")
    });
    let mut body = Vec::new();
    if chunked {
        loop {
            let mut size = String::new();
            if r.read_line(&mut size).unwrap() == 0 {
                break;
            }
            let n = usize::from_str_radix(size.trim(), 16).unwrap_or(0);
            if n == 0 {
                break;
            }
            let mut chunk = vec![0; n + 2];
            r.read_exact(&mut chunk).unwrap();
            body.extend_from_slice(&chunk[..n]);
        }
    } else {
        let _ = r.read_to_end(&mut body);
    }
    Resp {
        status,
        headers,
        body,
    }
}

/// A port nothing listens on now (for a `tern serve` child process).
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

pub fn get(addr: SocketAddr, path: &str) -> Resp {
    request(addr, "GET", path, &[], None)
}

pub fn post(addr: SocketAddr, path: &str, body: &Value) -> Resp {
    request(addr, "POST", path, &[], Some(body.to_string().as_bytes()))
}

pub fn post_raw(addr: SocketAddr, path: &str, body: &[u8]) -> Resp {
    request(addr, "POST", path, &[], Some(body))
}

/// Starts a streamed request and returns the open connection once the response head and the
/// first bytes of the body have arrived.
pub fn open_stream(addr: SocketAddr, path: &str, body: &Value) -> BufReader<TcpStream> {
    let mut s = TcpStream::connect(addr).unwrap();
    s.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
    write_request(
        &mut s,
        addr,
        "POST",
        path,
        &[],
        Some(body.to_string().as_bytes()),
    );
    let mut r = BufReader::new(s);
    let (status, _) = read_head(&mut r);
    assert_eq!(status, 200);
    let mut first = String::new();
    r.read_line(&mut first).unwrap();
    r
}

/// Polls `f` until it is true or `timeout` passes.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let t0 = std::time::Instant::now();
    while t0.elapsed() < timeout {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    f()
}
