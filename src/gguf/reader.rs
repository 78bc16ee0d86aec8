use std::collections::HashMap;
use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use super::{FormatError, GgufError, Value, ValueType, DEFAULT_ALIGNMENT, MAGIC, MAX_DIMS};
use crate::tensor::GgmlType;

/// Arrays inside arrays are legal GGUF, but nothing real nests more than a couple of levels;
/// the limit keeps a hostile file from recursing us off the stack.
const MAX_ARRAY_DEPTH: usize = 8;

enum Backing {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mmap(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// One entry of the tensor table.
#[derive(Clone, Debug)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` (ne0) is the fastest-varying, the row length of a matrix.
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset of the data relative to the start of the data section.
    pub offset: u64,
    /// Bytes of data, from the type's block size.
    pub nbytes: u64,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    pub fn ne0(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }
    /// Rows = product of all dims but the first.
    pub fn n_rows(&self) -> u64 {
        self.dims.iter().skip(1).product()
    }
    pub fn row_bytes(&self) -> u64 {
        self.ty.row_bytes(self.ne0()).unwrap_or(0)
    }
}

/// An opened GGUF file. Tensor data is borrowed from the mmap, never copied.
pub struct Gguf {
    path: PathBuf,
    backing: Arc<Backing>,
    pub version: u32,
    metadata: Vec<(String, Value)>,
    index: HashMap<String, usize>,
    tensors: Vec<TensorInfo>,
    tensor_index: HashMap<String, usize>,
    pub alignment: u64,
    /// Absolute file offset of the data section.
    pub data_offset: u64,
}

impl std::fmt::Debug for Gguf {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Gguf")
            .field("path", &self.path)
            .field("version", &self.version)
            .field("n_kv", &self.metadata.len())
            .field("n_tensors", &self.tensors.len())
            .finish()
    }
}

impl Gguf {
    /// Maps the file and parses header, metadata and tensor table.
    pub fn open(path: impl AsRef<Path>) -> Result<Gguf, GgufError> {
        let path = path.as_ref().to_path_buf();
        let io = |source| GgufError::Io {
            path: path.clone(),
            source,
        };
        let file = File::open(&path).map_err(io)?;
        // SAFETY: the mapping is read-only; a file changed underneath us is the user's
        // problem in every mmap-based loader (llama.cpp included).
        let mmap = unsafe { Mmap::map(&file) }.map_err(io)?;
        Self::parse(path, Backing::Mmap(mmap))
    }

    /// Parses an in-memory file (tests, fuzzing). `name` is used in error messages.
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Gguf, GgufError> {
        Self::parse(name.into(), Backing::Owned(bytes))
    }

    fn parse(path: PathBuf, backing: Backing) -> Result<Gguf, GgufError> {
        match parse_header(backing.bytes()) {
            Ok(h) => {
                let index = h
                    .metadata
                    .iter()
                    .enumerate()
                    .map(|(i, (k, _))| (k.clone(), i))
                    .collect();
                let tensor_index = h
                    .tensors
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (t.name.clone(), i))
                    .collect();
                Ok(Gguf {
                    path,
                    backing: Arc::new(backing),
                    version: h.version,
                    metadata: h.metadata,
                    index,
                    tensors: h.tensors,
                    tensor_index,
                    alignment: h.alignment,
                    data_offset: h.data_offset,
                })
            }
            Err(kind) => Err(GgufError::Format { path, kind }),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    pub fn file_len(&self) -> u64 {
        self.backing.bytes().len() as u64
    }

    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.index.get(key).map(|&i| &self.metadata[i].1)
    }

    pub fn get_str(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    pub fn get_u64(&self, key: &str) -> Option<u64> {
        self.get(key).and_then(Value::as_u64)
    }

    pub fn get_f64(&self, key: &str) -> Option<f64> {
        self.get(key).and_then(Value::as_f64)
    }

    pub fn architecture(&self) -> Option<&str> {
        self.get_str("general.architecture")
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// The tensor's bytes, borrowed from the mapping. Bounds were checked at open.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        let start = (self.data_offset + t.offset) as usize;
        &self.backing.bytes()[start..start + t.nbytes as usize]
    }

    /// Tells the kernel this process has stopped reading `t`'s bytes through the map (the CPU
    /// backend holds its own packed copy): its pages leave the resident set, staying in the
    /// page cache, so a loaded model is not counted twice; a later read faults them back in.
    /// Pages shared with a neighbouring tensor fault back the same way.
    #[cfg(unix)]
    pub fn release(&self, t: &TensorInfo) {
        if let Backing::Mmap(m) = &*self.backing {
            let start = (self.data_offset + t.offset) as usize;
            // SAFETY: a read-only shared mapping of the file: a dropped page reads back from
            // the file unchanged, so slices borrowed from it stay valid.
            let _ = unsafe {
                m.unchecked_advise_range(
                    memmap2::UncheckedAdvice::DontNeed,
                    start,
                    t.nbytes as usize,
                )
            };
        }
    }

    /// Where madvise is not available, the pages stay mapped.
    #[cfg(not(unix))]
    pub fn release(&self, _t: &TensorInfo) {}

    /// The same file with its tensor table and data but no metadata: what a walk over the
    /// tensors needs as an `Arc<Gguf>` (the data stays shared, nothing is copied but the table).
    pub fn table_view(&self) -> Gguf {
        Gguf {
            path: self.path.clone(),
            backing: self.backing.clone(),
            version: self.version,
            metadata: Vec::new(),
            index: HashMap::new(),
            tensors: self.tensors.clone(),
            tensor_index: self.tensor_index.clone(),
            alignment: self.alignment,
            data_offset: self.data_offset,
        }
    }

    /// The whole file as bytes (for hashing and for backends that upload straight from the map).
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }
}

struct Header {
    version: u32,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    alignment: u64,
    data_offset: u64,
}

struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], FormatError> {
        let len = self.buf.len() as u64;
        let end = (self.pos as u64)
            .checked_add(n)
            .filter(|&e| e <= len)
            .ok_or_else(|| FormatError::Truncated {
                what: what(),
                offset: self.pos as u64,
                needed: n,
                len,
            })?;
        let s = &self.buf[self.pos..end as usize];
        self.pos = end as usize;
        Ok(s)
    }
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }
    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.take(4, what)?.try_into().unwrap()))
    }
    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.take(8, what)?.try_into().unwrap()))
    }
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, FormatError> {
        let n = self.u64(what)?;
        let b = self.take(n, what)?;
        String::from_utf8(b.to_vec()).map_err(|_| FormatError::BadUtf8 { what: what() })
    }
}

fn read_value(
    c: &mut Cursor,
    ty: ValueType,
    key: &str,
    depth: usize,
) -> Result<Value, FormatError> {
    let what = || format!("value of {key:?}");
    Ok(match ty {
        ValueType::U8 => Value::U8(c.take(1, &what)?[0]),
        ValueType::I8 => Value::I8(c.take(1, &what)?[0] as i8),
        ValueType::U16 => Value::U16(u16::from_le_bytes(c.take(2, &what)?.try_into().unwrap())),
        ValueType::I16 => Value::I16(i16::from_le_bytes(c.take(2, &what)?.try_into().unwrap())),
        ValueType::U32 => Value::U32(c.u32(&what)?),
        ValueType::I32 => Value::I32(c.u32(&what)? as i32),
        ValueType::F32 => Value::F32(f32::from_bits(c.u32(&what)?)),
        ValueType::Bool => Value::Bool(c.take(1, &what)?[0] != 0),
        ValueType::String => Value::String(c.string(&what)?),
        ValueType::U64 => Value::U64(c.u64(&what)?),
        ValueType::I64 => Value::I64(c.u64(&what)? as i64),
        ValueType::F64 => Value::F64(f64::from_bits(c.u64(&what)?)),
        ValueType::Array => {
            if depth >= MAX_ARRAY_DEPTH {
                return Err(FormatError::NestingTooDeep {
                    key: key.to_string(),
                    max: MAX_ARRAY_DEPTH,
                });
            }
            let id = c.u32(&what)?;
            let ety = ValueType::from_id(id).ok_or_else(|| FormatError::UnknownValueType {
                key: key.to_string(),
                id,
            })?;
            let n = c.u64(&what)?;
            // Every element takes at least one byte: a count beyond the bytes left is a lie, and
            // must not drive an allocation.
            if n > c.remaining() {
                return Err(FormatError::Truncated {
                    what: format!("array {key:?} of {n} elements"),
                    offset: c.pos as u64,
                    needed: n,
                    len: c.buf.len() as u64,
                });
            }
            let mut items = Vec::with_capacity(n as usize);
            for _ in 0..n {
                items.push(read_value(c, ety, key, depth + 1)?);
            }
            Value::Array(ety, items)
        }
    })
}

fn parse_header(buf: &[u8]) -> Result<Header, FormatError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic = c.take(4, &|| "magic".into())?;
    if magic != MAGIC {
        return Err(FormatError::BadMagic(magic.try_into().unwrap()));
    }
    let version = c.u32(&|| "version".into())?;
    if !(2..=3).contains(&version) {
        return Err(FormatError::UnsupportedVersion(version));
    }
    let n_tensors = c.u64(&|| "tensor count".into())?;
    let n_kv = c.u64(&|| "metadata count".into())?;
    // A key/value pair takes at least 8 + 4 + 1 bytes, a tensor entry at least 8 + 4 + 8 + 4 + 8.
    if n_kv > c.remaining() / 13 {
        return Err(FormatError::TooManyKeys(n_kv));
    }
    if n_tensors > c.remaining() / 32 {
        return Err(FormatError::TooManyTensors(n_tensors));
    }

    let mut metadata: Vec<(String, Value)> = Vec::with_capacity(n_kv as usize);
    let mut seen = std::collections::HashSet::new();
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let id = c.u32(&|| format!("type of {key:?}"))?;
        let ty = ValueType::from_id(id).ok_or_else(|| FormatError::UnknownValueType {
            key: key.clone(),
            id,
        })?;
        let v = read_value(&mut c, ty, &key, 0)?;
        if !seen.insert(key.clone()) {
            return Err(FormatError::DuplicateKey(key));
        }
        metadata.push((key, v));
    }

    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, Value::U32(a))) => {
            let a = *a as u64;
            if a == 0 || !a.is_power_of_two() {
                return Err(FormatError::BadAlignment(a));
            }
            a
        }
        Some((_, v)) => return Err(FormatError::BadAlignmentType(v.value_type().name())),
    };

    let mut tensors = Vec::with_capacity(n_tensors as usize);
    let mut names = std::collections::HashSet::new();
    for i in 0..n_tensors {
        let name = c.string(&|| format!("tensor name #{i}"))?;
        let what = || format!("tensor info of {name:?}");
        let n_dims = c.u32(&what)?;
        if n_dims > MAX_DIMS {
            return Err(FormatError::TooManyDims { name, n_dims });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for _ in 0..n_dims {
            dims.push(c.u64(&what)?);
        }
        let id = c.u32(&what)?;
        let ty = GgmlType::from_id(id).ok_or_else(|| FormatError::UnknownTensorType {
            name: name.clone(),
            id,
        })?;
        let offset = c.u64(&what)?;
        let mut n_el: u64 = 1;
        for &d in &dims {
            n_el = match n_el.checked_mul(d) {
                Some(v) if v <= i64::MAX as u64 => v,
                _ => return Err(FormatError::DimensionOverflow { name, dims }),
            };
        }
        let ne0 = dims.first().copied().unwrap_or(1);
        let (block, _) = ty.block();
        if ne0 % block as u64 != 0 {
            return Err(FormatError::BadRowLength {
                name,
                ne0,
                ty,
                block,
            });
        }
        let nbytes = ty
            .row_bytes(ne0)
            .and_then(|rb| rb.checked_mul(n_el / ne0.max(1)))
            .filter(|_| ne0 != 0 || n_el == 0)
            .unwrap_or(0);
        if ne0 == 0 && n_el != 0 {
            return Err(FormatError::DimensionOverflow { name, dims });
        }
        if offset % alignment != 0 {
            return Err(FormatError::MisalignedTensor {
                name,
                offset,
                alignment,
            });
        }
        if !names.insert(name.clone()) {
            return Err(FormatError::DuplicateTensor(name));
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            nbytes,
        });
    }

    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let data_len = (buf.len() as u64).saturating_sub(data_offset);
    if !tensors.is_empty() && data_offset > buf.len() as u64 {
        return Err(FormatError::Truncated {
            what: "padding before the data section".into(),
            offset: c.pos as u64,
            needed: data_offset - c.pos as u64,
            len: buf.len() as u64,
        });
    }
    detect_legacy_q2_0(&mut tensors, data_len);
    for t in &tensors {
        let end = t.offset.checked_add(t.nbytes);
        match end {
            Some(end) if end <= data_len => {}
            _ => {
                return Err(FormatError::TensorOutOfBounds {
                    name: t.name.clone(),
                    start: t.offset,
                    end: end.unwrap_or(u64::MAX),
                    len: data_len,
                })
            }
        }
    }
    // ggml's gguf reader lays the data section out from the table: each tensor starts where
    // the one before it ends, padded to the alignment. Holding files to that refuses data
    // shared by two tensors (a weight read through another's bytes) and unaccounted gaps.
    let mut expected = 0u64;
    let mut prev: Option<&TensorInfo> = None;
    for t in &tensors {
        if t.offset != expected {
            return Err(FormatError::UnexpectedOffset {
                name: t.name.clone(),
                offset: t.offset,
                expected,
                previous: prev.map(|p| p.name.clone()),
            });
        }
        // In bounds (checked above), so neither sum can overflow.
        expected = (t.offset + t.nbytes).div_ceil(alignment) * alignment;
        prev = Some(t);
    }
    Ok(Header {
        version,
        metadata,
        tensors,
        alignment,
        data_offset,
    })
}

/// Type 42 means upstream Q2_0 (18 B per 64) in current files and PrismML's pre-v7 group-128
/// layout (34 B per 128) in old ones. The two differ in size (36 vs 34 bytes per 128 weights),
/// so a tensor whose span up to the next tensor (or the end of data) is too short for the
/// upstream layout but fits the legacy one is legacy.
fn detect_legacy_q2_0(tensors: &mut [TensorInfo], data_len: u64) {
    let mut starts: Vec<u64> = tensors.iter().map(|t| t.offset).collect();
    starts.sort_unstable();
    for t in tensors.iter_mut().filter(|t| t.ty == GgmlType::Q2_0) {
        let next = starts
            .iter()
            .copied()
            .find(|&s| s > t.offset)
            .unwrap_or(data_len);
        let span = next.saturating_sub(t.offset);
        let n_el = t.n_elements();
        let legacy = GgmlType::Q2_0Legacy
            .row_bytes(t.ne0())
            .map(|rb| rb * (n_el / t.ne0().max(1)));
        if let Some(legacy_bytes) = legacy {
            if span < t.nbytes && span >= legacy_bytes {
                t.ty = GgmlType::Q2_0Legacy;
                t.nbytes = legacy_bytes;
            }
        }
    }
}
