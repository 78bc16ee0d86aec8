//! Elementwise and row ops: RMSNorm, residual add, SwiGLU, column concat, row gathers.

use super::{u32_of, Device, GpuBackend, Grid, Kernel, Scalar, Tensor, Weight};

pub fn rms_norm<D: Device>(
    be: &GpuBackend<D>,
    x: &Tensor<D>,
    w: &Weight<D>,
    eps: f32,
) -> Tensor<D> {
    assert_eq!(w.ne0 * w.rows, x.cols, "rms_norm {}: width", w.name);
    let y = be.new_tensor(x.rows, x.cols);
    be.dev.launch(
        Kernel::RmsNorm,
        Grid::Linear(x.rows),
        &[x.view(), w.dense_view(), y.view()],
        &[
            Scalar::U(u32_of(x.rows, "rows")),
            Scalar::U(u32_of(x.cols, "cols")),
            Scalar::F(eps),
        ],
    );
    y
}

pub fn add_assign<D: Device>(be: &GpuBackend<D>, x: &mut Tensor<D>, y: &Tensor<D>) {
    assert_eq!(x.len(), y.len());
    be.dev.launch(
        Kernel::Add,
        Grid::Linear(x.len().div_ceil(256)),
        &[x.view(), y.view()],
        &[Scalar::U(u32_of(x.len(), "length"))],
    );
}

/// `y[r] += scales[r] * x[r]` for every row (a LoRA adapter's term, each row with the scale of
/// its sequence).
pub fn add_scaled_rows<D: Device>(
    be: &GpuBackend<D>,
    y: &mut Tensor<D>,
    x: &Tensor<D>,
    scales: &[f32],
) {
    assert_eq!(
        (y.rows, y.cols),
        (x.rows, x.cols),
        "add_scaled_rows: shapes"
    );
    assert_eq!(scales.len(), y.rows, "add_scaled_rows: one scale per row");
    if y.is_empty() {
        return;
    }
    let s = be.upload_pooled(bytemuck::cast_slice(scales));
    be.dev.launch(
        Kernel::AddScaled,
        Grid::Linear(y.len().div_ceil(256)),
        &[
            y.view(),
            x.view(),
            super::View {
                mem: s.mem(),
                offset: 0,
                len: scales.len() as u64 * 4,
            },
        ],
        &[
            Scalar::U(u32_of(y.rows, "rows")),
            Scalar::U(u32_of(y.cols, "cols")),
        ],
    );
}

pub fn swiglu<D: Device>(be: &GpuBackend<D>, gate: &Tensor<D>, up: &Tensor<D>) -> Tensor<D> {
    assert_eq!(gate.len(), up.len());
    let y = be.new_tensor(gate.rows, gate.cols);
    be.dev.launch(
        Kernel::Swiglu,
        Grid::Linear(gate.len().div_ceil(256)),
        &[gate.view(), up.view(), y.view()],
        &[Scalar::U(u32_of(gate.len(), "length"))],
    );
    y
}

pub fn concat_cols<D: Device>(be: &GpuBackend<D>, a: &Tensor<D>, b: &Tensor<D>) -> Tensor<D> {
    assert_eq!(a.rows, b.rows);
    let y = be.new_tensor(a.rows, a.cols + b.cols);
    be.dev.launch(
        Kernel::ConcatCols,
        Grid::Linear(y.len().div_ceil(256)),
        &[a.view(), b.view(), y.view()],
        &[
            Scalar::U(u32_of(a.rows, "rows")),
            Scalar::U(u32_of(a.cols, "cols")),
            Scalar::U(u32_of(b.cols, "cols")),
        ],
    );
    y
}

/// Stacks row blocks (all with the same column count).
pub fn concat_rows<D: Device>(be: &GpuBackend<D>, parts: &[&Tensor<D>]) -> Tensor<D> {
    let cols = parts[0].cols;
    let rows: usize = parts.iter().map(|p| p.rows).sum();
    let out = be.new_tensor(rows, cols);
    let mut at = 0u64;
    for p in parts {
        assert_eq!(p.cols, cols, "concat_rows: column counts differ");
        let n = p.len() as u64 * 4;
        be.dev.copy(p.buf.mem(), 0, out.buf.mem(), at, n);
        at += n;
    }
    out
}

/// The rows of `t` named by `runs` of `(first row, count)`, in order, as one tensor: one
/// device copy per run (the runs of a batch are few and long).
pub fn gather_rows<D: Device>(
    be: &GpuBackend<D>,
    t: &Tensor<D>,
    runs: &[(usize, usize)],
) -> Tensor<D> {
    let rows: usize = runs.iter().map(|r| r.1).sum();
    let out = be.new_tensor(rows, t.cols);
    let row_bytes = t.cols as u64 * 4;
    let mut at = 0u64;
    for &(start, n) in runs {
        assert!(
            start + n <= t.rows,
            "rows {start}..{} of {}",
            start + n,
            t.rows
        );
        be.dev.copy(
            t.buf.mem(),
            start as u64 * row_bytes,
            out.buf.mem(),
            at,
            n as u64 * row_bytes,
        );
        at += n as u64 * row_bytes;
    }
    out
}
