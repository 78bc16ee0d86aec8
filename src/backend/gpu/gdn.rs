//! Gated DeltaNet on the device (model-qwen35.md §4).
//!
//! One `gdn` call queues, with no host work:
//! 1. `gdn_conv`: causal conv over [carried state; tokens], SiLU, L2 norm of the q/k heads and
//!    the q scale, into a scratch `u` `[rows, conv_dim]`; the new conv state goes to a scratch
//!    buffer and is copied over the carried one after the launch.
//! 2. the recurrence, in one of two forms that agree with the CPU reference:
//!    - recurrent (`gdn_step`): token by token, one workgroup per V head × 16 state columns with
//!      the state in registers; used for decode (one row) and whenever the chunked form cannot
//!      run;
//!    - chunked (`gdn_chunk_prep` then `gdn_chunk_scan`, chunks of 64, §4.1): the prep is
//!      parallel over chunks × heads (decay matrix, (I+A)⁻¹ by forward substitution, U, W, P),
//!      the scan carries the state across chunks per V head × 16 state columns.
//! 3. `gdn_gated_norm`: rmsnorm(o) ⊙ norm ⊙ silu(z) per token and V head, in place.
//!
//! The output is `[rows, n_v*d]` in tiled V order (V head j reads K head j % n_k). The head
//! size is compiled into `gdn_step` and `gdn_chunk_scan`.

use super::kernels::consts::{
    CONV_TOKENS, GDN_CHUNK, GDN_COL_BLOCK, GDN_MAX_D, GDN_PREP_SHARED_BYTES,
    GDN_SEGMENT_SCRATCH_BYTES,
};
use super::plan::check_gdn;
use super::{u32_of, Device, GpuBackend, Grid, Kernel, PBuf, Scalar, Tensor, View, Weight};
use crate::backend::{GdnParams, GdnWeights};

pub use super::plan::GdnForm;

/// One layer's recurrent state on the device, zero for a fresh sequence.
pub struct Recurrent<D: Device> {
    /// The last `d_conv - 1` raw conv inputs, oldest first, `[d_conv-1][conv_dim]` f32.
    pub conv: D::Mem,
    /// Per V head `S[i=k][j=v]`, v fastest, `[n_v][d][d]` f32.
    pub ssm: D::Mem,
    pub conv_len: usize,
    pub ssm_len: usize,
}

fn zeros<D: Device>(be: &GpuBackend<D>, n: usize) -> D::Mem {
    let m = be
        .dev
        .alloc((n.max(1) * 4) as u64)
        .unwrap_or_else(|e| panic!("{}: recurrent state: {e}", D::NAME));
    be.dev.zero(&m);
    m
}

pub fn new_recurrent<D: Device>(be: &GpuBackend<D>, p: &GdnParams) -> Recurrent<D> {
    Recurrent {
        conv: zeros(be, p.conv_state_len()),
        ssm: zeros(be, p.ssm_state_len()),
        conv_len: p.conv_state_len(),
        ssm_len: p.ssm_state_len(),
    }
}

pub fn recurrent_copy<D: Device>(be: &GpuBackend<D>, from: &Recurrent<D>, to: &mut Recurrent<D>) {
    assert_eq!(
        (from.conv_len, from.ssm_len),
        (to.conv_len, to.ssm_len),
        "recurrent_copy: geometry"
    );
    be.dev
        .copy(&from.conv, 0, &to.conv, 0, from.conv_len as u64 * 4);
    be.dev
        .copy(&from.ssm, 0, &to.ssm, 0, from.ssm_len as u64 * 4);
}

/// Reads the state back as `(conv, ssm)` in the CPU backend's layout (tests, debugging).
pub fn read_state<D: Device>(be: &GpuBackend<D>, rs: &Recurrent<D>) -> (Vec<f32>, Vec<f32>) {
    let f32s = |m: &D::Mem, n: usize| -> Vec<f32> {
        be.dev
            .read(m, 0, n as u64 * 4)
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
            .collect()
    };
    (f32s(&rs.conv, rs.conv_len), f32s(&rs.ssm, rs.ssm_len))
}

/// Whether the chunked form can run for this geometry on this device.
pub fn chunked_supported<D: Device>(be: &GpuBackend<D>, p: &GdnParams) -> bool {
    p.d.is_multiple_of(GDN_COL_BLOCK as usize)
        && be.dev.caps().shared_bytes >= GDN_PREP_SHARED_BYTES
}

fn whole<M>(mem: &M, floats: usize) -> View<'_, M> {
    View {
        mem,
        offset: 0,
        len: (floats * 4).max(4) as u64,
    }
}

fn pooled<D: Device>(b: &PBuf<D>) -> View<'_, D::Mem> {
    b.view()
}

/// `gdn` with the form of the recurrence chosen by the caller (the tests run each form).
#[allow(clippy::too_many_arguments)]
pub fn gdn_with<D: Device>(
    be: &GpuBackend<D>,
    p: &GdnParams,
    mixed: &Tensor<D>,
    z: &Tensor<D>,
    b: &Tensor<D>,
    a: &Tensor<D>,
    w: &GdnWeights<'_, Weight<D>>,
    state: &mut Recurrent<D>,
    form: GdnForm,
) -> Tensor<D> {
    let (cd, d, n_k, n_v) = (p.conv_dim(), p.d, p.n_k, p.n_v);
    let rows = mixed.rows;
    check_gdn(
        p,
        (mixed.rows, mixed.cols),
        (z.rows, z.cols),
        (b.rows, b.cols),
        (a.rows, a.cols),
        (state.conv_len, state.ssm_len),
    );
    assert!(
        d <= GDN_MAX_D,
        "gdn: head size {d} above the kernels' {GDN_MAX_D}"
    );
    let out = be.new_tensor(rows, n_v * d);
    if rows == 0 {
        return out;
    }
    u32_of(rows * cd, "input length");
    let chunked = match form {
        GdnForm::Auto => rows > 1 && chunked_supported(be, p),
        GdnForm::Recurrent => false,
        GdnForm::Chunked | GdnForm::ChunkedIn(_) => {
            assert!(
                chunked_supported(be, p),
                "gdn: the chunked form needs d % {GDN_COL_BLOCK} == 0 (d = {d})"
            );
            true
        }
    };
    let (conv_w, dt_bias, ssm_a, norm_w) = (
        w.conv.dense_view(),
        w.dt_bias.dense_view(),
        w.ssm_a.dense_view(),
        w.norm.dense_view(),
    );
    let dev = &be.dev;
    let (u32s, ds) = (|n: usize| Scalar::U(n as u32), d as u32);

    // 1. conv + SiLU + q/k L2 norm + q scale; the new conv state lands in `new_conv`.
    let u = be.alloc(rows * cd * 4);
    let new_conv = be.alloc(state.conv_len.max(1) * 4);
    let q_scale = 1.0 / (d as f32).sqrt();
    dev.launch(
        Kernel::GdnConv,
        Grid::Dims([
            (2 * n_k + n_v) as u32,
            u32_of(rows.div_ceil(CONV_TOKENS as usize), "token blocks"),
            1,
        ]),
        &[
            mixed.view(),
            conv_w,
            whole(&state.conv, state.conv_len),
            pooled(&u),
            pooled(&new_conv),
        ],
        &[
            u32s(rows),
            u32s(cd),
            u32s(d),
            u32s(n_k),
            u32s(p.d_conv),
            Scalar::F(p.eps),
            Scalar::F(q_scale),
        ],
    );
    dev.copy(new_conv.mem(), 0, &state.conv, 0, state.conv_len as u64 * 4);

    // 2. the recurrence, o pre-norm into `out`.
    let col_blocks = d.div_ceil(GDN_COL_BLOCK as usize) as u32;
    let ssm = whole(&state.ssm, state.ssm_len);
    if chunked {
        let chunk = GDN_CHUNK as usize;
        let n_chunks = rows.div_ceil(chunk);
        let (uw_chunk, pm_chunk) = (chunk * n_v * 2 * d * 4, chunk * n_v * chunk * 4);
        let max_seg = match form {
            GdnForm::ChunkedIn(n) => n,
            _ => GDN_SEGMENT_SCRATCH_BYTES / uw_chunk.max(pm_chunk),
        };
        let seg = max_seg.clamp(1, n_chunks);
        let gam = be.alloc(seg * n_v * chunk * 4);
        let uw = be.alloc(seg * uw_chunk);
        let pm = be.alloc(seg * pm_chunk);
        let mut ch0 = 0;
        while ch0 < n_chunks {
            let n = seg.min(n_chunks - ch0);
            dev.launch(
                Kernel::GdnChunkPrep,
                Grid::Dims([n as u32, n_v as u32, 1]),
                &[
                    pooled(&u),
                    b.view(),
                    a.view(),
                    dt_bias,
                    ssm_a,
                    pooled(&gam),
                    pooled(&uw),
                    pooled(&pm),
                ],
                &[
                    u32s(rows),
                    u32s(n_k),
                    u32s(n_v),
                    u32s(cd),
                    u32s(d),
                    u32s(ch0),
                ],
            );
            dev.launch(
                Kernel::GdnChunkScan { d: ds },
                Grid::Dims([n_v as u32, col_blocks, 1]),
                &[
                    pooled(&u),
                    pooled(&gam),
                    pooled(&uw),
                    pooled(&pm),
                    ssm,
                    out.view(),
                ],
                &[
                    u32s(rows),
                    u32s(n_k),
                    u32s(n_v),
                    u32s(cd),
                    u32s(ch0),
                    u32s(n),
                ],
            );
            ch0 += n;
        }
    } else {
        dev.launch(
            Kernel::GdnStep { d: ds },
            Grid::Dims([n_v as u32, col_blocks, 1]),
            &[
                pooled(&u),
                b.view(),
                a.view(),
                dt_bias,
                ssm_a,
                ssm,
                out.view(),
            ],
            &[u32s(rows), u32s(n_k), u32s(n_v), u32s(cd)],
        );
    }

    // 3. gated RMSNorm in place.
    let n = rows * n_v;
    dev.launch(
        Kernel::GdnGatedNorm,
        Grid::Linear(n),
        &[out.view(), z.view(), norm_w],
        &[u32s(n), u32s(d), Scalar::F(p.eps)],
    );
    out
}
