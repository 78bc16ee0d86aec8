//! The qwen35 / qwen2 pre-tokenizer split, written after llama.cpp's hand-written splitters
//! `unicode_regex_split_custom_qwen35` and `_qwen2` (`src/unicode.cpp`), which stock llama.cpp
//! runs instead of the expression
//! `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+|\p{N}| ?[^\s\p{L}\p{M}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`
//! (qwen2: without the `\p{M}`s). It is one forward scan, linear in the input, with no
//! backtracking and no limit on input length, and it reproduces that code's decisions
//! exactly, including where it departs from the regex (e.g. `\s+(?!\S)` at the end of the
//! text, or a lone space before an unassigned code point).
//!
//! Code point classes are llama.cpp's (`unicode-data.cpp`): `\p{L}`, `\p{N}`, `\p{M}` and
//! White_Space from regex-syntax's Unicode tables, minus the letters, marks and digits first
//! assigned in Unicode 16, which llama.cpp's tables predate and leave without a category.

use std::ops::Range;
use std::sync::OnceLock;

const LETTER: u8 = 1;
const NUMBER: u8 = 2;
const MARK: u8 = 4;
const SPACE: u8 = 8;
/// Not a code point of the fragment (before its start or past its end): llama.cpp's
/// `unicode_cpt_flags{}` (all zero), against which every real code point, even an unassigned
/// one, has a non-zero `as_uint()` (its UNDEFINED bit).
const OUT: u8 = 0x80;

/// The letters, marks and digits first assigned in Unicode 16.0. llama.cpp's category tables
/// predate them and give them no category, so its splitter treats them like punctuation.
/// Checked against llama.cpp's `unicode_cpt_flags_from_cpt` over the whole code space (the
/// digest in `fixtures/golden/split.json`).
pub(crate) const UNICODE16_LMN: &str = r"\x{897}\x{1C89}-\x{1C8A}\x{A7CB}-\x{A7CD}\x{A7DA}-\x{A7DC}\x{105C0}-\x{105F3}\x{10D40}-\x{10D65}\x{10D69}-\x{10D6D}\x{10D6F}-\x{10D85}\x{10EC2}-\x{10EC4}\x{10EFC}\x{11380}-\x{11389}\x{1138B}\x{1138E}\x{11390}-\x{113B5}\x{113B7}-\x{113C0}\x{113C2}\x{113C5}\x{113C7}-\x{113CA}\x{113CC}-\x{113D3}\x{113E1}-\x{113E2}\x{116D0}-\x{116E3}\x{11BC0}-\x{11BE0}\x{11BF0}-\x{11BF9}\x{11F5A}\x{13460}-\x{143FA}\x{16100}-\x{16139}\x{16D40}-\x{16D6C}\x{16D70}-\x{16D79}\x{18CFF}\x{1CCF0}-\x{1CCF9}\x{1E5D0}-\x{1E5FA}";

const N_CODEPOINTS: usize = 0x11_0000;

/// One byte of class bits per code point (1.1 MB, built once), as llama.cpp's flags array.
fn table() -> &'static [u8] {
    static TABLE: OnceLock<Box<[u8]>> = OnceLock::new();
    TABLE.get_or_init(|| {
        let mut t = vec![0u8; N_CODEPOINTS].into_boxed_slice();
        for (class, bit) in [
            (format!(r"[\p{{L}}--[{UNICODE16_LMN}]]"), LETTER),
            (format!(r"[\p{{N}}--[{UNICODE16_LMN}]]"), NUMBER),
            (format!(r"[\p{{M}}--[{UNICODE16_LMN}]]"), MARK),
            (r"\s".to_string(), SPACE),
        ] {
            for r in unicode_class(&class) {
                for c in r {
                    t[c as usize] |= bit;
                }
            }
        }
        t
    })
}

/// The code point ranges of a Unicode class expression (a fixed, known-good expression).
fn unicode_class(expr: &str) -> Vec<std::ops::RangeInclusive<u32>> {
    use regex_syntax::hir::{Class, HirKind};
    let hir = regex_syntax::ParserBuilder::new()
        .unicode(true)
        .build()
        .parse(expr)
        .unwrap_or_else(|e| panic!("the class {expr:?} is a constant: {e}"));
    match hir.kind() {
        HirKind::Class(Class::Unicode(c)) => c
            .ranges()
            .iter()
            .map(|r| r.start() as u32..=r.end() as u32)
            .collect(),
        other => panic!("the class {expr:?} parsed as {other:?}"),
    }
}

/// A digest of the class table over the whole code space (the golden test compares it with
/// llama.cpp's): byte `c` = letter | number<<1 | mark<<2 | whitespace<<3.
pub fn class_table() -> &'static [u8] {
    table()
}

/// Which of llama.cpp's two splitters.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Flavor {
    /// `[\p{L}\p{M}]+` letter runs: a combining mark belongs to its word.
    Qwen35,
    /// `\p{L}+` letter runs: a combining mark is punctuation.
    Qwen2,
}

/// Cuts `text` into pre-tokens, returned as byte ranges that tile `text` in order.
pub fn split(text: &str, flavor: Flavor) -> Vec<Range<usize>> {
    let t = table();
    // (char, its flags, its byte offset); one extra entry marks the end.
    let mut cps: Vec<(char, u8, usize)> = Vec::with_capacity(text.len() + 1);
    for (i, c) in text.char_indices() {
        cps.push((c, t[c as usize], i));
    }
    let n = cps.len();
    let letterish_bits = match flavor {
        Flavor::Qwen35 => LETTER | MARK,
        Flavor::Qwen2 => LETTER,
    };
    let fl = |p: usize| if p < n { cps[p].1 } else { OUT };
    let cp = |p: usize| if p < n { Some(cps[p].0) } else { None };
    let letterish = |f: u8| f & OUT == 0 && f & letterish_bits != 0;
    let is = |f: u8, bit: u8| f & OUT == 0 && f & bit != 0;
    // `[^\s\p{L}(\p{M})\p{N}]` over a real code point (llama.cpp also requires as_uint() != 0,
    // i.e. not past the end).
    let punct = |f: u8| f & OUT == 0 && !(is(f, SPACE) || letterish(f) || is(f, NUMBER));
    let byte_at = |p: usize| if p < n { cps[p].2 } else { text.len() };

    let mut out: Vec<Range<usize>> = Vec::new();
    let mut prev = 0usize;
    let mut add = |end: usize, out: &mut Vec<Range<usize>>| -> usize {
        let len = end - prev;
        if len > 0 {
            out.push(byte_at(prev)..byte_at(end));
        }
        prev = end;
        len
    };
    let mut pos = 0usize;
    while pos < n {
        let c = cps[pos].0;
        let f = cps[pos].1;

        // (?i:'s|'t|'re|'ve|'m|'ll|'d): llama.cpp lowercases through its own table, which maps
        // nothing else onto these ASCII letters.
        if c == '\'' && pos + 1 < n {
            let nx = cps[pos + 1].0.to_ascii_lowercase();
            if matches!(nx, 's' | 't' | 'm' | 'd') {
                pos += add(pos + 2, &mut out);
                continue;
            }
            if pos + 2 < n {
                let nn = cps[pos + 2].0.to_ascii_lowercase();
                if matches!((nx, nn), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                    pos += add(pos + 3, &mut out);
                    continue;
                }
            }
        }

        // [^\r\n\p{L}\p{N}]?[\p{L}\p{M}]+
        if !(c == '\r' || c == '\n' || is(f, NUMBER)) && (letterish(f) || letterish(fl(pos + 1))) {
            pos += 1;
            while letterish(fl(pos)) {
                pos += 1;
            }
            add(pos, &mut out);
            continue;
        }

        // \p{N}
        if is(f, NUMBER) {
            pos += 1;
            add(pos, &mut out);
            continue;
        }

        // <space>?[^\s\p{L}\p{M}\p{N}]+[\r\n]*
        let mut f2 = if c == ' ' { fl(pos + 1) } else { f };
        if !(is(f2, SPACE) || letterish(f2) || is(f2, NUMBER)) {
            pos += (c == ' ') as usize;
            while punct(f2) {
                pos += 1;
                f2 = fl(pos);
            }
            while matches!(cp(pos), Some('\r' | '\n')) {
                pos += 1;
            }
            add(pos, &mut out);
            continue;
        }

        let mut n_ws = 0usize;
        let mut last_rn = 0usize;
        while is(fl(pos + n_ws), SPACE) {
            if matches!(cps[pos + n_ws].0, '\r' | '\n') {
                last_rn = pos + n_ws + 1;
            }
            n_ws += 1;
        }
        // \s*[\r\n]+
        if last_rn > 0 {
            pos = last_rn;
            add(pos, &mut out);
            continue;
        }
        // \s+(?!\S)
        if n_ws > 1 && pos + n_ws < n {
            pos += n_ws - 1;
            add(pos, &mut out);
            continue;
        }
        // \s+
        if n_ws > 0 {
            pos += n_ws;
            add(pos, &mut out);
            continue;
        }
        // No match: one code point on its own.
        pos += 1;
        add(pos, &mut out);
    }
    out
}
