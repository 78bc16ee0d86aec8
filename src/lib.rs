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
pub mod gguf;
pub mod model;
pub mod npy;
pub mod plan;
pub mod quant;
pub mod runtime;
pub mod server;
pub mod tensor;
pub mod tokenizer;
