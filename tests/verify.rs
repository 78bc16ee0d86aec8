//! `tern verify`: byte counts and sha256 of the fixtures, against the flags and the manifest.

mod scratch;
use std::path::{Path, PathBuf};

use tern::cli::verify::{check, measure, read_manifest, run_to, Expect, VerifyArgs};

const Q8: &str = "tiny-q8_0.gguf";

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("fixtures")
}

fn manifest() -> PathBuf {
    fixtures().join("manifest.json")
}

/// The fixture's (bytes, sha256) as the manifest pins them.
fn pinned(name: &str) -> (u64, String) {
    let e = read_manifest(&manifest())
        .unwrap()
        .into_iter()
        .find(|(n, _)| n == name)
        .unwrap()
        .1;
    (e.bytes.unwrap(), e.sha256.unwrap())
}

fn tmp(name: &str) -> PathBuf {
    scratch::dir("verify").join(name)
}

fn run(args: VerifyArgs) -> (anyhow::Result<()>, String) {
    let mut out = Vec::new();
    let r = run_to(&args, &mut out);
    (r, String::from_utf8(out).unwrap())
}

#[test]
fn a_fixture_matches_its_pinned_sha256() {
    let (bytes, sha) = pinned(Q8);
    let m = measure(&fixtures().join(Q8)).unwrap();
    assert_eq!(m.bytes, bytes);
    assert_eq!(m.sha256, sha);
    let (r, out) = run(VerifyArgs {
        model: Some(fixtures().join(Q8)),
        sha256: Some(sha.to_uppercase()),
        bytes: Some(bytes),
        ..Default::default()
    });
    r.unwrap();
    assert!(out.starts_with("ok"), "{out}");
    assert!(out.contains(&sha), "{out}");
}

#[test]
fn the_manifest_pins_the_model_and_every_fixture() {
    let (r, out) = run(VerifyArgs {
        model: Some(fixtures().join(Q8)),
        manifest: Some(manifest()),
        ..Default::default()
    });
    r.unwrap();
    assert!(out.starts_with("ok"), "{out}");
    // The manifest alone: every entry (twins included), relative to its directory.
    let (r, out) = run(VerifyArgs {
        manifest: Some(manifest()),
        ..Default::default()
    });
    r.unwrap_or_else(|e| panic!("{e:#}\n{out}"));
    let entries = read_manifest(&manifest()).unwrap();
    let present = entries
        .iter()
        .filter(|(n, e)| !e.optional || fixtures().join(n).exists())
        .count();
    assert_eq!(
        out.lines().filter(|l| l.starts_with("ok")).count(),
        present,
        "{out}"
    );
    // The twin is derived (not committed): checked when present, said to be skipped otherwise.
    assert!(entries
        .iter()
        .any(|(n, e)| e.optional && n == "tiny-pq2_0.twin-f32.gguf"));
    assert!(out.contains("tiny-pq2_0.twin-f32.gguf"), "{out}");
}

#[test]
fn a_truncated_copy_is_a_short_file_naming_itself() {
    let (bytes, sha) = pinned(Q8);
    let data = std::fs::read(fixtures().join(Q8)).unwrap();
    let cut = tmp(Q8);
    std::fs::write(&cut, &data[..data.len() - 4096]).unwrap();
    let (r, out) = run(VerifyArgs {
        model: Some(cut.clone()),
        sha256: Some(sha.clone()),
        bytes: Some(bytes),
        ..Default::default()
    });
    let e = format!("{:#}", r.unwrap_err());
    assert!(e.contains(&cut.display().to_string()), "{e}");
    assert!(
        e.contains("short file") && e.contains("4,096 missing"),
        "{e}"
    );
    assert!(out.starts_with("FAILED"), "{out}");
    // Through the manifest (matched by file name) as well.
    let (r, _) = run(VerifyArgs {
        model: Some(cut.clone()),
        manifest: Some(manifest()),
        ..Default::default()
    });
    assert!(format!("{:#}", r.unwrap_err()).contains("short file"));
    // Without a byte count the digest catches it.
    let e = check(
        &cut,
        &Expect {
            sha256: Some(sha),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("sha256 mismatch"), "{e:#}");
}

#[test]
fn a_changed_byte_is_a_sha256_mismatch() {
    let (bytes, sha) = pinned(Q8);
    let mut data = std::fs::read(fixtures().join(Q8)).unwrap();
    let n = data.len();
    data[n - 1] ^= 1;
    let bad = tmp("flipped.gguf");
    std::fs::write(&bad, &data).unwrap();
    let e = check(
        &bad,
        &Expect {
            sha256: Some(sha.clone()),
            bytes: Some(bytes),
            optional: false,
        },
    )
    .unwrap_err();
    let m = format!("{e:#}");
    assert!(
        m.contains("flipped.gguf") && m.contains("sha256 mismatch") && m.contains(&sha),
        "{m}"
    );
    // A longer file is refused by its size.
    data.push(0);
    std::fs::write(&bad, &data).unwrap();
    let e = check(
        &bad,
        &Expect {
            bytes: Some(bytes),
            ..Default::default()
        },
    )
    .unwrap_err();
    assert!(format!("{e:#}").contains("1 too many"), "{e:#}");
}

#[test]
fn missing_files_and_bad_input_are_errors_naming_them() {
    let missing = tmp("no-such-model.gguf");
    let (r, out) = run(VerifyArgs {
        model: Some(missing.clone()),
        mmproj: Some(fixtures().join(Q8)),
        ..Default::default()
    });
    let e = format!("{:#}", r.unwrap_err());
    assert!(
        e.contains("no-such-model.gguf") && e.contains("1 of 2"),
        "{e}"
    );
    // The other file was still checked (unpinned: its digest is printed).
    assert!(out.contains("unpinned") && out.contains(Q8), "{out}");

    let (r, _) = run(VerifyArgs {
        model: Some(fixtures().join(Q8)),
        sha256: Some("c79fcdfaf6b7bf47".into()),
        ..Default::default()
    });
    assert!(format!("{:#}", r.unwrap_err()).contains("64 hex digits"));

    let (r, _) = run(VerifyArgs::default());
    assert!(format!("{:#}", r.unwrap_err()).contains("nothing to verify"));

    let (r, _) = run(VerifyArgs {
        mmproj_sha256: Some("00".repeat(32)),
        ..Default::default()
    });
    assert!(r.is_err());

    let (r, _) = run(VerifyArgs {
        model: Some(tmp("not-listed.gguf")),
        manifest: Some(manifest()),
        ..Default::default()
    });
    let e = format!("{:#}", r.unwrap_err());
    assert!(
        e.contains("not listed") && e.contains("not-listed.gguf"),
        "{e}"
    );

    let bad = tmp("bad-manifest.json");
    std::fs::write(&bad, "{\"files\": [{\"sha256\": \"00\"}]}").unwrap();
    let e = format!("{:#}", read_manifest(&bad).unwrap_err());
    assert!(
        e.contains("bad-manifest.json") && e.contains("no \"file\""),
        "{e}"
    );
    std::fs::write(&bad, "not json").unwrap();
    assert!(read_manifest(&bad).is_err());
    assert!(read_manifest(&tmp("absent.json")).is_err());
}
