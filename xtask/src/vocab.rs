//! A small GPT-2-style byte-level BPE vocabulary, learned deterministically from an embedded
//! paragraph, so that stock llama.cpp can load the fixtures with `tokenizer.ggml.model = gpt2`.

use std::collections::{BTreeMap, BTreeSet};

const PARAGRAPH: &str = "The quick brown fox jumps over the lazy dog, and the dog does not seem to mind. \
In the morning the sun rises over the hills, the birds begin to sing, and the people of the town \
walk to the market to buy bread, fruit and fresh fish. Children play in the streets while their \
parents talk about the weather, the harvest and the news from the city. When the evening comes, \
the lights of the houses shine through the windows, and the smell of dinner fills the air. \
It's a simple life, but they're happy with it: they work, they rest, they share what they have. \
Some say the river that runs through the valley has been there for thousands of years, carving \
the stone slowly, patiently, one grain at a time. Others don't care about such things; they \
only want to know whether it will rain tomorrow, whether the road will be open, and whether \
the train will arrive on time. The teacher tells the students that every question is worth \
asking, that learning never ends, and that the world is larger than the town they know. \
In 1984, 42 travellers crossed the mountain pass in 7 days, writing letters home to their families.";

/// Special tokens and their GGUF token_type (3 = control, 4 = user-defined).
pub const SPECIALS: [(&str, i32); 7] = [
    ("<|endoftext|>", 3),
    ("<|im_start|>", 3),
    ("<|im_end|>", 3),
    ("<think>", 4),
    ("</think>", 4),
    ("<tool_call>", 4),
    ("</tool_call>", 4),
];

pub struct Vocab {
    pub tokens: Vec<String>,
    pub types: Vec<i32>,
    pub merges: Vec<String>,
    /// Ids `[0, n_learned)` are the byte symbols and the learned merges (normal, reachable).
    pub n_learned: usize,
    pub eos: u32,
}

/// GPT-2's byte-to-unicode table: printable Latin-1 bytes map to themselves, the rest to
/// U+0100 onwards in byte order.
pub fn byte_to_unicode() -> [char; 256] {
    let mut table = ['\0'; 256];
    let mut n = 0u32;
    for b in 0..256u32 {
        let printable =
            (0x21..=0x7E).contains(&b) || (0xA1..=0xAC).contains(&b) || (0xAE..=0xFF).contains(&b);
        table[b as usize] = if printable {
            char::from_u32(b).unwrap()
        } else {
            n += 1;
            char::from_u32(255 + n).unwrap()
        };
    }
    table
}

/// An ASCII approximation of the qwen35 pre-tokenizer regex (see model-qwen35.md §8):
/// contractions, an optional leading non-letter before a letter run, single digits,
/// punctuation runs with an optional leading space, whitespace.
fn pre_split(text: &str) -> Vec<String> {
    let c: Vec<char> = text.chars().collect();
    let is_letter = |ch: char| ch.is_alphabetic();
    let is_digit = |ch: char| ch.is_numeric();
    let is_punct = |ch: char| !ch.is_whitespace() && !is_letter(ch) && !is_digit(ch);
    let mut out = Vec::new();
    let mut i = 0;
    while i < c.len() {
        let start = i;
        if c[i] == '\'' {
            let rest: String = c[i + 1..c.len().min(i + 3)]
                .iter()
                .collect::<String>()
                .to_lowercase();
            let two = ["re", "ve", "ll"].iter().any(|s| rest.starts_with(s));
            let one = ["s", "t", "m", "d"].iter().any(|s| rest.starts_with(s));
            if two || one {
                i += if two { 3 } else { 2 };
                out.push(c[start..i].iter().collect());
                continue;
            }
        }
        let lead = c[i] != '\r' && c[i] != '\n' && !is_letter(c[i]) && !is_digit(c[i]);
        if is_letter(c[i]) || (lead && i + 1 < c.len() && is_letter(c[i + 1])) {
            i += 1;
            while i < c.len() && is_letter(c[i]) {
                i += 1;
            }
        } else if is_digit(c[i]) {
            i += 1;
        } else if is_punct(c[i]) || (c[i] == ' ' && i + 1 < c.len() && is_punct(c[i + 1])) {
            i += 1;
            while i < c.len() && is_punct(c[i]) {
                i += 1;
            }
        } else {
            // Whitespace: a run, leaving its last space to the next word when one follows.
            while i < c.len() && c[i].is_whitespace() {
                i += 1;
            }
            if i < c.len() && i - start > 1 {
                i -= 1;
            }
        }
        out.push(c[start..i].iter().collect());
    }
    out
}

/// Learns `n_merges` merges on the embedded paragraph. Ties on pair count break on the
/// lexicographically smallest pair, so the result is fully deterministic.
fn learn_merges(n_merges: usize) -> Vec<(String, String)> {
    let b2u = byte_to_unicode();
    let mut words: BTreeMap<Vec<String>, usize> = BTreeMap::new();
    for piece in pre_split(PARAGRAPH) {
        let syms: Vec<String> = piece.bytes().map(|b| b2u[b as usize].to_string()).collect();
        *words.entry(syms).or_insert(0) += 1;
    }
    let mut merges = Vec::new();
    while merges.len() < n_merges {
        let mut pairs: BTreeMap<(String, String), usize> = BTreeMap::new();
        for (w, n) in &words {
            for p in w.windows(2) {
                *pairs.entry((p[0].clone(), p[1].clone())).or_insert(0) += n;
            }
        }
        // max count; on ties the first (smallest) pair in BTreeMap order wins.
        let mut best: Option<(&(String, String), usize)> = None;
        for (p, &n) in &pairs {
            if best.is_none_or(|(_, bn)| n > bn) {
                best = Some((p, n));
            }
        }
        let Some(((a, b), _)) = best else { break };
        let (a, b) = (a.clone(), b.clone());
        let merged = format!("{a}{b}");
        let mut next = BTreeMap::new();
        for (w, n) in words {
            let mut nw = Vec::with_capacity(w.len());
            let mut i = 0;
            while i < w.len() {
                if i + 1 < w.len() && w[i] == a && w[i + 1] == b {
                    nw.push(merged.clone());
                    i += 2;
                } else {
                    nw.push(w[i].clone());
                    i += 1;
                }
            }
            *next.entry(nw).or_insert(0) += n;
        }
        words = next;
        merges.push((a, b));
    }
    merges
}

/// Builds the vocabulary: 256 byte symbols in byte order, the learned merge results, then
/// `n_filler` unreachable normal tokens ("ĠfillerN"), then the specials.
pub fn build(n_merges: usize, n_filler: usize) -> Vocab {
    let b2u = byte_to_unicode();
    let mut tokens: Vec<String> = b2u.iter().map(|c| c.to_string()).collect();
    let mut seen: BTreeSet<String> = tokens.iter().cloned().collect();
    let mut merges = Vec::new();
    for (a, b) in learn_merges(n_merges) {
        let m = format!("{a}{b}");
        if seen.insert(m.clone()) {
            tokens.push(m);
        }
        merges.push(format!("{a} {b}"));
    }
    let n_learned = tokens.len();
    for i in 0..n_filler {
        let t = format!("\u{120}filler{i}");
        assert!(seen.insert(t.clone()), "filler token collides: {t}");
        tokens.push(t);
    }
    let mut types = vec![1i32; tokens.len()];
    let eos = tokens.len() as u32;
    for (s, ty) in SPECIALS {
        tokens.push(s.to_string());
        types.push(ty);
    }
    Vocab {
        tokens,
        types,
        merges,
        n_learned,
        eos,
    }
}

/// The wrapper tokens mtmd puts around a Qwen-VL image (control tokens, after the specials).
pub const VISION_SPECIALS: [&str; 3] = ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"];

/// The tiny vocabulary plus the vision wrappers: ids of every other token are unchanged.
pub fn build_vl(n_merges: usize) -> Vocab {
    let mut v = build(n_merges, 0);
    for s in VISION_SPECIALS {
        v.tokens.push(s.to_string());
        v.types.push(3);
    }
    v
}

/// Builds a vocabulary of exactly `n_vocab` tokens (bench files), padding with fillers.
pub fn build_exact(n_merges: usize, n_vocab: usize) -> Vocab {
    let base = build(n_merges, 0);
    let n_filler = n_vocab - base.tokens.len();
    let v = build(n_merges, n_filler);
    assert_eq!(v.tokens.len(), n_vocab);
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn byte_table_is_gpt2() {
        let t = byte_to_unicode();
        assert_eq!(t[b'a' as usize], 'a');
        assert_eq!(t[b' ' as usize], '\u{120}'); // Ġ
        assert_eq!(t[b'\n' as usize], '\u{10A}'); // Ċ
        assert_eq!(t[0], '\u{100}');
        let uniq: BTreeSet<char> = t.iter().copied().collect();
        assert_eq!(uniq.len(), 256);
    }

    #[test]
    fn split_and_merges() {
        let p = pre_split("It's a dog, 42 x.");
        assert_eq!(p, ["It", "'s", " a", " dog", ",", " ", "4", "2", " x", "."]);
        let v = build(200, 3);
        assert_eq!(v.merges.len(), 200);
        assert!(v.tokens.contains(&"\u{120}the".to_string()));
        assert_eq!(v.tokens[v.eos as usize], "<|endoftext|>");
        assert_eq!(build_exact(200, 1000).tokens.len(), 1000);
    }
}
