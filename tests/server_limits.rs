//! The connection layer's bounds and the drain (issue #17): a 413 over `--max-body-mb`, a
//! cut-off body's 400 at `--timeout`, stalled and idle connections closed at
//! `--header-timeout`, `--max-connections`, a prompt refused by its length before it is
//! tokenized, and the drain: 6 requests over 2 slots at the stop signal, and SIGTERM on the
//! real binary (once: exit 0; twice: exit at once).

mod server_common;

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use server_common::*;

fn chat(content: &str, extra: Value) -> Value {
    let mut b = json!({
        "messages": [{"role": "user", "content": content}],
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

/// Reads until the peer closes (true) or `within` passes (false).
fn closed_within(s: &mut TcpStream, within: Duration) -> bool {
    s.set_read_timeout(Some(within)).unwrap();
    let mut buf = [0u8; 4096];
    let t0 = Instant::now();
    loop {
        match s.read(&mut buf) {
            Ok(0) => return true,
            Ok(_) => {}
            Err(e) if e.kind() == std::io::ErrorKind::ConnectionReset => return true,
            Err(_) => return false,
        }
        if t0.elapsed() > within {
            return false;
        }
    }
}

fn read_response(s: TcpStream) -> (u16, String) {
    let mut r = BufReader::new(s);
    let mut all = String::new();
    let _ = r.read_to_string(&mut all);
    let status = all
        .split_whitespace()
        .nth(1)
        .and_then(|s| s.parse().ok())
        .unwrap_or(0);
    (status, all)
}

#[test]
fn a_body_over_the_limit_is_a_413_in_openai_shape() {
    let h = start(); // 256 KiB bodies at most
    let path = "/v1/chat/completions";
    // By its Content-Length: answered before a byte of the body is sent.
    let mut s = TcpStream::connect(h.addr).unwrap();
    write!(
        s,
        "POST {path} HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 300000\r\n\r\n"
    )
    .unwrap();
    s.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let mut r = BufReader::new(s);
    let mut line = String::new();
    r.read_line(&mut line).unwrap();
    assert!(line.contains(" 413 "), "{line}");
    // A body sent whole: the same 413 and error object.
    let big = chat(&"x".repeat(300_000), json!({})).to_string();
    let r = post_raw(h.addr, path, big.as_bytes());
    assert_eq!(r.status, 413, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["code"], 413);
    assert_eq!(v["error"]["type"], "invalid_request_error");
    let m = v["error"]["message"].as_str().unwrap();
    assert!(
        m.contains("262144 bytes") && m.contains("--max-body-mb"),
        "{m}"
    );
    // Just under the limit is served.
    let ok = chat("hello", json!({})).to_string();
    assert_eq!(post_raw(h.addr, path, ok.as_bytes()).status, 200);
    h.stop().unwrap();
}

#[test]
fn a_cut_off_body_is_a_400_when_the_timeout_expires() {
    let mut s = settings();
    s.timeout = Some(1);
    let h = start_with(s, options());
    let mut c = TcpStream::connect(h.addr).unwrap();
    let t0 = Instant::now();
    write!(
        c,
        "POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n{{\"messages\""
    )
    .unwrap();
    c.set_read_timeout(Some(Duration::from_secs(10))).unwrap();
    let (status, all) = read_response(c);
    assert_eq!(status, 400, "{all}");
    assert!(all.contains("--timeout"), "{all}");
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(5),
        "{took:?}"
    );
    h.stop().unwrap();
}

#[test]
fn stalled_and_idle_connections_close_at_the_header_timeout() {
    let mut o = options();
    o.header_timeout = Duration::from_millis(700);
    let h = start_with(settings(), o);
    // A request head that never ends.
    let mut stalled = TcpStream::connect(h.addr).unwrap();
    stalled
        .write_all(b"GET /health HTTP/1.1\r\nHost: ")
        .unwrap();
    // A connection that never sends anything.
    let mut silent = TcpStream::connect(h.addr).unwrap();
    // A keep-alive connection idle after its first answer.
    let mut idle = TcpStream::connect(h.addr).unwrap();
    idle.write_all(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        .unwrap();
    idle.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
    let mut buf = [0u8; 1024];
    let n = idle.read(&mut buf).unwrap();
    assert!(String::from_utf8_lossy(&buf[..n]).contains("200 OK"));
    let t0 = Instant::now();
    for (name, c) in [
        ("stalled", &mut stalled),
        ("silent", &mut silent),
        ("idle", &mut idle),
    ] {
        assert!(
            closed_within(c, Duration::from_secs(5)),
            "{name} stays open"
        );
    }
    assert!(t0.elapsed() < Duration::from_secs(4), "{:?}", t0.elapsed());
    assert_eq!(get(h.addr, "/health").status, 200);
    h.stop().unwrap();
}

#[test]
fn connections_past_the_cap_wait_for_one_to_close() {
    let mut o = options();
    o.max_connections = 3;
    let h = start_with(settings(), o);
    let held: Vec<TcpStream> = (0..3)
        .map(|_| TcpStream::connect(h.addr).unwrap())
        .collect();
    std::thread::sleep(Duration::from_millis(200));
    // The fourth is in the listen backlog: not answered while the three are open.
    let mut extra = TcpStream::connect(h.addr).unwrap();
    extra
        .write_all(b"GET /health HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n")
        .unwrap();
    extra
        .set_read_timeout(Some(Duration::from_millis(500)))
        .unwrap();
    let mut buf = [0u8; 256];
    assert!(
        extra.read(&mut buf).is_err(),
        "answered past --max-connections"
    );
    drop(held);
    let (status, _) = read_response({
        extra
            .set_read_timeout(Some(Duration::from_secs(10)))
            .unwrap();
        extra
    });
    assert_eq!(status, 200);
    h.stop().unwrap();
}

#[test]
fn a_prompt_too_long_in_bytes_is_refused_before_tokenizing() {
    let mut o = options();
    o.body_limit = 32 << 20;
    let h = start_with(settings(), o);
    let body = chat(&"To be, or not to be. ".repeat(400_000), json!({})).to_string();
    let t0 = Instant::now();
    let r = post_raw(h.addr, "/v1/chat/completions", body.as_bytes());
    let took = t0.elapsed();
    assert_eq!(r.status, 400, "{}", r.text());
    let v = r.json();
    assert_eq!(v["error"]["type"], "exceed_context_size_error");
    assert_eq!(v["error"]["n_ctx"], 1024);
    let m = v["error"]["message"].as_str().unwrap();
    assert!(m.contains("at least"), "{m}");
    assert!(took < Duration::from_secs(5), "{took:?}");
    // /completion takes the same path.
    let body = json!({"prompt": "x".repeat(4_000_000)}).to_string();
    let r = post_raw(h.addr, "/completion", body.as_bytes());
    assert_eq!(r.status, 400);
    assert_eq!(r.json()["error"]["type"], "exceed_context_size_error");
    h.stop().unwrap();
}

/// Six requests over two slots at the stop signal: the two running finish whole within the
/// drain limit, the four waiting for a slot get a 503 with `Retry-After` at once, and the
/// server stops with success.
#[test]
fn the_drain_finishes_running_requests_and_refuses_waiting_ones() {
    let mut o = options();
    o.drain = Duration::from_secs(30);
    let h = start_with(long_settings(), o);
    let addr = h.addr;
    // Long enough that the two running requests cannot finish before the stop on a fast
    // machine (600 tokens of the tiny model took under 200 ms on a Zen 5 and let a third
    // request take a slot), within the slot's window of 4096.
    let max_tokens = 3500;
    let clients: Vec<_> = (0..6)
        .map(|i| {
            std::thread::spawn(move || {
                let stream = i % 2 == 1;
                let body = chat(
                    "Say hi.",
                    json!({"max_tokens": max_tokens, "stream": stream}),
                );
                let r = post(addr, "/v1/chat/completions", &body);
                (stream, r, Instant::now())
            })
        })
        .collect();
    let busy = |a: SocketAddr| {
        get(a, "/slots")
            .json()
            .as_array()
            .unwrap()
            .iter()
            .filter(|s| s["is_processing"] == true)
            .count()
    };
    assert!(eventually(Duration::from_secs(10), || busy(addr) == 2));
    // The stop comes once the other four wait for a slot (a sleep instead raced the running
    // requests' end).
    let waiting = |a: SocketAddr| {
        get(a, "/metrics")
            .text()
            .lines()
            .find_map(|l| l.strip_prefix("llamacpp:requests_deferred "))
            .and_then(|v| v.trim().parse::<f64>().ok())
    };
    assert!(eventually(Duration::from_secs(10), || waiting(addr) == Some(4.0)));
    let t0 = Instant::now();
    h.stop().unwrap();
    let stopped_in = t0.elapsed();
    let (mut finished, mut refused) = (0, 0);
    for c in clients {
        let (stream, r, arrived) = c.join().unwrap();
        match r.status {
            200 => {
                finished += 1;
                if stream {
                    assert_eq!(r.sse().last().map(String::as_str), Some("[DONE]"));
                    assert!(!r.text().contains("\"error\""), "{}", r.text());
                } else {
                    assert_eq!(r.json()["usage"]["completion_tokens"], max_tokens);
                }
                let finish = r.finish_reason();
                assert_eq!(finish.as_deref(), Some("length"), "{}", r.text());
            }
            503 => {
                refused += 1;
                assert_eq!(r.header("retry-after"), Some("1"));
                let v = r.json();
                assert_eq!(v["error"]["type"], "unavailable_error");
                let after = arrived.saturating_duration_since(t0);
                assert!(
                    after < Duration::from_secs(1),
                    "refused {after:?} after the stop"
                );
            }
            s => panic!("status {s}: {}", r.text()),
        }
    }
    assert_eq!((finished, refused), (2, 4));
    assert!(stopped_in < Duration::from_secs(20), "{stopped_in:?}");
}

fn spawn_serve(extra: &[&str]) -> (std::process::Child, SocketAddr) {
    let port = free_port();
    let child = Command::new(env!("CARGO_BIN_EXE_tern"))
        .args(["serve", "--model"])
        .arg(fixture("tiny-q8_0.gguf"))
        .args(["--backend", "cpu", "-c", "8192", "-np", "2", "-lv", "1"])
        .args(["--port", &port.to_string()])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    assert!(
        eventually(Duration::from_secs(60), || {
            TcpStream::connect(addr).is_ok() && get(addr, "/health").status == 200
        }),
        "tern serve is up"
    );
    (child, addr)
}

fn term(child: &std::process::Child) {
    // SAFETY: a plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(child.id() as i32, libc::SIGTERM);
    }
}

fn wait_exit(child: &mut std::process::Child, within: Duration) -> Option<i32> {
    let t0 = Instant::now();
    while t0.elapsed() < within {
        if let Some(s) = child.try_wait().unwrap() {
            return s.code();
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let _ = child.kill();
    None
}

#[test]
fn sigterm_drains_and_exits_0_and_a_second_one_exits_at_once() {
    // Idle: the drain has nothing to wait for.
    let (mut child, _) = spawn_serve(&["--drain-timeout", "30"]);
    term(&child);
    assert_eq!(wait_exit(&mut child, Duration::from_secs(5)), Some(0));
    // A stream running: the first signal waits for it, the second exits now.
    let (mut child, addr) = spawn_serve(&["--drain-timeout", "30"]);
    let body = chat("Say hi.", json!({"stream": true, "max_tokens": 100000}));
    let mut conn = open_stream(addr, "/v1/chat/completions", &body);
    term(&child);
    std::thread::sleep(Duration::from_millis(300));
    assert!(child.try_wait().unwrap().is_none(), "waits for the stream");
    let t0 = Instant::now();
    term(&child);
    assert_eq!(wait_exit(&mut child, Duration::from_secs(5)), Some(1));
    assert!(t0.elapsed() < Duration::from_secs(2), "{:?}", t0.elapsed());
    let mut rest = String::new();
    let _ = conn.read_to_string(&mut rest);
}
