//! `tern perplexity` and `tern kld` end to end: llama-perplexity's printed format, the two kld
//! steps, the gate failing and passing on purpose (exit status 3 and 0), `--json`, and the
//! refusals of a base file that does not fit the candidate or the text.

mod scratch;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::OnceLock;

use serde_json::Value;
use tern::gguf::{Gguf, GgufWriter, Value as Meta};

fn tern() -> Command {
    Command::new(env!("CARGO_BIN_EXE_tern"))
}

fn demo(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("fixtures/demo")
        .join(name)
}

fn tmp(name: &str) -> PathBuf {
    scratch::dir("kld-cli").join(name)
}

fn text(o: &Output) -> String {
    format!(
        "status {:?}\nstdout:\n{}\nstderr:\n{}",
        o.status.code(),
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    )
}

/// The F16 reference's base file over 4 chunks of 128 of the held-out text, made once.
fn base() -> &'static Path {
    static BASE: OnceLock<PathBuf> = OnceLock::new();
    BASE.get_or_init(|| {
        let p = tmp("f16.base");
        let o = tern()
            .args([
                "kld",
                "--backend",
                "cpu",
                "-c",
                "128",
                "--chunks",
                "4",
                "-m",
            ])
            .arg(demo("demo-f16.gguf"))
            .arg("-f")
            .arg(demo("heldout.txt"))
            .arg("--save-base")
            .arg(&p)
            .output()
            .unwrap();
        assert!(o.status.success(), "{}", text(&o));
        let out = String::from_utf8_lossy(&o.stdout);
        assert!(
            out.contains("[4]") && out.contains("Final estimate: PPL = "),
            "{out}"
        );
        p
    })
}

fn kld(model: &str, extra: &[&str]) -> Output {
    tern()
        .args(["kld", "--backend", "cpu", "-m"])
        .arg(demo(model))
        .arg("--base")
        .arg(base())
        .args(extra)
        .output()
        .unwrap()
}

#[test]
fn perplexity_prints_llama_perplexity_lines() {
    let j = tmp("ppl.json");
    let o = tern()
        .args([
            "perplexity",
            "--backend",
            "cpu",
            "-c",
            "128",
            "--chunks",
            "3",
            "-m",
        ])
        .arg(demo("demo-q8_0.gguf"))
        .arg("-f")
        .arg(demo("heldout.txt"))
        .arg("--json")
        .arg(&j)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(out.starts_with("[1]") && out.contains(",[3]"), "{out}");
    let last = out.lines().last().unwrap();
    assert!(last.starts_with("Final estimate: PPL = "), "{out}");
    assert!(
        err.contains("calculating perplexity over 3 chunks, n_ctx=128, batch_size=2048, n_seq=16"),
        "{err}"
    );
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    assert_eq!(v["positions"], 3 * 63);
    // The printed figure is the JSON's, at llama.cpp's 4 decimals.
    let ppl = v["ppl"].as_f64().unwrap();
    assert!(
        last.contains(&format!("PPL = {ppl:.4} +/- ")),
        "{last} vs {ppl}"
    );
}

#[test]
fn perplexity_refuses_a_short_text() {
    let short = tmp("short.txt");
    std::fs::write(&short, "To be, or not to be.\n").unwrap();
    let o = tern()
        .args(["perplexity", "--backend", "cpu", "-m"])
        .arg(demo("demo-q8_0.gguf"))
        .arg("-f")
        .arg(&short)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("at least 1024 are needed"), "{err}");
}

#[test]
fn gate_passes_for_q8_0() {
    let j = tmp("q8.json");
    let o = kld(
        "demo-q8_0.gguf",
        &[
            "--max-mean-kl",
            "0.03",
            "--min-top1",
            "0.95",
            "--json",
            j.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(0), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(
        out.contains("Mean    KLD:") && out.contains("Same top p:"),
        "{out}"
    );
    assert!(out.contains("gate: PASS"), "{out}");
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    let r = &v["report"];
    assert_eq!(r["positions"], 4 * 63);
    for key in [
        "ppl",
        "ppl_base",
        "ppl_ratio",
        "kld_mean",
        "top1",
        "delta_p_rms",
    ] {
        assert!(r[key]["value"].is_f64(), "{key}: {r}");
    }
    for key in ["median", "p90", "p99", "max"] {
        assert!(r["kld"][key].is_f64(), "{key}");
    }
    assert!(r["same_top_p"]["rate"].is_f64());
    assert_eq!(v["gate"]["pass"], true);
    assert_eq!(v["gate"]["checks"].as_array().unwrap().len(), 2);
    assert_eq!(v["base"]["header"]["top_k"], 32);
}

#[test]
fn gate_fails_for_ptq1_0_with_exit_status_3() {
    let j = tmp("ptq1.json");
    let o = kld(
        "demo-ptq1_0.gguf",
        &[
            "--max-mean-kl",
            "0.03",
            "--min-top1",
            "0.95",
            "--json",
            j.to_str().unwrap(),
        ],
    );
    assert_eq!(o.status.code(), Some(3), "{}", text(&o));
    let out = String::from_utf8_lossy(&o.stdout);
    assert!(out.contains("FAIL: mean KL <= --max-mean-kl"), "{out}");
    assert!(out.contains("gate: FAIL"), "{out}");
    // The report is written even when the gate fails.
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&j).unwrap()).unwrap();
    assert_eq!(v["gate"]["pass"], false);
    assert!(v["report"]["kld_mean"]["value"].as_f64().unwrap() > 0.03);
}

#[test]
fn the_text_is_optional_and_checked_when_given() {
    let o = kld(
        "demo-q8_0.gguf",
        &["-f", demo("heldout.txt").to_str().unwrap()],
    );
    assert!(o.status.success(), "{}", text(&o));
    let other = tmp("other.txt");
    std::fs::write(&other, "Another text.\n").unwrap();
    let o = kld("demo-q8_0.gguf", &["-f", other.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("is not the text") && err.contains("heldout.txt"),
        "{err}"
    );
}

#[test]
fn the_chunking_is_the_base_files() {
    let o = kld("demo-q8_0.gguf", &["-c", "256"]);
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(err.contains("chunks of 128"), "{err}");
}

#[test]
fn another_vocabulary_is_refused() {
    let tiny = Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures/tiny-q8_0.gguf");
    let o = tern()
        .args(["kld", "--backend", "cpu", "-m"])
        .arg(&tiny)
        .arg("--base")
        .arg(base())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("another vocabulary cannot be compared"),
        "{err}"
    );
}

/// The demo Q8_0 file with two vocabulary entries swapped: the same size, other tokens.
#[test]
fn another_tokenizer_of_the_same_size_is_refused() {
    let src = Gguf::open(demo("demo-q8_0.gguf")).unwrap();
    let mut w = GgufWriter::new();
    for (k, v) in src.metadata() {
        let v = match (k.as_str(), v) {
            ("tokenizer.ggml.tokens", Meta::Array(t, items)) => {
                let mut items = items.clone();
                items.swap(300, 301);
                Meta::Array(*t, items)
            }
            _ => v.clone(),
        };
        w.set(k, v);
    }
    for t in src.tensors() {
        w.add_tensor(&t.name, &t.dims, t.ty, src.tensor_data(t).to_vec());
    }
    let p = tmp("swapped.gguf");
    w.write(&p).unwrap();
    let o = tern()
        .args(["kld", "--backend", "cpu", "-m"])
        .arg(&p)
        .arg("--base")
        .arg(base())
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("tokenizer") && err.contains("is not the one"),
        "{err}"
    );
}

#[test]
fn a_corrupt_base_file_is_refused_by_name() {
    let mut b = std::fs::read(base()).unwrap();
    let n = b.len();
    b[n / 2] ^= 0x40;
    let p = tmp("corrupt.base");
    std::fs::write(&p, &b).unwrap();
    let o = tern()
        .args(["kld", "--backend", "cpu", "-m"])
        .arg(demo("demo-q8_0.gguf"))
        .arg("--base")
        .arg(&p)
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    let err = String::from_utf8_lossy(&o.stderr);
    assert!(
        err.contains("corrupt.base") && err.contains("checksum"),
        "{err}"
    );
    let o = tern()
        .args(["kld", "--backend", "cpu", "-m"])
        .arg(demo("demo-q8_0.gguf"))
        .arg("--base")
        .arg(demo("demo-q8_0.gguf"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("not a tern kld base file"));
}

#[test]
fn one_step_at_a_time() {
    let o = tern()
        .args(["kld", "-m"])
        .arg(demo("demo-q8_0.gguf"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let o = tern()
        .args(["kld", "--backend", "cpu", "--save-base"])
        .arg(tmp("x.base"))
        .output()
        .unwrap();
    assert_eq!(o.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&o.stderr).contains("--save-base needs the text"));
}
