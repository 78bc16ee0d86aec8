//! Gated DeltaNet on the device (model-qwen35.md §4; the port of `wgpu/gdn.rs`).
//!
//! One `gdn` call enqueues, with no host work:
//! 1. `gdn_conv`: causal conv over [carried state; tokens], SiLU, L2 norm of the q/k heads and
//!    the q scale, into a scratch `u` `[rows, conv_dim]`; the new conv state goes to a scratch
//!    buffer and is copied over the carried one after the launch.
//! 2. the recurrence, in one of two forms that agree with the CPU reference:
//!    - recurrent (`gdn_step`): token by token, one block per V head × 16 state columns with
//!      the state in registers; used for decode (one row) and whenever the chunked form cannot
//!      run;
//!    - chunked (`gdn_chunk_prep` then `gdn_chunk_scan`, chunks of 64, §4.1): the prep is
//!      parallel over chunks × heads (decay matrix, (I+A)⁻¹ by forward substitution, U, W, P),
//!      the scan carries the state across chunks per V head × 16 state columns.
//! 3. `gdn_gated_norm`: rmsnorm(o) ⊙ norm ⊙ silu(z) per token and V head, in place.
//!
//! The output is `[rows, n_v*d]` in tiled V order (V head j reads K head j % n_k). The head
//! size is compiled into `gdn_step` and `gdn_chunk_scan` (one module per d, at first use).

use super::basic::{new_tensor, run, u32_of};
use super::device::Arg;
use super::kernels::ModuleKey;
use super::{CudaBackend, DBuf, Tensor, Weight};
use crate::backend::{GdnParams, GdnWeights};

/// Tokens per block of `gdn_conv`.
const CONV_TB: usize = 16;
pub use crate::backend::gpu_plan::GDN_CHUNK as CHUNK;
/// State columns per block in `gdn_step` and `gdn_chunk_scan`.
const COL_BLOCK: usize = 16;
/// Largest head size the kernels are built for (`gdn_step` keeps d / 8 state values per
/// thread in registers; `gdn_chunk_scan` keeps a d × 16 block in shared memory).
const MAX_D: usize = 512;
/// Bound on each scratch buffer of one chunked launch pair (`[U | W]` and P); longer inputs
/// run in segments of whole chunks, the state carried between them.
const SEGMENT_SCRATCH_BYTES: usize = 64 << 20;

/// One layer's recurrent state on the device, zero for a fresh sequence.
pub struct Recurrent {
    /// The last `d_conv - 1` raw conv inputs, oldest first, `[d_conv-1][conv_dim]` f32.
    pub conv: DBuf,
    /// Per V head `S[i=k][j=v]`, v fastest, `[n_v][d][d]` f32.
    pub ssm: DBuf,
    pub conv_len: usize,
    pub ssm_len: usize,
}

pub use crate::backend::gpu_plan::GdnForm;

pub fn new_recurrent(be: &CudaBackend, p: &GdnParams) -> Recurrent {
    Recurrent {
        conv: be.dev.zeros(p.conv_state_len() * 4),
        ssm: be.dev.zeros(p.ssm_state_len() * 4),
        conv_len: p.conv_state_len(),
        ssm_len: p.ssm_state_len(),
    }
}

pub fn recurrent_copy(be: &CudaBackend, from: &Recurrent, to: &mut Recurrent) {
    assert_eq!(
        (from.conv_len, from.ssm_len),
        (to.conv_len, to.ssm_len),
        "recurrent_copy: geometry"
    );
    be.dev
        .copy(from.conv.ptr(), to.conv.ptr(), from.conv_len * 4);
    be.dev.copy(from.ssm.ptr(), to.ssm.ptr(), from.ssm_len * 4);
}

/// Reads the state back as `(conv, ssm)` in the CPU backend's layout (tests, debugging).
pub fn read_state(be: &CudaBackend, rs: &Recurrent) -> (Vec<f32>, Vec<f32>) {
    (
        be.dev.read_f32(rs.conv.ptr(), rs.conv_len),
        be.dev.read_f32(rs.ssm.ptr(), rs.ssm_len),
    )
}

/// Whether the chunked form can run for this geometry.
pub fn chunked_supported(p: &GdnParams) -> bool {
    p.d.is_multiple_of(COL_BLOCK)
}

#[allow(clippy::too_many_arguments)]
pub fn gdn(
    be: &CudaBackend,
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
    be: &CudaBackend,
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
    assert!(d <= MAX_D, "gdn: head size {d} above the kernels' {MAX_D}");
    let out = new_tensor(be, rows, n_v * d);
    if rows == 0 {
        return out;
    }
    u32_of(rows * cd, "input length");
    let chunked = match form {
        GdnForm::Auto => rows > 1 && chunked_supported(p),
        GdnForm::Recurrent => false,
        GdnForm::Chunked | GdnForm::ChunkedIn(_) => {
            assert!(
                chunked_supported(p),
                "gdn: the chunked form needs d % {COL_BLOCK} == 0 (d = {d})"
            );
            true
        }
    };
    let (conv_w, dt_bias, ssm_a, norm_w) = (
        w.conv.dense(),
        w.dt_bias.dense(),
        w.ssm_a.dense(),
        w.norm.dense(),
    );
    let dev = &be.dev;

    // 1. conv + SiLU + q/k L2 norm + q scale; the new conv state lands in `new_conv`.
    let u = dev.alloc(rows * cd * 4);
    let new_conv = dev.alloc(state.conv_len.max(1) * 4);
    let q_scale = 1.0 / (d as f32).sqrt();
    run(
        be,
        "gdn_conv",
        (
            (2 * n_k + n_v) as u32,
            u32_of(rows.div_ceil(CONV_TB), "block count"),
            1,
        ),
        64,
        &[
            Arg::P(mixed.ptr()),
            Arg::P(conv_w),
            Arg::P(state.conv.ptr()),
            Arg::P(u.ptr()),
            Arg::P(new_conv.ptr()),
            Arg::U(rows as u32),
            Arg::U(cd as u32),
            Arg::U(d as u32),
            Arg::U(n_k as u32),
            Arg::U(p.d_conv as u32),
            Arg::F(p.eps),
            Arg::F(q_scale),
        ],
    );
    dev.copy(new_conv.ptr(), state.conv.ptr(), state.conv_len * 4);

    // 2. the recurrence, o pre-norm into `out`.
    let col_blocks = d.div_ceil(COL_BLOCK) as u32;
    let with_d = |file: &'static str| ModuleKey::with(file, &[("D", d as u32)]);
    if chunked {
        let n_chunks = rows.div_ceil(CHUNK);
        let (uw_chunk, pm_chunk) = (CHUNK * n_v * 2 * d * 4, CHUNK * n_v * CHUNK * 4);
        let max_seg = match form {
            GdnForm::ChunkedIn(n) => n,
            _ => SEGMENT_SCRATCH_BYTES / uw_chunk.max(pm_chunk),
        };
        let seg = max_seg.clamp(1, n_chunks);
        let gam = dev.alloc(seg * n_v * CHUNK * 4);
        let uw = dev.alloc(seg * uw_chunk);
        let pm = dev.alloc(seg * pm_chunk);
        let scan = dev.function(&with_d("gdn_chunk_scan"), "gdn_chunk_scan");
        let mut ch0 = 0;
        while ch0 < n_chunks {
            let n = seg.min(n_chunks - ch0);
            run(
                be,
                "gdn_chunk_prep",
                (n as u32, n_v as u32, 1),
                256,
                &[
                    Arg::P(u.ptr()),
                    Arg::P(b.ptr()),
                    Arg::P(a.ptr()),
                    Arg::P(dt_bias),
                    Arg::P(ssm_a),
                    Arg::P(gam.ptr()),
                    Arg::P(uw.ptr()),
                    Arg::P(pm.ptr()),
                    Arg::U(rows as u32),
                    Arg::U(n_k as u32),
                    Arg::U(n_v as u32),
                    Arg::U(cd as u32),
                    Arg::U(d as u32),
                    Arg::U(ch0 as u32),
                ],
            );
            dev.launch(
                &scan,
                (n_v as u32, col_blocks, 1),
                256,
                &[
                    Arg::P(u.ptr()),
                    Arg::P(gam.ptr()),
                    Arg::P(uw.ptr()),
                    Arg::P(pm.ptr()),
                    Arg::P(state.ssm.ptr()),
                    Arg::P(out.ptr()),
                    Arg::U(rows as u32),
                    Arg::U(n_k as u32),
                    Arg::U(n_v as u32),
                    Arg::U(cd as u32),
                    Arg::U(ch0 as u32),
                    Arg::U(n as u32),
                ],
            );
            ch0 += n;
        }
    } else {
        let step = dev.function(&with_d("gdn_step"), "gdn_step");
        dev.launch(
            &step,
            (n_v as u32, col_blocks, 1),
            128,
            &[
                Arg::P(u.ptr()),
                Arg::P(b.ptr()),
                Arg::P(a.ptr()),
                Arg::P(dt_bias),
                Arg::P(ssm_a),
                Arg::P(state.ssm.ptr()),
                Arg::P(out.ptr()),
                Arg::U(rows as u32),
                Arg::U(n_k as u32),
                Arg::U(n_v as u32),
                Arg::U(cd as u32),
            ],
        );
    }

    // 3. gated RMSNorm in place.
    let n = rows * n_v;
    run(
        be,
        "gdn_gated_norm",
        (u32_of(n, "block count"), 1, 1),
        64,
        &[
            Arg::P(out.ptr()),
            Arg::P(z.ptr()),
            Arg::P(norm_w),
            Arg::U(n as u32),
            Arg::U(d as u32),
            Arg::F(p.eps),
        ],
    );
    out
}
