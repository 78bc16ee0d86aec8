//! The serving runtime: sampling and speculative decoding over the model's per-sequence state.

pub mod budget;
pub mod engine;
pub mod sampler;
pub mod speculative;
