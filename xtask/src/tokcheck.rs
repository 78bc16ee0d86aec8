//! `cargo xtask tokcheck`: tern's tokenizer against stock llama.cpp.
//!
//! - `split`: the pre-tokenizer split and the code point classes against llama.cpp's own
//!   `unicode.cpp` (built from `xtask/cpp/split_golden.cpp` with the C++ compiler against the
//!   llama.cpp source tree in `TERN_LLAMA_SRC`), on the whole code space and on random strings;
//!   `--write` records `fixtures/golden/split.json` for `tests/tokenizer.rs`.
//! - `ids`: token ids against llama-cpp-python (`TERN_PYTHON`) on vocabularies (default: the
//!   repo's fixture and demo vocabularies), on hard texts (runs of 10^6 spaces, newlines and
//!   digits, mixed scripts, contractions, marks) and random strings; `--write` records the hard
//!   texts on the fixture vocabulary as `fixtures/golden/tokens_hard.json`.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use sha2::{Digest, Sha256};
use tern::gguf::Gguf;
use tern::tokenizer::split::{self, Flavor};
use tern::tokenizer::Tokenizer;

use crate::rng::Rng;

/// Characters the split rules tell apart, drawn often; the rest of a random text comes from
/// the whole code space.
const PALETTE: &str = " \t\n\r\u{0b}\u{0c}\u{85}\u{a0}\u{1680}\u{2000}\u{2028}\u{2029}\u{202f}\u{3000}aZsStTlLeErRvVdDmMİıſK'\u{2019}`1٣٤Ⅻ½²𝟙\u{301}\u{64e}\u{94d}\u{200d}\u{fe0f}é你日本語한국어ภาษาไทยहिन्दीمرحبا!,.-_$%()[]{}<>/\\|~^@#&*+=?;:\"😀👍\u{1f3fd}🇺🇸\u{a7dc}\u{13460}\u{16130}\u{e000}\u{fffd}\u{378}";

/// A random text: mostly palette characters, some runs, some arbitrary code points.
pub fn random_text(rng: &mut Rng, max_len: usize) -> String {
    let palette: Vec<char> = PALETTE.chars().collect();
    let len = rng.below(max_len as u64 + 1) as usize;
    let mut s = String::new();
    while s.chars().count() < len {
        match rng.below(10) {
            0 => {
                // A run of one character (whitespace runs are what regexes choke on).
                let c = palette[rng.below(palette.len() as u64) as usize];
                for _ in 0..1 + rng.below(40) {
                    s.push(c);
                }
            }
            1 => {
                // Any scalar value but NUL (the C harness reads texts as C++ strings, which is
                // fine, but the Python binding's C string would stop there).
                let c = loop {
                    if let Some(c) = char::from_u32(1 + rng.below(0x10_FFFF) as u32) {
                        break c;
                    }
                };
                s.push(c);
            }
            _ => s.push(palette[rng.below(palette.len() as u64) as usize]),
        }
    }
    s
}

/// A hard text as its recipe: pieces, each repeated. The golden stores the recipe, not the
/// (megabyte) text.
pub struct Hard {
    pub label: &'static str,
    pub parts: Vec<(String, usize)>,
}

impl Hard {
    pub fn text(&self) -> String {
        self.parts.iter().map(|(p, n)| p.repeat(*n)).collect()
    }
}

/// Texts that stress the split: long runs, mixed scripts, digits, contractions, newlines.
pub fn hard_texts() -> Vec<Hard> {
    let h = |label: &'static str, parts: &[(&str, usize)]| Hard {
        label,
        parts: parts.iter().map(|(p, n)| (p.to_string(), *n)).collect(),
    };
    vec![
        h("1e6 spaces then a word", &[(" ", 1_000_000), ("x", 1)]),
        h("1e6 spaces alone", &[(" ", 1_000_000)]),
        h("word, 1e6 spaces, word", &[("a", 1), (" ", 1_000_000), ("b", 1)]),
        h("1e6 newlines", &[("\n", 1_000_000)]),
        h("CRLF x 2e5 then text", &[("\r\n", 200_000), ("end", 1)]),
        h("tab-space x 3e5", &[("a", 1), ("\t ", 300_000), ("b", 1)]),
        h("NBSP x 1e5", &[("a", 1), ("\u{a0}", 100_000), ("b", 1)]),
        h("ideographic spaces x 1e5", &[("\u{3000}", 100_000), ("字", 1)]),
        h("spaces, newline, spaces", &[("x", 1), (" ", 100_000), ("\n", 1), (" ", 100_000), ("y", 1)]),
        h("digits x 1e5", &[("1234567890", 10_000)]),
        h("letters x 1e6", &[("a", 1_000_000)]),
        h("punctuation x 1e5", &[("!?.,;:-", 15_000)]),
        h("contractions", &[("don't I'LL we've they're she's he'd I'M 'S 'T 'Re 'vE \u{2019}s ' s''s", 1)]),
        h("contractions x 1e4", &[("it's we'll they'RE I'm o'clock rock'n'roll ", 10_000)]),
        h(
            "mixed scripts",
            &[("Hello мир 世界 مرحبا नमस्ते สวัสดี 안녕하세요 Γειά σου שלום こんにちは 🇺🇸👍🏽 e\u{301}\u{302}\u{303}", 1)],
        ),
        h("mixed scripts x 1e3", &[("Grüße, 世界! مرحبا123 नमस्ते\n", 1_000)]),
        h("combining marks x 1e4", &[("e", 1), ("\u{301}", 10_000)]),
        h("emoji ZWJ x 1e4", &[("👩\u{200d}👩\u{200d}👧\u{200d}👦", 10_000)]),
        h("unicode 16 letters", &[("ab\u{a7dc}cd \u{13460}\u{13461}! x\u{16130}1", 1)]),
        h("code", &[("fn main() {\n    let x = vec![1, 2, 3];\n\tprintln!(\"{x:?}\");\n}\n", 2_000)]),
        h("lone space at the end", &[("word ", 1)]),
        h("space before unassigned", &[("a \u{378}b \u{e000}", 1)]),
    ]
}

fn le_cases(texts: &[String]) -> Vec<u8> {
    let mut out = Vec::new();
    for t in texts {
        out.extend_from_slice(&(t.len() as u32).to_le_bytes());
        out.extend_from_slice(t.as_bytes());
    }
    out
}

/// Builds the llama.cpp split harness (once per source change).
fn harness(root: &Path) -> Result<PathBuf> {
    let src = std::env::var("TERN_LLAMA_SRC").context(
        "TERN_LLAMA_SRC must name a llama.cpp source tree (the one with src/unicode.cpp)",
    )?;
    let src = PathBuf::from(src);
    let unicode = src.join("src/unicode.cpp");
    if !unicode.exists() {
        bail!("{} does not exist", unicode.display());
    }
    let dir = root.join("target/tokcheck");
    std::fs::create_dir_all(&dir)?;
    let exe = dir.join("split_golden");
    let cpp = root.join("xtask/cpp/split_golden.cpp");
    let newer = |a: &Path, b: &Path| -> bool {
        let m = |p: &Path| std::fs::metadata(p).and_then(|m| m.modified()).ok();
        matches!((m(a), m(b)), (Some(x), Some(y)) if x >= y)
    };
    if !(exe.exists() && newer(&exe, &cpp) && newer(&exe, &unicode)) {
        eprintln!(
            "[tokcheck] building {} against {}",
            exe.display(),
            src.display()
        );
        let st = Command::new(std::env::var("CXX").unwrap_or_else(|_| "c++".into()))
            .args(["-O2", "-std=c++17"])
            .arg(format!("-I{}", src.join("src").display()))
            .arg(format!("-I{}", src.join("include").display()))
            .arg(&cpp)
            .arg(&unicode)
            .arg(src.join("src/unicode-data.cpp"))
            .arg("-o")
            .arg(&exe)
            .status()?;
        if !st.success() {
            bail!("building the split harness failed ({st})");
        }
    }
    Ok(exe)
}

/// llama.cpp's pre-token byte lengths of each text, (qwen35, qwen2).
fn llama_splits(exe: &Path, dir: &Path, texts: &[String]) -> Result<Vec<(Vec<usize>, Vec<usize>)>> {
    let f = dir.join("split_cases.bin");
    std::fs::write(&f, le_cases(texts))?;
    let out = Command::new(exe).arg("split").arg(&f).output()?;
    if !out.status.success() {
        bail!(
            "split harness failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let text = String::from_utf8(out.stdout)?;
    let parse =
        |s: &str| -> Vec<usize> { s.split_whitespace().map(|x| x.parse().unwrap()).collect() };
    let rows: Vec<_> = text
        .lines()
        .map(|l| {
            let (a, b) = l.split_once('|').unwrap_or((l, ""));
            (parse(a), parse(b))
        })
        .collect();
    if rows.len() != texts.len() {
        bail!(
            "split harness answered {} of {} texts",
            rows.len(),
            texts.len()
        );
    }
    Ok(rows)
}

fn tern_split(text: &str, f: Flavor) -> Vec<usize> {
    split::split(text, f).into_iter().map(|r| r.len()).collect()
}

pub fn split_check(root: &Path, cases: usize, seed: u64, write: bool) -> Result<()> {
    let exe = harness(root)?;
    let dir = root.join("target/tokcheck");
    let out = Command::new(&exe).arg("classes").output()?;
    if !out.status.success() || out.stdout.len() != 0x11_0000 {
        bail!("class dump failed");
    }
    let llama_digest = hex(&Sha256::digest(&out.stdout));
    let tern_digest = hex(&Sha256::digest(split::class_table()));
    let differ = out
        .stdout
        .iter()
        .zip(split::class_table())
        .filter(|(a, b)| a != b)
        .count();
    println!(
        "classes: {differ} of 1114112 code points differ (llama.cpp {}…, tern {}…)",
        &llama_digest[..16],
        &tern_digest[..16]
    );

    let mut rng = Rng::for_label(seed, "split");
    let mut texts: Vec<String> = (0..cases)
        .map(|i| random_text(&mut rng, if i % 10 == 0 { 400 } else { 40 }))
        .collect();
    texts.extend(hard_texts().iter().map(Hard::text));
    let t0 = Instant::now();
    let want = llama_splits(&exe, &dir, &texts)?;
    let llama_s = t0.elapsed().as_secs_f64();
    let t0 = Instant::now();
    let got: Vec<_> = texts
        .iter()
        .map(|t| (tern_split(t, Flavor::Qwen35), tern_split(t, Flavor::Qwen2)))
        .collect();
    let tern_s = t0.elapsed().as_secs_f64();
    let mut bad = 0;
    let mut pieces = 0usize;
    for (i, (w, g)) in want.iter().zip(&got).enumerate() {
        pieces += w.0.len() + w.1.len();
        if w != g {
            bad += 1;
            if bad <= 5 {
                let t: String = texts[i].chars().take(80).collect();
                println!(
                    "  differ on {t:?}:\n    llama.cpp {:?}\n    tern      {:?}",
                    w, g
                );
            }
        }
    }
    let n_chars: usize = texts.iter().map(|t| t.chars().count()).sum();
    println!(
        "split: {} texts ({} random + {} hard, {n_chars} code points, {pieces} pre-tokens over qwen35+qwen2): {} differ; llama.cpp {llama_s:.2} s, tern {tern_s:.2} s",
        texts.len(),
        cases,
        texts.len() - cases,
        bad
    );
    if write {
        // The golden keeps the random texts small; the digest covers the classes.
        let keep = cases.min(1500);
        let rows: Vec<Value> = texts[..keep]
            .iter()
            .zip(&want)
            .filter(|(t, _)| t.len() <= 200)
            .map(|(t, (a, b))| json!({"text": t, "qwen35": a, "qwen2": b}))
            .collect();
        let doc = json!({
            "generator": "cargo xtask tokcheck split --write",
            "reference": "llama.cpp src/unicode.cpp unicode_regex_split and unicode_cpt_flags_from_cpt, built by xtask/cpp/split_golden.cpp",
            "classes_sha256": llama_digest,
            "classes_encoding": "one byte per code point 0..0x10FFFF: letter | number<<1 | mark<<2 | whitespace<<3",
            "cases": rows,
        });
        let path = root.join("fixtures/golden/split.json");
        std::fs::write(&path, serde_json::to_string(&doc)? + "\n")?;
        println!("wrote {}", path.display());
    }
    if bad > 0 || differ > 0 {
        bail!("tern's split differs from llama.cpp's");
    }
    Ok(())
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// llama.cpp's ids for each text (parse_special = true, no BOS), through llama-cpp-python.
fn llama_ids(
    root: &Path,
    python: &str,
    vocab: &Path,
    texts: &[String],
    special: bool,
) -> Result<Vec<Vec<u32>>> {
    let dir = root.join("target/tokcheck");
    std::fs::create_dir_all(&dir)?;
    let inp = dir.join("ids_in.bin");
    let outp = dir.join("ids_out.bin");
    std::fs::write(&inp, le_cases(texts))?;
    let st = Command::new(python)
        .arg(root.join("xtask/py/tokcheck.py"))
        .arg(vocab)
        .arg(&inp)
        .arg(&outp)
        .arg(if special { "1" } else { "0" })
        .status()?;
    if !st.success() {
        bail!("xtask/py/tokcheck.py failed ({st}); TERN_PYTHON must have llama-cpp-python");
    }
    let b = std::fs::read(&outp)?;
    let mut at = 0;
    let u32_at = |at: &mut usize| -> u32 {
        let v = u32::from_le_bytes(b[*at..*at + 4].try_into().unwrap());
        *at += 4;
        v
    };
    let mut out = Vec::with_capacity(texts.len());
    for _ in texts {
        let n = u32_at(&mut at) as usize;
        out.push((0..n).map(|_| u32_at(&mut at)).collect());
    }
    Ok(out)
}

fn ids_digest(ids: &[u32]) -> String {
    let mut h = Sha256::new();
    for i in ids {
        h.update(i.to_le_bytes());
    }
    hex(&h.finalize())
}

/// The texts of a llama.cpp vocabulary test input (`models/ggml-vocab-*.gguf.inp`).
pub fn inp_texts(path: &Path) -> Result<Vec<String>> {
    let raw = std::fs::read_to_string(path).with_context(|| path.display().to_string())?;
    Ok(raw
        .split("\n__ggml_vocab_test__\n")
        .map(str::to_string)
        .filter(|t| !t.is_empty())
        .collect())
}

pub fn ids_check(
    root: &Path,
    python: &str,
    vocabs: &[PathBuf],
    random: usize,
    seed: u64,
    write: bool,
    extra: &[String],
) -> Result<()> {
    let mut hard = hard_texts();
    let n_recipes = hard.len();
    for t in extra {
        hard.push(Hard {
            label: "--inp text",
            parts: vec![(t.clone(), 1)],
        });
    }
    let mut rng = Rng::for_label(seed, "ids");
    let random_texts: Vec<String> = (0..random).map(|_| random_text(&mut rng, 60)).collect();
    let mut failed = false;
    let mut golden: Vec<Value> = Vec::new();
    for vocab in vocabs {
        let g = Gguf::open(vocab)?;
        let tok = Tokenizer::from_gguf(&g).with_context(|| format!("{}", vocab.display()))?;
        for special in [true, false] {
            let mut texts: Vec<String> = hard.iter().map(Hard::text).collect();
            texts.extend(random_texts.iter().cloned());
            let t0 = Instant::now();
            let want = llama_ids(root, python, vocab, &texts, special)?;
            let llama_s = t0.elapsed().as_secs_f64();
            let t0 = Instant::now();
            let got: Vec<Result<Vec<u32>, String>> = texts
                .iter()
                .map(|t| tok.encode(t, false, special).map_err(|e| e.to_string()))
                .collect();
            let tern_s = t0.elapsed().as_secs_f64();
            let mut bad_hard = 0;
            let mut bad_random = 0;
            let n_ids: usize = want.iter().map(Vec::len).sum();
            for (i, (w, g)) in want.iter().zip(&got).enumerate() {
                let ok = matches!(g, Ok(g) if g == w);
                if !ok {
                    if i < hard.len() {
                        bad_hard += 1;
                    } else {
                        bad_random += 1;
                    }
                    if bad_hard + bad_random <= 3 {
                        let label = if i < hard.len() {
                            hard[i].label.to_string()
                        } else {
                            format!("random #{}", i - hard.len())
                        };
                        let t: String = texts[i].chars().take(60).collect();
                        match g {
                            Ok(g) => println!(
                                "  {label} {t:?}: llama.cpp {} ids {:?}…, tern {} ids {:?}…",
                                w.len(),
                                &w[..w.len().min(12)],
                                g.len(),
                                &g[..g.len().min(12)]
                            ),
                            Err(e) => println!("  {label} {t:?}: tern error {e}"),
                        }
                    }
                }
            }
            println!(
                "{} (parse_special={special}): hard {}/{} equal, random {}/{} equal, {n_ids} ids; llama.cpp {llama_s:.1} s, tern {tern_s:.1} s",
                vocab.display(),
                hard.len() - bad_hard,
                hard.len(),
                random - bad_random,
                random,
            );
            failed |= bad_hard + bad_random > 0;
            // The golden keeps the repo's own vocabularies (the tests can open them).
            let rel = vocab
                .strip_prefix(root)
                .ok()
                .filter(|r| r.starts_with("fixtures"));
            if let (true, true, Some(rel)) = (write, special, rel) {
                let rows: Vec<Value> = hard[..n_recipes]
                    .iter()
                    .zip(&want)
                    .map(|(h, ids)| {
                        json!({
                            "label": h.label,
                            "parts": h.parts.iter().map(|(p, n)| json!([p, n])).collect::<Vec<_>>(),
                            "n_ids": ids.len(),
                            "ids_sha256": ids_digest(ids),
                        })
                    })
                    .collect();
                golden.push(json!({"model": rel.display().to_string(), "cases": rows}));
            }
        }
    }
    if write {
        let doc = json!({
            "generator": "cargo xtask tokcheck ids --write (llama-cpp-python, parse_special=true, no BOS)",
            "vocabularies": golden,
        });
        let path = root.join("fixtures/golden/tokens_hard.json");
        let mut f = std::fs::File::create(&path)?;
        writeln!(f, "{}", serde_json::to_string_pretty(&doc)?)?;
        println!("wrote {}", path.display());
    }
    if failed {
        bail!("tern's ids differ from llama.cpp's");
    }
    Ok(())
}
