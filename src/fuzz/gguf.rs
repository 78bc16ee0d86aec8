//! GGUF mutation: the header of a seed file is mapped field by field ([`layout`]), and each case
//! rewrites a few fields to boundary values (counts, string and array lengths, value and tensor
//! type ids, dimensions, data offsets, metadata scalars), edits the metadata or the tensor table
//! through the writer (keys set to boundary values of any type, keys dropped, tensors dropped,
//! added or renamed), pokes NaN/Inf into weight bytes, flips header bytes or truncates. The
//! result is read as `tern serve` reads a model: parsed, tokenizer and template built, sampling
//! defaults and the memory plan computed, the config validated, the weights loaded on the CPU and
//! a few tokens generated through the runtime's sampling step, with the logits of the sampled
//! rows recomputed to tell a clean refusal of non-finite output from a silent one.

use std::sync::Arc;

use super::{Outcome, Rng, Verdict};
use crate::backend::cpu::CpuBackend;
use crate::backend::Backend;
use crate::gguf::{Gguf, GgufWriter, Value, ValueType};
use crate::model::{Config, Model, ModelError};
use crate::plan::{Ledger, Shape};
use crate::runtime::sampler::{non_finite, Sampler, SamplerConfig};
use crate::runtime::speculative::Generator;
use crate::tensor::GgmlType;
use crate::tokenizer::Tokenizer;

/// What a header field holds.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Version,
    TensorCount,
    KvCount,
    KeyLen,
    ValueType,
    StrLen,
    ArrType,
    ArrLen,
    Scalar(ValueType),
    NameLen,
    NDims,
    Dim,
    TensorType,
    Offset,
}

/// One field of a header: what it is, where it sits, its width, and whose it is (a key or a
/// tensor name).
#[derive(Clone, Debug)]
pub struct Field {
    pub kind: Kind,
    pub at: usize,
    pub size: usize,
    pub owner: String,
}

/// The fields of a header, in file order, and where the tensor table ends.
#[derive(Clone, Debug, Default)]
pub struct Layout {
    pub fields: Vec<Field>,
    pub table_end: usize,
}

impl Layout {
    /// The field of `kind` owned by `owner` (e.g. the offset of a tensor).
    pub fn find(&self, kind: Kind, owner: &str) -> Option<&Field> {
        self.fields
            .iter()
            .find(|f| f.kind == kind && f.owner == owner)
    }
}

struct Walk<'a> {
    b: &'a [u8],
    pos: usize,
    out: Layout,
}

impl Walk<'_> {
    fn field(&mut self, kind: Kind, size: usize, owner: &str, record: bool) -> Option<u64> {
        let end = self.pos.checked_add(size).filter(|&e| e <= self.b.len())?;
        let mut v = 0u64;
        for (i, &x) in self.b[self.pos..end].iter().enumerate() {
            v |= (x as u64) << (8 * i);
        }
        if record {
            self.out.fields.push(Field {
                kind,
                at: self.pos,
                size,
                owner: owner.to_string(),
            });
        }
        self.pos = end;
        Some(v)
    }
    fn string(&mut self, len_kind: Kind, owner: &str, record: bool) -> Option<String> {
        let n = self.field(len_kind, 8, owner, record)? as usize;
        let end = self.pos.checked_add(n).filter(|&e| e <= self.b.len())?;
        let s = String::from_utf8_lossy(&self.b[self.pos..end]).into_owned();
        self.pos = end;
        Some(s)
    }
    fn value(&mut self, ty: u32, key: &str, record: bool, depth: usize) -> Option<()> {
        let t = ValueType::from_id(ty)?;
        let size = match t {
            ValueType::U8 | ValueType::I8 | ValueType::Bool => 1,
            ValueType::U16 | ValueType::I16 => 2,
            ValueType::U32 | ValueType::I32 | ValueType::F32 => 4,
            ValueType::U64 | ValueType::I64 | ValueType::F64 => 8,
            ValueType::String => {
                self.string(Kind::StrLen, key, record)?;
                return Some(());
            }
            ValueType::Array => {
                if depth > 4 {
                    return None;
                }
                let ety = self.field(Kind::ArrType, 4, key, record)? as u32;
                let n = self.field(Kind::ArrLen, 8, key, record)?;
                if n > self.b.len() as u64 {
                    return None;
                }
                // The first and last few elements are mapped; a vocabulary's 150k strings
                // are walked, not recorded.
                for i in 0..n {
                    let rec = record && (i < 4 || i + 2 >= n);
                    self.value(ety, key, rec, depth + 1)?;
                }
                return Some(());
            }
        };
        self.field(Kind::Scalar(t), size, key, record)?;
        Some(())
    }
}

/// Maps the header of a GGUF file, or `None` where it does not parse.
pub fn layout(bytes: &[u8]) -> Option<Layout> {
    let mut w = Walk {
        b: bytes,
        pos: 4,
        out: Layout::default(),
    };
    w.field(Kind::Version, 4, "", true)?;
    let n_tensors = w.field(Kind::TensorCount, 8, "", true)?;
    let n_kv = w.field(Kind::KvCount, 8, "", true)?;
    if n_kv > bytes.len() as u64 || n_tensors > bytes.len() as u64 {
        return None;
    }
    for _ in 0..n_kv {
        let key = w.string(Kind::KeyLen, "", true)?;
        if let Some(f) = w.out.fields.last_mut() {
            f.owner = key.clone();
        }
        let ty = w.field(Kind::ValueType, 4, &key, true)? as u32;
        w.value(ty, &key, true, 0)?;
    }
    for _ in 0..n_tensors {
        let name = w.string(Kind::NameLen, "", true)?;
        if let Some(f) = w.out.fields.last_mut() {
            f.owner = name.clone();
        }
        let nd = w.field(Kind::NDims, 4, &name, true)?;
        if nd > 8 {
            return None;
        }
        for _ in 0..nd {
            w.field(Kind::Dim, 8, &name, true)?;
        }
        w.field(Kind::TensorType, 4, &name, true)?;
        w.field(Kind::Offset, 8, &name, true)?;
    }
    w.out.table_end = w.pos;
    Some(w.out)
}

/// A seed file, parsed once.
pub struct Seed {
    pub name: String,
    pub bytes: Vec<u8>,
    pub layout: Layout,
    pub gguf: Gguf,
}

impl Seed {
    pub fn new(name: &str, bytes: Vec<u8>) -> Result<Seed, String> {
        let layout = layout(&bytes).ok_or_else(|| format!("{name}: the header does not map"))?;
        let gguf = Gguf::from_bytes(name, bytes.clone()).map_err(|e| e.to_string())?;
        Ok(Seed {
            name: name.to_string(),
            bytes,
            layout,
            gguf,
        })
    }
}

/// The metadata keys a qwen35 file is read through; semantic edits aim at these most.
const KEYS: &[&str] = &[
    "general.architecture",
    "general.alignment",
    "qwen35.block_count",
    "qwen35.context_length",
    "qwen35.embedding_length",
    "qwen35.feed_forward_length",
    "qwen35.attention.head_count",
    "qwen35.attention.head_count_kv",
    "qwen35.attention.key_length",
    "qwen35.attention.value_length",
    "qwen35.attention.layer_norm_rms_epsilon",
    "qwen35.attention.recurrent_layers",
    "qwen35.rope.freq_base",
    "qwen35.rope.dimension_count",
    "qwen35.rope.dimension_sections",
    "qwen35.full_attention_interval",
    "qwen35.nextn_predict_layers",
    "qwen35.ssm.conv_kernel",
    "qwen35.ssm.state_size",
    "qwen35.ssm.group_count",
    "qwen35.ssm.time_step_rank",
    "qwen35.ssm.inner_size",
    "prism.hadamard.version",
    "prism.hadamard.block_size",
    "prism.hadamard.transform",
    "prism.hadamard.axis",
    "prism.hadamard.sign_mode",
    "prism.hadamard.sign_widths",
    "prism.hadamard.sign_values",
    "prism.hadamard.weight_names",
    "prism.hadamard.inverse_weight_names",
    "prism.hadamard.gdn_v_grouped",
    "prism.hadamard.tied_output",
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
    "tokenizer.chat_template",
    "general.sampling.temp",
    "general.sampling.top_k",
    "general.sampling.top_p",
    "general.sampling.min_p",
    "general.sampling.penalty_last_n",
];

/// Integers at the edges that break size arithmetic.
fn boundary_u64(rng: &mut Rng, old: u64) -> u64 {
    let edges = [
        0,
        1,
        2,
        3,
        4,
        7,
        8,
        31,
        32,
        64,
        127,
        128,
        255,
        256,
        511,
        512,
        513,
        1023,
        1024,
        4096,
        65535,
        65536,
        (1 << 31) - 1,
        1 << 31,
        (1 << 32) - 1,
        1 << 32,
        1 << 40,
        1 << 53,
        (1 << 62) + 1,
        1 << 63,
        u64::MAX - 1,
        u64::MAX,
    ];
    match rng.below(8) {
        0 => old.wrapping_add(1),
        1 => old.wrapping_sub(1),
        2 => old.wrapping_mul(2),
        3 => old / 2,
        4 => rng.next_u64(),
        _ => *rng.pick(&edges),
    }
}

fn boundary_f64(rng: &mut Rng, old: f64) -> f64 {
    let edges = [
        f64::NAN,
        f64::INFINITY,
        f64::NEG_INFINITY,
        0.0,
        -0.0,
        -1.0,
        1.0,
        0.5,
        1e-6,
        1e-45,
        -1e-6,
        f32::MIN_POSITIVE as f64,
        f32::MAX as f64,
        -(f32::MAX as f64),
        1e39,
        1e300,
        5e-324,
    ];
    match rng.below(6) {
        0 => -old,
        1 => old * 1e20,
        2 => old * 1e-20,
        _ => *rng.pick(&edges),
    }
}

fn write_le(bytes: &mut [u8], f: &Field, v: u64) {
    for i in 0..f.size {
        bytes[f.at + i] = (v >> (8 * i)) as u8;
    }
}

fn read_le(bytes: &[u8], f: &Field) -> u64 {
    (0..f.size).fold(0u64, |v, i| v | (bytes[f.at + i] as u64) << (8 * i))
}

/// Rewrites one header field to a value at a boundary for its kind.
fn mutate_field(bytes: &mut [u8], f: &Field, rng: &mut Rng) -> String {
    let old = read_le(bytes, f);
    let new = match f.kind {
        Kind::ValueType | Kind::ArrType => match rng.below(3) {
            0 => rng.below(13) as u64,
            1 => 13 + rng.below(4) as u64,
            _ => boundary_u64(rng, old) & 0xFFFF_FFFF,
        },
        Kind::TensorType => {
            let ids = [
                0u64, 1, 2, 3, 8, 9, 10, 12, 14, 16, 24, 26, 28, 30, 34, 35, 39, 41, 42, 142, 143,
                144, 255,
            ];
            if rng.chance(3, 4) {
                *rng.pick(&ids)
            } else {
                boundary_u64(rng, old) & 0xFFFF_FFFF
            }
        }
        Kind::Scalar(ValueType::F32) => {
            (boundary_f64(rng, f32::from_bits(old as u32) as f64) as f32).to_bits() as u64
        }
        Kind::Scalar(ValueType::F64) => boundary_f64(rng, f64::from_bits(old)).to_bits(),
        Kind::Scalar(ValueType::Bool) => *rng.pick(&[0u64, 1, 2, 255]),
        Kind::Version | Kind::NDims => *rng.pick(&[0u64, 1, 2, 3, 4, 5, 8, 0xFFFF_FFFF]),
        Kind::Offset => match rng.below(4) {
            0 => old.wrapping_add(32),
            1 => old.wrapping_sub(32),
            2 => 0,
            _ => boundary_u64(rng, old),
        },
        _ => boundary_u64(rng, old),
    };
    let new = if f.size < 8 {
        new & ((1u64 << (8 * f.size)) - 1)
    } else {
        new
    };
    write_le(bytes, f, new);
    format!("{:?} of {:?} {old} -> {new}", f.kind, f.owner)
}

/// A metadata value at a boundary, of the key's own type or another.
fn boundary_value(rng: &mut Rng, old: Option<&Value>) -> Value {
    let old_u = old.and_then(Value::as_u64).unwrap_or(4);
    let old_f = old.and_then(Value::as_f64).unwrap_or(1.0);
    let keep_type = old.is_some() && rng.chance(2, 3);
    let ty = if keep_type {
        old.unwrap().value_type()
    } else {
        *rng.pick(&[
            ValueType::U8,
            ValueType::I8,
            ValueType::U32,
            ValueType::I32,
            ValueType::U64,
            ValueType::I64,
            ValueType::F32,
            ValueType::F64,
            ValueType::Bool,
            ValueType::String,
            ValueType::Array,
        ])
    };
    match ty {
        ValueType::U8 => Value::U8(boundary_u64(rng, old_u) as u8),
        ValueType::I8 => Value::I8(boundary_u64(rng, old_u) as i8),
        ValueType::U16 => Value::U16(boundary_u64(rng, old_u) as u16),
        ValueType::I16 => Value::I16(boundary_u64(rng, old_u) as i16),
        ValueType::U32 => Value::U32(boundary_u64(rng, old_u) as u32),
        ValueType::I32 => Value::I32(boundary_u64(rng, old_u) as i32),
        ValueType::U64 => Value::U64(boundary_u64(rng, old_u)),
        ValueType::I64 => Value::I64(boundary_u64(rng, old_u) as i64),
        ValueType::F32 => Value::F32(boundary_f64(rng, old_f) as f32),
        ValueType::F64 => Value::F64(boundary_f64(rng, old_f)),
        ValueType::Bool => Value::Bool(rng.chance(1, 2)),
        ValueType::String => Value::String(match rng.below(5) {
            0 => String::new(),
            1 => "qwen35".into(),
            2 => "x".repeat(rng.below(20_000)),
            _ => super::random_text(rng, 64),
        }),
        ValueType::Array => match old {
            Some(Value::Array(ety, items)) if rng.chance(2, 3) => {
                let mut items = items.clone();
                match rng.below(5) {
                    0 => items.clear(),
                    1 => items.truncate(rng.below(items.len() + 1)),
                    2 if !items.is_empty() => {
                        let i = rng.below(items.len());
                        let v = boundary_value(rng, Some(&items[i].clone()));
                        // Elements keep the array's type (the writer encodes by it).
                        if v.value_type() == *ety {
                            items[i] = v;
                        }
                    }
                    3 if !items.is_empty() => {
                        let v = items[rng.below(items.len())].clone();
                        for _ in 0..1 + rng.below(64) {
                            items.push(v.clone());
                        }
                    }
                    _ => items.reverse(),
                }
                Value::Array(*ety, items)
            }
            _ => {
                let n = rng.below(9);
                let items: Vec<Value> = (0..n).map(|_| boundary_value(rng, None)).collect();
                // A homogeneous array keeps the writer honest about the element type.
                match items.first() {
                    Some(v) => {
                        let t = v.value_type();
                        Value::Array(
                            t,
                            items.into_iter().filter(|x| x.value_type() == t).collect(),
                        )
                    }
                    None => Value::Array(ValueType::U32, Vec::new()),
                }
            }
        },
    }
}

/// The seed re-encoded with edits to its metadata and tensor table.
fn rewrite(seed: &Seed, rng: &mut Rng) -> (Vec<u8>, String) {
    let g = &seed.gguf;
    let mut meta: Vec<(String, Value)> = g.metadata().to_vec();
    let mut tensors: Vec<(String, Vec<u64>, GgmlType, Vec<u8>)> = g
        .tensors()
        .iter()
        .map(|t| {
            (
                t.name.clone(),
                t.dims.clone(),
                t.ty,
                g.tensor_data(t).to_vec(),
            )
        })
        .collect();
    let mut notes = Vec::new();
    for _ in 0..1 + rng.below(3) {
        match rng.below(10) {
            0..=4 => {
                let key = if rng.chance(3, 4) {
                    rng.pick(KEYS).to_string()
                } else {
                    meta[rng.below(meta.len())].0.clone()
                };
                let old = meta.iter().find(|(k, _)| *k == key).map(|(_, v)| v.clone());
                let v = if key == "general.alignment" {
                    // The writer pads by this value: keep it one it can write (0 divides by
                    // zero, 2^31 would pad gigabytes); the reader judges the rest.
                    match rng.below(3) {
                        0 => Value::U32(*rng.pick(&[1, 2, 3, 8, 16, 64, 100, 4096])),
                        1 => Value::U64(32),
                        _ => Value::String("32".into()),
                    }
                } else {
                    boundary_value(rng, old.as_ref())
                };
                notes.push(format!("set {key} = {}", short(&v)));
                match meta.iter_mut().find(|(k, _)| *k == key) {
                    Some(slot) => slot.1 = v,
                    None => meta.push((key, v)),
                }
            }
            5 => {
                let key = rng.pick(KEYS).to_string();
                notes.push(format!("drop key {key}"));
                meta.retain(|(k, _)| *k != key);
            }
            6 if !tensors.is_empty() => {
                let i = rng.below(tensors.len());
                notes.push(format!("drop tensor {}", tensors[i].0));
                tensors.remove(i);
            }
            7 if !tensors.is_empty() => {
                let i = rng.below(tensors.len());
                let mut t = tensors[i].clone();
                t.0 = match rng.below(3) {
                    0 => "unknown.weight".to_string(),
                    1 => format!("blk.{}.attn_norm.weight", 8 + rng.below(600)),
                    _ => t.0.replace("blk.", "blk.1"),
                };
                if tensors.iter().all(|x| x.0 != t.0) {
                    notes.push(format!("add tensor {}", t.0));
                    tensors.push(t);
                }
            }
            8 if !tensors.is_empty() => {
                // Another tensor's data under this name: shapes and types must still agree.
                let i = rng.below(tensors.len());
                let j = rng.below(tensors.len());
                notes.push(format!(
                    "{} takes the shape of {}",
                    tensors[i].0, tensors[j].0
                ));
                let (d, ty, data) = (tensors[j].1.clone(), tensors[j].2, tensors[j].3.clone());
                tensors[i].1 = d;
                tensors[i].2 = ty;
                tensors[i].3 = data;
            }
            _ => {
                let v = poke_weights(&mut tensors, rng);
                notes.push(v);
            }
        }
    }
    let mut w = GgufWriter::new();
    for (k, v) in &meta {
        w.set(k, v.clone());
    }
    for (name, dims, ty, data) in tensors {
        w.add_tensor(&name, &dims, ty, data);
    }
    (w.to_bytes(), notes.join("; "))
}

fn short(v: &Value) -> String {
    let s = v.to_string();
    if s.len() > 80 {
        let mut cut = 80;
        while !s.is_char_boundary(cut) {
            cut -= 1;
        }
        format!("{}…", &s[..cut])
    } else {
        s
    }
}

/// Writes NaN, ±Inf or a huge value into a float weight or a block scale.
fn poke_weights(tensors: &mut [(String, Vec<u64>, GgmlType, Vec<u8>)], rng: &mut Rng) -> String {
    let i = rng.below(tensors.len());
    let (name, _, ty, data) = &mut tensors[i];
    let v = *rng.pick(&[f32::NAN, f32::INFINITY, f32::NEG_INFINITY, 3e38, -3e38, 6e4]);
    let (stride, width) = match ty {
        GgmlType::F32 => (4, 4),
        GgmlType::F16 | GgmlType::BF16 => (2, 2),
        // Block scales: Q8_0/Q4_0 (f16 first), PQ2_0 (f16 first).
        GgmlType::Q8_0 => (34, 2),
        GgmlType::Q4_0 => (18, 2),
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => (34, 2),
        _ => (1, 1),
    };
    if data.len() < width {
        return format!("poke {name}: too small");
    }
    let at = rng.below(data.len() / stride) * stride;
    let bytes: Vec<u8> = match (ty, width) {
        (GgmlType::BF16, _) => ((v.to_bits() >> 16) as u16).to_le_bytes().to_vec(),
        (_, 4) => v.to_le_bytes().to_vec(),
        (_, 2) => half::f16::from_f32(v).to_bits().to_le_bytes().to_vec(),
        _ => vec![0xFF],
    };
    data[at..at + bytes.len()].copy_from_slice(&bytes);
    format!("poke {v} into {name} at byte {at}")
}

/// Case `index` of a run: the mutated bytes and what was done to them.
pub fn case(seeds: &[Seed], seed: u64, index: u64) -> (Vec<u8>, String) {
    let mut rng = super::Rng::for_case(seed, index);
    let s = &seeds[rng.below(seeds.len())];
    let mut notes = vec![s.name.clone()];
    let mut bytes;
    let op = rng.below(100);
    if op < 30 {
        // Re-encoded with semantic edits, sometimes followed by a field mutation.
        let (b, note) = rewrite(s, &mut rng);
        bytes = b;
        notes.push(note);
        if rng.chance(1, 4) {
            if let Some(l) = layout(&bytes) {
                let f = &l.fields[rng.below(l.fields.len())];
                notes.push(mutate_field(&mut bytes, f, &mut rng));
            }
        }
    } else {
        bytes = s.bytes.clone();
        let l = &s.layout;
        match op {
            30..=69 => {
                for _ in 0..1 + rng.below(3) {
                    // Numeric fields of the qwen35 keys and the tensor table, or any field.
                    let f = if rng.chance(1, 2) {
                        let pool: Vec<&Field> = l
                            .fields
                            .iter()
                            .filter(|f| {
                                f.owner.starts_with("qwen35.")
                                    || f.owner.starts_with("prism.")
                                    || matches!(
                                        f.kind,
                                        Kind::Dim
                                            | Kind::Offset
                                            | Kind::TensorType
                                            | Kind::NDims
                                            | Kind::TensorCount
                                            | Kind::KvCount
                                    )
                            })
                            .collect();
                        pool[rng.below(pool.len())]
                    } else {
                        &l.fields[rng.below(l.fields.len())]
                    };
                    notes.push(mutate_field(&mut bytes, f, &mut rng));
                }
            }
            70..=84 => {
                // Byte havoc in the header.
                for _ in 0..1 + rng.below(8) {
                    let at = rng.below(l.table_end);
                    bytes[at] = match rng.below(3) {
                        0 => bytes[at] ^ (1 << rng.below(8)),
                        1 => 0xFF,
                        _ => rng.next_u64() as u8,
                    };
                    notes.push(format!("byte {at}"));
                }
            }
            85..=92 => {
                let cut = if rng.chance(3, 4) {
                    rng.below(l.table_end + 64)
                } else {
                    rng.below(bytes.len())
                };
                bytes.truncate(cut);
                notes.push(format!("truncate to {cut}"));
            }
            _ => {
                // Insert or delete bytes inside the header: every later field shifts.
                let at = rng.below(l.table_end);
                if rng.chance(1, 2) {
                    let n = 1 + rng.below(16);
                    bytes.drain(at..(at + n).min(bytes.len()));
                    notes.push(format!("delete {n} bytes at {at}"));
                } else {
                    let n = 1 + rng.below(16);
                    let ins: Vec<u8> = (0..n).map(|_| rng.next_u64() as u8).collect();
                    bytes.splice(at..at, ins);
                    notes.push(format!("insert {n} bytes at {at}"));
                }
            }
        }
    }
    (bytes, notes.join(" | "))
}

/// Reads `bytes` as `tern serve` and `tern generate` read a model, and classifies the result.
pub fn run(bytes: Vec<u8>) -> Verdict {
    let g = match Gguf::from_bytes("fuzz.gguf", bytes) {
        Ok(g) => g,
        Err(e) => return Verdict::clean(e.to_string()),
    };
    // What boot reads besides the weights; their errors are refusals like any other, but they
    // must not panic.
    if let Ok(tok) = Tokenizer::from_gguf(&g) {
        if let Ok(ids) = tok.encode("Hello <|im_start|>world 123 \n\n  x", true, true) {
            let _ = tok.decode(&ids, false);
        }
    }
    if let Some(src) = g.get_str("tokenizer.chat_template") {
        if let Ok(t) = crate::chat::ChatTemplate::new(src) {
            let _ = t.render(&crate::chat::TemplateInputs {
                messages: serde_json::json!([{"role": "user", "content": "hi"}]),
                tools: None,
                add_generation_prompt: true,
                kwargs: Default::default(),
                bos_token: String::new(),
                eos_token: String::new(),
            });
        }
    }
    let _ = SamplerConfig::from_gguf(&g).validate();
    let g = Arc::new(g);
    let _ = Ledger::price(&g, &Shape::default());
    let cfg = match Config::from_gguf(&g) {
        Ok(c) => c,
        Err(e) => return Verdict::clean(e.to_string()),
    };
    let be = CpuBackend::new();
    let m = match Model::load(&be, g) {
        Ok(m) => m,
        Err(e) => return Verdict::clean(e.to_string()),
    };
    let prompt: Vec<u32> = [1u32, 7, 42, 3, 99]
        .iter()
        .map(|&t| t % cfg.n_vocab as u32)
        .collect();
    // The runtime's sampling step (greedy: the device path on a GPU) over a prompt and a few
    // decoded tokens.
    let mut produced = Vec::new();
    let generated: Result<(), ModelError> = (|| {
        let mut gen = Generator::new(
            &m,
            &be,
            m.new_state(&be),
            Sampler::new(SamplerConfig::greedy()),
            None,
        )?;
        produced.push(gen.prefill(&prompt)?);
        for _ in 0..3 {
            produced.extend(gen.step()?);
        }
        Ok(())
    })();
    // The logits those samples were drawn from, recomputed: were any non-finite?
    let mut all = prompt.clone();
    all.extend(produced.iter().take(produced.len().saturating_sub(1)));
    let sampled_rows = produced.len().max(1);
    let truth = m
        .forward(&be, &mut m.new_state(&be), &all, true)
        .map(|o| be.to_host(&o.logits));
    let bad = match &truth {
        Ok(l) => {
            let start = (prompt.len() - 1) * cfg.n_vocab;
            let end = (start + sampled_rows * cfg.n_vocab).min(l.len());
            non_finite(&l[start..end])
        }
        Err(_) => None,
    };
    match (generated, bad) {
        (Ok(()), None) => Verdict::valid(format!("generated {produced:?}")),
        (Ok(()), Some((i, v))) => Verdict::new(
            Outcome::SilentNaN,
            format!("generated {produced:?} from a row with logit {i} = {v}"),
        ),
        (Err(e), _) => Verdict::clean(e.to_string()),
    }
}
