//! Gated DeltaNet on the device (model-qwen35.md §4).
//!
//! One `gdn` call records, with no host work:
//! 1. `gdn_conv`: causal conv over [carried state; tokens], SiLU, L2 norm of the q/k heads and
//!    the q scale, into a scratch `u` `[rows, conv_dim]`; the new conv state goes to a scratch
//!    buffer and is copied over the carried one after the dispatch.
//! 2. the recurrence, in one of two forms that agree with the CPU reference:
//!    - recurrent (`gdn_step`): token by token, one workgroup per V head × 16 state columns with
//!      the state in registers; used for decode (one row) and whenever the chunked form cannot
//!      run;
//!    - chunked (`gdn_chunk_prep` then `gdn_chunk_scan`, chunks of 64, §4.1): the prep is
//!      parallel over chunks × heads (decay matrix, (I+A)⁻¹ by forward substitution, U, W, P),
//!      the scan carries the state across chunks per V head × 16 state columns.
//! 3. `gdn_gated_norm`: rmsnorm(o) ⊙ norm ⊙ silu(z) per token and V head, in place.
//!
//! The output is `[rows, n_v*d]` in tiled V order (V head j reads K head j % n_k).

use super::basic::{new_tensor, params};
use super::gpu::groups_2d;
use super::{Tensor, Weight, WgpuBackend};
use crate::backend::{GdnParams, GdnWeights};

const CONV: &str = include_str!("../../../shaders/gdn_conv.wgsl");
const STEP: &str = include_str!("../../../shaders/gdn_step.wgsl");
const CHUNK_PREP: &str = include_str!("../../../shaders/gdn_chunk_prep.wgsl");
const CHUNK_SCAN: &str = include_str!("../../../shaders/gdn_chunk_scan.wgsl");
const GATED_NORM: &str = include_str!("../../../shaders/gdn_gated_norm.wgsl");

/// The line of `gdn_step` / `gdn_chunk_scan` that the host specialises with the head size.
const D_LINE: &str = "const D: u32 = 128u;";
/// Tokens per block of `gdn_conv`.
const CONV_TB: usize = 16;
pub use crate::backend::gpu_plan::GDN_CHUNK as CHUNK;
/// State columns per workgroup in `gdn_step` and `gdn_chunk_scan`.
const COL_BLOCK: usize = 16;
/// Workgroup memory of `gdn_chunk_prep`: the C×C matrix A plus gamma and beta.
const PREP_SHARED_BYTES: u32 = ((CHUNK * CHUNK + 2 * CHUNK) * 4) as u32;
/// Bound on each scratch buffer of one chunked dispatch pair (`[U | W]` and P, a power of two
/// below the 128 MiB storage binding minimum); longer inputs run in segments of whole chunks,
/// the state carried between them.
const SEGMENT_SCRATCH_BYTES: usize = 64 << 20;

/// One layer's recurrent state on the device, zero for a fresh sequence.
pub struct Recurrent {
    /// The last `d_conv - 1` raw conv inputs, oldest first, `[d_conv-1][conv_dim]` f32.
    pub conv: wgpu::Buffer,
    /// Per V head `S[i=k][j=v]`, v fastest, `[n_v][d][d]` f32.
    pub ssm: wgpu::Buffer,
    pub conv_len: usize,
    pub ssm_len: usize,
}

pub use crate::backend::gpu_plan::GdnForm;

fn zeros(be: &WgpuBackend, label: &str, n: usize) -> wgpu::Buffer {
    be.gpu.upload(label, &vec![0u8; n.max(1) * 4])
}

pub fn new_recurrent(be: &WgpuBackend, p: &GdnParams) -> Recurrent {
    Recurrent {
        conv: zeros(be, "gdn conv state", p.conv_state_len()),
        ssm: zeros(be, "gdn ssm state", p.ssm_state_len()),
        conv_len: p.conv_state_len(),
        ssm_len: p.ssm_state_len(),
    }
}

pub fn recurrent_copy(be: &WgpuBackend, from: &Recurrent, to: &mut Recurrent) {
    assert_eq!(
        (from.conv_len, from.ssm_len),
        (to.conv_len, to.ssm_len),
        "recurrent_copy: geometry"
    );
    be.gpu
        .copy(&from.conv, 0, &to.conv, 0, from.conv_len as u64 * 4);
    be.gpu
        .copy(&from.ssm, 0, &to.ssm, 0, from.ssm_len as u64 * 4);
}

/// Reads the state back as `(conv, ssm)` in the CPU backend's layout (tests, debugging).
pub fn read_state(be: &WgpuBackend, rs: &Recurrent) -> (Vec<f32>, Vec<f32>) {
    (
        be.gpu.read_f32(&rs.conv, 0, rs.conv_len),
        be.gpu.read_f32(&rs.ssm, 0, rs.ssm_len),
    )
}

/// Whether the chunked form can run for this geometry on this adapter.
pub fn chunked_supported(be: &WgpuBackend, p: &GdnParams) -> bool {
    p.d.is_multiple_of(COL_BLOCK)
        && be.gpu.limits.max_compute_workgroup_storage_size >= PREP_SHARED_BYTES
}

fn specialise(src: &str, d: usize) -> String {
    assert!(
        src.contains(D_LINE),
        "shader lacks the specialised line {D_LINE:?}"
    );
    src.replace(D_LINE, &format!("const D: u32 = {d}u;"))
}

#[allow(clippy::too_many_arguments)]
pub fn gdn(
    be: &WgpuBackend,
    p: &GdnParams,
    mixed: &Tensor,
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &GdnWeights<'_, Weight>,
    state: &mut Recurrent,
) -> Tensor {
    gdn_with(be, p, mixed, z, b, a, w, state, GdnForm::Auto)
}

/// `gdn` with the form of the recurrence chosen by the caller (the tests run both).
#[allow(clippy::too_many_arguments)]
pub fn gdn_with(
    be: &WgpuBackend,
    p: &GdnParams,
    mixed: &Tensor,
    z: &Tensor,
    b: &Tensor,
    a: &Tensor,
    w: &GdnWeights<'_, Weight>,
    state: &mut Recurrent,
    form: GdnForm,
) -> Tensor {
    let (cd, d, n_k, n_v) = (p.conv_dim(), p.d, p.n_k, p.n_v);
    let rows = mixed.rows;
    crate::backend::gpu_plan::check_gdn(
        p,
        (mixed.rows, mixed.cols),
        (z.rows, z.cols),
        (b.rows, b.cols),
        (a.rows, a.cols),
        (state.conv_len, state.ssm_len),
    );
    let out = new_tensor(be, rows, n_v * d);
    if rows == 0 {
        return out;
    }
    let chunked = match form {
        GdnForm::Auto => rows > 1 && chunked_supported(be, p),
        GdnForm::Recurrent => false,
        GdnForm::Chunked | GdnForm::ChunkedIn(_) => {
            assert!(
                chunked_supported(be, p),
                "gdn: the chunked form needs d % {COL_BLOCK} == 0 (d = {d})"
            );
            true
        }
    };
    let f = |x: f32| x.to_bits();
    let (conv_w, dt_bias, ssm_a, norm_w) = (
        w.conv.dense(),
        w.dt_bias.dense(),
        w.ssm_a.dense(),
        w.norm.dense(),
    );

    // 1. conv + SiLU + q/k L2 norm + q scale; the new conv state lands in `new_conv`.
    let u = be.gpu.alloc((rows * cd * 4) as u64);
    let new_conv = be.gpu.alloc((state.conv_len.max(1) * 4) as u64);
    let q_scale = 1.0 / (d as f32).sqrt();
    be.gpu.dispatch(
        &be.gpu.pipeline("gdn_conv", CONV),
        &params(&[
            rows as u32,
            cd as u32,
            d as u32,
            n_k as u32,
            p.d_conv as u32,
            f(p.eps),
            f(q_scale),
            0,
        ]),
        &[
            mixed.bind(),
            conv_w.into(),
            (&state.conv).into(),
            (&u).into(),
            (&new_conv).into(),
        ],
        [(2 * n_k + n_v) as u32, rows.div_ceil(CONV_TB) as u32, 1],
    );
    be.gpu.copy(
        new_conv.buffer(),
        0,
        &state.conv,
        0,
        state.conv_len as u64 * 4,
    );

    // 2. the recurrence, o pre-norm into `out`.
    let col_blocks = d.div_ceil(COL_BLOCK) as u32;
    if chunked {
        let n_chunks = rows.div_ceil(CHUNK);
        let (uw_chunk, pm_chunk) = (CHUNK * n_v * 2 * d * 4, CHUNK * n_v * CHUNK * 4);
        let max_seg = match form {
            GdnForm::ChunkedIn(n) => n,
            _ => SEGMENT_SCRATCH_BYTES / uw_chunk.max(pm_chunk),
        };
        let seg = max_seg.clamp(1, n_chunks);
        let gam = be.gpu.alloc((seg * n_v * CHUNK * 4) as u64);
        let uw = be.gpu.alloc((seg * uw_chunk) as u64);
        let pm = be.gpu.alloc((seg * pm_chunk) as u64);
        let prep = be.gpu.pipeline("gdn_chunk_prep", CHUNK_PREP);
        let scan = be
            .gpu
            .pipeline(&format!("gdn_chunk_scan_d{d}"), &specialise(CHUNK_SCAN, d));
        let mut ch0 = 0;
        while ch0 < n_chunks {
            let n = seg.min(n_chunks - ch0);
            be.gpu.dispatch(
                &prep,
                &params(&[
                    rows as u32,
                    n_k as u32,
                    n_v as u32,
                    cd as u32,
                    d as u32,
                    ch0 as u32,
                    0,
                    0,
                ]),
                &[
                    (&u).into(),
                    b.bind(),
                    a.bind(),
                    dt_bias.into(),
                    ssm_a.into(),
                    (&gam).into(),
                    (&uw).into(),
                    (&pm).into(),
                ],
                [n as u32, n_v as u32, 1],
            );
            be.gpu.dispatch(
                &scan,
                &params(&[
                    rows as u32,
                    n_k as u32,
                    n_v as u32,
                    cd as u32,
                    ch0 as u32,
                    n as u32,
                    0,
                    0,
                ]),
                &[
                    (&u).into(),
                    (&gam).into(),
                    (&uw).into(),
                    (&pm).into(),
                    (&state.ssm).into(),
                    out.bind(),
                ],
                [n_v as u32, col_blocks, 1],
            );
            ch0 += n;
        }
    } else {
        let step = be
            .gpu
            .pipeline(&format!("gdn_step_d{d}"), &specialise(STEP, d));
        be.gpu.dispatch(
            &step,
            &params(&[rows as u32, n_k as u32, n_v as u32, cd as u32]),
            &[
                (&u).into(),
                b.bind(),
                a.bind(),
                dt_bias.into(),
                ssm_a.into(),
                (&state.ssm).into(),
                out.bind(),
            ],
            [n_v as u32, col_blocks, 1],
        );
    }

    // 3. gated RMSNorm in place.
    let n = rows * n_v;
    be.gpu.dispatch(
        &be.gpu.pipeline("gdn_gated_norm", GATED_NORM),
        &params(&[n as u32, d as u32, f(p.eps), 0]),
        &[out.bind(), z.bind(), norm_w.into()],
        groups_2d(n as u32),
    );
    out
}
