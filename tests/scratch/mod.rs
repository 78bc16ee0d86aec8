//! Scratch directories for the integration tests: under cargo's `target/tmp` (removed by
//! `cargo clean`), one per test binary run, so no run leaves files in the system temp dir.

use std::path::PathBuf;

/// `target/tmp/tern-<name>-<pid>`, created if missing.
pub fn dir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join(format!("tern-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}
