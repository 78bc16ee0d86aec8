//! Embedding lookup and matmul for every weight dtype, and the Hadamard fold's transform.
//!
//! Weights stay in their stored bytes; the kernels decode them (`load8` in the shaders, the same
//! arithmetic as `quant::dequantize_row`). Activations and accumulation are f32.
//!
//! - `matmul`: up to `MATVEC_MAX_TOKENS` token rows take `matmul_vec.wgsl` (one workgroup per
//!   output row and group of 4 tokens, 64 threads over the row, workgroup sum through subgroups
//!   where the adapter has them); more take `matmul_tiled.wgsl` (64 rows x 32 tokens per
//!   workgroup, each decoded weight value used for 32 tokens). Both run once per weight part,
//!   writing output columns `[row0, row0 + n_rows)`.
//! - A folded weight's input first goes through `fold_input` (`fwht.wgsl`, plus `fwht_stage.wgsl`
//!   per stage past 1024), into a new tensor.
//! - `embed`: ids are grouped by table part on the host; `embed.wgsl` decodes the rows, then the
//!   inverse rule runs when the table carries one.
//!
//! No f16 arithmetic is used: f16 weights decode exactly through `unpack2x16float`, and the sums
//! stay f32, so there is no `enable f16;` variant to select.

use super::basic::{new_tensor, params};
use super::gpu::groups_2d;
use super::{Bind, GpuFold, Tensor, Weight, WeightPart, WgpuBackend};
use crate::backend::gpu_plan::FoldPlan;
use crate::backend::{BackendError, WeightSource};
use crate::tensor::GgmlType;

const MATMUL_VEC: &str = include_str!("../../../shaders/matmul_vec.wgsl");
const MATMUL_VEC_F16: &str = include_str!("../../../shaders/matmul_vec_f16.wgsl");
const MATMUL_TILED: &str = include_str!("../../../shaders/matmul_tiled.wgsl");
const EMBED: &str = include_str!("../../../shaders/embed.wgsl");
const FWHT: &str = include_str!("../../../shaders/fwht.wgsl");
const FWHT_STAGE: &str = include_str!("../../../shaders/fwht_stage.wgsl");

/// Token rows up to which `matmul` runs the matvec kernel (its token group size): one pass
/// over the weight. Beyond it the tiled kernel reuses each decoded weight slice for 32 tokens.
pub const MATVEC_MAX_TOKENS: usize = 4;

/// Elements one `fwht.wgsl` workgroup transforms in shared memory.

/// The decoder a kernel is specialised for: the value of `const TY` in the shaders.
fn dtype_code(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::BF16 => 2,
        GgmlType::Q8_0 => 3,
        GgmlType::Q4_0 => 4,
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => 5,
        GgmlType::PTQ1_0 => 6,
        other => unreachable!("upload refuses {other}"),
    }
}

/// Specialises a kernel's source: `const TY` becomes the dtype's decoder code and, with
/// `subgroups`, the `//#if subgroups` regions are uncommented and their `//#else` alternatives
/// dropped. Without subgroups the source is used as written (the portable path).
pub fn specialise(source: &str, ty: GgmlType, subgroups: bool) -> String {
    const TY_LINE: &str = "const TY: u32 = 0u;";
    assert_eq!(
        source.matches(TY_LINE).count(),
        1,
        "kernel source must declare `{TY_LINE}` once"
    );
    let source = source.replace(TY_LINE, &format!("const TY: u32 = {}u;", dtype_code(ty)));
    if !subgroups {
        return source;
    }
    enum Region {
        Common,
        If,
        Else,
    }
    let mut region = Region::Common;
    let mut out = String::with_capacity(source.len());
    for line in source.lines() {
        match line.trim() {
            "//#if subgroups" => region = Region::If,
            "//#else" => region = Region::Else,
            "//#endif" => region = Region::Common,
            _ => match region {
                Region::Common => {
                    out.push_str(line);
                    out.push('\n');
                }
                Region::If => {
                    let code = line.strip_prefix("//").unwrap_or_else(|| {
                        panic!("line {line:?} in an `//#if subgroups` region is not commented out")
                    });
                    out.push_str(code);
                    out.push('\n');
                }
                Region::Else => {}
            },
        }
    }
    out
}

/// Rows `[row0, row0 + n_rows)` of a weight as the kernels see them: a buffer of whole rows of
/// `row_bytes` in dtype `ty`.
struct PartView<'a> {
    buf: &'a wgpu::Buffer,
    ty: GgmlType,
    row_bytes: usize,
    row0: usize,
    n_rows: usize,
}

/// The parts of a weight; a small weight decoded to f32 at upload is one F32 part.
fn parts(w: &Weight) -> Vec<PartView<'_>> {
    match &w.dense {
        Some(buf) => vec![PartView {
            buf,
            ty: GgmlType::F32,
            row_bytes: w.ne0 * 4,
            row0: 0,
            n_rows: w.rows,
        }],
        None => w
            .parts
            .iter()
            .map(|p| PartView {
                buf: &p.buf,
                ty: w.ty,
                row_bytes: w.row_bytes,
                row0: p.row0,
                n_rows: p.n_rows,
            })
            .collect(),
    }
}

fn to_u32(n: usize, what: &str) -> u32 {
    u32::try_from(n).unwrap_or_else(|_| panic!("{what} {n} does not fit the kernels' u32 indices"))
}

/// `y[r] = W · x[r]` for every row of `x`, with the fold's forward rule on the input first.
pub fn matmul(be: &WgpuBackend, w: &Weight, x: &Tensor) -> Tensor {
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
    to_u32(x.len(), "input length");
    to_u32(y.len(), "output length");
    let tiled = x.rows > MATVEC_MAX_TOKENS;
    let subgroups = be.gpu.has_subgroups;
    for part in parts(w) {
        // Native f16 loads where the adapter has SHADER_F16; the u32-unpacking decoder
        // (identical numbers) everywhere else.
        if !tiled && part.ty == GgmlType::F16 && be.gpu.has_f16 && w.ne0 % 8 == 0 {
            let pipeline = be.gpu.pipeline("matmul_vec_f16", MATMUL_VEC_F16);
            let workgroups = part.n_rows * x.rows.div_ceil(MATVEC_MAX_TOKENS);
            be.gpu.dispatch(
                &pipeline,
                &params(&[
                    x.rows as u32,
                    w.ne0 as u32,
                    part.n_rows as u32,
                    part.row0 as u32,
                    w.rows as u32,
                    part.row_bytes as u32,
                ]),
                &[Bind::all(part.buf), x.bind(), y.bind()],
                groups_2d(to_u32(workgroups, "workgroup count")),
            );
            continue;
        }
        let (key, source) = if tiled {
            (
                format!("matmul_tiled/{}", dtype_code(part.ty)),
                MATMUL_TILED,
            )
        } else {
            (
                format!("matmul_vec/{}/sg{}", dtype_code(part.ty), subgroups as u8),
                MATMUL_VEC,
            )
        };
        let pipeline = be
            .gpu
            .pipeline(&key, &specialise(source, part.ty, subgroups && !tiled));
        let workgroups = if tiled {
            part.n_rows.div_ceil(64) * x.rows.div_ceil(32)
        } else {
            part.n_rows * x.rows.div_ceil(MATVEC_MAX_TOKENS)
        };
        be.gpu.dispatch(
            &pipeline,
            &params(&[
                x.rows as u32,
                w.ne0 as u32,
                part.n_rows as u32,
                part.row0 as u32,
                w.rows as u32,
                part.row_bytes as u32,
            ]),
            &[Bind::all(part.buf), x.bind(), y.bind()],
            groups_2d(to_u32(workgroups, "workgroup count")),
        );
    }
    y
}

/// The fold's transform of every row of `x` into a new tensor: the forward rule (GDN
/// permutation, ⊙ s, blockwise FWHT) or, with `inverse`, the inverse rule (blockwise FWHT, ⊙ s).
pub fn fold_input(be: &WgpuBackend, x: &Tensor, f: &GpuFold, inverse: bool) -> Tensor {
    let width = x.cols;
    let plan = FoldPlan::new(f.block, width, f.perm, f.signs.is_some(), inverse);
    let y = new_tensor(be, x.rows, width);
    if x.is_empty() {
        return y;
    }
    to_u32(x.len(), "input length");
    let signs = f
        .signs
        .as_ref()
        .map_or(Bind::all(x.buf.buffer()), Bind::all);
    let p = be.gpu.pipeline("fwht", FWHT);
    be.gpu.dispatch(
        &p,
        &params(&[
            x.rows as u32,
            width as u32,
            plan.chunk as u32,
            plan.scale.to_bits(),
            plan.flags,
            plan.hd as u32,
            plan.nk as u32,
            plan.rep as u32,
        ]),
        &[x.bind(), signs, y.bind()],
        groups_2d(to_u32(x.rows * (width / plan.chunk), "workgroup count")),
    );
    let stage = be.gpu.pipeline("fwht_stage", FWHT_STAGE);
    for (len, flags) in plan.stages() {
        be.gpu.dispatch(
            &stage,
            &params(&[x.rows as u32, width as u32, len as u32, flags]),
            &[signs, y.bind()],
            groups_2d(to_u32((x.len() / 2).div_ceil(256), "workgroup count")),
        );
    }
    y
}

/// Row lookup for every id, then the inverse rule when the table carries one.
pub fn embed(be: &WgpuBackend, table: &Weight, ids: &[u32]) -> Tensor {
    let ne0 = table.ne0;
    let rows = new_tensor(be, ids.len(), ne0);
    if ids.is_empty() {
        return rows;
    }
    to_u32(rows.len(), "output length");
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
        let pairs_buf = be.gpu.upload("embed ids", bytemuck::cast_slice(&pairs));
        let p = be.gpu.pipeline(
            &format!("embed/{}", dtype_code(part.ty)),
            &specialise(EMBED, part.ty, false),
        );
        let n = pairs.len() / 2;
        be.gpu.dispatch(
            &p,
            &params(&[n as u32, ne0 as u32, part.row_bytes as u32]),
            &[Bind::all(part.buf), Bind::all(&pairs_buf), rows.bind()],
            groups_2d(n as u32),
        );
    }
    match &table.inverse {
        Some(f) => fold_input(be, &rows, f, true),
        None => rows,
    }
}

/// Uploads `src` with its rows split into parts of at most `rows_per_part` (the last may be
/// shorter), as `upload` does for weights above the binding limit. For tests of the per-part
/// dispatch without a weight of that size.
pub fn upload_split(
    be: &WgpuBackend,
    src: &WeightSource,
    rows_per_part: usize,
) -> Result<Weight, BackendError> {
    use crate::backend::Backend;
    assert!(rows_per_part > 0);
    let mut w = be.upload(src)?;
    if w.dense.is_some() {
        return Err(BackendError::BadWeight {
            name: w.name,
            what: "a dense weight has no row parts".into(),
        });
    }
    let bytes = src.bytes();
    w.parts = (0..w.rows)
        .step_by(rows_per_part)
        .map(|row0| {
            let n_rows = rows_per_part.min(w.rows - row0);
            let buf = be.gpu.upload(
                &w.name,
                &bytes[row0 * w.row_bytes..(row0 + n_rows) * w.row_bytes],
            );
            WeightPart { buf, row0, n_rows }
        })
        .collect();
    Ok(w)
}
