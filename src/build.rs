//! Build script: the git commit and the compiler for `tern --version` and `/props`'
//! build_info (llama.cpp prints both). Outside a git checkout the commit is "unknown".

use std::process::Command;

fn git(args: &[&str]) -> Option<String> {
    let out = Command::new("git").args(args).output().ok()?;
    if !out.status.success() {
        return None;
    }
    let s = String::from_utf8(out.stdout).ok()?.trim().to_string();
    (!s.is_empty()).then_some(s)
}

fn main() {
    let commit = git(&["rev-parse", "--short=9", "HEAD"]).unwrap_or_else(|| "unknown".into());
    println!("cargo:rustc-env=TERN_GIT_COMMIT={commit}");
    let rustc = std::env::var("RUSTC").unwrap_or_else(|_| "rustc".into());
    let version = Command::new(rustc)
        .arg("--version")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .map(|s| s.trim().to_string())
        .unwrap_or_else(|| "rustc".into());
    println!("cargo:rustc-env=TERN_RUSTC={version}");
    println!(
        "cargo:rustc-env=TERN_TARGET={}",
        std::env::var("TARGET").unwrap_or_default()
    );
    // A new commit or a checkout moves HEAD or the branch ref. Only files that exist are
    // named: cargo counts a missing one as changed on every build, which recompiled the
    // crate each time in a checkout with no packed-refs.
    let watch = |p: &str| {
        if let Some(path) = git(&["rev-parse", "--git-path", p]) {
            if std::path::Path::new(&path).exists() {
                println!("cargo:rerun-if-changed={path}");
            }
        }
    };
    watch("HEAD");
    // This worktree's HEAD reflog: appended on each commit, checkout or reset here, even when
    // the branch ref itself is packed.
    watch("logs/HEAD");
    watch("packed-refs");
    if let Some(r) = git(&["symbolic-ref", "-q", "HEAD"]) {
        watch(&r);
    }
    println!("cargo:rerun-if-changed=src/build.rs");
}
