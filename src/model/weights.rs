//! The qwen35 tensor table (model-qwen35.md §2), checked for presence and shape, with each
//! Hadamard-folded weight bound to its transform at load time.

use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};

use super::{Config, ModelError};
use crate::backend::{BackendError, Fold, Uploader, WeightSource};
use crate::gguf::Gguf;
use crate::quant::hadamard::{GdnPermutation, HadamardConfig};

/// Walks the tensor table exactly as loading does, allocating nothing: every tensor the config
/// implies must be present with its shape and a type tern computes, the fold must cover what
/// it lists, and nothing else may be in the table (llama.cpp's loader refuses a file whose
/// table has tensors its graph does not create: "wrong number of tensors"). Optional tensors
/// follow llama.cpp: `output.weight` (else the tied embedding) and the MTP head's
/// `embed_tokens`/`shared_head_head`/`shared_head_norm`. An MTP block is read whole or not at
/// all: a header that declares one whose tensors are all absent loads without it.
pub(super) fn validate_table(g: &Gguf, cfg: &Config) -> Result<(), ModelError> {
    let had = HadamardConfig::from_gguf(g)?.map(Arc::new);
    let view = Arc::new(g.table_view());
    let seen = Validator::default();
    Weights::load(&seen, &view, cfg, had.as_ref(), 0)?;
    let seen = seen.names.into_inner().unwrap_or_else(|p| p.into_inner());
    if let Some(t) = g.tensors().iter().find(|t| !seen.contains(&t.name)) {
        return Err(ModelError::BadTensor {
            name: t.name.clone(),
            why: unread_reason(&t.name, cfg),
        });
    }
    Ok(())
}

/// Why a tensor that qwen35 does not read is in the table, as near as the name tells.
fn unread_reason(name: &str, cfg: &Config) -> String {
    let layer = name
        .strip_prefix("blk.")
        .and_then(|r| r.split_once('.'))
        .and_then(|(n, _)| n.parse::<u64>().ok());
    match layer {
        Some(il) if il >= cfg.n_layer_all as u64 => format!(
            "belongs to block {il}, but block_count = {} (the header describes fewer layers than the table holds)",
            cfg.n_layer_all
        ),
        Some(il) if il == cfg.n_layer as u64 && cfg.has_mtp() => {
            "belongs to the MTP block, whose tensors are incomplete (no blk.N.nextn.* tensors)".into()
        }
        Some(il) if il == cfg.n_layer as u64 => format!(
            "belongs to block {il}, which is past the trunk's {} layers and nextn_predict_layers = 0",
            cfg.n_layer
        ),
        Some(il) => format!(
            "is not a tensor of qwen35 block {il} ({} layer)",
            if cfg.is_recurrent(il as usize) { "Gated DeltaNet" } else { "full-attention" }
        ),
        None => "is not a tensor of the qwen35 architecture (llama.cpp refuses a table with tensors its graph does not read)".into(),
    }
}

/// The validation walk's uploader: records each tensor it is handed and refuses the types no
/// backend computes, before any backend allocates for the model.
#[derive(Default)]
struct Validator {
    names: Mutex<BTreeSet<String>>,
}

impl Uploader for Validator {
    type W = ();
    fn upload(&self, w: &WeightSource) -> Result<(), BackendError> {
        if !w.info.ty.can_compute() {
            return Err(BackendError::BadWeight {
                name: w.info.name.clone(),
                what: format!(
                    "type {} has no kernels in tern (F32, F16, BF16, Q8_0, Q4_0, PQ2_0, PTQ1_0 and legacy Q2_0 do)",
                    w.info.ty
                ),
            });
        }
        self.names
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(w.info.name.clone());
        Ok(())
    }
}

pub struct AttnWeights<W> {
    pub q: W,
    pub k: W,
    pub v: W,
    pub o: W,
    pub q_norm: W,
    pub k_norm: W,
}

pub struct GdnWeights<W> {
    pub qkv: W,
    pub gate: W,
    pub beta: W,
    pub alpha: W,
    pub conv: W,
    pub dt_bias: W,
    pub ssm_a: W,
    pub norm: W,
    pub out: W,
}

impl<W> GdnWeights<W> {
    /// The weights the backend's GDN core takes (`Backend::gdn`).
    pub fn core(&self) -> crate::backend::GdnWeights<'_, W> {
        crate::backend::GdnWeights {
            conv: &self.conv,
            dt_bias: &self.dt_bias,
            ssm_a: &self.ssm_a,
            norm: &self.norm,
        }
    }
}

pub enum Mixer<W> {
    Attn(AttnWeights<W>),
    Gdn(GdnWeights<W>),
}

pub struct Layer<W> {
    pub attn_norm: W,
    pub post_attn_norm: W,
    pub mixer: Mixer<W>,
    pub ffn_gate: W,
    pub ffn_up: W,
    pub ffn_down: W,
}

pub struct MtpWeights<W> {
    pub enorm: W,
    pub hnorm: W,
    pub eh_proj: W,
    pub layer: Layer<W>,
    /// `nextn.shared_head_norm`, else the trunk's `output_norm`.
    pub head_norm: Option<W>,
    /// `nextn.embed_tokens`, else `token_embd`.
    pub embed: Option<W>,
    /// `nextn.shared_head_head`, else the trunk's output.
    pub head: Option<W>,
    /// The first rows of the head the MTP block uses, for drafting only (FR-Spec's reduced
    /// draft vocabulary, [`super::draft_vocab`]): loaded when drafting on a large vocabulary.
    pub draft_head: Option<DraftHead<W>>,
}

/// The head's rows for token ids `0..n_vocab`. BPE ids follow merge order, so the low ids
/// are the tokenizer's most frequent tokens; a draft need not be exact (the trunk verifies
/// it), and a step over these rows reads a fraction of the full head.
pub struct DraftHead<W> {
    pub w: W,
    pub n_vocab: usize,
}

pub struct Weights<W> {
    pub token_embd: W,
    pub output_norm: W,
    /// `output.weight`, or `token_embd` used as a matrix when the output is tied.
    pub output: W,
    pub layers: Vec<Layer<W>>,
    pub mtp: Option<MtpWeights<W>>,
}

struct Loader<'a, B: Uploader> {
    be: &'a B,
    file: &'a Arc<Gguf>,
    cfg: &'a Config,
    had: Option<&'a Arc<HadamardConfig>>,
    /// Names consumed through `matmul` (so a folded one got its transform).
    as_matrix: BTreeSet<String>,
    as_lookup: BTreeSet<String>,
}

impl<B: Uploader> Loader<'_, B> {
    fn source(&self, name: &str, dims: &[usize]) -> Result<WeightSource, ModelError> {
        let info = self
            .file
            .tensor(name)
            .ok_or_else(|| ModelError::MissingTensor(name.to_string()))?;
        let found: Vec<u64> = info.dims.clone();
        let want: Vec<u64> = dims.iter().map(|&d| d as u64).collect();
        // ggml drops trailing 1s; accept either spelling of a vector.
        let trimmed = |v: &[u64]| -> Vec<u64> {
            let mut v = v.to_vec();
            while v.len() > 1 && *v.last().unwrap() == 1 {
                v.pop();
            }
            v
        };
        if trimmed(&found) != trimmed(&want) {
            return Err(ModelError::BadShape {
                name: name.to_string(),
                expected: format!("{want:?}"),
                found,
            });
        }
        Ok(WeightSource {
            file: self.file.clone(),
            info: info.clone(),
            fold: None,
            inverse: None,
        })
    }

    fn upload(&self, src: WeightSource) -> Result<B::W, ModelError> {
        Ok(self.be.upload(&src)?)
    }

    /// A matrix consumed by `matmul`: its fold (if listed) is attached here and only here.
    fn mat(&mut self, name: &str, ne0: usize, ne1: usize) -> Result<B::W, ModelError> {
        let mut src = self.source(name, &[ne0, ne1])?;
        if let Some(h) = self.had {
            if h.is_folded(name) {
                let perm = if name.ends_with(".ssm_out.weight") && h.gdn_v_grouped {
                    Some(GdnPermutation {
                        hd: self.cfg.ssm_state,
                        nk: self.cfg.ssm_n_k,
                        rep: self.cfg.ssm_n_v / self.cfg.ssm_n_k,
                    })
                } else {
                    None
                };
                src.fold = Some(Fold {
                    hadamard: h.clone(),
                    perm,
                });
            }
        }
        self.as_matrix.insert(name.to_string());
        self.upload(src)
    }

    /// A 1-D weight (norm, bias, decay).
    fn vec(&mut self, name: &str, n: usize) -> Result<B::W, ModelError> {
        self.plain(name, &[n])
    }

    fn plain(&mut self, name: &str, dims: &[usize]) -> Result<B::W, ModelError> {
        if let Some(h) = self.had {
            if h.is_folded(name) || h.is_inverse(name) {
                return Err(ModelError::FoldMisuse {
                    name: name.to_string(),
                    why: "listed in prism.hadamard but not a matrix input".into(),
                });
            }
        }
        let src = self.source(name, dims)?;
        self.upload(src)
    }

    /// An embedding table read by row lookup; the inverse rule rides along when listed.
    fn lookup(&mut self, name: &str) -> Result<B::W, ModelError> {
        let mut src = self.source(name, &[self.cfg.n_embd, self.cfg.n_vocab])?;
        if let Some(h) = self.had {
            if h.is_folded(name) {
                return Err(ModelError::FoldMisuse {
                    name: name.to_string(),
                    why: "folded on its input axis but consumed by row lookup".into(),
                });
            }
            if h.is_inverse(name) {
                src.inverse = Some(h.clone());
            }
        }
        self.as_lookup.insert(name.to_string());
        self.upload(src)
    }

    /// The tied output: the embedding table used as a matrix. Its rows hold `H(s ⊙ w)` when
    /// the table is inverse-folded, which the forward rule on the input undoes.
    fn tied_output(&mut self, name: &str) -> Result<B::W, ModelError> {
        let mut src = self.source(name, &[self.cfg.n_embd, self.cfg.n_vocab])?;
        if let Some(h) = self.had {
            if h.is_inverse(name) || h.is_folded(name) {
                src.fold = Some(Fold {
                    hadamard: h.clone(),
                    perm: None,
                });
            }
        }
        self.as_matrix.insert(name.to_string());
        self.upload(src)
    }

    /// The first `n` rows of the output head `name` (a prefix of its data: rows are stored
    /// whole, and the fold acts on the input width), with the head's transform.
    fn head_rows(&mut self, name: &str, n: usize) -> Result<B::W, ModelError> {
        let (e, v) = (self.cfg.n_embd, self.cfg.n_vocab);
        let mut src = self.source(name, &[e, v])?;
        src.info.nbytes = src.info.nbytes / v as u64 * n as u64;
        src.info.dims[1] = n as u64;
        if let Some(h) = self.had {
            if h.is_folded(name) || h.is_inverse(name) {
                src.fold = Some(Fold {
                    hadamard: h.clone(),
                    perm: None,
                });
            }
        }
        self.upload(src)
    }

    fn layer(&mut self, il: usize, recurrent: bool) -> Result<Layer<B::W>, ModelError> {
        let c = self.cfg;
        let (e, hd) = (c.n_embd, c.head_dim);
        let n = |s: &str| format!("blk.{il}.{s}");
        let mixer = if recurrent {
            let conv_dim = 2 * c.ssm_n_k * c.ssm_state + c.ssm_inner;
            Mixer::Gdn(GdnWeights {
                qkv: self.mat(&n("attn_qkv.weight"), e, conv_dim)?,
                gate: self.mat(&n("attn_gate.weight"), e, c.ssm_inner)?,
                beta: self.mat(&n("ssm_beta.weight"), e, c.ssm_n_v)?,
                alpha: self.mat(&n("ssm_alpha.weight"), e, c.ssm_n_v)?,
                conv: self.plain(&n("ssm_conv1d.weight"), &[c.ssm_conv, conv_dim])?,
                dt_bias: self.vec(&n("ssm_dt.bias"), c.ssm_n_v)?,
                ssm_a: self.vec(&n("ssm_a"), c.ssm_n_v)?,
                norm: self.vec(&n("ssm_norm.weight"), c.ssm_state)?,
                out: self.mat(&n("ssm_out.weight"), c.ssm_inner, e)?,
            })
        } else {
            Mixer::Attn(AttnWeights {
                q: self.mat(&n("attn_q.weight"), e, 2 * c.n_head * hd)?,
                k: self.mat(&n("attn_k.weight"), e, c.n_head_kv * hd)?,
                v: self.mat(&n("attn_v.weight"), e, c.n_head_kv * hd)?,
                o: self.mat(&n("attn_output.weight"), c.n_head * hd, e)?,
                q_norm: self.vec(&n("attn_q_norm.weight"), hd)?,
                k_norm: self.vec(&n("attn_k_norm.weight"), hd)?,
            })
        };
        Ok(Layer {
            attn_norm: self.vec(&n("attn_norm.weight"), e)?,
            post_attn_norm: self.vec(&n("post_attention_norm.weight"), e)?,
            mixer,
            ffn_gate: self.mat(&n("ffn_gate.weight"), e, c.n_ff)?,
            ffn_up: self.mat(&n("ffn_up.weight"), e, c.n_ff)?,
            ffn_down: self.mat(&n("ffn_down.weight"), c.n_ff, e)?,
        })
    }

    fn optional<T>(
        &mut self,
        name: &str,
        f: impl FnOnce(&mut Self, &str) -> Result<T, ModelError>,
    ) -> Result<Option<T>, ModelError> {
        if self.file.tensor(name).is_some() {
            f(self, name).map(Some)
        } else {
            Ok(None)
        }
    }
}

impl<W> Layer<W> {
    fn each<'a>(&'a self, f: &mut impl FnMut(&'a W)) {
        f(&self.attn_norm);
        f(&self.post_attn_norm);
        match &self.mixer {
            Mixer::Attn(a) => {
                for w in [&a.q, &a.k, &a.v, &a.o, &a.q_norm, &a.k_norm] {
                    f(w);
                }
            }
            Mixer::Gdn(g) => {
                for w in [
                    &g.qkv, &g.gate, &g.beta, &g.alpha, &g.conv, &g.dt_bias, &g.ssm_a, &g.norm,
                    &g.out,
                ] {
                    f(w);
                }
            }
        }
        for w in [&self.ffn_gate, &self.ffn_up, &self.ffn_down] {
            f(w);
        }
    }
}

impl<W> Weights<W> {
    /// Every weight held, once per use (a tied output is the table uploaded a second time).
    pub fn each<'a>(&'a self, mut f: impl FnMut(&'a W)) {
        f(&self.token_embd);
        f(&self.output_norm);
        f(&self.output);
        for l in &self.layers {
            l.each(&mut f);
        }
        if let Some(m) = &self.mtp {
            f(&m.enorm);
            f(&m.hnorm);
            f(&m.eh_proj);
            m.layer.each(&mut f);
            for w in [&m.head_norm, &m.embed, &m.head].into_iter().flatten() {
                f(w);
            }
            if let Some(d) = &m.draft_head {
                f(&d.w);
            }
        }
    }

    /// Walks the tensor table and hands every weight to `be`: a backend uploads it, the
    /// planner prices it (the same walk, so the plan and the allocation cannot drift).
    /// `draft_vocab` > 0 also loads the MTP head's first `draft_vocab` rows ([`DraftHead`]).
    pub fn load<B: Uploader<W = W>>(
        be: &B,
        file: &Arc<Gguf>,
        cfg: &Config,
        had: Option<&Arc<HadamardConfig>>,
        draft_vocab: usize,
    ) -> Result<Weights<W>, ModelError> {
        let mut l = Loader {
            be,
            file,
            cfg,
            had,
            as_matrix: BTreeSet::new(),
            as_lookup: BTreeSet::new(),
        };
        let token_embd = l.lookup("token_embd.weight")?;
        let output_norm = l.vec("output_norm.weight", cfg.n_embd)?;
        let output = if cfg.tied_output {
            l.tied_output("token_embd.weight")?
        } else {
            l.mat("output.weight", cfg.n_embd, cfg.n_vocab)?
        };
        let mut layers = Vec::with_capacity(cfg.n_layer);
        for il in 0..cfg.n_layer {
            layers.push(l.layer(il, cfg.is_recurrent(il))?);
        }
        // A header that declares an MTP block whose tensors are absent loads as a model without
        // one (drafting on it is refused by name: PlanError::MtpTensorsMissing).
        let mtp_prefix = format!("blk.{}.nextn.", cfg.n_layer);
        let mtp_present = file
            .tensors()
            .iter()
            .any(|t| t.name.starts_with(&mtp_prefix));
        let mtp = if cfg.has_mtp() && mtp_present {
            let il = cfg.n_layer;
            let n = |s: &str| format!("blk.{il}.nextn.{s}");
            let e = cfg.n_embd;
            let head_name = if file.tensor(&n("shared_head_head.weight")).is_some() {
                n("shared_head_head.weight")
            } else if cfg.tied_output {
                "token_embd.weight".to_string()
            } else {
                "output.weight".to_string()
            };
            Some(MtpWeights {
                enorm: l.vec(&n("enorm.weight"), e)?,
                hnorm: l.vec(&n("hnorm.weight"), e)?,
                eh_proj: l.mat(&n("eh_proj.weight"), 2 * e, e)?,
                layer: l.layer(il, false)?,
                head_norm: l.optional(&n("shared_head_norm.weight"), |l, n| l.vec(n, e))?,
                embed: l.optional(&n("embed_tokens.weight"), |l, n| l.lookup(n))?,
                head: l.optional(&n("shared_head_head.weight"), |l, n| {
                    let v = cfg.n_vocab;
                    l.mat(n, e, v)
                })?,
                draft_head: if draft_vocab > 0 && draft_vocab < cfg.n_vocab {
                    Some(DraftHead {
                        w: l.head_rows(&head_name, draft_vocab)?,
                        n_vocab: draft_vocab,
                    })
                } else {
                    None
                },
            })
        } else {
            None
        };
        // The fork's coverage check: every folded weight must be consumed through a matmul
        // (which applies its transform), every inverse one through a lookup.
        if let Some(h) = had {
            for name in h.folded_names() {
                if !l.as_matrix.contains(name) {
                    return Err(ModelError::FoldMisuse {
                        name: name.to_string(),
                        why: "Hadamard-folded weight is not consumed by any matmul of qwen35 (it would be used without its activation transform)".into(),
                    });
                }
            }
            if h.is_inverse("token_embd.weight") && !l.as_lookup.contains("token_embd.weight") {
                return Err(ModelError::FoldMisuse {
                    name: "token_embd.weight".into(),
                    why: "inverse-folded table is not consumed by a lookup".into(),
                });
            }
        }
        Ok(Weights {
            token_embd,
            output_norm,
            output,
            layers,
            mtp,
        })
    }
}
