//! The base file of `tern kld --save-base`: what a candidate is measured against, without the
//! reference model.
//!
//! llama-perplexity's `--kl-divergence-base` stores every position's whole distribution
//! (2 bytes per vocabulary entry: half a megabyte a position for Qwen3.5's 248k vocabulary).
//! This file keeps what the statistics need, 6·K + 8 bytes a position (200 at K = 32):
//!
//! ```text
//! "TERNKLDB"                      8 bytes, magic
//! version                         u32 LE (1)
//! header length H                 u32 LE
//! header                          H bytes of JSON (`Header`): the reference model's sha256,
//!                                 the tokenizer and its hash, the text's sha256, the chunking
//! tokens                          n_chunk·n_ctx u32 LE, the evaluated token ids
//! ids                             P·K u32 LE, per scored position its top-K token ids
//!                                 (by probability, descending)
//! log-probs                       P·K f16 LE, their ln p
//! rest                            P f32 LE, the probability of every other token
//! target                          P f32 LE, ln p of the token that followed
//! checksum                        32 bytes, sha256 of everything above
//! ```
//! with P = n_chunk · (n_ctx − 1 − n_ctx/2) scored positions, in chunk order.

use std::path::{Path, PathBuf};

use half::f16;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

use super::stats::{BaseEntry, BaseRow};
use super::EvalError;
use crate::gguf::{Gguf, Value};

pub const MAGIC: &[u8; 8] = b"TERNKLDB";
pub const VERSION: u32 = 1;

/// The reference model a base file was made with.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct ModelId {
    pub file: String,
    pub sha256: String,
    pub bytes: u64,
    pub name: Option<String>,
}

/// The vocabulary: its kind and a sha256 over every `tokenizer.ggml.*` key, so that a candidate
/// whose tokens mean something else is refused even at the same size.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TokenizerId {
    pub model: String,
    pub pre: Option<String>,
    pub n_vocab: usize,
    pub sha256: String,
}

/// The evaluated text, as read from its file (before llama.cpp's trailing-newline rule).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct TextId {
    pub file: String,
    pub sha256: String,
    pub bytes: u64,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Header {
    pub model: ModelId,
    pub tokenizer: TokenizerId,
    pub text: TextId,
    pub n_ctx: usize,
    pub n_chunk: usize,
    /// The token that replaced each chunk's first (add_bos vocabularies).
    pub bos: Option<u32>,
    pub top_k: usize,
    /// How the reference ran (informative).
    pub backend: String,
    pub cache_type_k: String,
    pub cache_type_v: String,
    pub ppl: f64,
    pub ppl_err: Option<f64>,
    pub tern_version: String,
}

impl Header {
    pub fn scored_per_chunk(&self) -> usize {
        self.n_ctx - 1 - self.n_ctx / 2
    }

    pub fn positions(&self) -> usize {
        self.n_chunk * self.scored_per_chunk()
    }
}

/// A base file in memory.
#[derive(Clone, Debug, PartialEq)]
pub struct BaseFile {
    pub header: Header,
    pub tokens: Vec<u32>,
    ids: Vec<u32>,
    logp: Vec<f16>,
    rest: Vec<f32>,
    target: Vec<f32>,
}

pub fn sha256_hex(bytes: &[u8]) -> String {
    hex(&Sha256::digest(bytes))
}

fn hex(b: &[u8]) -> String {
    b.iter().map(|x| format!("{x:02x}")).collect()
}

/// The model's identity: its file's bytes hashed.
pub fn model_id(g: &Gguf) -> ModelId {
    ModelId {
        file: g
            .path()
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| g.path().display().to_string()),
        sha256: sha256_hex(g.bytes()),
        bytes: g.file_len(),
        name: g.get_str("general.name").map(str::to_string),
    }
}

/// Feeds a metadata value in a canonical byte form (type, then little-endian payload; lengths
/// before strings and arrays).
fn hash_value(h: &mut Sha256, v: &Value) {
    h.update(v.value_type().name().as_bytes());
    h.update([0]);
    match v {
        Value::String(s) => {
            h.update((s.len() as u64).to_le_bytes());
            h.update(s.as_bytes());
        }
        Value::Array(_, items) => {
            h.update((items.len() as u64).to_le_bytes());
            for it in items {
                hash_value(h, it);
            }
        }
        Value::F32(x) => h.update((*x as f64).to_bits().to_le_bytes()),
        Value::F64(x) => h.update(x.to_bits().to_le_bytes()),
        Value::Bool(b) => h.update([*b as u8]),
        Value::U64(x) => h.update(x.to_le_bytes()),
        other => h.update(other.as_i64().unwrap_or_default().to_le_bytes()),
    }
}

pub fn tokenizer_id(g: &Gguf, n_vocab: usize) -> TokenizerId {
    let mut keys: Vec<&(String, Value)> = g
        .metadata()
        .iter()
        .filter(|(k, _)| k.starts_with("tokenizer.ggml."))
        .collect();
    keys.sort_by(|a, b| a.0.cmp(&b.0));
    let mut h = Sha256::new();
    for (k, v) in keys {
        h.update((k.len() as u64).to_le_bytes());
        h.update(k.as_bytes());
        hash_value(&mut h, v);
    }
    TokenizerId {
        model: g.get_str("tokenizer.ggml.model").unwrap_or("?").to_string(),
        pre: g.get_str("tokenizer.ggml.pre").map(str::to_string),
        n_vocab,
        sha256: hex(&h.finalize()),
    }
}

pub fn text_id(path: &Path, bytes: &[u8]) -> TextId {
    TextId {
        file: path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| path.display().to_string()),
        sha256: sha256_hex(bytes),
        bytes: bytes.len() as u64,
    }
}

impl BaseFile {
    /// An empty base for `header` over `tokens` (the evaluated chunks), filled by `push`.
    pub fn new(header: Header, tokens: Vec<u32>) -> BaseFile {
        let (p, k) = (header.positions(), header.top_k);
        BaseFile {
            header,
            tokens,
            ids: Vec::with_capacity(p * k),
            logp: Vec::with_capacity(p * k),
            rest: Vec::with_capacity(p),
            target: Vec::with_capacity(p),
        }
    }

    /// Appends the next scored position. A row with fewer than K tokens (a vocabulary smaller
    /// than K) is refused when the header is written, never here.
    pub fn push(&mut self, r: &BaseRow) {
        self.ids.extend_from_slice(&r.ids);
        self.logp.extend_from_slice(&r.logp);
        self.rest.push(r.rest);
        self.target.push(r.target_logp);
    }

    pub fn len(&self) -> usize {
        self.rest.len()
    }

    pub fn is_empty(&self) -> bool {
        self.rest.is_empty()
    }

    pub fn entry(&self, i: usize) -> BaseEntry<'_> {
        let k = self.header.top_k;
        BaseEntry {
            ids: &self.ids[i * k..(i + 1) * k],
            logp: &self.logp[i * k..(i + 1) * k],
            rest: self.rest[i],
            target_logp: self.target[i],
        }
    }

    /// The scored positions' next tokens, in order.
    pub fn targets(&self) -> Vec<u32> {
        let (n_ctx, first) = (self.header.n_ctx, self.header.n_ctx / 2);
        (0..self.header.n_chunk)
            .flat_map(|c| {
                self.tokens[c * n_ctx + first + 1..(c + 1) * n_ctx]
                    .iter()
                    .copied()
            })
            .collect()
    }

    pub fn to_bytes(&self) -> Vec<u8> {
        assert_eq!(
            self.len(),
            self.header.positions(),
            "an unfinished base file"
        );
        let header = serde_json::to_vec(&self.header).expect("the header serializes");
        let mut b = Vec::with_capacity(
            48 + header.len() + 4 * self.tokens.len() + 6 * self.ids.len() + 8 * self.rest.len(),
        );
        b.extend_from_slice(MAGIC);
        b.extend_from_slice(&VERSION.to_le_bytes());
        b.extend_from_slice(&(header.len() as u32).to_le_bytes());
        b.extend_from_slice(&header);
        for t in &self.tokens {
            b.extend_from_slice(&t.to_le_bytes());
        }
        for t in &self.ids {
            b.extend_from_slice(&t.to_le_bytes());
        }
        for t in &self.logp {
            b.extend_from_slice(&t.to_bits().to_le_bytes());
        }
        for t in self.rest.iter().chain(&self.target) {
            b.extend_from_slice(&t.to_le_bytes());
        }
        let sum = Sha256::digest(&b);
        b.extend_from_slice(&sum);
        b
    }

    pub fn write(&self, path: &Path) -> Result<(), EvalError> {
        std::fs::write(path, self.to_bytes()).map_err(|source| EvalError::Io {
            path: path.to_path_buf(),
            source,
        })
    }

    pub fn read(path: &Path) -> Result<BaseFile, EvalError> {
        let b = std::fs::read(path).map_err(|source| EvalError::Io {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_bytes(path, &b)
    }

    /// Parses and checks a base file; every refusal names what is wrong.
    pub fn from_bytes(path: &Path, b: &[u8]) -> Result<BaseFile, EvalError> {
        let bad = |why: String| EvalError::BaseFile {
            path: PathBuf::from(path),
            why,
        };
        if b.len() < 16 || &b[..8] != MAGIC {
            return Err(bad(
                "not a tern kld base file (made by `tern kld --save-base`): bad magic".into(),
            ));
        }
        let version = u32::from_le_bytes(b[8..12].try_into().unwrap());
        if version != VERSION {
            return Err(bad(format!(
                "base file version {version}; this tern reads version {VERSION} (re-run --save-base)"
            )));
        }
        let hl = u32::from_le_bytes(b[12..16].try_into().unwrap()) as usize;
        if b.len() < 16 + hl + 32 {
            return Err(bad(format!(
                "truncated: {} bytes, the header alone needs {}",
                b.len(),
                16 + hl + 32
            )));
        }
        let header: Header =
            serde_json::from_slice(&b[16..16 + hl]).map_err(|e| bad(format!("header: {e}")))?;
        let h = &header;
        if h.n_ctx < 4 || h.n_chunk == 0 || h.top_k == 0 || h.top_k > h.tokenizer.n_vocab {
            return Err(bad(format!(
                "header: n_ctx {}, n_chunk {}, top_k {} (n_vocab {}) are out of range",
                h.n_ctx, h.n_chunk, h.top_k, h.tokenizer.n_vocab
            )));
        }
        let (p, k) = (h.positions(), h.top_k);
        let n_tok = h.n_chunk * h.n_ctx;
        let want = 16 + hl + 4 * n_tok + 6 * p * k + 8 * p + 32;
        if b.len() != want {
            return Err(bad(format!(
                "{} bytes where the header ({} chunks of {}, {p} positions, top-{k}) needs {want}{}",
                b.len(),
                h.n_chunk,
                h.n_ctx,
                if b.len() < want { ": truncated" } else { "" }
            )));
        }
        let body = &b[..want - 32];
        if Sha256::digest(body).as_slice() != &b[want - 32..] {
            return Err(bad("checksum mismatch: the file is corrupt".into()));
        }
        let mut at = 16 + hl;
        let mut take = |n: usize| {
            let s = &b[at..at + n];
            at += n;
            s
        };
        let u32s = |s: &[u8]| -> Vec<u32> {
            s.chunks_exact(4)
                .map(|c| u32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let f32s = |s: &[u8]| -> Vec<f32> {
            s.chunks_exact(4)
                .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
                .collect()
        };
        let tokens = u32s(take(4 * n_tok));
        let ids = u32s(take(4 * p * k));
        let logp: Vec<f16> = take(2 * p * k)
            .chunks_exact(2)
            .map(|c| f16::from_bits(u16::from_le_bytes([c[0], c[1]])))
            .collect();
        let rest = f32s(take(4 * p));
        let target = f32s(take(4 * p));
        let nv = h.tokenizer.n_vocab;
        if let Some((i, t)) = tokens
            .iter()
            .chain(&ids)
            .enumerate()
            .find(|(_, &t)| t as usize >= nv)
        {
            return Err(bad(format!(
                "token id {t} (entry {i}) is outside the vocabulary of {nv}"
            )));
        }
        Ok(BaseFile {
            header,
            tokens,
            ids,
            logp,
            rest,
            target,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::eval::stats::base_row;

    fn sample() -> BaseFile {
        let header = Header {
            model: ModelId {
                file: "m.gguf".into(),
                sha256: "00".repeat(32),
                bytes: 1,
                name: None,
            },
            tokenizer: TokenizerId {
                model: "gpt2".into(),
                pre: Some("qwen35".into()),
                n_vocab: 16,
                sha256: "11".repeat(32),
            },
            text: TextId {
                file: "t.txt".into(),
                sha256: "22".repeat(32),
                bytes: 3,
            },
            n_ctx: 8,
            n_chunk: 2,
            bos: None,
            top_k: 4,
            backend: "cpu".into(),
            cache_type_k: "f16".into(),
            cache_type_v: "f16".into(),
            ppl: 3.0,
            ppl_err: Some(0.1),
            tern_version: "0".into(),
        };
        let tokens: Vec<u32> = (0..16).map(|i| (i * 7) % 16).collect();
        let mut f = BaseFile::new(header, tokens);
        for (i, t) in f.targets().into_iter().enumerate() {
            let row: Vec<f32> = (0..16)
                .map(|j| ((i * 5 + j * 3) % 11) as f32 * 0.3)
                .collect();
            f.push(&base_row(&row, t, 4));
        }
        f
    }

    #[test]
    fn round_trip() {
        let f = sample();
        assert_eq!(f.len(), 6);
        let b = f.to_bytes();
        let g = BaseFile::from_bytes(Path::new("x.bin"), &b).unwrap();
        assert_eq!(f, g);
        assert_eq!(g.entry(5).ids.len(), 4);
    }

    #[test]
    fn refusals_name_the_problem() {
        let b = sample().to_bytes();
        let err = |bytes: &[u8]| {
            BaseFile::from_bytes(Path::new("ref.bin"), bytes)
                .unwrap_err()
                .to_string()
        };
        assert!(err(b"GGUF....").contains("bad magic"));
        let mut v = b.clone();
        v[8] = 9;
        assert!(err(&v).contains("version 9"), "{}", err(&v));
        assert!(err(&b[..b.len() - 40]).contains("truncated"));
        let mut v = b.clone();
        let n = v.len();
        v[n - 40] ^= 1;
        assert!(err(&v).contains("checksum"));
        let mut v = b.clone();
        v[20] = b'!';
        assert!(err(&v).contains("header"), "{}", err(&v));
        assert!(err(&v).starts_with("ref.bin: "));
    }
}
