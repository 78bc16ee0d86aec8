//! The `tern` binary end to end: inspect, logits and generate on the fixtures and the bundled
//! default model, and clear errors for bad input.

mod scratch;
use std::path::{Path, PathBuf};
use std::process::Command;

fn tern() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tern"))
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures")
        .join(name)
}

fn tmp(name: &str) -> PathBuf {
    scratch::dir("cli").join(name)
}

#[test]
fn inspect_describes_the_fixture() {
    let out = tern()
        .args(["inspect", "--model"])
        .arg(fixture("tiny-pq2_0.gguf"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("general.architecture"), "{s}");
    assert!(s.contains("PQ2_0"), "{s}");
    assert!(s.contains("prism.hadamard: block 64"), "{s}");
    assert!(s.contains("6 GDN + 2 attention"), "{s}");
}

#[test]
fn logits_rows_match_between_prefill_and_decode_modes() {
    let (a, b) = (tmp("a.npy"), tmp("b.npy"));
    for (mode, out) in [("prefill", &a), ("decode", &b)] {
        let st = tern()
            .args([
                "logits",
                "--backend",
                "cpu",
                "--tokens",
                "1,2,3,40,5",
                "--mode",
                mode,
                "--model",
            ])
            .arg(fixture("tiny-f32.gguf"))
            .arg("--out")
            .arg(out)
            .output()
            .unwrap();
        assert!(
            st.status.success(),
            "{}",
            String::from_utf8_lossy(&st.stderr)
        );
    }
    let (x, sx) = tern::npy::read(&a).unwrap();
    let (y, sy) = tern::npy::read(&b).unwrap();
    assert_eq!(sx, sy);
    assert_eq!(sx[0], 5);
    assert!(tern::backend::nmse(&x, &y) < 1e-9);
}

#[test]
fn generate_on_the_bundled_model_is_deterministic() {
    let run = || {
        let out = tern()
            .args([
                "generate",
                "--prompt",
                "Hello there",
                "-n",
                "12",
                "--temp",
                "0.8",
                "--seed",
                "5",
            ])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let err = String::from_utf8_lossy(&out.stderr).to_string();
        assert!(err.contains("t/s"), "tokens/s on stderr: {err}");
        String::from_utf8_lossy(&out.stdout).to_string()
    };
    let a = run();
    assert!(!a.trim().is_empty());
    assert_eq!(a, run(), "same seed, same text");
}

#[test]
fn bad_input_is_an_error_not_a_panic() {
    let bogus = tmp("bogus.gguf");
    std::fs::write(&bogus, b"GGUF\x03\x00\x00\x00\xff").unwrap();
    let out = tern()
        .args(["inspect", "--model"])
        .arg(&bogus)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("bogus.gguf") && err.contains("truncated"),
        "{err}"
    );
    assert!(!err.contains("panicked"), "{err}");

    let out = tern()
        .args(["logits", "--tokens", "999999", "--out"])
        .arg(tmp("x.npy"))
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("999999") && !err.contains("panicked"), "{err}");

    let out = tern()
        .args(["generate", "--prompt", "x", "--backend", "cuda"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("not available"));
}

#[test]
fn version_names_the_commit_and_the_features() {
    let out = tern().arg("--version").output().unwrap();
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.starts_with(&format!("tern {} (", env!("CARGO_PKG_VERSION"))),
        "{s}"
    );
    assert!(s.contains("features: cpu, wgpu"), "{s}");
    assert!(s.contains("built with rustc"), "{s}");
    let out = tern().args(["completions", "bash"]).output().unwrap();
    assert!(out.status.success());
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(
        s.contains("_tern()") && s.contains("--ctx-size"),
        "{}",
        &s[..200.min(s.len())]
    );
}

/// Command-line errors are the message and its causes, never a stack trace, whatever
/// RUST_BACKTRACE says.
#[test]
fn errors_print_no_backtrace() {
    for args in [
        vec!["inspect", "--model", "/nonexistent/m.gguf"],
        vec!["generate", "-p", "x", "-hf", "unsloth/whatever"],
        vec!["serve", "--no-jinja"],
        vec!["config", "--print", "--lora-scaled", "a.gguf:x"],
    ] {
        let out = tern()
            .args(&args)
            .env("RUST_BACKTRACE", "full")
            .env("RUST_LIB_BACKTRACE", "1")
            .output()
            .unwrap();
        assert!(!out.status.success(), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.starts_with("error: "), "{args:?}: {err}");
        assert!(!err.to_lowercase().contains("backtrace"), "{args:?}: {err}");
        assert!(err.lines().count() <= 4, "{args:?}: {err}");
    }
    let out = tern()
        .args(["generate", "-p", "x", "-hf", "unsloth/whatever"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("-hf unsloth/whatever") && err.contains("downloads are not supported"),
        "{err}"
    );
}

#[test]
fn a_directory_or_another_architecture_is_refused_first() {
    let dir = fixture("");
    let out = tern()
        .args(["generate", "-p", "x", "--model"])
        .arg(&dir)
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("is a directory") && err.contains("tiny-q8_0.gguf"),
        "{err}"
    );
    assert!(!err.contains("No such device"), "{err}");

    let llama = tmp("llama.gguf");
    let mut w = tern::gguf::GgufWriter::new();
    w.set(
        "general.architecture",
        tern::gguf::Value::String("llama".into()),
    );
    w.write(&llama).unwrap();
    for cmd in [
        &["generate", "-p", "x"][..],
        &["serve"],
        &["fit", "--device-mib", "100"],
    ] {
        let out = tern()
            .args(cmd)
            .arg("--model")
            .arg(&llama)
            .output()
            .unwrap();
        assert!(!out.status.success());
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains("is a `llama` model") && err.contains("qwen35"),
            "{cmd:?}: {err}"
        );
    }
}

/// `-n 0` generates nothing (the prompt is still evaluated), and a draft deeper than any slot
/// can use is refused before anything is allocated.
#[test]
fn cli_sizes_have_llama_cpp_s_ranges() {
    let out = tern()
        .args(["generate", "--prompt", "To be", "-n", "0", "--seed", "1"])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "");
    assert!(String::from_utf8_lossy(&out.stderr).contains("generated 0 tokens"));

    let t0 = std::time::Instant::now();
    let out = tern()
        .args([
            "generate",
            "-p",
            "x",
            "--spec-type",
            "draft-mtp",
            "--spec-draft-n-max",
            "100000",
        ])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("spec-draft-n-max 100000"), "{err}");
    assert!(t0.elapsed().as_secs() < 20);
    let out = tern()
        .args(["generate", "-p", "x", "--threads", "100000"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("threads"));

    let out = tern()
        .args(["config", "--print", "--config", "/dev/zero"])
        .output()
        .unwrap();
    assert!(!out.status.success());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("/dev/zero") && err.contains("larger than"),
        "{err}"
    );
}

/// The seed deployment's flags (shared/seeds/000), through `tern config`: every one is read,
/// and the ones that change nothing say so.
#[test]
fn config_explain_shows_each_source() {
    let out = tern()
        .args([
            "config",
            "--print",
            "--explain",
            "-c",
            "8192",
            "-np",
            "2",
            "--jinja",
            "-ngl",
            "99",
        ])
        .env("LLAMA_ARG_TEMPERATURE", "0.7")
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let s = String::from_utf8_lossy(&out.stdout);
    assert!(s.contains("ctx-size: 8192  # flag"), "{s}");
    assert!(s.contains("temp: 0.7  # env LLAMA_ARG_TEMPERATURE"), "{s}");
    assert!(s.contains("# port: 8080  # default"), "{s}");
    assert!(s.contains("# warning: --jinja: ignored"), "{s}");
    assert!(s.contains("# warning: -ngl 99: ignored"), "{s}");
}
