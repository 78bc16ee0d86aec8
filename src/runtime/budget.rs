//! The reasoning budget (`--reasoning-budget N`), as llama.cpp's reasoning-budget sampler
//! (`common/reasoning-budget.cpp`) applies it: after the thinking start tag, N generated
//! tokens are free; then, at the next complete UTF-8 character, the forced sequence (the
//! `--reasoning-budget-message` tokens, then the end tag) is produced one token per step
//! whatever the logits say. An end tag the model writes itself ends the count; a new start tag
//! arms a fresh budget.

use std::sync::Arc;

/// One request's budget: the tags as token sequences and what to force.
#[derive(Clone, Debug, PartialEq)]
pub struct BudgetConfig {
    /// Thinking tokens before the forced end (0 = force at once).
    pub budget: usize,
    pub start: Vec<u32>,
    /// End tags; a natural end is any of them.
    pub end: Vec<Vec<u32>>,
    /// The message tokens, then the first end tag.
    pub forced: Vec<u32>,
    /// The generation prompt's tokens (llama.cpp feeds them through the sampler first, so a
    /// prompt that opens thinking starts the count).
    pub prefill: Vec<u32>,
    /// Per token id: its text ends inside a UTF-8 character (forcing waits for the next).
    pub incomplete: Arc<Vec<bool>>,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum State {
    Idle,
    Counting { remaining: usize },
    WaitingUtf8,
    Forcing { pos: usize },
    Done,
}

/// Matches token sequences ending at the latest token; the window restarts after a match.
#[derive(Clone, Debug, Default)]
struct Matcher {
    window: Vec<u32>,
}

impl Matcher {
    fn advance(&mut self, seqs: &[&[u32]], id: u32) -> bool {
        let longest = seqs.iter().map(|s| s.len()).max().unwrap_or(0);
        if longest == 0 {
            return false;
        }
        self.window.push(id);
        if self.window.len() > longest {
            let cut = self.window.len() - longest;
            self.window.drain(..cut);
        }
        let hit = seqs
            .iter()
            .any(|s| !s.is_empty() && self.window.ends_with(s));
        if hit {
            self.window.clear();
        }
        hit
    }

    fn reset(&mut self) {
        self.window.clear();
    }
}

/// The budget's state over one generation.
#[derive(Clone, Debug)]
pub struct ReasoningBudget {
    cfg: BudgetConfig,
    state: State,
    start: Matcher,
    end: Matcher,
}

impl ReasoningBudget {
    pub fn new(cfg: BudgetConfig) -> ReasoningBudget {
        let prefill = cfg.prefill.clone();
        let mut b = ReasoningBudget {
            cfg,
            state: State::Idle,
            start: Matcher::default(),
            end: Matcher::default(),
        };
        for id in prefill {
            b.accept(id);
        }
        b
    }

    fn arm(&mut self) {
        self.end.reset();
        self.state = if self.cfg.budget == 0 {
            State::Forcing { pos: 0 }
        } else {
            State::Counting {
                remaining: self.cfg.budget,
            }
        };
    }

    /// The token the next step must produce, when the budget is being enforced.
    pub fn forced(&self) -> Option<u32> {
        match self.state {
            State::Forcing { pos } => self.cfg.forced.get(pos).copied(),
            _ => None,
        }
    }

    /// Records a produced token.
    pub fn accept(&mut self, id: u32) {
        let start = [self.cfg.start.as_slice()];
        let ends: Vec<&[u32]> = self.cfg.end.iter().map(Vec::as_slice).collect();
        match self.state {
            State::Idle | State::Done => {
                if self.start.advance(&start, id) {
                    self.arm();
                }
            }
            State::Counting { remaining } => {
                if self.end.advance(&ends, id) {
                    self.state = State::Done;
                    return;
                }
                let remaining = remaining.saturating_sub(1);
                self.state = if remaining > 0 {
                    State::Counting { remaining }
                } else if self.incomplete(id) {
                    State::WaitingUtf8
                } else {
                    self.end.reset();
                    State::Forcing { pos: 0 }
                };
            }
            State::WaitingUtf8 => {
                if self.end.advance(&ends, id) {
                    self.state = State::Done;
                } else if !self.incomplete(id) {
                    self.end.reset();
                    self.state = State::Forcing { pos: 0 };
                }
            }
            State::Forcing { pos } => {
                let pos = pos + 1;
                self.state = if pos >= self.cfg.forced.len() {
                    State::Done
                } else {
                    State::Forcing { pos }
                };
            }
        }
    }

    fn incomplete(&self, id: u32) -> bool {
        self.cfg
            .incomplete
            .get(id as usize)
            .copied()
            .unwrap_or(false)
    }
}

/// Whether `bytes` end inside a UTF-8 character (llama.cpp's `common_utf8_is_complete`,
/// negated).
pub fn ends_mid_char(bytes: &[u8]) -> bool {
    let n = bytes.len();
    for back in 1..=n.min(4) {
        let b = bytes[n - back];
        if b & 0xC0 == 0x80 {
            continue;
        }
        let need = match b {
            0x00..=0x7F => 1,
            0xC0..=0xDF => 2,
            0xE0..=0xEF => 3,
            0xF0..=0xF7 => 4,
            _ => return false,
        };
        return back < need;
    }
    false
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg(budget: usize, prefill: Vec<u32>) -> BudgetConfig {
        BudgetConfig {
            budget,
            start: vec![10],
            end: vec![vec![11]],
            forced: vec![7, 11],
            prefill,
            incomplete: Arc::new(vec![false; 32]),
        }
    }

    #[test]
    fn forces_the_end_after_the_budget() {
        // The prompt opens thinking: <think> and "\n" (which counts, as in llama.cpp).
        let mut b = ReasoningBudget::new(cfg(3, vec![10, 1]));
        assert_eq!(b.forced(), None);
        b.accept(2);
        assert_eq!(b.forced(), None);
        b.accept(3);
        assert_eq!(
            b.forced(),
            Some(7),
            "3 tokens of thinking, then the message"
        );
        b.accept(7);
        assert_eq!(b.forced(), Some(11), "then the end tag");
        b.accept(11);
        assert_eq!(b.forced(), None);
        // A new start tag arms a fresh budget.
        b.accept(10);
        b.accept(4);
        b.accept(4);
        assert_eq!(b.forced(), None);
        b.accept(4);
        assert_eq!(b.forced(), Some(7));
    }

    #[test]
    fn a_natural_end_stops_the_count_and_zero_forces_at_once() {
        let mut b = ReasoningBudget::new(cfg(2, vec![10]));
        b.accept(11);
        b.accept(5);
        b.accept(5);
        assert_eq!(b.forced(), None);
        let b = ReasoningBudget::new(cfg(0, vec![10]));
        assert_eq!(b.forced(), Some(7));
        let b = ReasoningBudget::new(cfg(0, vec![]));
        assert_eq!(b.forced(), None, "no thinking opened, nothing to close");
    }

    #[test]
    fn waits_for_a_whole_character() {
        let mut c = cfg(1, vec![10]);
        let mut inc = vec![false; 32];
        inc[20] = true;
        c.incomplete = Arc::new(inc);
        let mut b = ReasoningBudget::new(c);
        b.accept(20);
        assert_eq!(b.forced(), None, "mid-character");
        b.accept(21);
        assert_eq!(b.forced(), Some(7));
        assert!(ends_mid_char(&[0xE2, 0x82]));
        assert!(!ends_mid_char(&[0xE2, 0x82, 0xAC]));
        assert!(!ends_mid_char(b"abc"));
        assert!(ends_mid_char(&[b'a', 0xF0]));
    }
}
