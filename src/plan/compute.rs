//! The compute/scratch estimate.
//!
//! No backend exposes an allocation plan yet, so the compute buffers are priced by an explicit
//! formula and every such line is marked *estimated*. Once a backend reports what its graph
//! allocates for a ubatch, that figure replaces this one (the ledger and the allocator must
//! share one source of truth). All activations are f32 (4 B).
//!
//! With `rows = min(ubatch-size, batch-size)` (one ubatch in flight; layers run one after the
//! other, so only the widest layer's intermediates are live at once):
//!
//! ```text
//! attn_w  = 2·n_head·hd (q | gate) + 2·n_head_kv·hd (k, v) + n_head·hd (attention out)
//! gdn_w   = 2·conv_dim (qkv before and after the conv) + 2·inner (z, core out) + 2·n_v (β, α)
//! ffn_w   = 3·n_ff (gate, up, gate·up)
//! row     = 3·n_embd (residual, normed input, block output) + max(attn_w, gdn_w, ffn_w)
//! acts    = rows · row · 4
//! scores  = rows · n_head · ATTN_TILE · 4          flash-style attention: one KV tile of scores
//!         = rows · n_head · n_ctx_slot · 4         --flash-attn off: the whole score rows
//! chunks  = ceil(rows / GDN_CHUNK) · n_v · d_state² · 4   chunked delta rule: one state per chunk
//! logits  = parallel · (1 + spec-draft-n-max if drafting) · n_vocab · 4
//! compute = acts + scores + chunks + logits
//! ```
//!
//! The MTP drafter, when armed, runs its block over the same ubatch (to fill its own KV) and
//! then one row per slot per draft step:
//!
//! ```text
//! draft row     = 2·n_embd (embedding | hidden) + n_embd (eh_proj out) + 3·n_embd
//!                 + max(attn_w, ffn_w)
//! draft compute = rows · draft row · 4 + scores + parallel · n_vocab · 4
//! ```

use super::price::{Geometry, Line, Term};
use super::table::count;
use super::{BackendKind, FlashAttn, Shape};

/// Keys per tile of the flash-style attention kernel (scores held per row and head).
pub const ATTN_TILE: u64 = 256;
/// Tokens per chunk of the chunked Gated-DeltaNet kernel.
pub const GDN_CHUNK: u64 = 64;

const F32: u64 = 4;

/// What the adapters add to a step: their widest rank, and whether one modifies the output
/// head (then a second logits-sized product is live while it is added).
#[derive(Clone, Copy, Debug, Default)]
pub(crate) struct LoraLoad {
    pub max_rank: u64,
    pub output: bool,
}

pub(crate) fn estimate(
    geo: &Geometry,
    shape: &Shape,
    lora: Option<LoraLoad>,
) -> (Line, Option<Line>) {
    // Saturating throughout: header numbers are untrusted.
    let rows = shape.effective_ubatch();
    let hd = geo.head_dim;
    let inner = mul(&[geo.ssm_n_v, geo.ssm_state]);
    let conv_dim = mul(&[2, geo.ssm_n_k, geo.ssm_state]).saturating_add(inner);
    let attn_w = add(&[
        mul(&[2, geo.n_head, hd]),
        mul(&[2, geo.n_head_kv, hd]),
        mul(&[geo.n_head, hd]),
    ]);
    let gdn_w = if geo.n_gdn > 0 {
        add(&[
            mul(&[2, conv_dim]),
            mul(&[2, inner]),
            mul(&[2, geo.ssm_n_v]),
        ])
    } else {
        0
    };
    let ffn_w = mul(&[3, geo.n_ff]);
    let row = mul(&[3, geo.n_embd]).saturating_add(attn_w.max(gdn_w).max(ffn_w));
    let acts = mul(&[rows, row, F32]);
    let (scores, scores_what) = if shape.flash_attn == FlashAttn::Off {
        (
            mul(&[rows, geo.n_head, shape.n_ctx_slot(), F32]),
            format!(
                "full score rows over n_ctx_slot {}",
                count(shape.n_ctx_slot())
            ),
        )
    } else {
        (
            mul(&[rows, geo.n_head, ATTN_TILE, F32]),
            format!("one {ATTN_TILE}-key tile"),
        )
    };
    let chunks = if geo.n_gdn > 0 {
        mul(&[
            rows.div_ceil(GDN_CHUNK),
            geo.ssm_n_v,
            geo.ssm_state,
            geo.ssm_state,
            F32,
        ])
    } else {
        0
    };
    let out_rows = shape.parallel.saturating_mul(shape.recurrent_copies());
    let logits = mul(&[out_rows, geo.n_vocab, F32]);
    let mut parts = vec![
        ("activations".to_string(), acts),
        ("attention scores".to_string(), scores),
        ("gdn chunk states".to_string(), chunks),
        ("logits".to_string(), logits),
    ];
    if let Some(l) = lora {
        // Per adapter and matrix: A·x (rank wide) and B(A·x) (the matrix's width) live beside
        // the product they are added to.
        let terms = mul(&[rows, row.saturating_add(l.max_rank), F32]);
        let head = if l.output { logits } else { 0 };
        parts.push(("LoRA terms".to_string(), terms.saturating_add(head)));
    }
    if shape.parallel > 1 {
        // A step mixing slots splits each projection per slot for the mixers and joins the
        // outputs: a second copy of the activations is live meanwhile.
        parts.push(("per-slot splits of a mixed batch".to_string(), acts));
    }
    pooled(shape, &mut parts);
    let main = Line {
        term: Term::Compute,
        bytes: sum(&parts),
        detail: format!(
            "estimated: ubatch {rows} × {} f32/row (widest layer) + scores ({scores_what}) \
             + {} GDN chunk states + {out_rows} logits rows × {}",
            count(row),
            rows.div_ceil(GDN_CHUNK),
            count(geo.n_vocab)
        ),
        estimated: true,
        parts,
    };
    if !shape.drafting() {
        return (main, None);
    }
    let draft_row = mul(&[6, geo.n_embd]).saturating_add(attn_w.max(ffn_w));
    let d_acts = mul(&[rows, draft_row, F32]);
    let d_scores = scores;
    let d_logits = mul(&[shape.parallel, geo.n_vocab, F32]);
    let mut parts = vec![
        ("activations".to_string(), d_acts),
        ("attention scores".to_string(), d_scores),
        ("logits".to_string(), d_logits),
    ];
    if let Some(l) = lora {
        let terms = mul(&[rows, draft_row.saturating_add(l.max_rank), F32]);
        parts.push(("LoRA terms".to_string(), terms.saturating_add(d_logits)));
    }
    pooled(shape, &mut parts);
    let draft = Line {
        term: Term::DraftCompute,
        bytes: sum(&parts),
        detail: format!(
            "estimated: MTP block over ubatch {rows} × {} f32/row + scores + {} logits rows",
            count(draft_row),
            shape.parallel
        ),
        estimated: true,
        parts,
    };
    (main, Some(draft))
}

/// A GPU backend takes activations from a pool of power-of-two size classes, so a buffer can
/// be up to twice its tensor and a freed one serves only its own class: the pool is priced at
/// twice the live set.
fn pooled(shape: &Shape, parts: &mut Vec<(String, u64)>) {
    if matches!(shape.backend, BackendKind::Wgpu | BackendKind::Cuda) {
        let live = sum(parts);
        parts.push((
            "pool rounding (power-of-two size classes)".to_string(),
            live,
        ));
    }
}

fn mul(xs: &[u64]) -> u64 {
    xs.iter().fold(1u64, |a, &b| a.saturating_mul(b))
}

fn add(xs: &[u64]) -> u64 {
    xs.iter().fold(0u64, |a, &b| a.saturating_add(b))
}

fn sum(parts: &[(String, u64)]) -> u64 {
    parts.iter().fold(0u64, |a, (_, b)| a.saturating_add(*b))
}
