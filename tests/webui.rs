//! The chat page at `/` (src/server/webui.rs): how it is served (open without a key, under
//! `--api-prefix`, revalidated by ETag, off with `--no-webui`), then the page itself in headless
//! Chromium driven by Playwright (tests/e2e/webui.py) against `tern serve` on the bundled
//! model. The browser test skips, saying why, where Chromium or Playwright is missing, unless
//! TERN_REQUIRE_CHROMIUM=1 (set by .ci/run, which installs both).

mod scratch;
mod server_common;

use std::net::SocketAddr;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use serde_json::json;
use server_common::{eventually, free_port, get, request, settings, start_with};

const TERN: &str = env!("CARGO_BIN_EXE_tern");
const CHROMIUM: &str = "/usr/bin/chromium";

#[test]
fn the_page_is_served_open_and_under_the_prefix() {
    let mut s = settings();
    s.api_key = Some("sekret".into());
    s.ui_config = Some(r#"{"systemMessage": "Be brief."}"#.into());
    let h = start_with(s, server_common::options());
    let page = get(h.addr, "/");
    assert_eq!(page.status, 200, "the page needs no key, as llama-server's");
    assert_eq!(
        page.header("content-type"),
        Some("text/html; charset=utf-8")
    );
    assert!(
        page.text().contains(r#"<base href="/">"#),
        "{}",
        page.text()
    );
    let csp = page.header("content-security-policy").unwrap();
    assert!(csp.contains("script-src 'self'") && !csp.contains("unsafe-inline"));
    assert_eq!(get(h.addr, "/index.html").text(), page.text());
    let mut total =
        page.body.len() - r#"<base href="/">"#.len() + r#"<base href="{{BASE}}">"#.len();
    for (file, ty) in [
        ("app.js", "text/javascript"),
        ("markdown.js", "text/javascript"),
        ("app.css", "text/css"),
    ] {
        let r = get(h.addr, &format!("/webui/{file}"));
        assert_eq!(r.status, 200, "/webui/{file}");
        assert!(r.header("content-type").unwrap().starts_with(ty));
        assert!(
            !r.text().contains("http://") && !r.text().contains("https://"),
            "{file} loads nothing from elsewhere"
        );
        total += r.body.len();
        // Revalidation: the same ETag answers 304 with no body.
        let tag = r.header("etag").unwrap().to_string();
        let again = request(
            h.addr,
            "GET",
            &format!("/webui/{file}"),
            &[("If-None-Match", &tag)],
            None,
        );
        assert_eq!(again.status, 304);
        assert!(again.body.is_empty());
    }
    assert_eq!(total, tern::server::webui::size_bytes());
    println!("the page in the binary: {total} bytes");
    assert_eq!(
        get(h.addr, "/webui/nope.js").status,
        401,
        "not a UI path: keyed"
    );
    assert_eq!(
        get(h.addr, "/props").status,
        401,
        "the API still needs the key"
    );
    let props = request(
        h.addr,
        "GET",
        "/props",
        &[("Authorization", "Bearer sekret")],
        None,
    )
    .json();
    assert_eq!(props["ui_settings"], json!({"systemMessage": "Be brief."}));
    h.stop().unwrap();

    let mut s = settings();
    s.api_prefix = Some("/llm".into());
    let h = start_with(s, server_common::options());
    for path in ["/llm/", "/llm", "/llm/index.html"] {
        let page = get(h.addr, path);
        assert_eq!(page.status, 200, "{path}");
        assert!(page.text().contains(r#"<base href="/llm/">"#), "{path}");
    }
    assert_eq!(get(h.addr, "/llm/webui/app.js").status, 200);
    assert_eq!(get(h.addr, "/llm/webui/nope.js").status, 404);
    assert_eq!(get(h.addr, "/webui/app.js").status, 404);
    h.stop().unwrap();

    let mut s = settings();
    s.webui = Some(false);
    let h = start_with(s, server_common::options());
    assert_eq!(get(h.addr, "/").status, 404);
    assert_eq!(get(h.addr, "/webui/app.js").status, 404);
    assert_eq!(get(h.addr, "/props").json()["ui_settings"], json!({}));
    h.stop().unwrap();
}

/// `--ui-config` that is not JSON stops the boot with a message naming it, as llama-server
/// refuses to start; `--ui-config-file` is read, and `--ui-config` wins over it.
#[test]
fn ui_config_is_json_or_the_boot_stops() {
    let mut s = settings();
    s.ui_config = Some("{temperature: 0".into());
    let err = format!(
        "{:#}",
        tern::server::spawn(s, server_common::options())
            .err()
            .unwrap()
    );
    assert!(
        err.contains("ui-config") && err.contains("not JSON"),
        "{err}"
    );

    let file = scratch::dir("webui").join("ui-config.json");
    std::fs::write(&file, r#"{"temperature": 0.2}"#).unwrap();
    let mut s = settings();
    s.ui_config_file = Some(file.clone());
    let h = start_with(s.clone(), server_common::options());
    assert_eq!(
        get(h.addr, "/props").json()["ui_settings"],
        json!({"temperature": 0.2})
    );
    h.stop().unwrap();
    s.ui_config = Some(r#"{"temperature": 0.9}"#.into());
    let h = start_with(s, server_common::options());
    assert_eq!(
        get(h.addr, "/props").json()["ui_settings"],
        json!({"temperature": 0.9})
    );
    h.stop().unwrap();
    let _ = std::fs::remove_file(file);
}

/// Kills the server when the test ends, however it ends.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(extra: &[&str]) -> (Server, SocketAddr) {
    let port = free_port();
    let addr: SocketAddr = format!("127.0.0.1:{port}").parse().unwrap();
    let child = Command::new(TERN)
        .args(["serve", "--port", &port.to_string(), "--backend", "cpu"])
        .args(extra)
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .expect("tern serve starts");
    let server = Server(child);
    assert!(
        eventually(Duration::from_secs(60), || {
            std::net::TcpStream::connect(addr).is_ok() && get(addr, "/health").status == 200
        }),
        "tern serve answers /health"
    );
    (server, addr)
}

fn browser_missing() -> Option<String> {
    if !std::path::Path::new(CHROMIUM).exists() {
        return Some(format!("{CHROMIUM} is missing (apt-get install chromium)"));
    }
    let playwright = Command::new("python3")
        .args(["-c", "import playwright.sync_api"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !playwright {
        return Some(
            "`python3 -c \"import playwright.sync_api\"` fails (pip install playwright)".into(),
        );
    }
    None
}

#[test]
fn the_page_in_headless_chromium() {
    if let Some(why) = browser_missing() {
        assert!(
            std::env::var_os("TERN_REQUIRE_CHROMIUM").is_none(),
            "TERN_REQUIRE_CHROMIUM is set but {why}"
        );
        println!("SKIPPED the_page_in_headless_chromium: {why}");
        return;
    }
    let (_plain, addr) = serve(&[]);
    // Matches UI_CONFIG in webui.py.
    let ui_config = r#"{"systemMessage": "Answer briefly.", "temperature": 0.5, "max_tokens": 8}"#;
    let (_keyed, keyed) = serve(&["--api-key", "webui-test-key", "--ui-config", ui_config]);
    let out = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("target/webui");
    let t0 = Instant::now();
    let run = Command::new("timeout")
        .args(["110", "python3"])
        .arg(concat!(env!("CARGO_MANIFEST_DIR"), "/tests/e2e/webui.py"))
        .args(["--base-url", &format!("http://{addr}")])
        .args(["--keyed-url", &format!("http://{keyed}")])
        .args(["--key", "webui-test-key", "--chromium", CHROMIUM])
        .arg("--out")
        .arg(&out)
        .output()
        .expect("python3 runs");
    let transcript = String::from_utf8_lossy(&run.stdout);
    println!(
        "--- webui.py ({:.1} s) ---\n{transcript}",
        t0.elapsed().as_secs_f64()
    );
    eprintln!("{}", String::from_utf8_lossy(&run.stderr));
    assert!(
        run.status.success(),
        "the browser checks pass: {:?}",
        run.status
    );
    assert!(transcript.contains("all webui checks passed"));
    for shot in [
        "desktop.png",
        "desktop-dark.png",
        "phone.png",
        "phone-list.png",
    ] {
        let len = std::fs::metadata(out.join(shot))
            .map(|m| m.len())
            .unwrap_or(0);
        assert!(len > 10_000, "{shot} was written ({len} bytes)");
    }
}
