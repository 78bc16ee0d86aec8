//! The serving runtime: sampling, grammar constraints and speculative decoding over the model's
//! per-sequence state.

pub mod budget;
pub mod constraint;
pub mod engine;
pub mod media;
pub mod sampler;
pub mod speculative;
