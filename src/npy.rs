//! Minimal `.npy` (format 1.0) for little-endian float32 matrices: what `tern logits` writes
//! and the golden tests read.

use std::path::Path;

#[derive(Debug, thiserror::Error)]
pub enum NpyError {
    #[error("{path}: {source}")]
    Io {
        path: String,
        source: std::io::Error,
    },
    #[error("{path}: {why}")]
    Format { path: String, why: String },
}

pub fn to_bytes(data: &[f32], shape: &[usize]) -> Vec<u8> {
    assert_eq!(data.len(), shape.iter().product::<usize>());
    let dims = match shape {
        [n] => format!("({n},)"),
        _ => format!(
            "({})",
            shape
                .iter()
                .map(|d| d.to_string())
                .collect::<Vec<_>>()
                .join(", ")
        ),
    };
    let mut header = format!("{{'descr': '<f4', 'fortran_order': False, 'shape': {dims}, }}");
    // Magic (6) + version (2) + header length (2) + header, padded with spaces to a multiple
    // of 64 and ended by a newline, as numpy writes it.
    let total = 10 + header.len() + 1;
    header.push_str(&" ".repeat(total.div_ceil(64) * 64 - total));
    header.push('\n');
    let mut out = Vec::with_capacity(10 + header.len() + data.len() * 4);
    out.extend_from_slice(b"\x93NUMPY\x01\x00");
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    for v in data {
        out.extend_from_slice(&v.to_le_bytes());
    }
    out
}

pub fn write(path: impl AsRef<Path>, data: &[f32], shape: &[usize]) -> Result<(), NpyError> {
    let p = path.as_ref();
    std::fs::write(p, to_bytes(data, shape)).map_err(|source| NpyError::Io {
        path: p.display().to_string(),
        source,
    })
}

/// Reads a C-order float32 array; returns the data and its shape.
pub fn read(path: impl AsRef<Path>) -> Result<(Vec<f32>, Vec<usize>), NpyError> {
    let p = path.as_ref();
    let name = p.display().to_string();
    let bytes = std::fs::read(p).map_err(|source| NpyError::Io {
        path: name.clone(),
        source,
    })?;
    let bad = |why: &str| NpyError::Format {
        path: name.clone(),
        why: why.to_string(),
    };
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(bad("not an .npy file"));
    }
    let (hlen, hstart) = match bytes[6] {
        1 => (u16::from_le_bytes([bytes[8], bytes[9]]) as usize, 10),
        2 | 3 if bytes.len() >= 12 => (
            u32::from_le_bytes(bytes[8..12].try_into().unwrap()) as usize,
            12,
        ),
        _ => return Err(bad("unsupported .npy version")),
    };
    let header = std::str::from_utf8(
        bytes
            .get(hstart..hstart + hlen)
            .ok_or_else(|| bad("truncated header"))?,
    )
    .map_err(|_| bad("header is not UTF-8"))?;
    if !header.contains("'descr': '<f4'") {
        return Err(bad("dtype is not little-endian float32"));
    }
    if header.contains("'fortran_order': True") {
        return Err(bad("Fortran-order arrays are not supported"));
    }
    let s = header.find("'shape': (").ok_or_else(|| bad("no shape"))? + 10;
    let e = s + header[s..].find(')').ok_or_else(|| bad("bad shape"))?;
    let shape: Vec<usize> = header[s..e]
        .split(',')
        .map(str::trim)
        .filter(|t| !t.is_empty())
        .map(|t| t.parse().map_err(|_| bad("bad shape entry")))
        .collect::<Result<_, _>>()?;
    let n: usize = shape.iter().product();
    let body = &bytes[hstart + hlen..];
    if body.len() != n * 4 {
        return Err(bad(&format!(
            "data has {} bytes, shape {shape:?} needs {}",
            body.len(),
            n * 4
        )));
    }
    let data = body
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    Ok((data, shape))
}

#[cfg(test)]
mod tests {
    #[test]
    fn round_trip() {
        let dir = std::env::temp_dir().join(format!("tern-npy-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("a.npy");
        let data: Vec<f32> = (0..15).map(|i| i as f32 * 0.5 - 3.0).collect();
        super::write(&p, &data, &[3, 5]).unwrap();
        let bytes = std::fs::read(&p).unwrap();
        assert_eq!((bytes.len() - 15 * 4) % 64, 0, "header padded to 64");
        let (d, s) = super::read(&p).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(s, vec![3, 5]);
        assert_eq!(d, data);
    }
}
