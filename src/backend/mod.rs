//! The op set every backend implements. The model is written once against this trait; a
//! backend knows tensors and ops, never the model.
//!
//! Activations are row-major `[rows, cols]` f32 tensors (one row per token). Weights are
//! uploaded once from their GGUF view and keep their stored dtype: a quantized weight is never
//! expanded to f32 in memory, and a Hadamard-folded weight carries its fold, so `matmul` cannot
//! consume it without the activation transform.

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod gpu;
pub mod pick;
pub mod wgpu;

use std::sync::Arc;

use crate::gguf::{Gguf, TensorInfo};
use crate::quant::hadamard::{GdnPermutation, HadamardConfig};
use crate::tensor::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("tensor {name:?}: type {ty} has no kernel in the {backend} backend")]
    UnsupportedType {
        name: String,
        ty: GgmlType,
        backend: &'static str,
    },
    #[error("tensor {name:?}: {what}")]
    BadWeight { name: String, what: String },
    #[error("backend {0:?} is not available: {1}")]
    Unavailable(String, String),
}

/// How a folded weight's input must be transformed before the product (format-pq2_0.md §5).
#[derive(Clone, Debug)]
pub struct Fold {
    pub hadamard: Arc<HadamardConfig>,
    /// Set for `ssm_out` when `gdn_v_grouped`: the activation arrives in tiled V order and the
    /// weight's columns are in grouped order.
    pub perm: Option<GdnPermutation>,
}

impl Fold {
    /// Applies the forward rule to one input row in place (`x` has the weight's ne0 width).
    pub fn apply(&self, x: &mut [f32], scratch: &mut Vec<f32>) {
        if let Some(p) = &self.perm {
            scratch.clear();
            scratch.resize(x.len(), 0.0);
            p.tiled_to_grouped(x, scratch);
            x.copy_from_slice(scratch);
        }
        self.hadamard.forward_in_place(x);
    }
}

/// A weight as the model asks for it: the GGUF view plus its transform. `Weights` builds these
/// with the fold already attached, so no caller can forget it.
#[derive(Clone)]
pub struct WeightSource {
    pub file: Arc<Gguf>,
    pub info: TensorInfo,
    pub fold: Option<Fold>,
    /// Embedding tables stored with the inverse rule (`h = s ⊙ H z` after the lookup).
    pub inverse: Option<Arc<HadamardConfig>>,
}

impl WeightSource {
    pub fn name(&self) -> &str {
        &self.info.name
    }
    pub fn bytes(&self) -> &[u8] {
        self.file.tensor_data(&self.info)
    }
    /// Small 1-D weights (norms, biases, decays) and conv taps: every backend decodes these to
    /// f32 once at upload instead of keeping the stored blocks.
    pub fn decode_once(&self) -> bool {
        let (ne0, rows) = self.shape2();
        rows == 1 || self.info.dims.len() == 1 || (ne0 * rows <= 1 << 16 && ne0 <= 8)
    }

    /// The lengths of the ±1 sign vectors the weight's Hadamard rules use at its input width
    /// (fold, then inverse), which a GPU backend uploads beside it.
    pub fn sign_vectors(&self) -> Vec<usize> {
        let ne0 = self.shape2().0;
        self.fold
            .as_ref()
            .map(|f| &f.hadamard)
            .into_iter()
            .chain(self.inverse.as_ref())
            .filter_map(|h| h.signs(ne0).map(<[f32]>::len))
            .collect()
    }

    /// The weight decoded to f32 (what `decode_once` weights are kept as).
    pub fn decoded(&self) -> Result<Vec<f32>, BackendError> {
        let (ne0, rows) = self.shape2();
        let mut out = vec![0f32; ne0 * rows];
        crate::quant::dequantize_row(self.info.ty, self.bytes(), &mut out).map_err(|e| {
            BackendError::BadWeight {
                name: self.info.name.clone(),
                what: e.to_string(),
            }
        })?;
        Ok(out)
    }

    /// (ne0, rows): input width and output count of a matrix.
    pub fn shape2(&self) -> (usize, usize) {
        (self.info.ne0() as usize, self.info.n_rows() as usize)
    }
}

/// Geometry of a gated full-attention layer.
#[derive(Copy, Clone, Debug)]
pub struct AttnParams {
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub rope_base: f32,
    pub rope_sections: [i32; 4],
    pub eps: f32,
    pub scale: f32,
}

/// Element types of an attention cache, chosen separately for K and V.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct KvTypes {
    pub k: GgmlType,
    pub v: GgmlType,
}

impl Default for KvTypes {
    fn default() -> Self {
        KvTypes {
            k: GgmlType::F32,
            v: GgmlType::F32,
        }
    }
}

impl KvTypes {
    /// The cache dtypes tern supports: f32, f16, bf16, q8_0, q4_0.
    pub fn check(&self) -> Result<(), BackendError> {
        for (which, t) in [("K", self.k), ("V", self.v)] {
            if !matches!(
                t,
                GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0 | GgmlType::Q4_0
            ) {
                return Err(BackendError::BadWeight {
                    name: format!("{which} cache"),
                    what: format!("type {t} is not a KV cache type (f32, f16, bf16, q8_0, q4_0)"),
                });
            }
        }
        Ok(())
    }
}

/// Geometry of a Gated DeltaNet layer.
#[derive(Copy, Clone, Debug)]
pub struct GdnParams {
    pub n_k: usize,
    pub n_v: usize,
    /// d_k = d_v = ssm.state_size.
    pub d: usize,
    pub d_conv: usize,
    pub eps: f32,
}

impl GdnParams {
    pub fn conv_dim(&self) -> usize {
        2 * self.n_k * self.d + self.n_v * self.d
    }
    pub fn conv_state_len(&self) -> usize {
        (self.d_conv - 1) * self.conv_dim()
    }
    pub fn ssm_state_len(&self) -> usize {
        self.n_v * self.d * self.d
    }
}

/// The weights a GDN layer's core consumes besides its projections.
pub struct GdnWeights<'a, W> {
    pub conv: &'a W,
    pub dt_bias: &'a W,
    pub ssm_a: &'a W,
    pub norm: &'a W,
}

/// One sequence's share of [`Backend::attention_batch`]: its row count, its cache, the cache
/// position its rows start at and their rope table.
pub struct AttnSeq<'a, Kv> {
    pub rows: usize,
    pub kv: &'a mut Kv,
    pub pos0: usize,
    pub rope: &'a [f32],
}

/// One sequence's share of [`Backend::gdn_batch`]: its row count, its live recurrent state and,
/// for a verify batch, the rollback cells (at least `rows - 1`): afterwards the live state
/// stands for the state after the last row and cell t, restored by
/// [`Backend::recurrent_restore`], for the state after row t. A cell may hold that state (the
/// GPU backends) or only what restoring it needs (the CPU keeps the rows' rank-1 updates, see
/// `cpu::gdn::Pending`).
pub struct GdnSeq<'a, Rs> {
    pub rows: usize,
    pub state: &'a mut Rs,
    pub cells: Option<&'a mut [Rs]>,
}

/// What a backend holds for one uploaded weight. `mapped` is the file's own bytes used in
/// place (the CPU reads the mapping), counted once per tensor however many uses share it;
/// `owned` is what the backend allocated for this use alone (device copies, decoded f32
/// copies, sign tables); `shared` is an allocation every use of the tensor shares (the CPU's
/// packed Q8_0, PQ2_0 and PTQ1_0 rows, `quant::packed`: the tied output head and the draft head's
/// first rows read the embedding table's one copy), counted once per tensor at its largest use.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct WeightBytes {
    pub tensor: String,
    pub mapped: u64,
    pub owned: u64,
    pub shared: u64,
}

/// Takes the weights the model loader hands over: a backend uploads them, the planner prices
/// them with the backend's allocation rule.
pub trait Uploader {
    type W;
    fn upload(&self, w: &WeightSource) -> Result<Self::W, BackendError>;
}

impl<B: Backend> Uploader for B {
    type W = B::W;
    fn upload(&self, w: &WeightSource) -> Result<B::W, BackendError> {
        Backend::upload(self, w)
    }
}

/// Sums `WeightBytes` with the mapped part counted once per tensor, and the shared part once
/// per tensor at its largest use.
#[derive(Clone, Debug, Default)]
pub struct WeightTally {
    seen: std::collections::BTreeSet<String>,
    shared_by: std::collections::BTreeMap<String, u64>,
    pub mapped: u64,
    pub owned: u64,
    pub shared: u64,
    pub count: usize,
}

impl WeightTally {
    pub fn add(&mut self, b: WeightBytes) {
        if b.shared > 0 {
            let s = self.shared_by.entry(b.tensor.clone()).or_default();
            if b.shared > *s {
                self.shared = self.shared - *s + b.shared;
                *s = b.shared;
            }
        }
        if self.seen.insert(b.tensor) {
            self.mapped = self.mapped.saturating_add(b.mapped);
        }
        self.owned = self.owned.saturating_add(b.owned);
        self.count += 1;
    }
    pub fn total(&self) -> u64 {
        self.mapped
            .saturating_add(self.owned)
            .saturating_add(self.shared)
    }
}

/// The op trait. `T` is an activation tensor resident on the backend, `W` an uploaded weight,
/// `Kv` one layer's attention cache and `Rs` one layer's recurrent state.
pub trait Backend: Send + Sync {
    type T: Send;
    type W: Send + Sync;
    type Kv: Send;
    type Rs: Send;

    fn name(&self) -> &'static str;

    /// Runs `f`, a whole forward step of many ops, where the backend's ops run best. The CPU
    /// backend runs it on a worker of its rayon pool with the other workers kept busy-waiting
    /// for the step's jobs until it ends (cpu/step.rs): ~140 parallel regions a decode step,
    /// each of which would otherwise park and wake threads (tens of µs on a VM). Others run
    /// `f` here.
    fn run_step<R: Send>(f: impl FnOnce() -> R + Send) -> R
    where
        Self: Sized,
    {
        f()
    }

    fn upload(&self, w: &WeightSource) -> Result<Self::W, BackendError>;
    /// What `upload` allocated for `w` (the boot ledger's weights line).
    fn weight_bytes(&self, w: &Self::W) -> WeightBytes;
    #[allow(clippy::wrong_self_convention)]
    fn from_host(&self, data: &[f32], rows: usize, cols: usize) -> Self::T;
    fn to_host(&self, t: &Self::T) -> Vec<f32>;
    /// Copies rows `[start, start + n)` of `t`.
    fn rows(&self, t: &Self::T, start: usize, n: usize) -> Self::T;
    /// The rows named by `runs` of `(first row, count)`, in order, as one tensor (a batch's
    /// output rows).
    fn gather_rows(&self, t: &Self::T, runs: &[(usize, usize)]) -> Self::T;
    fn concat_cols(&self, a: &Self::T, b: &Self::T) -> Self::T;
    /// Stacks row blocks (all with the same column count).
    fn concat_rows(&self, parts: &[&Self::T]) -> Self::T;

    /// Row lookup; applies the inverse Hadamard rule when the table carries one.
    fn embed(&self, table: &Self::W, ids: &[u32]) -> Self::T;
    fn rms_norm(&self, x: &Self::T, w: &Self::W, eps: f32) -> Self::T;
    /// `y[r] = W · x[r]` for every row, with the fold's transform on the input when folded.
    fn matmul(&self, w: &Self::W, x: &Self::T) -> Self::T;
    /// `matmul` of one input by several weights (q/k/v, the GDN projections, ffn gate/up):
    /// the fold's transform of the shared input runs once for the weights that share a fold.
    fn matmul_many(&self, ws: &[&Self::W], x: &Self::T) -> Vec<Self::T>;
    fn add_assign(&self, x: &mut Self::T, y: &Self::T);
    /// `y[r] += scales[r] * x[r]` for every row: a LoRA adapter's term, each row with the
    /// scale its sequence asked for (the product rounded, then the sum, as llama.cpp).
    fn add_scaled_rows(&self, y: &mut Self::T, x: &Self::T, scales: &[f32]);
    /// `silu(gate) ⊙ up`.
    fn swiglu(&self, gate: &Self::T, up: &Self::T) -> Self::T;

    /// An empty attention cache for one layer of one sequence, K and V in the given dtypes.
    fn new_kv(&self, p: &AttnParams, types: KvTypes) -> Result<Self::Kv, BackendError>;
    fn kv_len(&self, kv: &Self::Kv) -> usize;
    /// Bytes the cache holds now (both K and V, as allocated).
    fn kv_bytes(&self, kv: &Self::Kv) -> u64;
    /// Allocates room for `positions` positions now (a slot's whole window, at boot), so that
    /// decoding never allocates cache memory and `kv_bytes` reports what the planner priced.
    /// A cache already holding more positions is left as it is.
    fn kv_reserve(&self, kv: &mut Self::Kv, positions: usize) -> Result<(), BackendError>;
    /// Drops cached positions `>= len` (rollback and prefix reuse).
    fn kv_truncate(&self, kv: &mut Self::Kv, len: usize);
    /// Makes `to` hold what `from` holds (same geometry and dtypes): the runtime forks one
    /// prompt's state into the slots of a request's other choices (`n > 1`).
    fn kv_copy(&self, from: &Self::Kv, to: &mut Self::Kv);
    /// The gated attention core for rows at cache indices `pos0..pos0+rows`: splits `qg` into q
    /// and gate per head, q/k RMSNorm, partial NEOX (IMROPE) RoPE by `rope` (the rows' `(sin,
    /// cos)` table from [`rope_table`] / [`rope_table_at`]: a row's M-RoPE position need not be
    /// its cache index once an image has run), appends k/v to the cache, causal grouped-GQA
    /// softmax attention in cache order, sigmoid gate. Returns `[rows, n_head*head_dim]` (the
    /// input of `attn_output`).
    #[allow(clippy::too_many_arguments)]
    fn attention(
        &self,
        p: &AttnParams,
        qg: &Self::T,
        k: &Self::T,
        v: &Self::T,
        q_norm: &Self::W,
        k_norm: &Self::W,
        kv: &mut Self::Kv,
        pos0: usize,
        rope: &[f32],
    ) -> Self::T;

    /// [`Backend::attention`] over several sequences at once, each on its own cache: `qg`, `k`
    /// and `v` hold every sequence's rows, one sequence after another; returns the outputs in
    /// the same order. Backends that run the sequences in one pass override this; the default
    /// runs them one after another.
    #[allow(clippy::too_many_arguments)]
    fn attention_batch(
        &self,
        p: &AttnParams,
        qg: &Self::T,
        k: &Self::T,
        v: &Self::T,
        q_norm: &Self::W,
        k_norm: &Self::W,
        seqs: &mut [AttnSeq<'_, Self::Kv>],
    ) -> Self::T {
        if let [s] = seqs {
            return self.attention(p, qg, k, v, q_norm, k_norm, s.kv, s.pos0, s.rope);
        }
        let mut outs = Vec::new();
        let mut at = 0;
        for s in seqs.iter_mut() {
            let [q, kk, vv] = [qg, k, v].map(|t| self.rows(t, at, s.rows));
            at += s.rows;
            outs.push(self.attention(p, &q, &kk, &vv, q_norm, k_norm, s.kv, s.pos0, s.rope));
        }
        self.concat_rows(&outs.iter().collect::<Vec<_>>())
    }

    fn new_recurrent(&self, p: &GdnParams) -> Self::Rs;
    fn recurrent_copy(&self, from: &Self::Rs, to: &mut Self::Rs);
    /// Makes `live` the state that rollback cell `cell` of the last snapshot batch stands for
    /// (`GdnSeq::cells`); the cell is scratch afterwards. Where a cell holds a whole state the
    /// two trade places, so nothing is copied.
    fn recurrent_restore(&self, live: &mut Self::Rs, cell: &mut Self::Rs) {
        std::mem::swap(live, cell)
    }
    /// Bytes of one recurrent state (conv + SSM).
    fn recurrent_bytes(&self, rs: &Self::Rs) -> u64;
    /// The Gated DeltaNet core over consecutive tokens of one sequence: causal conv with the
    /// carried state, SiLU, L2 norm, decay and delta rule, gated RMSNorm. Inputs are the
    /// projections `mixed` (conv_dim), `z` (n_v*d), `b` and `a` (n_v). Returns `[rows, n_v*d]`
    /// in tiled V order (the input of `ssm_out`).
    #[allow(clippy::too_many_arguments)]
    fn gdn(
        &self,
        p: &GdnParams,
        mixed: &Self::T,
        z: &Self::T,
        b: &Self::T,
        a: &Self::T,
        w: &GdnWeights<'_, Self::W>,
        state: &mut Self::Rs,
    ) -> Self::T;

    /// [`Backend::gdn`] over several sequences at once: `mixed`, `z`, `b` and `a` hold every
    /// sequence's rows, one sequence after another; returns the outputs in the same order. A
    /// sequence with `cells` (a verify batch) leaves the state after each of its rows but the
    /// last in those cells, so a rejected suffix rolls back by taking a cell. Backends that run
    /// the sequences in one pass override this; the default runs them one after another (a
    /// sequence with cells one row at a time, copying the state after each).
    #[allow(clippy::too_many_arguments)]
    fn gdn_batch(
        &self,
        p: &GdnParams,
        mixed: &Self::T,
        z: &Self::T,
        b: &Self::T,
        a: &Self::T,
        w: &GdnWeights<'_, Self::W>,
        seqs: &mut [GdnSeq<'_, Self::Rs>],
    ) -> Self::T {
        if let [s] = seqs {
            if s.cells.is_none() {
                return self.gdn(p, mixed, z, b, a, w, s.state);
            }
        }
        let mut outs = Vec::new();
        let mut at = 0;
        for s in seqs.iter_mut() {
            let steps = match s.cells {
                Some(_) => vec![1; s.rows],
                None => vec![s.rows],
            };
            for (r, n) in steps.into_iter().enumerate() {
                let part = [mixed, z, b, a].map(|t| self.rows(t, at, n));
                at += n;
                let [m, zz, bb, aa] = &part;
                outs.push(self.gdn(p, m, zz, bb, aa, w, s.state));
                if let Some(cells) = s.cells.as_deref_mut().filter(|_| r + 1 < s.rows) {
                    self.recurrent_copy(s.state, &mut cells[r]);
                }
            }
        }
        self.concat_rows(&outs.iter().collect::<Vec<_>>())
    }

    fn argmax_rows(&self, x: &Self::T) -> Vec<u32>;

    /// Row `row` of `x`'s argmax (as `argmax_rows`) and its first non-finite value as
    /// `(index, value)`, read in one pass where the row lies; `None` on a backend whose rows
    /// are not host memory, where a caller reads the row back or takes `argmax_rows`. Plain
    /// greedy sampling on the CPU checked each logits row in a copy, then found its argmax
    /// in a second pass: three passes over a megabyte per stream and token.
    fn argmax_checked(&self, _x: &Self::T, _row: usize) -> Option<(u32, Option<(usize, f32)>)> {
        None
    }

    /// `t` cut into consecutive runs of `counts` rows (summing to its rows), as `rows` would
    /// copy them; a backend may move the data instead (the CPU keeps the first run in `t`'s
    /// buffer).
    fn split_rows(&self, t: Self::T, counts: &[usize]) -> Vec<Self::T> {
        let mut at = 0;
        counts
            .iter()
            .map(|&n| {
                let part = self.rows(&t, at, n);
                at += n;
                part
            })
            .collect()
    }

    /// LayerNorm with weight and bias over each row (the vision tower's ln1/ln2/post_ln), as
    /// `ggml_norm` then `ggml_mul`, `ggml_add`: mean and variance of the row, then
    /// `((x - mean) * scale) * w + b` with `scale = 1 / sqrt(var + eps)`, each step rounded to
    /// f32. `w` and `b` are 1-D weights of the row's width.
    fn layer_norm(&self, x: &Self::T, w: &Self::W, b: &Self::W, eps: f32) -> Self::T;
    /// `x[r][c] += b[c]` (the bias of every tower matmul; `b` is a 1-D weight of x's width).
    fn add_bias(&self, x: &mut Self::T, b: &Self::W);
    /// GELU as ggml's CPU backend evaluates it on f32 (`ggml_vec_gelu_f32` with
    /// `GGML_GELU_FP16`): 0 at or below -10, `x` at or above 10, otherwise the tanh form looked
    /// up at `x` rounded to f16 and itself rounded to f16 ([`gelu_f16_table`]).
    fn gelu(&self, x: &Self::T) -> Self::T;
    /// The same data read as `[rows, cols]` (row-major, `rows * cols` unchanged): the 2x2
    /// merge of four consecutive patch rows into one row of 4x the width. No data moves.
    fn reshape(&self, t: Self::T, rows: usize, cols: usize) -> Self::T;
    /// Full (non-causal) multi-head attention of the vision tower over one image. `qkv` is
    /// `[n, 3 * n_head * head_dim]` (q | k | v, bias already added); q and k get NEOX rotary
    /// (pairs `(j, j + head_dim/2)`) from `rope`, `n * head_dim/2` `(sin, cos)` pairs as
    /// [`vision_rope_table`] makes them; then softmax(q·k / sqrt(head_dim)) v per head.
    /// Returns `[n, n_head * head_dim]`. GPU backends run it flash-style (online softmax over
    /// key tiles), so no `n x n` score matrix is ever stored.
    fn vision_attention(
        &self,
        qkv: &Self::T,
        n_head: usize,
        head_dim: usize,
        rope: &[f32],
    ) -> Self::T;

    /// Bytes the backend holds for activations and scratch now, when it pools them (a GPU's
    /// buffer pool); `None` when they live on the heap (the CPU), where the boot ledger
    /// measures the heap instead.
    fn compute_bytes(&self) -> Option<u64>;
}

/// `(sin θ, cos θ)` for every (row, rotated pair) of a RoPE'd batch of text at positions
/// `pos0..`: each row at M-RoPE position `(p, p, p, 0)` ([`rope_table_at`]). GPU backends upload
/// this table rather than evaluate sin/cos of angles up to the context length, which shader
/// sin/cos do not promise to do accurately.
pub fn rope_table(
    pos0: usize,
    rows: usize,
    n_rot: usize,
    base: f32,
    sections: [i32; 4],
) -> Vec<f32> {
    let pos: Vec<[u32; 4]> = (0..rows)
        .map(|t| {
            let p = (pos0 + t) as u32;
            [p, p, p, 0]
        })
        .collect();
    rope_table_at(&pos, n_rot, base, sections)
}

/// `(sin θ, cos θ)` for every (row, rotated pair) at explicit M-RoPE positions `[t, h, w, e]`
/// (an image token is `[p0, p0 + row, p0 + col, 0]`, text `[p, p, p, 0]`), as the CPU
/// reference computes them: each of the four streams multiplied up by base^(-2/n_rot) in f32
/// once per pair (ggml's `ggml_mrope_cache_init`), and pair i takes stream t, h or w by the
/// IMROPE sector rule (sector i mod Σsections, inside 3·section), the 4th stream otherwise.
pub fn rope_table_at(pos: &[[u32; 4]], n_rot: usize, base: f32, sections: [i32; 4]) -> Vec<f32> {
    let half = n_rot / 2;
    let theta_scale = base.powf(-2.0 / n_rot as f32);
    let sect_dims: i32 = sections.iter().sum();
    let mut out = Vec::with_capacity(pos.len() * half * 2);
    for p in pos {
        let mut th = p.map(|x| x as f32);
        for i in 0..half {
            let stream = if sect_dims <= 0 {
                0
            } else {
                let s = (i as i32) % sect_dims;
                if s % 3 == 1 && s < 3 * sections[1] {
                    1
                } else if s % 3 == 2 && s < 3 * sections[2] {
                    2
                } else if s % 3 == 0 && s < 3 * sections[0] {
                    0
                } else {
                    3
                }
            };
            let (sin, cos) = th[stream].sin_cos();
            out.push(sin);
            out.push(cos);
            for t in &mut th {
                *t *= theta_scale;
            }
        }
    }
    out
}

/// The shapes `Backend::vision_attention` takes, checked once for every backend: `qkv` is
/// `[n, 3 * n_head * hd]`, `hd` even (NEOX pairs), `rope` a (sin, cos) per row and pair.
pub fn check_vision_attention(qkv_cols: usize, n: usize, n_head: usize, hd: usize, rope: usize) {
    assert_eq!(
        qkv_cols,
        3 * n_head * hd,
        "vision_attention: qkv has {qkv_cols} columns, not 3 x {n_head} heads x {hd}"
    );
    assert!(
        hd > 0 && hd.is_multiple_of(2),
        "vision_attention: head_dim {hd} is not even (NEOX pairs)"
    );
    assert_eq!(
        rope,
        n * hd,
        "vision_attention: the rope table has {rope} values, not (sin, cos) for {n} x {} pairs",
        hd / 2
    );
}

/// `(sin θ, cos θ)` for every (patch, rotated pair `j < head_dim/2`) of the vision tower's
/// 2-D rotary (model-vision.md §3), as ggml's `GGML_ROPE_TYPE_VISION` rope computes them
/// (`ggml_mrope_cache_init` with independent sections, `clip.cpp`'s positions). Patches come
/// in the tower's token order: 2x2 merge blocks in row-major order, inside a block (0,0)
/// (0,1) (1,0) (1,1). Each patch has positions `[row, col, row, col]`; with
/// `s = θ^(-4/head_dim)` (`powf(θ, -2/n_dims)`, `n_dims = head_dim/2`), pair j rotates by
/// `row · s^j` for `j < head_dim/4` and by `col · s^(j - head_dim/4)` above, each power
/// multiplied up in f32 one step at a time from the section's start, as ggml does.
///
/// `grid_rows` and `grid_cols` are the patch grid (even: whole merge blocks); `head_dim` is a
/// multiple of 4 (ggml's vision rope asserts an even `n_dims`).
pub fn vision_rope_table(
    grid_rows: usize,
    grid_cols: usize,
    head_dim: usize,
    theta: f32,
) -> Vec<f32> {
    assert!(
        grid_rows.is_multiple_of(2) && grid_cols.is_multiple_of(2),
        "vision rope: a {grid_rows}x{grid_cols} patch grid is not whole 2x2 merge blocks"
    );
    assert!(
        head_dim > 0 && head_dim.is_multiple_of(4),
        "vision rope: head_dim {head_dim} is not a multiple of 4"
    );
    let (half, sect) = (head_dim / 2, head_dim / 4);
    let theta_scale = theta.powf(-2.0 / half as f32);
    let mut out = Vec::with_capacity(grid_rows * grid_cols * head_dim);
    for y in (0..grid_rows).step_by(2) {
        for x in (0..grid_cols).step_by(2) {
            for (dy, dx) in [(0, 0), (0, 1), (1, 0), (1, 1)] {
                let (row, col) = ((y + dy) as f32, (x + dx) as f32);
                // ggml keeps one running angle per section, all multiplied every step, and
                // resets a section's angle to its position where the section starts.
                let (mut t_row, mut t_col) = (row, col);
                for j in 0..half {
                    if j == 0 {
                        t_row = row;
                    } else if j == sect {
                        t_col = col;
                    }
                    let a = if j < sect { t_row } else { t_col };
                    out.push(a.sin());
                    out.push(a.cos());
                    t_row *= theta_scale;
                    t_col *= theta_scale;
                }
            }
        }
    }
    out
}

/// ggml's tanh-form GELU of one f32 (`ggml_gelu_f32`), in its order of operations and with
/// the one fused multiply-add an x86-64 build with FMA makes of it (`1 + (A·x)·x`): without it
/// the table differs from that build's in one entry (x = -1.999).
fn gelu_tanh(x: f32) -> f32 {
    const GELU_COEF_A: f32 = 0.044715;
    #[allow(clippy::excessive_precision)]
    const SQRT_2_OVER_PI: f32 = 0.797_884_560_802_865_355_879_892_119_868_76;
    0.5 * x * (1.0 + (SQRT_2_OVER_PI * x * (GELU_COEF_A * x).mul_add(x, 1.0)).tanh())
}

/// ggml-cpu's `ggml_table_gelu_f16`: for every f16 bit pattern h, the f16 bits of
/// `gelu_tanh(h)`. GELU on f32 reads it at the input rounded to f16 (round to nearest even,
/// as F16C's `_cvtss_sh`), so every backend that uses this table returns ggml's bits.
pub fn gelu_f16_table() -> &'static [u16] {
    static TABLE: std::sync::OnceLock<Vec<u16>> = std::sync::OnceLock::new();
    TABLE.get_or_init(|| {
        (0..=u16::MAX)
            .map(|h| {
                let x = half::f16::from_bits(h);
                if x.is_nan() {
                    // ggml's entries for NaN inputs are the quiet NaN of the input's sign.
                    (h & 0x8000) | 0x7e00
                } else {
                    half::f16::from_f32(gelu_tanh(x.to_f32())).to_bits()
                }
            })
            .collect()
    })
}

/// GELU of one f32 as ggml's CPU backend computes it (see [`Backend::gelu`]).
pub fn gelu_ggml(x: f32) -> f32 {
    if x <= -10.0 {
        0.0
    } else if x >= 10.0 {
        x
    } else {
        half::f16::from_bits(gelu_f16_table()[half::f16::from_f32(x).to_bits() as usize]).to_f32()
    }
}

/// NMSE = Σ(a−b)² / Σb², the comparison measure of goldens.md.
pub fn nmse(a: &[f32], b: &[f32]) -> f64 {
    assert_eq!(a.len(), b.len());
    let mut num = 0f64;
    let mut den = 0f64;
    for (&x, &y) in a.iter().zip(b) {
        num += (x as f64 - y as f64).powi(2);
        den += (y as f64).powi(2);
    }
    if den == 0.0 {
        if num == 0.0 {
            0.0
        } else {
            f64::INFINITY
        }
    } else {
        num / den
    }
}
