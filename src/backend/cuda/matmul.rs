//! Embedding lookup and matmul for every weight dtype, and the Hadamard fold's transform
//! (the port of `wgpu/matmul.rs`).
//!
//! Weights stay in their stored bytes; the kernels decode them (`load8` in `cuda/common.cuh`,
//! the same arithmetic as `quant::dequantize_row`). Activations and accumulation are f32.
//!
//! - `matmul`: up to `MATVEC_MAX_TOKENS` token rows take `matmul_vec.cu` (one warp per output
//!   row and group of 4 tokens, each decoded unit used for every token of the group); more take
//!   `matmul_tiled.cu` (64 rows x 32 tokens per block, each decoded weight value used for 32
//!   tokens).
//! - A folded weight's input first goes through `fold_input` (`fwht.cu`, plus `fwht_stage.cu`
//!   per stage past 1024), into a new tensor.
//! - `embed`: the ids go up through the pinned ring; `embed.cu` decodes the rows, then the
//!   inverse rule runs when the table carries one.

use super::basic::{new_tensor, run, u32_of};
use super::device::{blocks, Arg};
use super::kernels::{weight_suffix, ModuleKey};
use super::{CudaBackend, CudaFold, Tensor, Weight};
use crate::backend::gpu_plan::FoldPlan;
use crate::tensor::GgmlType;

/// Token rows up to which `matmul` runs the matvec kernel (its token group size): one pass over
/// the weight. Beyond it the tiled kernel reuses each decoded weight slice for 32 tokens.
pub const MATVEC_MAX_TOKENS: usize = 4;

/// Elements one `fwht.cu` block transforms in shared memory.
/// Warps (output rows) per `matmul_vec` block.
const VEC_WARPS: usize = 4;

/// Entry point `<file>_<dtype>` of a per-weight-type kernel file.
fn entry(file: &'static str, ty: GgmlType) -> &'static str {
    let want = format!("{file}_{}", weight_suffix(ty));
    super::kernels::file(file)
        .entries
        .iter()
        .copied()
        .find(|e| *e == want)
        .unwrap_or_else(|| panic!("cuda/{file}.cu has no entry {want}"))
}

/// The stored rows of a weight as the kernels see them: (pointer, dtype, row bytes). A small
/// weight decoded to f32 at upload is read as F32.
fn view(w: &Weight) -> (u64, GgmlType, usize) {
    match (&w.dense, &w.data) {
        (Some(d), _) => (d.ptr(), GgmlType::F32, w.ne0 * 4),
        (None, Some(d)) => (d.ptr(), w.ty, w.row_bytes),
        (None, None) => unreachable!("{}: a weight holds data or dense values", w.name),
    }
}

/// `y[r] = W · x[r]` for every row of `x`, with the fold's forward rule on the input first.
pub fn matmul(be: &CudaBackend, w: &Weight, x: &Tensor) -> Tensor {
    assert_eq!(x.cols, w.ne0, "matmul {}: input width", w.name);
    let folded;
    let x = match &w.fold {
        Some(f) => {
            folded = fold_input(be, x, f, false);
            &folded
        }
        None => x,
    };
    let y = new_tensor(be, x.rows, w.rows);
    if x.rows == 0 || w.rows == 0 {
        return y;
    }
    let (ptr, ty, row_bytes) = view(w);
    let tiled = x.rows > MATVEC_MAX_TOKENS;
    let file = if tiled { "matmul_tiled" } else { "matmul_vec" };
    let f = be.dev.function(&ModuleKey::plain(file), entry(file, ty));
    let grid = if tiled {
        w.rows.div_ceil(64) * x.rows.div_ceil(32)
    } else {
        (w.rows * x.rows.div_ceil(MATVEC_MAX_TOKENS)).div_ceil(VEC_WARPS)
    };
    be.dev.launch(
        &f,
        (u32_of(grid, "block count"), 1, 1),
        if tiled { 256 } else { 32 * VEC_WARPS as u32 },
        &[
            Arg::P(ptr),
            Arg::P(x.ptr()),
            Arg::P(y.ptr()),
            Arg::U(u32_of(x.rows, "token rows")),
            Arg::U(u32_of(w.ne0, "input width")),
            Arg::U(u32_of(w.rows, "output rows")),
            Arg::U(u32_of(row_bytes, "row bytes")),
        ],
    );
    y
}

/// The fold's transform of every row of `x` into a new tensor: the forward rule (GDN
/// permutation, ⊙ s, blockwise FWHT) or, with `inverse`, the inverse rule (blockwise FWHT, ⊙ s).
pub fn fold_input(be: &CudaBackend, x: &Tensor, f: &CudaFold, inverse: bool) -> Tensor {
    let width = x.cols;
    let plan = FoldPlan::new(f.block, width, f.perm, f.signs.is_some(), inverse);
    let y = new_tensor(be, x.rows, width);
    if x.is_empty() {
        return y;
    }
    let signs = f.signs.as_ref().map_or(0, |s| s.ptr());
    run(
        be,
        "fwht",
        (u32_of(x.rows * (width / plan.chunk), "block count"), 1, 1),
        256,
        &[
            Arg::P(x.ptr()),
            Arg::P(signs),
            Arg::P(y.ptr()),
            Arg::U(u32_of(x.rows, "rows")),
            Arg::U(u32_of(width, "width")),
            Arg::U(plan.chunk as u32),
            Arg::F(plan.scale),
            Arg::U(plan.flags),
            Arg::U(plan.hd as u32),
            Arg::U(plan.nk as u32),
            Arg::U(plan.rep as u32),
        ],
    );
    for (len, flags) in plan.stages() {
        run(
            be,
            "fwht_stage",
            (blocks(x.len() / 2, 256), 1, 1),
            256,
            &[
                Arg::P(signs),
                Arg::P(y.ptr()),
                Arg::U(x.rows as u32),
                Arg::U(width as u32),
                Arg::U(len as u32),
                Arg::U(flags),
            ],
        );
    }
    y
}

/// Row lookup for every id, then the inverse rule when the table carries one.
pub fn embed(be: &CudaBackend, table: &Weight, ids: &[u32]) -> Tensor {
    let ne0 = table.ne0;
    let rows = new_tensor(be, ids.len(), ne0);
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
    let (ptr, ty, row_bytes) = view(table);
    let ids_buf = be.dev.upload(bytemuck::cast_slice(ids));
    let f = be
        .dev
        .function(&ModuleKey::plain("embed"), entry("embed", ty));
    be.dev.launch(
        &f,
        (u32_of(ids.len(), "id count"), 1, 1),
        64,
        &[
            Arg::P(ptr),
            Arg::P(ids_buf.ptr()),
            Arg::P(rows.ptr()),
            Arg::U(ids.len() as u32),
            Arg::U(u32_of(ne0, "width")),
            Arg::U(u32_of(row_bytes, "row bytes")),
        ],
    );
    match &table.inverse {
        Some(f) => fold_input(be, &rows, f, true),
        None => rows,
    }
}
