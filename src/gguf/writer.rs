use std::io::Write;
use std::path::Path;

use super::{Value, DEFAULT_ALIGNMENT, MAGIC};
use crate::tensor::GgmlType;

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: TensorData,
}

enum TensorData {
    Bytes(Vec<u8>),
    /// Header-only files (planner tests): the table says the tensor is there, the bytes are
    /// zeros written as a hole by `set_len`.
    Sparse(u64),
}

/// Builds a GGUF v3 file in memory: metadata in insertion order, tensors in insertion order,
/// each aligned to `general.alignment` (32 unless set).
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

impl GgufWriter {
    pub fn new() -> Self {
        GgufWriter {
            metadata: Vec::new(),
            tensors: Vec::new(),
        }
    }

    /// Sets a key, replacing an earlier value of the same key in place.
    pub fn set(&mut self, key: &str, v: Value) -> &mut Self {
        if let Some(slot) = self.metadata.iter_mut().find(|(k, _)| k == key) {
            slot.1 = v;
        } else {
            self.metadata.push((key.to_string(), v));
        }
        self
    }

    /// Adds a tensor whose bytes are already encoded in `ty`. Panics on a size mismatch: the
    /// writer is for our own fixtures, where that is a programming error.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        let expect = expected_bytes(dims, ty);
        assert_eq!(
            data.len() as u64,
            expect,
            "tensor {name}: {ty} {dims:?} needs {expect} bytes"
        );
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            data: TensorData::Bytes(data),
        });
        self
    }

    pub fn add_f32(&mut self, name: &str, dims: &[u64], data: &[f32]) -> &mut Self {
        self.add_tensor(
            name,
            dims,
            GgmlType::F32,
            bytemuck::cast_slice(data).to_vec(),
        )
    }

    /// A tensor whose data is all zeros and costs no disk (for header-only fixtures).
    pub fn add_sparse(&mut self, name: &str, dims: &[u64], ty: GgmlType) -> &mut Self {
        let n = expected_bytes(dims, ty);
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            data: TensorData::Sparse(n),
        });
        self
    }

    fn alignment(&self) -> u64 {
        match self.metadata.iter().find(|(k, _)| k == "general.alignment") {
            Some((_, Value::U32(a))) => *a as u64,
            _ => DEFAULT_ALIGNMENT,
        }
    }

    /// Header and tensor table, padded to the data section, plus each tensor's data offset.
    fn header(&self) -> (Vec<u8>, Vec<u64>, u64) {
        let align = self.alignment();
        let mut h = Vec::new();
        h.extend_from_slice(MAGIC);
        h.extend_from_slice(&3u32.to_le_bytes());
        h.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        h.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            write_str(&mut h, k);
            h.extend_from_slice(&(v.value_type() as u32).to_le_bytes());
            write_value(&mut h, v);
        }
        let mut offsets = Vec::new();
        let mut off = 0u64;
        for t in &self.tensors {
            write_str(&mut h, &t.name);
            h.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                h.extend_from_slice(&d.to_le_bytes());
            }
            h.extend_from_slice(&t.ty.id().to_le_bytes());
            h.extend_from_slice(&off.to_le_bytes());
            offsets.push(off);
            let n = match &t.data {
                TensorData::Bytes(b) => b.len() as u64,
                TensorData::Sparse(n) => *n,
            };
            off = (off + n).div_ceil(align) * align;
        }
        let pad = (h.len() as u64).div_ceil(align) * align - h.len() as u64;
        h.extend(std::iter::repeat_n(0u8, pad as usize));
        (h, offsets, off)
    }

    /// The whole file in memory (sparse tensors become real zeros).
    pub fn to_bytes(&self) -> Vec<u8> {
        let (mut out, offsets, total) = self.header();
        let base = out.len() as u64;
        out.resize((base + total) as usize, 0);
        for (t, off) in self.tensors.iter().zip(offsets) {
            if let TensorData::Bytes(b) = &t.data {
                let s = (base + off) as usize;
                out[s..s + b.len()].copy_from_slice(b);
            }
        }
        out
    }

    /// Writes the file; sparse tensors are left as a hole so a 2.7 GB header-only file costs
    /// only its header on disk.
    pub fn write(&self, path: impl AsRef<Path>) -> std::io::Result<()> {
        let (header, offsets, total) = self.header();
        let mut f = std::io::BufWriter::new(std::fs::File::create(path.as_ref())?);
        f.write_all(&header)?;
        let base = header.len() as u64;
        let mut pos = base;
        for (t, off) in self.tensors.iter().zip(offsets) {
            if let TensorData::Bytes(b) = &t.data {
                let at = base + off;
                if at > pos {
                    f.flush()?;
                    use std::io::Seek;
                    f.seek(std::io::SeekFrom::Start(at))?;
                }
                f.write_all(b)?;
                pos = at + b.len() as u64;
            }
        }
        f.flush()?;
        let f = f.into_inner().map_err(|e| e.into_error())?;
        f.set_len(base + total)?;
        Ok(())
    }
}

fn expected_bytes(dims: &[u64], ty: GgmlType) -> u64 {
    let ne0 = dims.first().copied().unwrap_or(1);
    let rows: u64 = dims.iter().skip(1).product();
    ty.row_bytes(ne0)
        .expect("row length is a whole number of blocks")
        * rows
}

fn write_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn write_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => write_str(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(ty, items) => {
            out.extend_from_slice(&(*ty as u32).to_le_bytes());
            out.extend_from_slice(&(items.len() as u64).to_le_bytes());
            for it in items {
                debug_assert_eq!(it.value_type(), *ty, "array element type");
                write_value(out, it);
            }
        }
    }
}
