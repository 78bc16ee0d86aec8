//! Chat: the model's Jinja chat template ([`template`]) and the split of its output into
//! reasoning, content and tool calls ([`parse`]).

pub mod parse;
pub mod template;

pub use parse::{ChatParser, Delta, ParsedMessage, ParserConfig, ToolCall, ToolSpecs};
pub use template::{map_reasoning_effort, ChatTemplate, TemplateError, TemplateInputs};

use std::collections::hash_map::RandomState;
use std::hash::{BuildHasher, Hasher};
use std::sync::atomic::{AtomicU64, Ordering};

/// `n` random alphanumerics (ids for completions and tool calls; not for secrets).
pub fn random_id(n: usize) -> String {
    const ALPHABET: &[u8] = b"0123456789ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz";
    static COUNTER: AtomicU64 = AtomicU64::new(0);
    let mut out = String::with_capacity(n);
    let mut state = 0u64;
    for i in 0..n {
        if i % 8 == 0 {
            // RandomState is seeded from the OS once per process and perturbed per instance.
            let mut h = RandomState::new().build_hasher();
            h.write_u64(COUNTER.fetch_add(1, Ordering::Relaxed));
            h.write_u128(
                std::time::SystemTime::now()
                    .duration_since(std::time::UNIX_EPOCH)
                    .map(|d| d.as_nanos())
                    .unwrap_or(0),
            );
            state = h.finish();
        }
        out.push(ALPHABET[(state % ALPHABET.len() as u64) as usize] as char);
        state /= ALPHABET.len() as u64;
    }
    out
}
