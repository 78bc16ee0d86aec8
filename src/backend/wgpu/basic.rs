//! Elementwise and row ops: RMSNorm, residual add, SwiGLU, column concat.

use super::gpu::groups_2d;
use super::{Tensor, Weight, WgpuBackend};

const RMS_NORM: &str = include_str!("../../../shaders/rms_norm.wgsl");
const ADD: &str = include_str!("../../../shaders/add.wgsl");
const SWIGLU: &str = include_str!("../../../shaders/swiglu.wgsl");
const CONCAT_COLS: &str = include_str!("../../../shaders/concat_cols.wgsl");

/// Packs u32/f32 fields into a 16-byte-aligned uniform block.
pub fn params(words: &[u32]) -> Vec<u8> {
    let mut v: Vec<u32> = words.to_vec();
    v.resize(words.len().div_ceil(4).max(1) * 4, 0);
    bytemuck::cast_slice(&v).to_vec()
}

pub fn new_tensor(be: &WgpuBackend, rows: usize, cols: usize) -> Tensor {
    Tensor {
        buf: be.gpu.alloc((rows * cols * 4) as u64),
        rows,
        cols,
    }
}

pub fn rms_norm(be: &WgpuBackend, x: &Tensor, w: &Weight, eps: f32) -> Tensor {
    assert_eq!(w.ne0 * w.rows, x.cols, "rms_norm {}: width", w.name);
    let y = new_tensor(be, x.rows, x.cols);
    let p = be.gpu.pipeline("rms_norm", RMS_NORM);
    be.gpu.dispatch(
        &p,
        &params(&[x.rows as u32, x.cols as u32, eps.to_bits()]),
        &[x.bind(), w.dense().into(), y.bind()],
        groups_2d(x.rows as u32),
    );
    y
}

pub fn add_assign(be: &WgpuBackend, x: &mut Tensor, y: &Tensor) {
    assert_eq!(x.len(), y.len());
    let p = be.gpu.pipeline("add", ADD);
    be.gpu.dispatch(
        &p,
        &params(&[x.len() as u32]),
        &[x.bind(), y.bind()],
        groups_2d(x.len().div_ceil(256) as u32),
    );
}

pub fn swiglu(be: &WgpuBackend, gate: &Tensor, up: &Tensor) -> Tensor {
    assert_eq!(gate.len(), up.len());
    let y = new_tensor(be, gate.rows, gate.cols);
    let p = be.gpu.pipeline("swiglu", SWIGLU);
    be.gpu.dispatch(
        &p,
        &params(&[gate.len() as u32]),
        &[gate.bind(), up.bind(), y.bind()],
        groups_2d(gate.len().div_ceil(256) as u32),
    );
    y
}

pub fn concat_cols(be: &WgpuBackend, a: &Tensor, b: &Tensor) -> Tensor {
    assert_eq!(a.rows, b.rows);
    let y = new_tensor(be, a.rows, a.cols + b.cols);
    let p = be.gpu.pipeline("concat_cols", CONCAT_COLS);
    be.gpu.dispatch(
        &p,
        &params(&[a.rows as u32, a.cols as u32, b.cols as u32]),
        &[a.bind(), b.bind(), y.bind()],
        groups_2d(y.len().div_ceil(256) as u32),
    );
    y
}
