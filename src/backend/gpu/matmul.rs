//! Embedding lookup and matmul for every weight dtype, and the Hadamard fold's transform.
//!
//! Weights stay in their stored bytes; the kernels decode them (`load8`: `shaders/decode.wgsl`,
//! `cuda/common.cuh`, the same arithmetic as `quant::dequantize_row`). Activations and
//! accumulation are f32.
//!
//! - `matmul`: up to `MATVEC_MAX_TOKENS` token rows take `matmul_vec` (each decoded unit of a
//!   row used for every token of the group, one pass over the weight); more take
//!   `matmul_tiled` (64 rows × 32 tokens per workgroup, each decoded weight value used for 32
//!   tokens). Both run once per weight part, writing output columns `[row0, row0 + n_rows)`.
//! - A folded weight's input first goes through `fold_input` (`fwht`, plus `fwht_stage` per
//!   stage past 1024), into a new tensor; `matmul_many` transforms an input shared by several
//!   weights with the same fold once.
//! - `embed`: ids are grouped by table part on the host; `embed` decodes the rows, then the
//!   inverse rule runs when the table carries one.
//!
//! No f16 arithmetic is used: f16 weights decode exactly, and the sums stay f32.

use super::kernels::consts::{MATVEC_MAX_TOKENS, TILED_BM, TILED_BN};
use super::kernels::weight_code;
use super::plan::FoldPlan;
use super::{u32_of, Device, GpuBackend, GpuFold, Grid, Kernel, Scalar, Tensor, View, Weight};
use crate::tensor::GgmlType;

/// Rows `[row0, row0 + n_rows)` of a weight as the kernels see them: an allocation of whole
/// rows of `row_bytes` in dtype `ty`.
struct PartView<'a, M> {
    mem: &'a M,
    ty: GgmlType,
    row_bytes: usize,
    row0: usize,
    n_rows: usize,
}

/// The parts of a weight; a small weight decoded to f32 at upload is one F32 part.
fn parts<D: Device>(w: &Weight<D>) -> Vec<PartView<'_, D::Mem>> {
    match &w.dense {
        Some(mem) => vec![PartView {
            mem,
            ty: GgmlType::F32,
            row_bytes: w.ne0 * 4,
            row0: 0,
            n_rows: w.rows,
        }],
        None => w
            .parts
            .iter()
            .map(|p| PartView {
                mem: &p.mem,
                ty: w.ty,
                row_bytes: w.row_bytes,
                row0: p.row0,
                n_rows: p.n_rows,
            })
            .collect(),
    }
}

fn part_view<'a, M>(p: &PartView<'a, M>) -> View<'a, M> {
    View {
        mem: p.mem,
        offset: 0,
        len: (p.n_rows * p.row_bytes).div_ceil(4) as u64 * 4,
    }
}

/// `y[r] = W · x[r]` for every row of `x`, with the fold's forward rule on the input first.
pub fn matmul<D: Device>(be: &GpuBackend<D>, w: &Weight<D>, x: &Tensor<D>) -> Tensor<D> {
    assert_eq!(x.cols, w.ne0, "matmul {}: input width", w.name);
    match &w.fold {
        Some(f) => product(be, w, &fold_input(be, x, f, false)),
        None => product(be, w, x),
    }
}

/// `matmul` of one input by several weights. Weights whose folds transform the input the
/// same way (q/k/v, the GDN projections, ffn gate/up) share one transform.
pub fn matmul_many<D: Device>(
    be: &GpuBackend<D>,
    ws: &[&Weight<D>],
    x: &Tensor<D>,
) -> Vec<Tensor<D>> {
    let mut folded: Vec<(&GpuFold<D::Mem>, Tensor<D>)> = Vec::new();
    ws.iter()
        .map(|w| {
            assert_eq!(x.cols, w.ne0, "matmul {}: input width", w.name);
            let Some(f) = &w.fold else {
                return product(be, w, x);
            };
            let i = match folded.iter().position(|(g, _)| g.same_as(f)) {
                Some(i) => i,
                None => {
                    folded.push((f, fold_input(be, x, f, false)));
                    folded.len() - 1
                }
            };
            product(be, w, &folded[i].1)
        })
        .collect()
}

/// The product of a weight with an input already in the weight's (folded) basis.
fn product<D: Device>(be: &GpuBackend<D>, w: &Weight<D>, x: &Tensor<D>) -> Tensor<D> {
    let y = be.new_tensor(x.rows, w.rows);
    if x.rows == 0 || w.rows == 0 {
        return y;
    }
    u32_of(x.len(), "input length");
    u32_of(y.len(), "output length");
    let tiled = x.rows > MATVEC_MAX_TOKENS;
    for part in parts(w) {
        // Native f16 loads where the device has them; the u32-unpacking decoder (identical
        // numbers) everywhere else.
        let kernel = if tiled {
            Kernel::MatmulTiled {
                ty: weight_code(part.ty),
            }
        } else if part.ty == GgmlType::F16 && be.dev.caps().native_f16 && w.ne0.is_multiple_of(8) {
            Kernel::MatmulVecF16
        } else {
            Kernel::MatmulVec {
                ty: weight_code(part.ty),
            }
        };
        let workgroups = if tiled {
            part.n_rows.div_ceil(TILED_BM as usize) * x.rows.div_ceil(TILED_BN as usize)
        } else {
            part.n_rows * x.rows.div_ceil(MATVEC_MAX_TOKENS)
        };
        be.dev.launch(
            kernel,
            Grid::Linear(u32_of(workgroups, "workgroup count") as usize),
            &[part_view(&part), x.view(), y.view()],
            &[
                Scalar::U(x.rows as u32),
                Scalar::U(u32_of(w.ne0, "input width")),
                Scalar::U(u32_of(part.n_rows, "part rows")),
                Scalar::U(u32_of(part.row0, "part row")),
                Scalar::U(u32_of(w.rows, "output rows")),
                Scalar::U(u32_of(part.row_bytes, "row bytes")),
            ],
        );
    }
    y
}

/// The fold's transform of every row of `x` into a new tensor: the forward rule (GDN
/// permutation, ⊙ s, blockwise FWHT) or, with `inverse`, the inverse rule (blockwise FWHT, ⊙ s).
pub fn fold_input<D: Device>(
    be: &GpuBackend<D>,
    x: &Tensor<D>,
    f: &GpuFold<D::Mem>,
    inverse: bool,
) -> Tensor<D> {
    let width = x.cols;
    let plan = FoldPlan::new(
        f.hadamard.block_size,
        width,
        f.perm,
        f.signs.is_some(),
        inverse,
    );
    let y = be.new_tensor(x.rows, width);
    if x.is_empty() {
        return y;
    }
    u32_of(x.len(), "input length");
    // Without signs the kernels never read the binding; any buffer stands in for it.
    let signs = f.signs.as_ref().map_or(x.view(), |s| View {
        mem: s,
        offset: 0,
        len: width as u64 * 4,
    });
    be.dev.launch(
        Kernel::Fwht,
        Grid::Linear(u32_of(x.rows * (width / plan.chunk), "workgroup count") as usize),
        &[x.view(), signs, y.view()],
        &[
            Scalar::U(x.rows as u32),
            Scalar::U(width as u32),
            Scalar::U(plan.chunk as u32),
            Scalar::F(plan.scale),
            Scalar::U(plan.flags),
            Scalar::U(plan.hd as u32),
            Scalar::U(plan.nk as u32),
            Scalar::U(plan.rep as u32),
        ],
    );
    for (len, flags) in plan.stages() {
        be.dev.launch(
            Kernel::FwhtStage,
            Grid::Linear((x.len() / 2).div_ceil(256)),
            &[signs, y.view()],
            &[
                Scalar::U(x.rows as u32),
                Scalar::U(width as u32),
                Scalar::U(len as u32),
                Scalar::U(flags),
            ],
        );
    }
    y
}

/// Row lookup for every id, then the inverse rule when the table carries one.
pub fn embed<D: Device>(be: &GpuBackend<D>, table: &Weight<D>, ids: &[u32]) -> Tensor<D> {
    let ne0 = table.ne0;
    let rows = be.new_tensor(ids.len(), ne0);
    if ids.is_empty() {
        return rows;
    }
    u32_of(rows.len(), "output length");
    for &id in ids {
        assert!(
            (id as usize) < table.rows,
            "token id {id} outside the {} rows",
            table.rows
        );
    }
    for part in parts(table) {
        // (output row, row within the part) for the ids this part holds.
        let pairs: Vec<u32> = ids
            .iter()
            .enumerate()
            .filter(|&(_, &id)| (part.row0..part.row0 + part.n_rows).contains(&(id as usize)))
            .flat_map(|(o, &id)| [o as u32, id - part.row0 as u32])
            .collect();
        if pairs.is_empty() {
            continue;
        }
        let pairs_buf = be.upload_pooled(bytemuck::cast_slice(&pairs));
        let n = pairs.len() / 2;
        be.dev.launch(
            Kernel::Embed {
                ty: weight_code(part.ty),
            },
            Grid::Linear(n),
            &[
                part_view(&part),
                View {
                    mem: pairs_buf.mem(),
                    offset: 0,
                    len: pairs.len() as u64 * 4,
                },
                rows.view(),
            ],
            &[
                Scalar::U(n as u32),
                Scalar::U(ne0 as u32),
                Scalar::U(part.row_bytes as u32),
            ],
        );
    }
    match &table.inverse {
        Some(f) => fold_input(be, &rows, f, true),
        None => rows,
    }
}
