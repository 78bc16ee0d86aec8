//! tern: an inference engine for the Qwen3.5 (`qwen35`) hybrid model family.
//!
//! Layering (dependencies point down): `gguf`, `quant` → `tensor` → `backend` → `model` →
//! `runtime` → `server` → the `tern` binary.

pub mod alloc;
pub mod backend;
pub mod bundled;
pub mod chat;
pub mod cli;
pub mod config;
pub mod eval;
pub mod fuzz;
pub mod gguf;
pub mod model;
pub mod npy;
pub mod plan;
pub mod quant;
pub mod runtime;
pub mod server;
pub mod tensor;
pub mod tokenizer;

/// The build as llama-server's build_info names it: version and commit.
pub fn build_info() -> String {
    format!(
        "tern-{}-{}",
        env!("CARGO_PKG_VERSION"),
        env!("TERN_GIT_COMMIT")
    )
}

#[cfg(feature = "cuda")]
macro_rules! features_str {
    () => {
        "cpu, wgpu, cuda"
    };
}
#[cfg(not(feature = "cuda"))]
macro_rules! features_str {
    () => {
        "cpu, wgpu"
    };
}

/// The backends compiled in (cpu and wgpu always; cuda with `--features cuda`).
pub fn features() -> &'static [&'static str] {
    if cfg!(feature = "cuda") {
        &["cpu", "wgpu", "cuda"]
    } else {
        &["cpu", "wgpu"]
    }
}

/// `tern --version`, after llama.cpp's: the version and commit, the compiled features, the
/// compiler and target.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (",
    env!("TERN_GIT_COMMIT"),
    ")\nfeatures: ",
    features_str!(),
    "\nbuilt with ",
    env!("TERN_RUSTC"),
    " for ",
    env!("TERN_TARGET")
);
