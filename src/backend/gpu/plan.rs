//! Plans and shape checks of the GPU ops: the work split of the attention kernels, the cache
//! row layout, the geometry each kernel family accepts, and the launch plan of the Hadamard
//! fold.

use super::kernels::consts::{FWHT_CHUNK, MAX_CHUNKS, MAX_HD, TARGET_GROUPS, TILE};
use crate::backend::{AttnParams, BackendError, GdnParams, KvTypes};
use crate::quant::hadamard::GdnPermutation;
use crate::tensor::GgmlType;

/// (chunks, positions per chunk) for `tiles` query tiles over at most `n_ctx` positions.
pub fn plan_chunks(tiles: usize, n_ctx: usize) -> (usize, usize) {
    let tile = TILE as usize;
    let want = TARGET_GROUPS.div_ceil(tiles);
    let n = want.clamp(1, n_ctx.div_ceil(tile)).min(MAX_CHUNKS as usize);
    let len = n_ctx.div_ceil(n).div_ceil(tile) * tile;
    (n_ctx.div_ceil(len), len)
}

/// u32 words of one cache row of `width` elements stored as `ty` (the kernels address words).
pub fn kv_row_words(ty: GgmlType, width: usize) -> usize {
    (ty.row_bytes(width as u64).expect("whole blocks") as usize).div_ceil(4)
}

/// The cache geometry the attention kernels accept; returns the row width.
pub fn check_kv(p: &AttnParams, types: KvTypes) -> Result<usize, BackendError> {
    types.check()?;
    let bad = |what: String| BackendError::BadWeight {
        name: "KV cache".into(),
        what,
    };
    let hd = p.head_dim;
    for t in [types.k, types.v] {
        // The kernels read whole blocks (and whole f16 pairs) per head, so rows are whole
        // blocks too.
        if !hd.is_multiple_of(t.block_size()) || !hd.is_multiple_of(2) {
            return Err(bad(format!("head_dim {hd} does not hold whole {t} blocks")));
        }
    }
    if hd == 0 || hd > MAX_HD as usize || p.n_rot > hd || !p.n_rot.is_multiple_of(2) {
        return Err(bad(format!(
            "head_dim {hd} / n_rot {} outside the kernels' range (even, head_dim <= {MAX_HD})",
            p.n_rot
        )));
    }
    if p.n_head_kv == 0 || !p.n_head.is_multiple_of(p.n_head_kv) {
        return Err(bad(format!(
            "{} query heads do not group over {} kv heads",
            p.n_head, p.n_head_kv
        )));
    }
    Ok(p.n_head_kv * hd)
}

/// The shapes `attention` is called with: `qg`, `k`, `v` as (rows, cols), the cache's row
/// width and length, and the q/k norm lengths.
#[allow(clippy::too_many_arguments)]
pub fn check_attention(
    p: &AttnParams,
    qg: (usize, usize),
    k: (usize, usize),
    v: (usize, usize),
    kv_width: usize,
    kv_len: usize,
    pos0: usize,
    norms: (usize, usize),
) {
    let hd = p.head_dim;
    let (rows, width) = (qg.0, p.n_head_kv * hd);
    assert_eq!(qg.1, 2 * p.n_head * hd, "attention: qg width");
    assert_eq!(k, (rows, width), "attention: k shape");
    assert_eq!(v, (rows, width), "attention: v shape");
    assert_eq!(kv_width, width, "attention: cache row width");
    assert_eq!(
        kv_len, pos0,
        "attention: cache holds {kv_len} positions, batch starts at {pos0}"
    );
    assert_eq!(norms.0, hd, "attention: q_norm width");
    assert_eq!(norms.1, hd, "attention: k_norm width");
}

/// Which form of the recurrence `gdn_with` runs.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum GdnForm {
    /// Chunked when there is more than one row and the geometry allows it, else recurrent.
    Auto,
    /// Token by token, any geometry.
    Recurrent,
    /// Chunks of 64 tokens; needs `d % 16 == 0` (see `chunked_supported`).
    Chunked,
    /// The chunked form with at most this many chunks per launch pair, the state carried
    /// between them (long inputs are split this way to bound the scratch; tests force it).
    ChunkedIn(usize),
}

/// The shapes `gdn` is called with: `mixed`, `z`, `b`, `a` as (rows, cols) and the state's
/// conv and SSM lengths.
pub fn check_gdn(
    p: &GdnParams,
    mixed: (usize, usize),
    z: (usize, usize),
    b: (usize, usize),
    a: (usize, usize),
    state: (usize, usize),
) {
    let (cd, d, n_k, n_v) = (p.conv_dim(), p.d, p.n_k, p.n_v);
    let rows = mixed.0;
    assert_eq!(mixed.1, cd, "gdn: mixed width");
    assert_eq!(z, (rows, n_v * d), "gdn: z shape");
    assert_eq!(b, (rows, n_v), "gdn: b shape");
    assert_eq!(a, (rows, n_v), "gdn: a shape");
    assert_eq!(
        state,
        (p.conv_state_len(), p.ssm_state_len()),
        "gdn: state geometry"
    );
    assert!(p.d_conv >= 1 && n_k >= 1 && n_v >= 1 && d >= 1);
}

/// How the fold kernels run over rows of `width`: the shared-memory FWHT over `chunk`
/// elements, then global stages when the block is wider (`whole` false).
#[derive(Clone, Copy, Debug)]
pub struct FoldPlan {
    pub perm: Option<GdnPermutation>,
    pub chunk: usize,
    pub whole: bool,
    /// bit 0: permute first; bit 1: ⊙ s before the FWHT; bit 2: ⊙ s after it (inverse rule,
    /// when the in-memory FWHT is the whole transform; otherwise the last stage applies it).
    pub flags: u32,
    /// The permutation's (head size, K heads, repeat), (1, 1, 1) without one.
    pub hd: usize,
    pub nk: usize,
    pub rep: usize,
    /// Exactly the CPU's scale (hadamard::fwht_normalized).
    pub scale: f32,
    block: usize,
    inverse_signs: bool,
}

impl FoldPlan {
    /// The forward rule (GDN permutation, ⊙ s, blockwise FWHT) or, with `inverse`, the
    /// inverse rule (blockwise FWHT, ⊙ s).
    pub fn new(
        block: usize,
        width: usize,
        perm: Option<GdnPermutation>,
        signs: bool,
        inverse: bool,
    ) -> FoldPlan {
        assert!(
            block.is_power_of_two() && width.is_multiple_of(block),
            "Hadamard fold: width {width} is not a multiple of the block {block}"
        );
        let perm = if inverse {
            None
        } else {
            perm.filter(|p| !p.is_identity())
        };
        if let Some(p) = &perm {
            assert_eq!(p.len(), width, "GDN permutation: length");
        }
        let chunk = block.min(FWHT_CHUNK as usize);
        let whole = block <= FWHT_CHUNK as usize;
        let mut flags = 0u32;
        if perm.is_some() {
            flags |= 1;
        }
        if signs {
            flags |= match (inverse, whole) {
                (false, _) => 2,
                (true, true) => 4,
                // Applied by the last global stage.
                (true, false) => 0,
            };
        }
        let (hd, nk, rep) = perm.map_or((1, 1, 1), |p| (p.hd, p.nk, p.rep));
        FoldPlan {
            perm,
            chunk,
            whole,
            flags,
            hd,
            nk,
            rep,
            scale: 1.0 / (block as f32).sqrt(),
            block,
            inverse_signs: inverse && signs,
        }
    }

    /// The global stages after the in-memory FWHT, as (half-length, flags): the last one
    /// applies the inverse rule's ⊙ s.
    pub fn stages(&self) -> Vec<(usize, u32)> {
        let mut out = Vec::new();
        let mut len = self.chunk;
        while len < self.block {
            let last = 2 * len == self.block;
            out.push((len, if last && self.inverse_signs { 4 } else { 0 }));
            len *= 2;
        }
        out
    }
}
