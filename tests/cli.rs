//! The `tern` binary end to end: inspect, logits and generate on the fixtures and the bundled
//! default model, and clear errors for bad input.

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
    let d = std::env::temp_dir().join(format!("tern-cli-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join(name)
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
