//! The GGUF vocabulary (`tokenizer.ggml.*`) as a byte-level BPE tokenizer, matching llama.cpp.
//!
//! Qwen3.5 files carry a GPT-2 style vocabulary (`tokenizer.ggml.model = "gpt2"`): byte-level
//! BPE over pre-tokens cut by the `tokenizer.ggml.pre` rules. The cut is [`split`], a port of
//! llama.cpp's own hand-written qwen35/qwen2 splitter (linear, no length limit); each
//! pre-token is byte-level mapped and merged by the `tokenizers` crate's BPE model (built from
//! the GGUF vocab and merges; no normalizer: llama.cpp applies none, not even the NFC step of
//! HF's Qwen3.5 tokenizer). A pre-token the BPE cannot cover entirely (a byte with no symbol in
//! the vocabulary) is an error, never a silently shortened encoding.
//!
//! Everything around the BPE follows llama.cpp (`src/llama-vocab.cpp`), which is the reference
//! our goldens come from:
//! - special tokens are split out of the text before BPE, by llama.cpp's rules: longest token
//!   text first, and *user-defined* tokens (type 4, e.g. `<think>`) are split out even when
//!   `parse_special` is off; only control (3) and unknown (2) tokens are then left as text.
//!   The HF added-token machinery has different rules (one flag for all added tokens,
//!   leftmost-longest matching), so this module partitions the text itself and hands the
//!   `tokenizers` pipeline only plain text.
//! - detokenization is per piece, as `llama_token_to_piece`: normal tokens are byte-level
//!   decoded, control/unknown tokens render as their text (or nothing when skipping
//!   specials), user-defined tokens always render as their text, byte tokens as their byte,
//!   unused/undefined tokens as nothing. The pieces are precomputed once at load.
//! - end-of-generation tokens are chosen by llama.cpp's text list plus eos/eot/eom and the
//!   FIM pad/repo/separator tokens.
//! - the pre-tokenizer split is llama.cpp's, code point classes included (see [`split`]):
//!   it cuts any text exactly as llama.cpp's `unicode.cpp` does, whatever its length.
//!
//! Deliberate differences from llama.cpp, all on malformed or foreign files: a missing
//! `tokenizer.ggml.pre`, a pre other than `qwen35`/`qwen2`, an out-of-range special token id,
//! a duplicate token text and a merge whose parts or result are not tokens are load errors
//! here (llama.cpp falls back, warns or asserts); and a missing bos/eos id is "none" here,
//! not llama.cpp's gpt2 default of 11.

use std::collections::{HashMap, HashSet};

pub mod split;

use tokenizers::models::bpe::{Vocab, BPE};
use tokenizers::Model;

use crate::gguf::{Gguf, Value};

/// GGUF metadata keys (llama.cpp `llama-arch.cpp`).
mod key {
    pub const MODEL: &str = "tokenizer.ggml.model";
    pub const PRE: &str = "tokenizer.ggml.pre";
    pub const TOKENS: &str = "tokenizer.ggml.tokens";
    pub const TOKEN_TYPE: &str = "tokenizer.ggml.token_type";
    pub const MERGES: &str = "tokenizer.ggml.merges";
    pub const BOS: &str = "tokenizer.ggml.bos_token_id";
    pub const EOS: &str = "tokenizer.ggml.eos_token_id";
    pub const EOT: &str = "tokenizer.ggml.eot_token_id";
    pub const EOM: &str = "tokenizer.ggml.eom_token_id";
    pub const PAD: &str = "tokenizer.ggml.padding_token_id";
    pub const FIM_PRE: &str = "tokenizer.ggml.fim_pre_token_id";
    pub const FIM_SUF: &str = "tokenizer.ggml.fim_suf_token_id";
    pub const FIM_MID: &str = "tokenizer.ggml.fim_mid_token_id";
    pub const FIM_PAD: &str = "tokenizer.ggml.fim_pad_token_id";
    pub const FIM_REP: &str = "tokenizer.ggml.fim_rep_token_id";
    pub const FIM_SEP: &str = "tokenizer.ggml.fim_sep_token_id";
    // Deprecated spellings of the FIM keys; llama.cpp reads them after the new ones, so they win.
    pub const PREFIX: &str = "tokenizer.ggml.prefix_token_id";
    pub const SUFFIX: &str = "tokenizer.ggml.suffix_token_id";
    pub const MIDDLE: &str = "tokenizer.ggml.middle_token_id";
    pub const ADD_BOS: &str = "tokenizer.ggml.add_bos_token";
    pub const ADD_EOS: &str = "tokenizer.ggml.add_eos_token";
}

/// Token attributes, as llama.cpp's `llama_token_attr` bits (only the ones that matter here).
mod attr {
    pub const UNDEFINED: u8 = 0;
    pub const UNKNOWN: u8 = 1 << 0;
    pub const UNUSED: u8 = 1 << 1;
    pub const NORMAL: u8 = 1 << 2;
    pub const CONTROL: u8 = 1 << 3;
    pub const USER_DEFINED: u8 = 1 << 4;
    pub const BYTE: u8 = 1 << 5;

    /// What `token_to_piece(special = false)` suppresses.
    pub const SPECIAL: u8 = UNKNOWN | CONTROL;

    /// GGUF `tokenizer.ggml.token_type` values (llama.cpp `llama_token_type`).
    pub fn from_token_type(t: i64) -> u8 {
        match t {
            1 => NORMAL,
            2 => UNKNOWN,
            3 => CONTROL,
            4 => USER_DEFINED,
            5 => UNUSED,
            6 => BYTE,
            _ => UNDEFINED,
        }
    }
}

/// Texts llama.cpp auto-detects as the eot token when no `eot_token_id` is given.
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];
const EOM_TEXTS: &[&str] = &["<|eom_id|>"];
const FIM_PRE_TEXTS: &[&str] = &[
    "<|fim_prefix|>",
    "<fim-prefix>",
    "<fim_prefix>",
    "<｜fim▁begin｜>",
    "<PRE>",
    "▁<PRE>",
    "<|code_prefix|>",
    "<|prefix|>",
];
const FIM_SUF_TEXTS: &[&str] = &[
    "<|fim_suffix|>",
    "<fim-suffix>",
    "<fim_suffix>",
    "<｜fim▁hole｜>",
    "<SUF>",
    "▁<SUF>",
    "<|code_suffix|>",
    "<|suffix|>",
];
const FIM_MID_TEXTS: &[&str] = &[
    "<|fim_middle|>",
    "<fim-middle>",
    "<fim_middle>",
    "<｜fim▁end｜>",
    "<MID>",
    "▁<MID>",
    "<|code_middle|>",
    "<|middle|>",
];
const FIM_PAD_TEXTS: &[&str] = &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"];
const FIM_REP_TEXTS: &[&str] = &[
    "<|fim_repo|>",
    "<|repo_name|>",
    "<fim-repo>",
    "<REPO>",
    "<reponame>",
];
const FIM_SEP_TEXTS: &[&str] = &["<|file_sep|>"];

/// Texts llama.cpp always treats as end-of-generation (and forces to control type). The
/// gpt-oss / solar-open `<|end|>` and gemma4 / plamo `</s>` exceptions are not reproduced:
/// they need those families' own pre-tokenizers, which this loader rejects.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

#[derive(Debug, thiserror::Error)]
pub enum TokenizerError {
    #[error("GGUF metadata key {0:?} is missing")]
    MissingKey(&'static str),
    #[error("GGUF metadata key {key:?}: {reason}")]
    BadValue { key: &'static str, reason: String },
    #[error("unsupported tokenizer.ggml.model {0:?} (tern supports \"gpt2\")")]
    UnsupportedModel(String),
    #[error("unsupported tokenizer.ggml.pre {0:?} (tern supports \"qwen35\" and \"qwen2\")")]
    UnsupportedPre(String),
    #[error("tokenizers library failed while {context}: {message}")]
    Tokenizers {
        context: &'static str,
        message: String,
    },
    #[error("the pre-tokenizer split of a {len}-byte text stopped at byte {at}")]
    SplitIncomplete { at: usize, len: usize },
    #[error("the vocabulary has no token for part of the pre-token {piece:?} (byte-level BPE needs a symbol for every byte)")]
    Untokenizable { piece: String },
    #[error("token id {id} ({what}) is out of range: the vocabulary has {n_vocab} tokens")]
    TokenIdOutOfRange {
        what: String,
        id: i64,
        n_vocab: usize,
    },
}

/// The pre-tokenizer flavours we accept (`tokenizer.ggml.pre`).
type PreType = split::Flavor;

/// A piece of input after special-token partitioning.
enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

pub struct Tokenizer {
    /// The BPE merges over byte-level symbols; knows no special tokens (see the module comment).
    bpe: BPE,
    pre: PreType,
    /// GPT-2's `bytes_to_unicode`: the symbol each byte is spelled with in the vocabulary.
    b2u: [char; 256],
    /// Raw vocab strings, concatenated; token `i` is `texts[text_off[i]..text_off[i + 1]]`.
    texts: String,
    text_off: Vec<usize>,
    /// Detokenized bytes of each token as rendered with specials shown (llama.cpp's
    /// piece cache); token `i` is `pieces[piece_off[i]..piece_off[i + 1]]`.
    pieces: Vec<u8>,
    piece_off: Vec<usize>,
    attrs: Vec<u8>,
    /// Control, user-defined and unknown tokens, longest text first (llama.cpp's
    /// `cache_special_tokens`): the order in which they are split out of the input.
    specials: Vec<u32>,
    /// Sorted, deduplicated.
    eog: Vec<u32>,
    bos: Option<u32>,
    eos: Option<u32>,
    pad: Option<u32>,
    add_bos: bool,
    add_eos: bool,
}

impl std::fmt::Debug for Tokenizer {
    // The vocabulary is large; show its shape only.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tokenizer")
            .field("pre", &self.pre)
            .field("n_vocab", &self.n_vocab())
            .field("n_special", &self.specials.len())
            .field("bos", &self.bos)
            .field("eos", &self.eos)
            .field("eog", &self.eog)
            .field("add_bos", &self.add_bos)
            .field("add_eos", &self.add_eos)
            .finish()
    }
}

impl Tokenizer {
    pub fn from_gguf(g: &Gguf) -> Result<Tokenizer, TokenizerError> {
        let model = require_str(g, key::MODEL)?;
        if model != "gpt2" {
            return Err(TokenizerError::UnsupportedModel(model.to_string()));
        }
        let pre = match require_str(g, key::PRE)? {
            "qwen35" => split::Flavor::Qwen35,
            "qwen2" => split::Flavor::Qwen2,
            other => return Err(TokenizerError::UnsupportedPre(other.to_string())),
        };

        // Vocabulary. llama.cpp renames empty tokens so that every text is a distinct key.
        let raw_tokens = require_array(g, key::TOKENS)?;
        if raw_tokens.is_empty() {
            return Err(bad(key::TOKENS, "the token list is empty"));
        }
        if u32::try_from(raw_tokens.len()).is_err() {
            return Err(bad(
                key::TOKENS,
                format!("{} tokens do not fit u32 ids", raw_tokens.len()),
            ));
        }
        let n = raw_tokens.len();
        let mut texts = String::new();
        let mut text_off = Vec::with_capacity(n + 1);
        text_off.push(0);
        let mut vocab: Vocab = Vocab::default();
        vocab.reserve(n);
        for (i, v) in raw_tokens.iter().enumerate() {
            let s = v.as_str().ok_or_else(|| {
                bad(
                    key::TOKENS,
                    format!("element {i} is a {}, not a string", v.value_type().name()),
                )
            })?;
            let start = texts.len();
            if s.is_empty() {
                texts.push_str(&format!("[EMPTY_{i}]"));
            } else {
                texts.push_str(s);
            }
            let t = &texts[start..];
            if let Some(prev) = vocab.insert(t.to_string(), i as u32) {
                // llama.cpp asserts on this: the text -> id map would silently lose a token.
                return Err(bad(
                    key::TOKENS,
                    format!("token {i} {t:?} duplicates token {prev}"),
                ));
            }
            text_off.push(texts.len());
        }
        let text = |i: usize| &texts[text_off[i]..text_off[i + 1]];

        // Types. Absent means all normal (llama.cpp).
        let mut attrs = vec![attr::NORMAL; n];
        if let Some(v) = g.get(key::TOKEN_TYPE) {
            let types = v
                .as_array()
                .ok_or_else(|| bad(key::TOKEN_TYPE, "not an array"))?;
            if types.len() < n {
                return Err(bad(
                    key::TOKEN_TYPE,
                    format!("{} entries for {n} tokens", types.len()),
                ));
            }
            for (i, (a, t)) in attrs.iter_mut().zip(types).enumerate() {
                let t = t.as_i64().ok_or_else(|| {
                    bad(key::TOKEN_TYPE, format!("element {i} is not an integer"))
                })?;
                *a = attr::from_token_type(t);
            }
        }

        let merges = parse_merges(g, &vocab)?;

        // Special token ids given by the file.
        let id_of = |k: &'static str| read_id(g, k, n);
        let bos = id_of(key::BOS)?;
        let eos = id_of(key::EOS)?;
        let pad = id_of(key::PAD)?;
        let mut eot = id_of(key::EOT)?;
        let mut eom = id_of(key::EOM)?;
        let mut fim_pre = id_of(key::PREFIX)?.or(id_of(key::FIM_PRE)?);
        let mut fim_suf = id_of(key::SUFFIX)?.or(id_of(key::FIM_SUF)?);
        let mut fim_mid = id_of(key::MIDDLE)?.or(id_of(key::FIM_MID)?);
        let mut fim_pad = id_of(key::FIM_PAD)?;
        let mut fim_rep = id_of(key::FIM_REP)?;
        let mut fim_sep = id_of(key::FIM_SEP)?;
        let add_bos = read_bool(g, key::ADD_BOS)?.unwrap_or(false);
        let add_eos = read_bool(g, key::ADD_EOS)?.unwrap_or(false);
        if add_bos && bos.is_none() {
            return Err(bad(
                key::ADD_BOS,
                format!("is true but {} is absent", key::BOS),
            ));
        }
        if add_eos && eos.is_none() {
            return Err(bad(
                key::ADD_EOS,
                format!("is true but {} is absent", key::EOS),
            ));
        }

        // llama.cpp fills the ids the file left out by looking for well-known texts, and forces
        // what it finds to control type (so `<|im_end|>` is never plain text even in a file
        // that typed it user-defined). It walks a hash map; we walk ids in order, which picks
        // the same token whenever the vocabulary has only one candidate text.
        let mut slots: [(&mut Option<u32>, &[&str]); 8] = [
            (&mut eot, EOT_TEXTS),
            (&mut eom, EOM_TEXTS),
            (&mut fim_pre, FIM_PRE_TEXTS),
            (&mut fim_suf, FIM_SUF_TEXTS),
            (&mut fim_mid, FIM_MID_TEXTS),
            (&mut fim_pad, FIM_PAD_TEXTS),
            (&mut fim_rep, FIM_REP_TEXTS),
            (&mut fim_sep, FIM_SEP_TEXTS),
        ];
        for (slot, candidates) in slots.iter_mut() {
            if slot.is_some() {
                continue;
            }
            if let Some(i) = candidates
                .iter()
                .filter_map(|c| vocab.get(*c).copied())
                .min()
            {
                **slot = Some(i);
                attrs[i as usize] |= attr::CONTROL;
            }
        }

        // End of generation: the FIM pad/repo/separator tokens, every token with a known
        // end-of-turn text (forced to control), and eos/eot/eom.
        let mut eog: Vec<u32> = [fim_pad, fim_rep, fim_sep].into_iter().flatten().collect();
        for &i in EOG_TEXTS.iter().filter_map(|t| vocab.get(*t)) {
            eog.push(i);
            attrs[i as usize] |= attr::CONTROL;
        }
        eog.extend([eos, eot, eom].into_iter().flatten());
        eog.sort_unstable();
        eog.dedup();

        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&i| {
                attrs[i as usize] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
            })
            .collect();
        // Stable, so equal-length tokens keep id order (llama.cpp's std::sort leaves that
        // unspecified; it only matters for two equal-length texts that overlap in the input).
        specials.sort_by_key(|&i| std::cmp::Reverse(text(i as usize).len()));

        // Pieces, as llama.cpp's token-to-piece cache (rendered with specials shown).
        let u2b = unicode_to_byte();
        let mut pieces = Vec::with_capacity(texts.len());
        let mut piece_off = Vec::with_capacity(n + 1);
        piece_off.push(0);
        for (i, &a) in attrs.iter().enumerate() {
            let t = text(i);
            if a & (attr::SPECIAL | attr::USER_DEFINED) != 0 {
                pieces.extend_from_slice(t.as_bytes());
            } else if a & attr::NORMAL != 0 {
                byte_level_decode(t, &u2b, &mut pieces);
            } else if a & attr::BYTE != 0 {
                pieces.push(byte_token_value(t));
            }
            // Unused and undefined tokens render as nothing.
            piece_off.push(pieces.len());
        }

        let bpe = build_bpe(vocab, merges)?;
        let mut b2u = ['\0'; 256];
        for (c, b) in u2b {
            b2u[b as usize] = c;
        }
        Ok(Tokenizer {
            bpe,
            pre,
            b2u,
            texts,
            text_off,
            pieces,
            piece_off,
            attrs,
            specials,
            eog,
            bos,
            eos,
            pad,
            add_bos,
            add_eos,
        })
    }

    /// parse_special: control/user-defined token texts in `text` become their ids (llama.cpp
    /// `special=true`); otherwise control and unknown token texts are encoded as plain text.
    /// User-defined tokens (type 4, e.g. `<think>`) are split out either way, as llama.cpp
    /// does. add_bos only when the file asks for it (tokenizer.ggml.add_bos_token) and
    /// `add_special` is true; likewise eos with tokenizer.ggml.add_eos_token.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<u32>, TokenizerError> {
        let mut out = Vec::new();
        if add_special && self.add_bos {
            out.extend(self.bos);
        }
        for fragment in self.partition(text, parse_special) {
            match fragment {
                Fragment::Token(id) => out.push(id),
                Fragment::Text(s) => self.encode_text(s, &mut out)?,
            }
        }
        if add_special && self.add_eos {
            out.extend(self.eos);
        }
        Ok(out)
    }

    /// Byte-level BPE over the pre-tokens of one text fragment.
    fn encode_text(&self, s: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        let mut at = 0;
        let mut word = String::new();
        for r in split::split(s, self.pre) {
            if r.start != at || r.end <= r.start {
                return Err(TokenizerError::SplitIncomplete { at, len: s.len() });
            }
            at = r.end;
            word.clear();
            word.extend(
                s.as_bytes()[r.clone()]
                    .iter()
                    .map(|&b| self.b2u[b as usize]),
            );
            let toks = self
                .bpe
                .tokenize(&word)
                .map_err(|e| TokenizerError::Tokenizers {
                    context: "encoding",
                    message: e.to_string(),
                })?;
            // The BPE drops a symbol it has no token for: the tokens must tile the word.
            let mut end = 0;
            for t in &toks {
                if t.offsets.0 != end {
                    break;
                }
                end = t.offsets.1;
            }
            if end != word.len() {
                return Err(TokenizerError::Untokenizable {
                    piece: s[r].to_string(),
                });
            }
            out.extend(toks.iter().map(|t| t.id));
        }
        if at != s.len() {
            return Err(TokenizerError::SplitIncomplete { at, len: s.len() });
        }
        Ok(())
    }

    /// Concatenated bytes of the pieces (special tokens rendered as their text unless
    /// skip_special), lossless for byte-level tokens, so a streaming caller can hold back
    /// incomplete UTF-8. skip_special drops control and unknown tokens; user-defined tokens
    /// such as `<think>` are always rendered, as llama.cpp does.
    pub fn decode_bytes(&self, ids: &[u32], skip_special: bool) -> Result<Vec<u8>, TokenizerError> {
        let mut out = Vec::new();
        for (pos, &id) in ids.iter().enumerate() {
            let i = id as usize;
            if i >= self.n_vocab() {
                return Err(TokenizerError::TokenIdOutOfRange {
                    what: format!("decode input at position {pos}"),
                    id: id as i64,
                    n_vocab: self.n_vocab(),
                });
            }
            if skip_special && self.attrs[i] & attr::SPECIAL != 0 {
                continue;
            }
            out.extend_from_slice(&self.pieces[self.piece_off[i]..self.piece_off[i + 1]]);
        }
        Ok(out)
    }

    /// Lossy UTF-8 of [`Tokenizer::decode_bytes`].
    pub fn decode(&self, ids: &[u32], skip_special: bool) -> Result<String, TokenizerError> {
        let bytes = self.decode_bytes(ids, skip_special)?;
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The raw vocabulary string (byte-level encoded for normal tokens; `[EMPTY_<id>]` for a
    /// token the file left empty, as llama.cpp names it).
    pub fn token_piece(&self, id: u32) -> Option<&str> {
        let i = id as usize;
        (i < self.n_vocab()).then(|| &self.texts[self.text_off[i]..self.text_off[i + 1]])
    }

    pub fn n_vocab(&self) -> usize {
        self.attrs.len()
    }

    pub fn bos(&self) -> Option<u32> {
        self.bos
    }

    pub fn eos(&self) -> Option<u32> {
        self.eos
    }

    /// tokenizer.ggml.padding_token_id, if the file has one.
    pub fn pad(&self) -> Option<u32> {
        self.pad
    }

    /// End of generation: eos, eot, eom, `<|im_end|>`, `<|endoftext|>` etc. as llama.cpp decides.
    pub fn is_eog(&self, id: u32) -> bool {
        self.eog.binary_search(&id).is_ok()
    }

    /// The id of a raw vocabulary string (the inverse of [`Tokenizer::token_piece`]).
    pub fn token_id(&self, text: &str) -> Option<u32> {
        self.bpe.token_to_id(text)
    }

    /// Splits out special tokens as llama.cpp's `tokenizer_st_partition`: for each special
    /// token, longest first, every occurrence in every remaining text fragment becomes a token
    /// fragment. Control and unknown tokens take part only with `parse_special`.
    fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut fragments = Vec::new();
        if !text.is_empty() {
            fragments.push(Fragment::Text(text));
        }
        for &id in &self.specials {
            if !parse_special && self.attrs[id as usize] & attr::SPECIAL != 0 {
                continue;
            }
            let needle = self.token_piece(id).unwrap_or_default();
            let found = fragments
                .iter()
                .any(|f| matches!(f, Fragment::Text(s) if s.contains(needle)));
            if !found {
                continue;
            }
            let mut next = Vec::with_capacity(fragments.len() + 2);
            for f in fragments {
                let Fragment::Text(mut s) = f else {
                    next.push(f);
                    continue;
                };
                while let Some(at) = s.find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(&s[..at]));
                    }
                    next.push(Fragment::Token(id));
                    s = &s[at + needle.len()..];
                }
                if !s.is_empty() {
                    next.push(Fragment::Text(s));
                }
            }
            fragments = next;
        }
        fragments
    }
}

fn bad(key: &'static str, reason: impl Into<String>) -> TokenizerError {
    TokenizerError::BadValue {
        key,
        reason: reason.into(),
    }
}

fn require_str<'g>(g: &'g Gguf, k: &'static str) -> Result<&'g str, TokenizerError> {
    let v = g.get(k).ok_or(TokenizerError::MissingKey(k))?;
    v.as_str()
        .ok_or_else(|| bad(k, format!("is a {}, not a string", v.value_type().name())))
}

fn require_array<'g>(g: &'g Gguf, k: &'static str) -> Result<&'g [Value], TokenizerError> {
    let v = g.get(k).ok_or(TokenizerError::MissingKey(k))?;
    v.as_array()
        .ok_or_else(|| bad(k, format!("is a {}, not an array", v.value_type().name())))
}

fn read_bool(g: &Gguf, k: &'static str) -> Result<Option<bool>, TokenizerError> {
    match g.get(k) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| bad(k, format!("is a {}, not a bool", v.value_type().name()))),
    }
}

/// An optional token-id key, checked against the vocabulary size.
fn read_id(g: &Gguf, k: &'static str, n_vocab: usize) -> Result<Option<u32>, TokenizerError> {
    let Some(v) = g.get(k) else { return Ok(None) };
    let id = v
        .as_i64()
        .ok_or_else(|| bad(k, format!("is a {}, not an integer", v.value_type().name())))?;
    if id < 0 || id as u64 >= n_vocab as u64 {
        return Err(TokenizerError::TokenIdOutOfRange {
            what: k.to_string(),
            id,
            n_vocab,
        });
    }
    Ok(Some(id as u32))
}

/// `tokenizer.ggml.merges` as (left, right) pairs in rank order. Each entry splits at its first
/// space after the first byte (llama.cpp's `find(' ', 1)`); an entry without one can never match
/// and is skipped, and a repeated pair keeps its first rank (llama.cpp's `emplace`). The
/// `tokenizers` BPE needs both parts and their concatenation to be tokens; llama.cpp would
/// instead merge such strings and byte-split the result, which we cannot reproduce, so those
/// files are rejected with the offending entry named.
fn parse_merges(g: &Gguf, vocab: &Vocab) -> Result<Vec<(String, String)>, TokenizerError> {
    let raw = require_array(g, key::MERGES)?;
    let mut seen: HashSet<&str> = HashSet::with_capacity(raw.len());
    let mut merges = Vec::with_capacity(raw.len());
    for (i, v) in raw.iter().enumerate() {
        let line = v.as_str().ok_or_else(|| {
            bad(
                key::MERGES,
                format!("element {i} is a {}, not a string", v.value_type().name()),
            )
        })?;
        // Byte-wise like llama.cpp; a space byte is always a char boundary.
        let Some(pos) = line.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
            continue;
        };
        if !seen.insert(line) {
            continue;
        }
        let (a, b) = (&line[..pos], &line[pos + 1..]);
        for part in [a, b, &format!("{a}{b}")] {
            if !vocab.contains_key(part) {
                return Err(bad(
                    key::MERGES,
                    format!("merge {i} {line:?}: {part:?} is not a token"),
                ));
            }
        }
        merges.push((a.to_string(), b.to_string()));
    }
    Ok(merges)
}

fn build_bpe(vocab: Vocab, merges: Vec<(String, String)>) -> Result<BPE, TokenizerError> {
    BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| TokenizerError::Tokenizers {
            context: "building the BPE model",
            message: e.to_string(),
        })
}

/// GPT-2's `bytes_to_unicode`, inverted: printable Latin-1 bytes stand for themselves, the
/// other bytes for U+0100 onwards in byte order.
fn unicode_to_byte() -> HashMap<char, u8> {
    let mut map = HashMap::with_capacity(256);
    let mut n = 0u32;
    for b in 0..=255u8 {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let c = if printable {
            char::from(b)
        } else {
            n += 1;
            char::from_u32(255 + n).expect("U+0100..U+0143 are chars")
        };
        map.insert(c, b);
    }
    map
}

/// llama.cpp's `llama_decode_text`: each symbol back to its byte; a symbol outside the table
/// (not produced by byte-level BPE) becomes `[UNK_BYTE_0x<its UTF-8 in hex><whole token>]`.
fn byte_level_decode(token: &str, u2b: &HashMap<char, u8>, out: &mut Vec<u8>) {
    for c in token.chars() {
        match u2b.get(&c) {
            Some(&b) => out.push(b),
            None => {
                out.extend_from_slice(b"[UNK_BYTE_0x");
                let mut buf = [0u8; 4];
                for b in c.encode_utf8(&mut buf).bytes() {
                    out.extend_from_slice(format!("{b:02x}").as_bytes());
                }
                out.extend_from_slice(token.as_bytes());
                out.push(b']');
            }
        }
    }
}

/// The byte of a byte-type token `<0xXX>`, read as llama.cpp's `strtol(text.substr(3, 2), 16)`:
/// the leading hex digits of those two characters, 0 if there are none.
fn byte_token_value(text: &str) -> u8 {
    let digits = text
        .as_bytes()
        .iter()
        .skip(3)
        .take(2)
        .map_while(|&c| (c as char).to_digit(16));
    digits.fold(0u32, |acc, d| acc * 16 + d) as u8
}

#[cfg(test)]
mod tests {
    use std::collections::BTreeMap;

    use super::*;
    use crate::gguf::GgufWriter;

    const CORPUS: &str =
        "The quick brown fox jumps over the lazy dog. The dog sleeps, the fox runs \
        into the forest and the birds sing in the trees. It's the third time they're here; \
        I don't think we'll see the fox again. Numbers like 2024 and 1999 are years. \
        Le café est très bon, le café du matin. 你好世界，你好朋友。 مرحبا بالعالم مرحبا";

    /// Special tokens of the test vocabulary with their GGUF token types.
    const SPECIALS: [(&str, i32); 5] = [
        ("<|endoftext|>", 3),
        ("<|im_start|>", 3),
        ("<|im_end|>", 3),
        ("<think>", 4),
        ("</think>", 4),
    ];

    fn byte_to_unicode() -> [char; 256] {
        let u2b = unicode_to_byte();
        let mut t = ['\0'; 256];
        for (c, b) in u2b {
            t[b as usize] = c;
        }
        t
    }

    fn to_symbols(s: &str) -> Vec<String> {
        let b2u = byte_to_unicode();
        s.bytes().map(|b| b2u[b as usize].to_string()).collect()
    }

    /// Learns `n` merges greedily on CORPUS cut at spaces (the leading space stays with the
    /// word, as GPT-2 does). Ties break on the smallest pair so the vocabulary is fixed.
    fn learn_merges(n: usize) -> Vec<(String, String)> {
        let mut words: Vec<Vec<String>> = Vec::new();
        for (i, w) in CORPUS.split(' ').enumerate() {
            let w = if i == 0 {
                w.to_string()
            } else {
                format!(" {w}")
            };
            words.push(to_symbols(&w));
        }
        let mut merges = Vec::new();
        while merges.len() < n {
            let mut counts: BTreeMap<(String, String), usize> = BTreeMap::new();
            for w in &words {
                for p in w.windows(2) {
                    *counts.entry((p[0].clone(), p[1].clone())).or_default() += 1;
                }
            }
            let Some((pair, &best)) = counts.iter().rev().max_by_key(|(_, &c)| c) else {
                break;
            };
            if best < 2 {
                break;
            }
            let (a, b) = pair.clone();
            for w in &mut words {
                let mut i = 0;
                while i + 1 < w.len() {
                    if w[i] == a && w[i + 1] == b {
                        w[i] = format!("{a}{b}");
                        w.remove(i + 1);
                    }
                    i += 1;
                }
            }
            merges.push((a, b));
        }
        merges
    }

    struct TestVocab {
        tokens: Vec<String>,
        types: Vec<i32>,
        merges: Vec<(String, String)>,
    }

    fn test_vocab() -> TestVocab {
        let mut tokens: Vec<String> = byte_to_unicode().iter().map(|c| c.to_string()).collect();
        let merges = learn_merges(120);
        for (a, b) in &merges {
            let m = format!("{a}{b}");
            if !tokens.contains(&m) {
                tokens.push(m);
            }
        }
        let mut types = vec![1; tokens.len()];
        for (s, t) in SPECIALS {
            tokens.push(s.to_string());
            types.push(t);
        }
        TestVocab {
            tokens,
            types,
            merges,
        }
    }

    fn writer(v: &TestVocab, pre: &str) -> GgufWriter {
        let mut w = GgufWriter::new();
        let merges: Vec<String> = v.merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
        let eos = v.tokens.iter().position(|t| t == "<|endoftext|>").unwrap() as u32;
        w.set("general.architecture", Value::String("qwen35".into()))
            .set(key::MODEL, Value::String("gpt2".into()))
            .set(key::PRE, Value::String(pre.into()))
            .set(key::TOKENS, Value::str_array(&v.tokens))
            .set(key::TOKEN_TYPE, Value::i32_array(&v.types))
            .set(key::MERGES, Value::str_array(&merges))
            .set(key::EOS, Value::U32(eos))
            .set(key::PAD, Value::U32(eos))
            .set(key::ADD_BOS, Value::Bool(false));
        w
    }

    fn open(w: &GgufWriter) -> Result<Tokenizer, TokenizerError> {
        let g = Gguf::from_bytes("test.gguf", w.to_bytes()).expect("writer output parses");
        Tokenizer::from_gguf(&g)
    }

    fn tok(pre: &str) -> Tokenizer {
        open(&writer(&test_vocab(), pre)).expect("test vocabulary loads")
    }

    /// The pre-tokens of `text` under `t`'s split.
    fn pre_tokens(t: &Tokenizer, text: &str) -> Vec<String> {
        split::split(text, t.pre)
            .into_iter()
            .map(|r| text[r].to_string())
            .collect()
    }

    /// llama.cpp's BPE on one pre-token: repeatedly merge the lowest-ranked adjacent pair,
    /// leftmost first; map the final symbols to ids.
    fn reference_bpe(v: &TestVocab, pre_token: &str) -> Vec<u32> {
        let ranks: HashMap<(&str, &str), usize> = v
            .merges
            .iter()
            .enumerate()
            .map(|(i, (a, b))| ((a.as_str(), b.as_str()), i))
            .collect();
        let mut syms = to_symbols(pre_token);
        loop {
            let best = (0..syms.len().saturating_sub(1))
                .filter_map(|i| {
                    ranks
                        .get(&(syms[i].as_str(), syms[i + 1].as_str()))
                        .map(|&r| (r, i))
                })
                .min();
            let Some((_, i)) = best else { break };
            let right = syms.remove(i + 1);
            syms[i].push_str(&right);
        }
        syms.iter()
            .map(|s| v.tokens.iter().position(|t| t == s).unwrap() as u32)
            .collect()
    }

    fn reference_encode(v: &TestVocab, pre_tokens: &[&str]) -> Vec<u32> {
        pre_tokens
            .iter()
            .flat_map(|p| reference_bpe(v, p))
            .collect()
    }

    /// Character classes for the reference splitter, from the regex engine the `tokenizers`
    /// crate re-exports (a second reading of the Unicode tables, beside `split`'s own).
    struct Classes {
        letter: tokenizers::utils::SysRegex,
        mark: tokenizers::utils::SysRegex,
        number: tokenizers::utils::SysRegex,
        space: tokenizers::utils::SysRegex,
    }

    #[derive(Default, Clone, Copy)]
    struct Flags {
        in_range: bool,
        letter: bool,
        mark: bool,
        number: bool,
        space: bool,
    }

    impl Classes {
        fn new() -> Classes {
            // The classes the pre-tokenizer uses: minus Unicode 16 additions, as llama.cpp.
            let re = |c: &str| {
                tokenizers::utils::SysRegex::new(&format!("[{c}--[{}]]", split::UNICODE16_LMN))
                    .unwrap()
            };
            Classes {
                letter: re(r"\p{L}"),
                mark: re(r"\p{M}"),
                number: re(r"\p{N}"),
                space: re(r"\s"),
            }
        }

        fn flags(&self, c: char) -> Flags {
            let s = c.to_string();
            let is = |r: &tokenizers::utils::SysRegex| r.find_iter(&s).next().is_some();
            Flags {
                in_range: true,
                letter: is(&self.letter),
                mark: is(&self.mark),
                number: is(&self.number),
                space: is(&self.space),
            }
        }
    }

    /// A port of llama.cpp's hand-written splitters `unicode_regex_split_custom_qwen35` and
    /// `_qwen2` (unicode.cpp), which is what stock llama.cpp runs instead of the regex.
    fn llama_split(cls: &Classes, text: &str, qwen35: bool) -> Vec<String> {
        let cpts: Vec<char> = text.chars().collect();
        let n = cpts.len();
        let fl = |p: usize| {
            if p < n {
                cls.flags(cpts[p])
            } else {
                Flags::default()
            }
        };
        let letterish = |f: Flags| f.letter || (qwen35 && f.mark);
        let punct = |f: Flags| !(f.space || letterish(f) || f.number) && f.in_range;
        let lower = |c: char| c.to_ascii_lowercase();
        let mut out = Vec::new();
        let mut prev = 0;
        let mut add = |end: usize, out: &mut Vec<String>| {
            let len = end - prev;
            if len > 0 {
                out.push(cpts[prev..end].iter().collect::<String>());
            }
            prev = end;
            len
        };
        let mut pos = 0;
        while pos < n {
            let c = cpts[pos];
            let f = fl(pos);
            if c == '\'' && pos + 1 < n {
                let nx = lower(cpts[pos + 1]);
                if matches!(nx, 's' | 't' | 'm' | 'd') {
                    pos += add(pos + 2, &mut out);
                    continue;
                }
                if pos + 2 < n {
                    let nn = lower(cpts[pos + 2]);
                    if matches!((nx, nn), ('r', 'e') | ('v', 'e') | ('l', 'l')) {
                        pos += add(pos + 3, &mut out);
                        continue;
                    }
                }
            }
            if !(c == '\r' || c == '\n' || f.number) && (letterish(f) || letterish(fl(pos + 1))) {
                pos += 1;
                while letterish(fl(pos)) {
                    pos += 1;
                }
                add(pos, &mut out);
                continue;
            }
            if f.number {
                pos += 1;
                add(pos, &mut out);
                continue;
            }
            let mut f2 = if c == ' ' { fl(pos + 1) } else { f };
            if !(f2.space || letterish(f2) || f2.number) && f.in_range {
                pos += (c == ' ') as usize;
                while punct(f2) {
                    pos += 1;
                    f2 = fl(pos);
                }
                while pos < n && (cpts[pos] == '\r' || cpts[pos] == '\n') {
                    pos += 1;
                }
                add(pos, &mut out);
                continue;
            }
            let mut n_ws = 0;
            let mut last_rn = 0;
            while fl(pos + n_ws).space {
                if matches!(cpts[pos + n_ws], '\r' | '\n') {
                    last_rn = pos + n_ws + 1;
                }
                n_ws += 1;
            }
            if last_rn > 0 {
                pos = last_rn;
                add(pos, &mut out);
                continue;
            }
            if n_ws > 1 && pos + n_ws < n {
                pos += n_ws - 1;
                add(pos, &mut out);
                continue;
            }
            if n_ws > 0 {
                pos += n_ws;
                add(pos, &mut out);
                continue;
            }
            pos += 1;
            add(pos, &mut out);
        }
        out
    }

    fn id(t: &Tokenizer, s: &str) -> u32 {
        t.token_id(s)
            .unwrap_or_else(|| panic!("{s:?} is in the test vocabulary"))
    }

    fn roundtrip(t: &Tokenizer, text: &str) {
        for parse_special in [false, true] {
            let ids = t.encode(text, false, parse_special).unwrap();
            assert_eq!(
                t.decode(&ids, false).unwrap(),
                text,
                "parse_special={parse_special} ids={ids:?}"
            );
            assert_eq!(t.decode_bytes(&ids, false).unwrap(), text.as_bytes());
        }
    }

    #[test]
    fn vocabulary_shape() {
        let v = test_vocab();
        let t = tok("qwen35");
        assert_eq!(t.n_vocab(), v.tokens.len());
        assert!(
            v.merges.len() >= 40,
            "the corpus teaches enough merges ({})",
            v.merges.len()
        );
        let eos = id(&t, "<|endoftext|>");
        assert_eq!(t.eos(), Some(eos));
        assert_eq!(t.pad(), Some(eos));
        assert_eq!(t.bos(), None);
        assert_eq!(t.token_piece(eos), Some("<|endoftext|>"));
        assert_eq!(t.token_piece(id(&t, "Ġ")), Some("Ġ"));
        assert_eq!(t.token_piece(t.n_vocab() as u32), None);
        assert_eq!(t.token_id("no such token"), None);
        for (i, s) in v.tokens.iter().enumerate() {
            assert_eq!(t.token_id(s), Some(i as u32));
            assert_eq!(t.token_piece(i as u32), Some(s.as_str()));
        }
    }

    #[test]
    fn tokenizer_is_send_and_sync() {
        fn check<T: Send + Sync>() {}
        check::<Tokenizer>();
    }

    #[test]
    fn end_of_generation() {
        let t = tok("qwen35");
        assert!(t.is_eog(id(&t, "<|endoftext|>")));
        assert!(t.is_eog(id(&t, "<|im_end|>")));
        assert!(!t.is_eog(id(&t, "<|im_start|>")));
        assert!(!t.is_eog(id(&t, "<think>")));
        assert!(!t.is_eog(id(&t, "a")));
        assert!(!t.is_eog(u32::MAX));
    }

    #[test]
    fn eog_follows_eos_key_and_forces_control() {
        // An eos that is not an end-of-turn text is still end of generation; a `<|im_end|>`
        // mistyped as user-defined becomes control (skipped on decode), as in llama.cpp.
        let mut v = test_vocab();
        let im_end = v.tokens.iter().position(|t| t == "<|im_end|>").unwrap();
        v.types[im_end] = 4;
        let mut w = writer(&v, "qwen35");
        let eos = v.tokens.iter().position(|t| t == "!").unwrap() as u32;
        w.set(key::EOS, Value::U32(eos));
        let t = open(&w).unwrap();
        assert!(t.is_eog(eos));
        assert!(t.is_eog(im_end as u32));
        assert_eq!(t.decode(&[im_end as u32], true).unwrap(), "");
        // Were it still user-defined, it would be split out even with parse_special off.
        assert!(!t
            .encode("<|im_end|>", false, false)
            .unwrap()
            .contains(&(im_end as u32)));
    }

    #[test]
    fn pre_tokens_match_llama_cpp_rules() {
        let t = tok("qwen35");
        let cases: &[(&str, &[&str])] = &[
            ("Hello, world!!\n", &["Hello", ",", " world", "!!\n"]),
            ("don't", &["don", "'t"]),
            ("I'LL be there", &["I", "'LL", " be", " there"]),
            ("they're", &["they", "'re"]),
            ("It's 2024", &["It", "'s", " ", "2", "0", "2", "4"]),
            ("a   b", &["a", "  ", " b"]),
            ("a\n\n  b", &["a", "\n\n", " ", " b"]),
            ("end  ", &["end", "  "]),
            ("x \t\ny", &["x", " \t\n", "y"]),
            // A punctuation mark before letters is the letter run's optional prefix.
            ("你好世界，你好", &["你好世界", "，你好"]),
            ("e\u{301}te\u{301}", &["e\u{301}te\u{301}"]),
            ("مرحبا بالعالم", &["مرحبا", " بالعالم"]),
            ("👍🏽 ok", &["👍🏽", " ok"]),
            ("(a)", &["(a", ")"]),
            ("", &[]),
        ];
        for (text, want) in cases {
            assert_eq!(pre_tokens(&t, text), *want, "{text:?}");
        }
    }

    #[test]
    fn class_table_leaves_unicode16_unassigned() {
        let t = split::class_table();
        assert_eq!(t.len(), 0x11_0000);
        // letter | number << 1 | mark << 2 | whitespace << 3
        for (c, want) in [
            ('a', 1),
            ('\u{4f60}', 1),
            ('7', 2),
            ('\u{663}', 2),
            ('\u{301}', 4),
            (' ', 8),
            ('\u{3000}', 8),
            ('\u{85}', 8),
            ('!', 0),
            ('\u{A7DC}', 0),
            ('\u{13460}', 0),
            ('\u{16130}', 0),
        ] {
            assert_eq!(t[c as usize], want, "U+{:04X}", c as u32);
        }
    }

    #[test]
    fn unicode16_letters_split_as_unassigned() {
        // U+A7DC (Unicode 16) is a letter to the regex crate but has no category in
        // llama.cpp's tables, so llama.cpp makes it the optional prefix of the next letter run.
        let t = tok("qwen35");
        assert_eq!(pre_tokens(&t, "ab\u{A7DC}cd"), ["ab", "\u{A7DC}cd"]);
        assert_eq!(
            pre_tokens(&t, "\u{13460}\u{13461}!"),
            ["\u{13460}\u{13461}!"]
        );
        assert_eq!(pre_tokens(&t, "x\u{16130}1"), ["x", "\u{16130}", "1"]);
        roundtrip(&t, "ab\u{A7DC}cd \u{13460}");
    }

    #[test]
    fn qwen2_splits_combining_marks_off() {
        let q35 = tok("qwen35");
        let q2 = tok("qwen2");
        assert_eq!(pre_tokens(&q35, "cafe\u{301} ok"), ["cafe\u{301}", " ok"]);
        assert_eq!(
            pre_tokens(&q2, "cafe\u{301} ok"),
            ["cafe", "\u{301}", " ok"]
        );
        // Under qwen2 a mark is punctuation, so it becomes the prefix of the next letter run.
        assert_eq!(pre_tokens(&q2, "مَرْحَبًا"), ["م", "َر", "ْح", "َب", "ًا"]);
        assert_eq!(pre_tokens(&q35, "مَرْحَبًا"), ["مَرْحَبًا"]);
        roundtrip(&q2, "cafe\u{301} مَرْحَبًا");
    }

    /// `split` against a second port of llama.cpp's hand-written splitter classifying through
    /// the regex engine, on strings drawn from a palette of the characters the rules
    /// distinguish.
    #[test]
    fn pre_tokens_agree_with_llama_cpp_splitter() {
        let palette: Vec<char> = " \t\n\r\u{a0}\u{3000}\u{2028}aZsStTlLeErRvVdDmM'\u{2019}1٣Ⅻ½\u{301}\u{64e}é你!,.-_$😀\u{1f3fd}\u{200d}"
            .chars()
            .collect();
        let cls = Classes::new();
        let q35 = tok("qwen35");
        let q2 = tok("qwen2");
        let mut state = 0x2545_f491_4f6c_dd1du64;
        let mut next = || {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state
        };
        for _ in 0..1500 {
            let len = (next() % 24) as usize;
            let s: String = (0..len)
                .map(|_| palette[(next() % palette.len() as u64) as usize])
                .collect();
            assert_eq!(
                pre_tokens(&q35, &s),
                llama_split(&cls, &s, true),
                "qwen35 {s:?}"
            );
            assert_eq!(
                pre_tokens(&q2, &s),
                llama_split(&cls, &s, false),
                "qwen2 {s:?}"
            );
        }
    }

    #[test]
    fn encode_matches_reference_bpe() {
        let v = test_vocab();
        let t = tok("qwen35");
        let cases: &[(&str, &[&str])] = &[
            ("The quick brown fox", &["The", " quick", " brown", " fox"]),
            (
                "the forest and the trees.",
                &["the", " forest", " and", " the", " trees", "."],
            ),
            ("I don't think", &["I", " don", "'t", " think"]),
            (
                "Le café est très bon",
                &["Le", " café", " est", " très", " bon"],
            ),
            ("1999", &["1", "9", "9", "9"]),
            ("你好世界", &["你好世界"]),
        ];
        for (text, pre) in cases {
            assert_eq!(pre_tokens(&t, text), *pre, "{text:?}");
            assert_eq!(
                t.encode(text, false, true).unwrap(),
                reference_encode(&v, pre),
                "{text:?}"
            );
        }
        // Merges were learned, so common words are single tokens.
        assert_eq!(t.encode(" the", false, false).unwrap(), [id(&t, "Ġthe")]);
        // And on arbitrary text, ids are the reference BPE over the pipeline's pre-tokens.
        let text = "The fox's café: 42 birds, 你好! Don't STOP\n\n  the  dog.";
        let pre = pre_tokens(&t, text);
        let pre: Vec<&str> = pre.iter().map(String::as_str).collect();
        assert_eq!(
            t.encode(text, false, false).unwrap(),
            reference_encode(&v, &pre)
        );
    }

    #[test]
    fn roundtrips() {
        let t = tok("qwen35");
        for text in [
            "",
            "Hello, world!",
            "The quick brown fox jumps over the lazy dog.",
            "你好世界，你好朋友。",
            "😀👍🏽👩\u{200d}💻 emoji",
            "e\u{301} and \u{e9}",
            "مرحبا بالعالم",
            "   leading and trailing   ",
            "\n\n\nnew\r\nlines\n",
            "tabs\tand\u{a0}nbsp\u{3000}ideographic",
            "0123456789 3.14159 -42",
            "don't I'LL we're YOU'VE she'd",
            "<|im_start|>user\nhi<|im_end|>",
            "<think>\nreasoning\n</think>\n\nanswer",
            "<|im_start<|im_end|>|>",
            "\u{0}\u{1}\u{7f}\u{80}\u{ff}\u{fffd}",
        ] {
            roundtrip(&t, text);
        }
    }

    #[test]
    fn digits_are_single_pre_tokens() {
        let t = tok("qwen35");
        let ids = t.encode("2024", false, false).unwrap();
        assert_eq!(ids, ["2", "0", "2", "4"].map(|d| id(&t, d)));
        assert_eq!(pre_tokens(&t, " 12"), [" ", "1", "2"]);
        assert_eq!(pre_tokens(&t, "x٣٤"), ["x", "٣", "٤"]);
    }

    #[test]
    fn special_tokens_parsed_only_when_asked() {
        let v = test_vocab();
        let t = tok("qwen35");
        let (start, end) = (id(&t, "<|im_start|>"), id(&t, "<|im_end|>"));
        let text = "<|im_start|>user\nhi<|im_end|>";
        let on = t.encode(text, false, true).unwrap();
        let mut want = vec![start];
        want.extend(reference_encode(&v, &["user", "\n", "hi"]));
        want.push(end);
        assert_eq!(on, want);

        // Off: the control texts are ordinary text, cut by the regex like any other.
        let off = t.encode(text, false, false).unwrap();
        assert!(!off.contains(&start) && !off.contains(&end), "{off:?}");
        let pre = pre_tokens(&t, text);
        assert_eq!(pre[..4], ["<|", "im", "_start", "|>"]);
        let pre: Vec<&str> = pre.iter().map(String::as_str).collect();
        assert_eq!(off, reference_encode(&v, &pre));
    }

    #[test]
    fn user_defined_tokens_split_even_without_parse_special() {
        // llama.cpp's tokenizer_st_partition skips only control and unknown tokens when
        // parse_special is off: `<think>` (user-defined) is always its own token.
        let v = test_vocab();
        let t = tok("qwen35");
        let (think, end_think) = (id(&t, "<think>"), id(&t, "</think>"));
        for parse_special in [false, true] {
            let ids = t
                .encode("<think>\nhmm</think>ok", false, parse_special)
                .unwrap();
            let mut want = vec![think];
            want.extend(reference_encode(&v, &["\n", "hmm"]));
            want.push(end_think);
            want.extend(reference_encode(&v, &["ok"]));
            assert_eq!(ids, want, "parse_special={parse_special}");
        }
    }

    #[test]
    fn longest_special_token_wins() {
        // Two user-defined tokens where one contains the other: llama.cpp splits out the
        // longer one everywhere first, then the shorter one in what is left.
        let mut v = test_vocab();
        v.tokens.extend(["<x>".to_string(), "<x><x>".to_string()]);
        v.types.extend([4, 4]);
        let t = open(&writer(&v, "qwen35")).unwrap();
        let (x, xx) = (id(&t, "<x>"), id(&t, "<x><x>"));
        assert_eq!(t.encode("<x><x><x>", false, false).unwrap(), [xx, x]);
        assert_eq!(
            t.encode("<x>a<x><x>", false, false).unwrap(),
            [x, id(&t, "a"), xx]
        );
        let ids = t
            .encode("</think><think><|im_end|><|im_end|>", false, true)
            .unwrap();
        assert_eq!(
            ids,
            ["</think>", "<think>", "<|im_end|>", "<|im_end|>"].map(|s| id(&t, s))
        );
    }

    #[test]
    fn decode_skip_special() {
        let t = tok("qwen35");
        let ids = t
            .encode(
                "<|im_start|>hi<think>x</think><|im_end|><|endoftext|>",
                false,
                true,
            )
            .unwrap();
        assert_eq!(
            t.decode(&ids, false).unwrap(),
            "<|im_start|>hi<think>x</think><|im_end|><|endoftext|>"
        );
        // Control tokens vanish, user-defined ones stay (llama.cpp's token_to_piece).
        assert_eq!(t.decode(&ids, true).unwrap(), "hi<think>x</think>");
    }

    #[test]
    fn decode_bytes_of_a_split_character() {
        let t = tok("qwen35");
        // U+20AC is three bytes no merge joins: three tokens, each one byte.
        let ids = t.encode("€", false, false).unwrap();
        assert_eq!(ids.len(), 3);
        assert_eq!(t.decode_bytes(&ids[..1], false).unwrap(), [0xE2]);
        assert_eq!(t.decode_bytes(&ids[1..], false).unwrap(), [0x82, 0xAC]);
        assert_eq!(t.decode(&ids[..1], false).unwrap(), "\u{fffd}");
        let mut joined = t.decode_bytes(&ids[..2], false).unwrap();
        joined.extend(t.decode_bytes(&ids[2..], false).unwrap());
        assert_eq!(String::from_utf8(joined).unwrap(), "€");
    }

    #[test]
    fn decode_rejects_out_of_range_ids() {
        let t = tok("qwen35");
        let n = t.n_vocab() as u32;
        let err = t.decode(&[0, n], false).unwrap_err();
        assert!(matches!(err, TokenizerError::TokenIdOutOfRange { id, .. } if id == n as i64));
        assert!(err.to_string().contains("position 1"), "{err}");
    }

    #[test]
    fn add_special_follows_the_file() {
        let v = test_vocab();
        let t = tok("qwen35");
        let plain = t.encode("hi", false, false).unwrap();
        // add_bos_token = false: nothing is added even when asked.
        assert_eq!(t.encode("hi", true, false).unwrap(), plain);

        let mut w = writer(&v, "qwen35");
        let bos = v.tokens.iter().position(|t| t == "<|im_start|>").unwrap() as u32;
        w.set(key::BOS, Value::U32(bos))
            .set(key::ADD_BOS, Value::Bool(true));
        let t = open(&w).unwrap();
        assert_eq!(t.bos(), Some(bos));
        assert_eq!(
            t.encode("hi", true, false).unwrap(),
            [&[bos][..], &plain[..]].concat()
        );
        assert_eq!(t.encode("hi", false, false).unwrap(), plain);
        assert_eq!(t.encode("", true, false).unwrap(), [bos]);

        // add_eos_token appends eos the same way.
        w.set(key::ADD_EOS, Value::Bool(true));
        let t = open(&w).unwrap();
        let eos = t.eos().unwrap();
        assert_eq!(
            t.encode("hi", true, false).unwrap(),
            [&[bos][..], &plain[..], &[eos][..]].concat()
        );
    }

    #[test]
    fn long_runs_are_split_like_short_ones() {
        // A backtracking regex gives up past its stack limit (the old pipeline left the rest of
        // a ~10^6-space run as one unsplit chunk); the scan has no such limit.
        let t = tok("qwen35");
        let spaces = format!("{}x", " ".repeat(1_000_000));
        assert_eq!(
            pre_tokens(&t, &spaces),
            [" ".repeat(999_999), " x".to_string()]
        );
        let ids = t.encode(&spaces, false, false).unwrap();
        assert_eq!(t.decode(&ids, false).unwrap(), spaces);
        let tabs = format!("a{}\n\n{}b", "\t ".repeat(300_000), " ".repeat(300_000));
        assert_eq!(
            pre_tokens(&t, &tabs),
            [
                "a".to_string(),
                format!("{}\n\n", "\t ".repeat(300_000)),
                " ".repeat(299_999),
                " b".to_string()
            ]
        );
        let letters = format!("{} {}", "a".repeat(200_000), "b".repeat(3));
        assert_eq!(
            pre_tokens(&t, &letters),
            ["a".repeat(200_000), " bbb".to_string()]
        );
        let mixed = "It's 42 days, isn't it?\n".repeat(5_000);
        // It | 's | " " | 4 | 2 | " days" | , | " isn" | 't | " it" | ?\n
        assert_eq!(pre_tokens(&t, &mixed).len(), 5_000 * 11);
        roundtrip(&t, &mixed);
    }

    #[test]
    fn a_byte_without_a_symbol_is_an_error_not_dropped() {
        // The BPE skips a symbol it has no token for; the encoding must not come back short.
        let mut v = test_vocab();
        let b2u = byte_to_unicode();
        let gone = b2u[b'~' as usize].to_string();
        let at = v.tokens.iter().position(|t| *t == gone).unwrap();
        v.tokens[at] = "<unreachable>".into();
        v.merges
            .retain(|(a, b)| *a != gone && *b != gone && !a.contains('~') && !b.contains('~'));
        let t = open(&writer(&v, "qwen35")).unwrap();
        assert!(t.encode("ab", false, false).is_ok());
        let e = t.encode("a~b", false, false).unwrap_err().to_string();
        assert!(e.contains("\"~b\"") && e.contains("no token"), "{e}");
    }

    #[test]
    fn empty_token_is_renamed_like_llama_cpp() {
        let mut v = test_vocab();
        v.tokens.push(String::new());
        v.types.push(1);
        let t = open(&writer(&v, "qwen35")).unwrap();
        let last = (v.tokens.len() - 1) as u32;
        assert_eq!(
            t.token_piece(last),
            Some(format!("[EMPTY_{last}]").as_str())
        );
    }

    #[test]
    fn byte_and_unused_tokens_decode_like_llama_cpp() {
        let mut v = test_vocab();
        v.tokens
            .extend(["<0x41>".to_string(), "[PAD0]".to_string(), "Ā€".to_string()]);
        v.types.extend([6, 5, 1]);
        let t = open(&writer(&v, "qwen35")).unwrap();
        let base = (v.tokens.len() - 3) as u32;
        assert_eq!(t.decode_bytes(&[base], false).unwrap(), b"A");
        assert_eq!(t.decode_bytes(&[base + 1], false).unwrap(), b"");
        // A normal token outside the byte alphabet: llama_decode_text's marker.
        assert_eq!(
            t.decode(&[base + 2], false).unwrap(),
            "\u{0}[UNK_BYTE_0xe282acĀ€]"
        );
    }

    #[test]
    fn missing_tokens_is_named() {
        let mut w = GgufWriter::new();
        w.set(key::MODEL, Value::String("gpt2".into()))
            .set(key::PRE, Value::String("qwen35".into()));
        let err = open(&w).unwrap_err();
        assert!(
            matches!(err, TokenizerError::MissingKey(k) if k == key::TOKENS),
            "{err:?}"
        );
        assert!(err.to_string().contains("tokenizer.ggml.tokens"), "{err}");
    }

    #[test]
    fn unsupported_pre_and_model_are_named() {
        let v = test_vocab();
        let err = open(&writer(&v, "llama-bpe")).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::UnsupportedPre(p) if p == "llama-bpe"),
            "{err:?}"
        );
        assert!(
            err.to_string().contains("\"llama-bpe\"")
                && err.to_string().contains("tokenizer.ggml.pre")
        );

        let mut w = writer(&v, "qwen35");
        w.set(key::MODEL, Value::String("llama".into()));
        let err = open(&w).unwrap_err();
        assert!(
            matches!(&err, TokenizerError::UnsupportedModel(m) if m == "llama"),
            "{err:?}"
        );
        assert!(err.to_string().contains("\"llama\""));
    }

    #[test]
    fn malformed_metadata_is_named() {
        let v = test_vocab();

        let mut w = writer(&v, "qwen35");
        w.set(key::EOS, Value::U32(v.tokens.len() as u32));
        let err = open(&w).unwrap_err();
        assert!(err.to_string().contains(key::EOS), "{err}");

        let mut w = writer(&v, "qwen35");
        w.set(key::TOKEN_TYPE, Value::i32_array(&v.types[1..]));
        assert!(open(&w).unwrap_err().to_string().contains(key::TOKEN_TYPE));

        let mut w = writer(&v, "qwen35");
        let (a, b) = &v.merges[0];
        w.set(
            key::MERGES,
            Value::str_array(&[format!("{a} {b}"), "q z".to_string()]),
        );
        let err = open(&w).unwrap_err();
        assert!(err.to_string().contains("merge 1 \"q z\""), "{err}");

        let mut tokens = v.tokens.clone();
        tokens[300] = tokens[299].clone();
        let mut w = writer(&v, "qwen35");
        w.set(key::TOKENS, Value::str_array(&tokens));
        assert!(open(&w)
            .unwrap_err()
            .to_string()
            .contains("duplicates token 299"));

        let mut w = writer(&v, "qwen35");
        w.set(key::ADD_BOS, Value::Bool(true));
        assert!(open(&w).unwrap_err().to_string().contains(key::BOS));

        let mut w = writer(&v, "qwen35");
        w.set(key::PRE, Value::U32(3));
        assert!(open(&w).unwrap_err().to_string().contains(key::PRE));

        let mut w = writer(&v, "qwen35");
        w.set(key::MERGES, Value::str_array(&Vec::<String>::new()));
        // No merges is a valid (if useless) vocabulary: every byte is its own token.
        let t = open(&w).unwrap();
        assert_eq!(
            t.encode("the", false, false).unwrap(),
            ["t", "h", "e"].map(|s| id(&t, s))
        );
    }

    #[test]
    fn merges_without_space_and_repeats_are_ignored() {
        let mut v = test_vocab();
        let first = v.merges[0].clone();
        v.merges.push(first);
        let mut w = writer(&v, "qwen35");
        let mut merges: Vec<String> = v.merges.iter().map(|(a, b)| format!("{a} {b}")).collect();
        merges.insert(0, "nospace".to_string());
        w.set(key::MERGES, Value::str_array(&merges));
        let t = open(&w).unwrap();
        let text = "The quick brown fox";
        let pre = ["The", " quick", " brown", " fox"];
        v.merges.pop();
        assert_eq!(
            t.encode(text, false, false).unwrap(),
            reference_encode(&v, &pre)
        );
    }
}
