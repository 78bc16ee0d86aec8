//! LoRA adapters in llama.cpp's format (`llama_adapter_lora_init`, `build_lora_mm`).
//!
//! An adapter is a GGUF with `general.type = adapter`, `adapter.type = lora`,
//! `adapter.lora.alpha` and, for each matrix `W` it modifies, a pair `W.lora_a` (`[n_in, rank]`
//! in ggml order) and `W.lora_b` (`[rank, n_out]`). A matmul with adapters is
//! `y = W·x + Σ s·B(A·x)` with `s = scale · alpha / rank`, or `scale` when alpha is 0. The
//! adapter sees the layer's true input: over a Hadamard-folded weight `W·x` runs through the
//! fold, while `A·x` takes `x` as it is (the adapter was made for the unfolded model, whose
//! `ssm_out` input is in the tiled V order the GDN core produces).
//!
//! Each pair is tied to the matmul it modifies by a [`Site`], so the forward asks for the
//! adapters of "layer 3's q projection" without looking at names.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::backend::{BackendError, Uploader, WeightSource};
use crate::gguf::{Gguf, GgufError, TensorInfo};
use crate::tensor::GgmlType;

#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    #[error("LoRA adapter {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: GgufError,
    },
    #[error("LoRA adapter {}: {why}", path.display())]
    Bad { path: PathBuf, why: String },
    #[error("LoRA adapter {}: tensor {tensor:?}: {why}", path.display())]
    Tensor {
        path: PathBuf,
        tensor: String,
        why: String,
    },
    #[error("LoRA adapter {}: tensor {tensor:?}: {source}", path.display())]
    Upload {
        path: PathBuf,
        tensor: String,
        #[source]
        source: BackendError,
    },
}

/// A matrix of a decoder layer that an adapter may modify.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Mat {
    /// Full attention: `attn_q` (q and gate), `attn_k`, `attn_v`, `attn_output`.
    Q,
    K,
    V,
    O,
    /// Gated DeltaNet: `attn_qkv`, `attn_gate`, `ssm_beta`, `ssm_alpha`, `ssm_out`.
    Qkv,
    Gate,
    Beta,
    Alpha,
    SsmOut,
    FfnGate,
    FfnUp,
    FfnDown,
}

/// Where a LoRA pair applies: a matrix of layer `il` (the MTP block's layer is layer
/// `n_layer`), the output head, the MTP block's `eh_proj`, or its own head.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Site {
    Layer(usize, Mat),
    Output,
    EhProj,
    MtpHead,
}

impl Site {
    /// The site of a base tensor name, or `None` for a tensor no matmul of qwen35 reads
    /// (norms, conv taps, decays), which llama.cpp loads and never applies.
    pub fn of(name: &str, n_layer: usize) -> Option<Site> {
        if name == "output.weight" {
            return Some(Site::Output);
        }
        let rest = name.strip_prefix("blk.")?;
        let (il, what) = rest.split_once('.')?;
        let il: usize = il.parse().ok()?;
        let mtp = il == n_layer;
        let mat = match what {
            "attn_q.weight" => Mat::Q,
            "attn_k.weight" => Mat::K,
            "attn_v.weight" => Mat::V,
            "attn_output.weight" => Mat::O,
            "attn_qkv.weight" => Mat::Qkv,
            "attn_gate.weight" => Mat::Gate,
            "ssm_beta.weight" => Mat::Beta,
            "ssm_alpha.weight" => Mat::Alpha,
            "ssm_out.weight" => Mat::SsmOut,
            "ffn_gate.weight" => Mat::FfnGate,
            "ffn_up.weight" => Mat::FfnUp,
            "ffn_down.weight" => Mat::FfnDown,
            "nextn.eh_proj.weight" if mtp => return Some(Site::EhProj),
            "nextn.shared_head_head.weight" if mtp => return Some(Site::MtpHead),
            _ => return None,
        };
        (il <= n_layer).then_some(Site::Layer(il, mat))
    }
}

/// One uploaded pair.
pub struct LoraPair<W> {
    pub a: W,
    pub b: W,
    pub rank: usize,
}

/// An adapter as loaded: its file, alpha, and its pairs by site.
pub struct Adapter<W> {
    pub path: PathBuf,
    pub alpha: f32,
    pub pairs: BTreeMap<Site, LoraPair<W>>,
    /// Base tensors the adapter names that no matmul reads (kept for the report; llama.cpp
    /// loads them and never applies them).
    pub unused: Vec<String>,
}

impl<W> Adapter<W> {
    pub fn get(&self, site: Site) -> Option<&LoraPair<W>> {
        self.pairs.get(&site)
    }

    /// The factor a pair's term is multiplied by at adapter scale `scale`: llama.cpp's
    /// `scale * alpha / rank` (in that order, in f32), or `scale` when alpha is 0.
    pub fn pair_scale(&self, pair: &LoraPair<W>, scale: f32) -> f32 {
        if self.alpha != 0.0 {
            scale * self.alpha / pair.rank as f32
        } else {
            scale
        }
    }
}

/// The weight types a pair may be stored in (llama.cpp converts adapters to these).
fn pair_type_ok(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
    )
}

/// Reads and checks an adapter against its base model, the way llama.cpp's loader does, and
/// hands every pair to `up` (a backend uploads it; the planner prices it).
pub fn load<U: Uploader>(
    up: &U,
    path: &Path,
    base: &Gguf,
    n_layer: usize,
) -> Result<Adapter<U::W>, LoraError> {
    let file = Arc::new(Gguf::open(path).map_err(|source| LoraError::Read {
        path: path.to_path_buf(),
        source,
    })?);
    load_from(up, file, base, n_layer)
}

/// `load` of an adapter already read (tests build them in memory).
pub fn load_from<U: Uploader>(
    up: &U,
    file: Arc<Gguf>,
    base: &Gguf,
    n_layer: usize,
) -> Result<Adapter<U::W>, LoraError> {
    let path = file.path().to_path_buf();
    let bad = |why: String| LoraError::Bad {
        path: path.clone(),
        why,
    };
    let tensor_err = |tensor: &str, why: String| LoraError::Tensor {
        path: path.clone(),
        tensor: tensor.to_string(),
        why,
    };
    match file.get_str("general.type") {
        Some("adapter") => {}
        other => {
            return Err(bad(format!(
                "general.type is {other:?}, expected \"adapter\" (is this a model rather than an adapter?)"
            )))
        }
    }
    let base_arch = base.architecture().unwrap_or("");
    match file.architecture() {
        Some(a) if a == base_arch => {}
        other => {
            return Err(bad(format!(
                "general.architecture is {other:?} but the model is {base_arch:?}"
            )))
        }
    }
    match file.get_str("adapter.type") {
        Some("lora") => {}
        other => return Err(bad(format!("adapter.type is {other:?}, expected \"lora\""))),
    }
    let alpha = match file.get("adapter.lora.alpha") {
        None => 0.0,
        Some(v) => v
            .as_f64()
            .filter(|a| a.is_finite())
            .ok_or_else(|| bad(format!("adapter.lora.alpha is not a finite number ({v:?})")))?
            as f32,
    };

    // Bundle lora_a and lora_b by base name.
    let mut halves: BTreeMap<String, (Option<&TensorInfo>, Option<&TensorInfo>)> = BTreeMap::new();
    for t in file.tensors() {
        if let Some(b) = t.name.strip_suffix(".lora_a") {
            halves.entry(b.to_string()).or_default().0 = Some(t);
        } else if let Some(b) = t.name.strip_suffix(".lora_b") {
            halves.entry(b.to_string()).or_default().1 = Some(t);
        } else if t.name.ends_with("_norm.weight") {
            // llama.cpp skips norm vectors in adapters.
            continue;
        } else {
            return Err(tensor_err(
                &t.name,
                "unexpected suffix (an adapter holds <tensor>.lora_a / <tensor>.lora_b pairs)"
                    .into(),
            ));
        }
    }
    if halves.is_empty() {
        return Err(bad("holds no lora_a / lora_b pairs".into()));
    }

    let mut pairs = BTreeMap::new();
    let mut unused = Vec::new();
    for (name, (a, b)) in halves {
        let (Some(a), Some(b)) = (a, b) else {
            return Err(tensor_err(
                &name,
                "the LoRA pair is missing one half".into(),
            ));
        };
        if name.ends_with("token_embd.weight") {
            return Err(tensor_err(
                &name,
                "a LoRA on the token embedding is not supported by tern yet".into(),
            ));
        }
        let Some(w) = base.tensor(&name) else {
            return Err(tensor_err(
                &name,
                "does not exist in the base model (is this adapter for another model?)".into(),
            ));
        };
        for h in [a, b] {
            if h.dims.len() != 2 {
                return Err(tensor_err(
                    &h.name,
                    format!("is not a matrix ({:?})", h.dims),
                ));
            }
            if !pair_type_ok(h.ty) {
                return Err(tensor_err(
                    &h.name,
                    format!("type {} (adapters hold F32, F16, BF16 or Q8_0)", h.ty),
                ));
            }
        }
        let (ne0, ne1) = (w.ne0(), w.n_rows());
        if a.dims[0] != ne0 || b.dims[1] != ne1 {
            return Err(tensor_err(
                &name,
                format!(
                    "shape mismatch with the base: lora_a {:?} and lora_b {:?} against {:?} (is this adapter for another model?)",
                    a.dims, b.dims, w.dims
                ),
            ));
        }
        if a.dims[1] != b.dims[0] {
            return Err(tensor_err(
                &name,
                format!(
                    "lora_a {:?} and lora_b {:?} disagree on the rank (lora_a must be transposed)",
                    a.dims, b.dims
                ),
            ));
        }
        let Some(site) = Site::of(&name, n_layer) else {
            unused.push(name);
            continue;
        };
        let rank = b.dims[0] as usize;
        let upload = |t: &TensorInfo| {
            up.upload(&WeightSource {
                file: file.clone(),
                info: t.clone(),
                fold: None,
                inverse: None,
            })
            .map_err(|source| LoraError::Upload {
                path: path.clone(),
                tensor: t.name.clone(),
                source,
            })
        };
        pairs.insert(
            site,
            LoraPair {
                a: upload(a)?,
                b: upload(b)?,
                rank,
            },
        );
    }
    Ok(Adapter {
        path,
        alpha,
        pairs,
        unused,
    })
}
