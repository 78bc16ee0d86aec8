//! Structure-aware fuzzing of what tern reads from outside: GGUF files ([`gguf`]: header counts,
//! lengths, type ids, dimensions, offsets and metadata values at their boundaries, tensor
//! tables and weight bytes) and requests ([`request`]: JSON bodies through the HTTP routes,
//! chat-template inputs, tool-call text from the model).
//!
//! Every case is a pure function of `(seed, index)`, so a failure is reproduced by its index.
//! A case ends in one [`Outcome`]; the last four are failures. `cargo xtask fuzz` runs cases in
//! child processes (under a memory limit, so an allocation sized by a hostile header aborts
//! there and is counted, and with a watchdog for hangs); `tests/fuzz.rs` runs a bounded slice in
//! process, where a panic or a non-finite output fails the test.

pub mod gguf;
pub mod request;

use std::cell::RefCell;
use std::panic::{catch_unwind, AssertUnwindSafe};

/// How one fuzz case ended.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Outcome {
    /// Refused with an error that says what is wrong (a `Result::Err`, an HTTP 4xx/503).
    CleanError,
    /// Accepted, and what came out is sound (finite logits, a well-formed response).
    AcceptedValid,
    /// A Rust panic (or a 500 from the server's panic guard).
    Panic,
    /// The process died (allocation failure, stack overflow, signal).
    Abort,
    /// The case ran past its time limit.
    Hang,
    /// Accepted, but non-finite numbers came out as if they were results.
    SilentNaN,
}

impl Outcome {
    pub const ALL: [Outcome; 6] = [
        Outcome::CleanError,
        Outcome::AcceptedValid,
        Outcome::Panic,
        Outcome::Abort,
        Outcome::Hang,
        Outcome::SilentNaN,
    ];

    pub fn name(self) -> &'static str {
        match self {
            Outcome::CleanError => "clean-error",
            Outcome::AcceptedValid => "accepted-valid",
            Outcome::Panic => "panic",
            Outcome::Abort => "abort",
            Outcome::Hang => "hang",
            Outcome::SilentNaN => "silent-nan",
        }
    }

    pub fn parse(s: &str) -> Option<Outcome> {
        Outcome::ALL.into_iter().find(|o| o.name() == s)
    }

    pub fn is_failure(self) -> bool {
        matches!(
            self,
            Outcome::Panic | Outcome::Abort | Outcome::Hang | Outcome::SilentNaN
        )
    }
}

/// An outcome and a one-line note (the error text, the panic message).
#[derive(Clone, Debug)]
pub struct Verdict {
    pub outcome: Outcome,
    pub detail: String,
}

impl Verdict {
    pub fn new(outcome: Outcome, detail: impl Into<String>) -> Verdict {
        let mut detail: String = detail.into();
        if detail.len() > 300 {
            let mut cut = 300;
            while !detail.is_char_boundary(cut) {
                cut -= 1;
            }
            detail.truncate(cut);
            detail.push('…');
        }
        Verdict { outcome, detail }
    }
    pub fn clean(detail: impl Into<String>) -> Verdict {
        Verdict::new(Outcome::CleanError, detail)
    }
    pub fn valid(detail: impl Into<String>) -> Verdict {
        Verdict::new(Outcome::AcceptedValid, detail)
    }
}

thread_local! {
    static LAST_PANIC: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Replaces the panic hook with one that records the message (with its location) for
/// [`guarded`] instead of printing it: a fuzz run meets panics in parsers it then reports.
pub fn quiet_panics() {
    std::panic::set_hook(Box::new(|info| {
        let msg = match info.payload().downcast_ref::<&str>() {
            Some(s) => s.to_string(),
            None => info
                .payload()
                .downcast_ref::<String>()
                .cloned()
                .unwrap_or_else(|| "(non-string panic)".into()),
        };
        let at = info
            .location()
            .map(|l| format!(" at {}:{}", l.file(), l.line()))
            .unwrap_or_default();
        LAST_PANIC.with(|p| *p.borrow_mut() = Some(format!("{msg}{at}")));
    }));
}

/// The most recent panic recorded on this thread by the [`quiet_panics`] hook.
pub fn take_panic() -> Option<String> {
    LAST_PANIC.with(|p| p.borrow_mut().take())
}

/// Runs one case, turning a panic that escapes it into [`Outcome::Panic`].
pub fn guarded(f: impl FnOnce() -> Verdict) -> Verdict {
    match catch_unwind(AssertUnwindSafe(f)) {
        Ok(v) => v,
        Err(p) => {
            let msg = take_panic().unwrap_or_else(|| {
                p.downcast_ref::<&str>()
                    .map(|s| s.to_string())
                    .or_else(|| p.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "(non-string panic)".into())
            });
            Verdict::new(Outcome::Panic, msg)
        }
    }
}

/// xoshiro256** seeded through SplitMix64: every case draws from its own stream.
#[derive(Clone, Debug)]
pub struct Rng {
    s: [u64; 4],
}

impl Rng {
    pub fn new(seed: u64) -> Rng {
        let mut x = seed;
        let mut next = || {
            x = x.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut z = x;
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^ (z >> 31)
        };
        Rng {
            s: [next(), next(), next(), next()],
        }
    }

    /// The stream of case `index` of a run seeded `seed`.
    pub fn for_case(seed: u64, index: u64) -> Rng {
        Rng::new(seed ^ index.wrapping_mul(0xD1B5_4A32_D192_ED03))
    }

    pub fn next_u64(&mut self) -> u64 {
        let result = self.s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = self.s[1] << 17;
        self.s[2] ^= self.s[0];
        self.s[3] ^= self.s[1];
        self.s[1] ^= self.s[2];
        self.s[0] ^= self.s[3];
        self.s[2] ^= t;
        self.s[3] = self.s[3].rotate_left(45);
        result
    }

    /// Uniform in `0..n` (0 when n is 0).
    pub fn below(&mut self, n: usize) -> usize {
        if n == 0 {
            return 0;
        }
        ((self.next_u64() as u128 * n as u128) >> 64) as usize
    }

    /// True with probability `num / den`.
    pub fn chance(&mut self, num: usize, den: usize) -> bool {
        self.below(den) < num
    }

    pub fn pick<'a, T>(&mut self, items: &'a [T]) -> &'a T {
        &items[self.below(items.len())]
    }
}

/// A random string: mostly characters that matter to parsers (quotes, braces, tags, specials,
/// whitespace, multi-byte and unusual code points).
pub fn random_text(rng: &mut Rng, max_len: usize) -> String {
    const PIECES: &[&str] = &[
        "<think>",
        "</think>",
        "<tool_call>",
        "</tool_call>",
        "<function=",
        "</function>",
        "<parameter=",
        "</parameter>",
        "<|im_start|>",
        "<|im_end|>",
        "<|endoftext|>",
        "{",
        "}",
        "[",
        "]",
        "\"",
        "\\",
        ":",
        ",",
        "\n",
        "\r\n",
        " ",
        "\t",
        "'s",
        "{{",
        "}}",
        "{%",
        "%}",
        "null",
        "true",
        "1e999",
        "-0",
        "é",
        "你",
        "😀",
        "\u{301}",
        "\u{200d}",
        "\u{fffd}",
        "\u{0}",
        "\u{85}",
        "\u{2028}",
        "a",
        "Z",
        "7",
    ];
    let n = rng.below(max_len + 1);
    let mut s = String::new();
    while s.len() < n {
        if rng.chance(1, 8) {
            if let Some(c) = char::from_u32(rng.below(0x11_0000) as u32) {
                s.push(c);
            }
        } else {
            s.push_str(rng.pick(PIECES).as_ref());
        }
    }
    s
}
