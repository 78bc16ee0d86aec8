//! GGUF v2/v3: a zero-copy reader over an mmap (or owned bytes) and a writer for fixtures.

mod reader;
mod value;
mod writer;

pub use reader::{Gguf, TensorInfo};
pub use value::{Value, ValueType};
pub use writer::GgufWriter;

use std::path::PathBuf;

use crate::tensor::GgmlType;

pub const MAGIC: &[u8; 4] = b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's GGML_MAX_DIMS.
pub const MAX_DIMS: u32 = 4;

#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    #[error("{path}: {source}")]
    Io {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    #[error("{path}: {kind}")]
    Format { path: PathBuf, kind: FormatError },
}

/// What is wrong with a file's bytes. Every variant names the thing at fault.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum FormatError {
    #[error("bad magic {0:02x?}: not a GGUF file")]
    BadMagic([u8; 4]),
    #[error("unsupported GGUF version {0} (tern reads versions 2 and 3)")]
    UnsupportedVersion(u32),
    #[error("truncated header: needed {needed} bytes at offset {offset} while reading {what}, file has {len}")]
    Truncated {
        what: String,
        offset: u64,
        needed: u64,
        len: u64,
    },
    #[error("metadata key {key:?}: unknown value type id {id}")]
    UnknownValueType { key: String, id: u32 },
    #[error("metadata key {key:?}: arrays nested deeper than {max}")]
    NestingTooDeep { key: String, max: usize },
    #[error("{what}: string is not valid UTF-8")]
    BadUtf8 { what: String },
    #[error("duplicate metadata key {0:?}")]
    DuplicateKey(String),
    #[error("general.alignment = {0} is not a non-zero power of two")]
    BadAlignment(u64),
    #[error("general.alignment has type {0}, expected u32")]
    BadAlignmentType(&'static str),
    #[error("tensor {name:?}: unknown ggml type id {id}")]
    UnknownTensorType { name: String, id: u32 },
    #[error("tensor {name:?}: {n_dims} dimensions (at most {MAX_DIMS})")]
    TooManyDims { name: String, n_dims: u32 },
    #[error("tensor {name:?}: dimensions {dims:?} overflow the element count")]
    DimensionOverflow { name: String, dims: Vec<u64> },
    #[error("tensor {name:?}: ne0 = {ne0} is not a multiple of the {ty} block size {block}")]
    BadRowLength {
        name: String,
        ne0: u64,
        ty: GgmlType,
        block: usize,
    },
    #[error("tensor {name:?}: data offset {offset} is not aligned to {alignment}")]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },
    #[error("tensor {name:?}: data [{start}, {end}) lies outside the {len}-byte data section (truncated data?)")]
    TensorOutOfBounds {
        name: String,
        start: u64,
        end: u64,
        len: u64,
    },
    #[error("tensor {name:?}: data offset {offset} {}, expected {expected}", offset_problem(*.offset, *.expected, .previous.as_deref()))]
    UnexpectedOffset {
        name: String,
        offset: u64,
        expected: u64,
        /// The tensor before it in the table, if any.
        previous: Option<String>,
    },
    #[error("duplicate tensor name {0:?}")]
    DuplicateTensor(String),
    #[error("tensor count {0} is larger than the file could hold")]
    TooManyTensors(u64),
    #[error("metadata count {0} is larger than the file could hold")]
    TooManyKeys(u64),
}

fn offset_problem(offset: u64, expected: u64, previous: Option<&str>) -> String {
    match previous {
        Some(p) if offset < expected => format!("overlaps the data of tensor {p:?}"),
        Some(p) => format!("leaves a gap after the data of tensor {p:?}"),
        None => "does not start the data section".to_string(),
    }
}
