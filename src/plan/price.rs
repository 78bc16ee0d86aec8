//! Pricing a shape into ledger terms, from the GGUF header alone.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use serde::Serialize;

use super::compute;
use super::table::{count, mib};
use super::{BackendKind, KvType, PlanError, Shape};
use crate::backend::{BackendError, Uploader, WeightBytes, WeightSource, WeightTally};
use crate::gguf::Gguf;
use crate::model::{Config, Weights};
use crate::quant::hadamard::HadamardConfig;

/// One line of the ledger.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Term {
    Weights,
    Kv,
    DraftKv,
    Recurrent,
    Checkpoint,
    Compute,
    DraftCompute,
    Projector,
    VisionCompute,
    Lora,
}

impl Term {
    pub fn name(self) -> &'static str {
        match self {
            Term::Weights => "weights",
            Term::Kv => "kv",
            Term::DraftKv => "draft kv",
            Term::Recurrent => "recurrent",
            Term::Checkpoint => "checkpoint",
            Term::Compute => "compute",
            Term::DraftCompute => "draft compute",
            Term::Projector => "projector",
            Term::VisionCompute => "vision compute",
            Term::Lora => "lora",
        }
    }
}

#[derive(Clone, Debug, PartialEq)]
pub struct Line {
    pub term: Term,
    pub bytes: u64,
    /// How the figure was made, in words and numbers.
    pub detail: String,
    /// True for the terms priced by a formula of ours rather than by the file or the cache
    /// arithmetic (compute buffers, until a backend exposes its allocation plan).
    pub estimated: bool,
    /// Named sub-terms (K and V of a cache, the parts of an estimate); they add up to `bytes`.
    pub parts: Vec<(String, u64)>,
}

/// The model geometry the ledger was priced from.
#[derive(Clone, Debug, PartialEq, Serialize)]
pub struct Geometry {
    pub name: Option<String>,
    pub n_layer: u64,
    pub n_full_attn: u64,
    pub n_gdn: u64,
    pub n_nextn: u64,
    pub n_embd: u64,
    pub n_ff: u64,
    pub n_vocab: u64,
    pub n_head: u64,
    pub n_head_kv: u64,
    pub head_dim: u64,
    pub ssm_conv: u64,
    pub ssm_state: u64,
    pub ssm_n_k: u64,
    pub ssm_n_v: u64,
    pub context_length: u64,
    /// `n_full_attn × n_head_kv × head_dim`: KV elements per token per cache.
    pub kv_elems_per_token: u64,
    /// Recurrent-state bytes of one slot (one copy, all GDN layers).
    pub recurrent_bytes_per_slot: u64,
    pub file_bytes: u64,
}

/// A priced shape.
#[derive(Clone, Debug)]
pub struct Ledger {
    pub model: PathBuf,
    pub geometry: Geometry,
    pub shape: Shape,
    pub n_ctx_slot: u64,
    pub lines: Vec<Line>,
}

impl Ledger {
    /// Opens the model (header only: the mapping's data pages are never touched) and prices
    /// `shape`.
    pub fn price_file(model: impl AsRef<Path>, shape: &Shape) -> Result<Ledger, PlanError> {
        let g = Arc::new(Gguf::open(model)?);
        Ledger::price(&g, shape)
    }

    /// Prices `shape` for the model `g`: validates the shape against the model, then every
    /// term. Errors name the rule that was broken.
    pub fn price(g: &Arc<Gguf>, shape: &Shape) -> Result<Ledger, PlanError> {
        let cfg = Config::from_gguf(g)?;
        Ledger::price_with(g, &cfg, shape)
    }

    pub(crate) fn price_with(
        g: &Arc<Gguf>,
        cfg: &Config,
        shape: &Shape,
    ) -> Result<Ledger, PlanError> {
        shape.validate()?;
        let n_ctx_slot = shape.n_ctx_slot();
        if n_ctx_slot > cfg.context_length as u64 {
            return Err(PlanError::SlotTooLong {
                n_ctx_slot,
                ctx_size: shape.ctx_size,
                parallel: shape.parallel,
                context_length: cfg.context_length as u64,
            });
        }
        if shape.drafting() {
            if !cfg.has_mtp() {
                return Err(PlanError::DraftWithoutMtp {
                    model: g.path().to_path_buf(),
                });
            }
            let block = format!("blk.{}", cfg.n_layer);
            let prefix = format!("{block}.nextn.");
            if !g.tensors().iter().any(|t| t.name.starts_with(&prefix)) {
                return Err(PlanError::MtpTensorsMissing {
                    model: g.path().to_path_buf(),
                    n_nextn: cfg.n_nextn,
                    block,
                });
            }
        }
        let geometry = geometry(g, cfg);
        let mut lines = vec![weights(g, cfg, shape)?];
        lines.push(kv(&geometry, shape)?);
        if shape.drafting() {
            lines.push(draft_kv(&geometry, shape)?);
        }
        lines.push(recurrent(&geometry, shape));
        lines.push(checkpoint(&geometry, shape));
        let (lora_line, lora_load) = if shape.lora.is_empty() {
            (None, None)
        } else {
            let (l, load) = lora(g, cfg, shape)?;
            (Some(l), Some(load))
        };
        let (c, dc) = compute::estimate(&geometry, shape, lora_load);
        lines.push(c);
        if let Some(dc) = dc {
            lines.push(dc);
        }
        if let Some(p) = &shape.mmproj {
            let (weights, compute) = projector(p, cfg, shape)?;
            lines.push(weights);
            lines.push(compute);
        }
        lines.extend(lora_line);
        Ok(Ledger {
            model: g.path().to_path_buf(),
            geometry,
            shape: shape.clone(),
            n_ctx_slot,
            lines,
        })
    }

    /// The sum of all terms (the margin is not a term).
    pub fn total(&self) -> u64 {
        self.lines
            .iter()
            .map(|l| l.bytes)
            .fold(0u64, u64::saturating_add)
    }

    pub fn line(&self, term: Term) -> Option<&Line> {
        self.lines.iter().find(|l| l.term == term)
    }

    /// A term's bytes, 0 when the shape does not have it.
    pub fn bytes(&self, term: Term) -> u64 {
        self.line(term).map_or(0, |l| l.bytes)
    }

    /// A named part of a term (e.g. `("kv", "K")`), matched on the part's first word.
    pub fn part(&self, term: Term, name: &str) -> Option<u64> {
        self.line(term)?
            .parts
            .iter()
            .find(|(n, _)| n.split_whitespace().next() == Some(name))
            .map(|(_, b)| *b)
    }
}

fn geometry(g: &Arc<Gguf>, cfg: &Config) -> Geometry {
    // Saturating: the header's numbers are untrusted, and an absurd one must price as a huge
    // (refused) figure, never wrap or panic.
    let m = |xs: &[u64]| xs.iter().fold(1u64, |a, &b| a.saturating_mul(b));
    let n_gdn = (0..cfg.n_layer).filter(|&il| cfg.is_recurrent(il)).count() as u64;
    let n_full = (cfg.n_layer as u64).saturating_sub(n_gdn);
    let kv_elems = m(&[n_full, cfg.n_head_kv as u64, cfg.head_dim as u64]);
    let d = cfg.ssm_state as u64;
    let (n_k, n_v) = (cfg.ssm_n_k as u64, cfg.ssm_n_v as u64);
    let conv_dim = m(&[2, n_k, d]).saturating_add(m(&[n_v, d]));
    let floats =
        m(&[(cfg.ssm_conv as u64).saturating_sub(1), conv_dim]).saturating_add(m(&[d, d, n_v]));
    Geometry {
        name: g.get_str("general.name").map(str::to_string),
        n_layer: cfg.n_layer as u64,
        n_full_attn: n_full,
        n_gdn,
        n_nextn: cfg.n_nextn as u64,
        n_embd: cfg.n_embd as u64,
        n_ff: cfg.n_ff as u64,
        n_vocab: cfg.n_vocab as u64,
        n_head: cfg.n_head as u64,
        n_head_kv: cfg.n_head_kv as u64,
        head_dim: cfg.head_dim as u64,
        ssm_conv: cfg.ssm_conv as u64,
        ssm_state: d,
        ssm_n_k: cfg.ssm_n_k as u64,
        ssm_n_v: cfg.ssm_n_v as u64,
        context_length: cfg.context_length as u64,
        kv_elems_per_token: kv_elems,
        recurrent_bytes_per_slot: m(&[n_gdn, floats, 4]),
        file_bytes: g.file_len(),
    }
}

/// The binding limit wgpu's default limits promise (and lavapipe reports): weights larger than
/// this are uploaded in parts, each padded on its own.
pub const WGPU_BINDING_LIMIT: u64 = 128 << 20;

/// Prices each weight with a backend's allocation rule, through the model loader's own walk.
struct Pricer(fn(&WeightSource) -> WeightBytes);

impl Uploader for Pricer {
    type W = WeightBytes;
    fn upload(&self, w: &WeightSource) -> Result<WeightBytes, BackendError> {
        Ok((self.0)(w))
    }
}

fn wgpu_rule(w: &WeightSource) -> WeightBytes {
    crate::backend::gpu::planned_weight_bytes(
        w,
        crate::backend::wgpu::alloc_rule(WGPU_BINDING_LIMIT),
    )
}

/// What the cuda backend's `upload` allocates for `w`: one exact device allocation (at least 4
/// bytes) of the stored rows, or of the f32 copy of a small weight, plus a sign vector per
/// Hadamard rule it carries.
fn cuda_rule(w: &WeightSource) -> WeightBytes {
    crate::backend::gpu::planned_weight_bytes(w, crate::backend::gpu::cuda_alloc_rule())
}

/// The backend's rule for what one weight takes: the file's bytes in place on the CPU (its
/// serving path's packed copies of Q8_0, PQ2_0 and PTQ1_0 matrices when `packs`), device copies on a GPU,
/// plus the decoded copies of small weights and the sign vectors of folded ones (a backend
/// not yet chosen is priced as the CPU).
fn weight_rule(backend: BackendKind, packs: bool) -> fn(&WeightSource) -> WeightBytes {
    match backend {
        BackendKind::Cpu | BackendKind::Auto if !packs => crate::backend::cpu::planned_weight_bytes,
        BackendKind::Cpu | BackendKind::Auto => crate::backend::cpu::planned_weight_bytes_serving,
        BackendKind::Wgpu => wgpu_rule,
        BackendKind::Cuda => cuda_rule,
    }
}

/// The weights the loader takes for `backend`, walking the tensor table as loading does (a
/// tied output is priced twice on a GPU, where it is uploaded twice; the reduced draft head,
/// loaded when `drafting`, is priced as its own upload). `packs`: the CPU's serving path
/// with its packed matrices (`Shape::packs_weights`).
pub fn weight_tally(
    g: &Arc<Gguf>,
    cfg: &Config,
    backend: BackendKind,
    packs: bool,
    drafting: bool,
) -> Result<WeightTally, PlanError> {
    let had = HadamardConfig::from_gguf(g)
        .map_err(crate::model::ModelError::from)?
        .map(Arc::new);
    let draft = crate::model::draft_vocab(cfg.n_vocab, drafting);
    let priced = Weights::load(
        &Pricer(weight_rule(backend, packs)),
        g,
        cfg,
        had.as_ref(),
        draft,
    )?;
    let mut t = WeightTally::default();
    priced.each(|b| t.add(b.clone()));
    Ok(t)
}

fn weights(g: &Arc<Gguf>, cfg: &Config, shape: &Shape) -> Result<Line, PlanError> {
    let backend = shape.backend;
    let t = weight_tally(g, cfg, backend, shape.packs_weights(), shape.drafting())?;
    let mut by_type: std::collections::BTreeMap<&str, (u64, u64)> = Default::default();
    for t in g.tensors() {
        let e = by_type.entry(t.ty.name()).or_default();
        e.0 += 1;
        e.1 = e.1.saturating_add(t.nbytes);
    }
    let mut types: Vec<_> = by_type.into_iter().collect();
    types.sort_by(|a, b| b.1 .1.cmp(&a.1 .1).then(a.0.cmp(b.0)));
    let stored: Vec<String> = types
        .iter()
        .map(|(n, (c, b))| format!("{n} ×{c} {}", mib(*b)))
        .collect();

    let mut parts = Vec::new();
    if t.mapped > 0 {
        parts.push(("mapped from the file".to_string(), t.mapped));
    }
    parts.push(("allocated by the backend".to_string(), t.owned));
    if t.shared > 0 {
        parts.push((
            "packed Q8_0 / PQ2_0 / PTQ1_0 rows for the int8 kernels (PTQ1_0 as PQ2_0)".to_string(),
            t.shared,
        ));
    }
    let pricing = match backend {
        BackendKind::Cpu | BackendKind::Auto if t.shared > 0 => {
            "cpu: stored rows read in place, Q8_0 and ternary matrices packed once + f32 copies of small weights"
        }
        BackendKind::Cpu | BackendKind::Auto => {
            "cpu: stored rows read in place + f32 copies of small weights"
        }
        _ => "device copies + f32 copies of small weights + Hadamard sign vectors",
    };
    Ok(Line {
        term: Term::Weights,
        bytes: t.total(),
        detail: format!(
            "{} uses of {} tensors (stored: {}); {pricing}",
            t.count,
            g.tensors().len(),
            stored.join(", ")
        ),
        estimated: false,
        parts,
    })
}

/// The projector's weights as the backend takes them (walked by its loader, as the text
/// weights are) and the worst-case compute of one encode at the shape's image-token limits.
fn projector(p: &Path, cfg: &Config, shape: &Shape) -> Result<(Line, Line), PlanError> {
    use crate::model::vision::{self, VisionError};
    file_size("projector", p)?;
    let err = |source: VisionError| PlanError::Projector {
        path: p.to_path_buf(),
        source: Box::new(source),
    };
    let file = Gguf::open(p).map(Arc::new).map_err(|source| {
        err(VisionError::Gguf {
            path: p.display().to_string(),
            source,
        })
    })?;
    let rule = Pricer(weight_rule(shape.backend, shape.packs_weights()));
    let (mut vcfg, priced) = vision::upload_weights(&rule, &file, cfg.n_embd).map_err(err)?;
    let limit = |t: Option<u64>| t.map(|t| usize::try_from(t).unwrap_or(usize::MAX));
    vcfg.set_token_limits(limit(shape.image_min_tokens), limit(shape.image_max_tokens))
        .map_err(err)?;
    let mut t = WeightTally::default();
    for b in priced {
        t.add(b);
    }
    let mut parts = Vec::new();
    if t.mapped > 0 {
        parts.push(("mapped from the file".to_string(), t.mapped));
    }
    parts.push(("allocated by the backend".to_string(), t.owned));
    if t.shared > 0 {
        parts.push((
            "packed Q8_0 / PQ2_0 / PTQ1_0 rows for the int8 kernels (PTQ1_0 as PQ2_0)".to_string(),
            t.shared,
        ));
    }
    let host_grid = matches!(shape.backend, BackendKind::Cpu | BackendKind::Auto);
    if host_grid {
        parts.push((
            "position grid (host f32)".to_string(),
            vcfg.pos_grid_bytes(),
        ));
    }
    let bytes = parts.iter().fold(0u64, |a, (_, b)| a.saturating_add(*b));
    let weights = Line {
        term: Term::Projector,
        bytes,
        detail: format!(
            "{}: {} uses of {} tensors ({} B as stored), {} layers × width {}; {}",
            p.display(),
            t.count,
            file.tensors().len(),
            count(file.tensors().iter().map(|t| t.nbytes).sum::<u64>()),
            vcfg.n_layer,
            vcfg.width,
            if host_grid {
                "cpu: stored rows read in place + f32 copies of small weights and the position grid"
            } else {
                "device copies + f32 copies of small weights"
            }
        ),
        estimated: false,
        parts,
    };
    let dims = |name: &str| {
        file.tensor(name)
            .map(|t| t.dims.clone())
            .unwrap_or_default()
    };
    let enc = super::vision::Encoder {
        mid: dims("mm.0.weight").get(1).copied().unwrap_or(0),
        pre_ln: file.tensor("v.pre_ln.weight").is_some(),
        post_ln: file.tensor("v.post_ln.weight").is_some(),
        cfg: vcfg,
    };
    let compute = enc.line(shape.backend, rayon::current_num_threads() as u64);
    Ok((weights, compute))
}

/// The adapters' pairs as the backend takes them: the loader checks each adapter against the
/// model and hands every pair to the same allocation rule as the base weights.
fn lora(
    g: &Arc<Gguf>,
    cfg: &Config,
    shape: &Shape,
) -> Result<(Line, compute::LoraLoad), PlanError> {
    use crate::model::lora::Site;
    let rule = Pricer(weight_rule(shape.backend, shape.packs_weights()));
    let mut parts = Vec::new();
    let mut pairs = 0;
    let mut load = compute::LoraLoad::default();
    for p in &shape.lora {
        let a = crate::model::lora::load(&rule, p, g, cfg.n_layer)
            .map_err(crate::model::ModelError::from)?;
        let mut t = WeightTally::default();
        for (site, pair) in a.pairs {
            load.max_rank = load.max_rank.max(pair.rank as u64);
            load.output |= matches!(site, Site::Output | Site::MtpHead);
            t.add(pair.a);
            t.add(pair.b);
            pairs += 1;
        }
        parts.push((p.display().to_string(), t.total()));
    }
    let bytes = parts
        .iter()
        .map(|(_, b)| *b)
        .fold(0u64, u64::saturating_add);
    let names: Vec<String> = parts
        .iter()
        .map(|(n, b)| format!("{n} {} B", count(*b)))
        .collect();
    let line = Line {
        term: Term::Lora,
        bytes,
        detail: format!(
            "{pairs} A/B pairs: {} (their activations are in compute)",
            names.join(", ")
        ),
        estimated: false,
        parts,
    };
    Ok((line, load))
}

/// Bytes of one cache over `positions` tokens: `layers` rows of `elems` elements per token.
/// A GPU backend keeps each cache row in whole 32-bit words (its shaders address words), so a
/// row of odd blocks (a 34-byte q8_0 block, an 18-byte q4_0 one) is padded to 4 bytes there.
fn word_rows(shape: &Shape) -> bool {
    matches!(shape.backend, BackendKind::Wgpu | BackendKind::Cuda)
}

fn cache_bytes(
    which: &'static str,
    ty: KvType,
    elems: u64,
    layers: u64,
    positions: u64,
    words: bool,
) -> Result<u64, PlanError> {
    let mut row = ty
        .ggml()
        .row_bytes(elems)
        .ok_or(PlanError::KvRow { which, ty, elems })?;
    if words {
        row = row.div_ceil(4).saturating_mul(4);
    }
    Ok(row.saturating_mul(layers).saturating_mul(positions))
}

fn kv(geo: &Geometry, shape: &Shape) -> Result<Line, PlanError> {
    let elems = geo.n_head_kv.saturating_mul(geo.head_dim);
    let pool = shape.ctx_size;
    let (tk, tv) = (shape.cache_type_k, shape.cache_type_v);
    let k = cache_bytes("K", tk, elems, geo.n_full_attn, pool, word_rows(shape))?;
    let v = cache_bytes("V", tv, elems, geo.n_full_attn, pool, word_rows(shape))?;
    let per_token =
        cache_bytes("K", tk, elems, geo.n_full_attn, 1, word_rows(shape))?.saturating_add(
            cache_bytes("V", tv, elems, geo.n_full_attn, 1, word_rows(shape))?,
        );
    Ok(Line {
        term: Term::Kv,
        bytes: k.saturating_add(v),
        detail: format!(
            "{} full-attn layers × {} kv heads × {} = {} elem/token/cache; \
             K {tk} {} + V {tv} {} = {} B/token × pool {} ({} × {})",
            geo.n_full_attn,
            geo.n_head_kv,
            geo.head_dim,
            count(geo.kv_elems_per_token),
            mib(k),
            mib(v),
            count(per_token),
            count(pool),
            shape.parallel,
            count(shape.n_ctx_slot()),
        ),
        estimated: false,
        parts: vec![(format!("K {tk}"), k), (format!("V {tv}"), v)],
    })
}

fn draft_kv(geo: &Geometry, shape: &Shape) -> Result<Line, PlanError> {
    let elems = geo.n_head_kv.saturating_mul(geo.head_dim);
    let pool = shape.ctx_size;
    let (tk, tv) = (shape.spec_draft_type_k, shape.spec_draft_type_v);
    let k = cache_bytes("draft K", tk, elems, geo.n_nextn, pool, word_rows(shape))?;
    let v = cache_bytes("draft V", tv, elems, geo.n_nextn, pool, word_rows(shape))?;
    let per_pos =
        cache_bytes("draft K", tk, elems, geo.n_nextn, 1, word_rows(shape))?.saturating_add(
            cache_bytes("draft V", tv, elems, geo.n_nextn, 1, word_rows(shape))?,
        );
    Ok(Line {
        term: Term::DraftKv,
        bytes: k.saturating_add(v),
        detail: format!(
            "MTP blk.{}: {} full-attn layer × {} elem; K {tk} + V {tv} = {} B/position \
             over the whole pool {}",
            geo.n_layer,
            geo.n_nextn,
            count(elems),
            count(per_pos),
            count(pool),
        ),
        estimated: false,
        parts: vec![(format!("K {tk}"), k), (format!("V {tv}"), v)],
    })
}

/// One recurrent state per slot kept at the end of its last prompt, so a follow-up request
/// that extends that prompt resumes there (prefix reuse on a hybrid model cannot truncate the
/// recurrent state the way it truncates attention caches).
fn checkpoint(geo: &Geometry, shape: &Shape) -> Line {
    let bytes = geo.recurrent_bytes_per_slot.saturating_mul(shape.parallel);
    Line {
        term: Term::Checkpoint,
        bytes,
        detail: format!(
            "prompt checkpoint for prefix reuse: 1 recurrent state ({} MiB) × {} slots",
            mib(geo.recurrent_bytes_per_slot),
            shape.parallel
        ),
        estimated: false,
        parts: Vec::new(),
    }
}

fn recurrent(geo: &Geometry, shape: &Shape) -> Line {
    let copies = shape.recurrent_copies();
    let bytes = geo
        .recurrent_bytes_per_slot
        .saturating_mul(shape.parallel)
        .saturating_mul(copies);
    let conv_dim = (2 * geo.ssm_n_k)
        .saturating_mul(geo.ssm_state)
        .saturating_add(geo.ssm_n_v.saturating_mul(geo.ssm_state));
    let copies_note = if shape.drafting() {
        format!(
            " × {copies} copies (1 + spec-draft-n-max {})",
            shape.draft_n_max
        )
    } else {
        String::new()
    };
    Line {
        term: Term::Recurrent,
        bytes,
        detail: format!(
            "{} GDN layers × ({} × {} + {}² × {}) f32 = {} B = {} MiB per slot × {} slots{}",
            geo.n_gdn,
            geo.ssm_conv.saturating_sub(1),
            count(conv_dim),
            geo.ssm_state,
            geo.ssm_n_v,
            count(geo.recurrent_bytes_per_slot),
            mib(geo.recurrent_bytes_per_slot),
            shape.parallel,
            copies_note
        ),
        estimated: false,
        parts: Vec::new(),
    }
}

fn file_size(what: &'static str, p: &Path) -> Result<u64, PlanError> {
    let md = std::fs::metadata(p).map_err(|source| PlanError::File {
        what,
        path: p.to_path_buf(),
        source,
    })?;
    if !md.is_file() {
        return Err(PlanError::File {
            what,
            path: p.to_path_buf(),
            source: std::io::Error::other("not a regular file"),
        });
    }
    Ok(md.len())
}
