//! Elementwise and row ops: RMSNorm, residual add, SwiGLU, column concat.

use super::device::{blocks, Arg};
use super::kernels::ModuleKey;
use super::{CudaBackend, Tensor, Weight};

pub fn new_tensor(be: &CudaBackend, rows: usize, cols: usize) -> Tensor {
    Tensor {
        buf: be.dev.alloc(rows * cols * 4),
        rows,
        cols,
    }
}

/// `n` as a kernel's u32 parameter.
pub fn u32_of(n: usize, what: &str) -> u32 {
    u32::try_from(n).unwrap_or_else(|_| panic!("{what} {n} does not fit the kernels' u32 indices"))
}

/// Launches the single entry point of the plain kernel file `file`.
pub fn run(be: &CudaBackend, file: &'static str, grid: (u32, u32, u32), block: u32, args: &[Arg]) {
    let f = be.dev.function(&ModuleKey::plain(file), file);
    be.dev.launch(&f, grid, block, args);
}

pub fn rms_norm(be: &CudaBackend, x: &Tensor, w: &Weight, eps: f32) -> Tensor {
    assert_eq!(w.ne0 * w.rows, x.cols, "rms_norm {}: width", w.name);
    let y = new_tensor(be, x.rows, x.cols);
    run(
        be,
        "rms_norm",
        (u32_of(x.rows, "rows"), 1, 1),
        256,
        &[
            Arg::P(x.ptr()),
            Arg::P(w.dense()),
            Arg::P(y.ptr()),
            Arg::U(u32_of(x.rows, "rows")),
            Arg::U(u32_of(x.cols, "cols")),
            Arg::F(eps),
        ],
    );
    y
}

pub fn add_assign(be: &CudaBackend, x: &mut Tensor, y: &Tensor) {
    assert_eq!(x.len(), y.len());
    let n = u32_of(x.len(), "length");
    run(
        be,
        "add",
        (blocks(x.len(), 256), 1, 1),
        256,
        &[Arg::P(x.ptr()), Arg::P(y.ptr()), Arg::U(n)],
    );
}

pub fn swiglu(be: &CudaBackend, gate: &Tensor, up: &Tensor) -> Tensor {
    assert_eq!(gate.len(), up.len());
    let y = new_tensor(be, gate.rows, gate.cols);
    let n = u32_of(gate.len(), "length");
    run(
        be,
        "swiglu",
        (blocks(gate.len(), 256), 1, 1),
        256,
        &[
            Arg::P(gate.ptr()),
            Arg::P(up.ptr()),
            Arg::P(y.ptr()),
            Arg::U(n),
        ],
    );
    y
}

pub fn concat_cols(be: &CudaBackend, a: &Tensor, b: &Tensor) -> Tensor {
    assert_eq!(a.rows, b.rows);
    let y = new_tensor(be, a.rows, a.cols + b.cols);
    run(
        be,
        "concat_cols",
        (blocks(y.len(), 256), 1, 1),
        256,
        &[
            Arg::P(a.ptr()),
            Arg::P(b.ptr()),
            Arg::P(y.ptr()),
            Arg::U(u32_of(a.rows, "rows")),
            Arg::U(u32_of(a.cols, "cols")),
            Arg::U(u32_of(b.cols, "cols")),
        ],
    );
    y
}
