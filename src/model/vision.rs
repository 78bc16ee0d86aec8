//! The Qwen3-VL projector (`--mmproj`, `clip.projector_type = qwen3vl_merger`): its file, its
//! hparams checked against what llama.cpp's qwen3vl graph assumes, and the tower written once
//! against the backend ops (model-vision.md §1–§3), so it runs on every backend.

use std::path::Path;
use std::sync::Arc;

use super::image::{self, ImageError, Rgb};
use crate::backend::{Backend, BackendError, Uploader, WeightSource};
use crate::gguf::{Gguf, GgufError, TensorInfo};
use crate::tensor::GgmlType;

/// llama.cpp's token limits for Qwen-VL images (`set_limit_image_tokens(8, 4096)`), in merged
/// tokens.
pub const DEFAULT_MIN_TOKENS: usize = 8;
pub const DEFAULT_MAX_TOKENS: usize = 4096;
/// θ of the tower's 2-D rotary (`ggml_rope_multi(..., 10000, ...)` in qwen3vl.cpp).
const ROPE_THETA: f32 = 10000.0;

#[derive(Debug, thiserror::Error)]
pub enum VisionError {
    #[error("{path}: {source}")]
    Gguf { path: String, source: GgufError },
    #[error(
        "{path}: general.architecture is {found:?}, not \"clip\": not a projector (mmproj) file"
    )]
    NotClip { path: String, found: Option<String> },
    #[error("{path}: clip.projector_type is {found:?}; tern runs \"qwen3vl_merger\" (Qwen3-VL / Qwen3.5) projectors only")]
    ProjectorType { path: String, found: Option<String> },
    #[error("{path}: missing metadata key {key:?}")]
    MissingKey { path: String, key: String },
    #[error("{path}: metadata key {key:?}: {why}")]
    BadKey {
        path: String,
        key: String,
        why: String,
    },
    #[error("{path}: missing tensor {name:?}")]
    MissingTensor { path: String, name: String },
    #[error("{path}: tensor {name:?}: shape {found:?}, expected {expected:?}")]
    BadShape {
        path: String,
        name: String,
        found: Vec<u64>,
        expected: Vec<u64>,
    },
    #[error("{path}: tensor {name:?} has type {ty}; projector weights are F32, F16, BF16 or Q8_0")]
    BadType {
        path: String,
        name: String,
        ty: GgmlType,
    },
    #[error("{path}: the projector has deepstack layers ({name:?}); qwen35 text models cannot consume them (llama.cpp refuses the pair too: its output would be {width} wide, the text model's n_embd is {n_embd})")]
    Deepstack {
        path: String,
        name: String,
        width: usize,
        n_embd: usize,
    },
    #[error("{path}: the projector's output width (clip.vision.projection_dim = {proj}) differs from the text model's n_embd = {n_embd}: this projector belongs to another model")]
    WidthMismatch {
        path: String,
        proj: usize,
        n_embd: usize,
    },
    #[error("image tokens: the maximum {max} is less than the minimum {min} (--image-max-tokens / --image-min-tokens over the projector's own {DEFAULT_MIN_TOKENS}..{DEFAULT_MAX_TOKENS}); llama.cpp refuses this too (image_max_pixels is less than image_min_pixels)")]
    TokenLimits { min: usize, max: usize },
    #[error(transparent)]
    Image(#[from] ImageError),
    #[error(transparent)]
    Backend(#[from] BackendError),
}

/// The tower's hparams, each checked.
#[derive(Clone, Debug, PartialEq)]
pub struct VisionConfig {
    pub width: usize,
    pub n_head: usize,
    pub head_dim: usize,
    pub n_ff: usize,
    pub n_layer: usize,
    pub eps: f32,
    pub patch: usize,
    /// Side of the learned position grid, in patches.
    pub pos_side: usize,
    pub merge: usize,
    pub proj_dim: usize,
    pub mean: [f32; 3],
    pub std: [f32; 3],
    pub min_tokens: usize,
    pub max_tokens: usize,
}

/// An image ready for the tower: the grid it was brought to and its normalized pixels.
#[derive(Clone, Debug)]
pub struct Prepared {
    /// Pixels after the resize: multiples of patch × merge.
    pub width: usize,
    pub height: usize,
    /// Planar `[3][height][width]`.
    pub pixels: Vec<f32>,
}

impl Prepared {
    /// The merged-token grid `(rows, cols)`.
    pub fn grid(&self, cfg: &VisionConfig) -> (usize, usize) {
        let a = cfg.patch * cfg.merge;
        (self.height / a, self.width / a)
    }
}

/// A weight and its bias (or a LayerNorm's weight and bias).
type Pair<W> = (W, W);

struct Layer<W> {
    ln1: (W, W),
    ln2: (W, W),
    qkv: (W, W),
    out: (W, W),
    up: (W, W),
    down: (W, W),
}

/// The tower's weights as an [`Uploader`] takes them: a backend's uploads, or the planner's
/// prices of them (one walk of the file serves both, so the two cannot drift apart).
struct Tower<W> {
    patch: [W; 2],
    /// The patch kernels' storage rounds the conv's im2col to f16 (ggml builds im2col in the
    /// kernel's type).
    patch_f16: bool,
    patch_bias: W,
    pre_ln: Option<Pair<W>>,
    layers: Vec<Layer<W>>,
    post_ln: Option<Pair<W>>,
    mm0: Pair<W>,
    mm2: Pair<W>,
}

impl<W> Tower<W> {
    /// Every uploaded weight, in load order.
    fn each(&self, mut f: impl FnMut(&W)) {
        f(&self.patch[0]);
        f(&self.patch[1]);
        f(&self.patch_bias);
        let layers = self
            .layers
            .iter()
            .flat_map(|l| [&l.ln1, &l.ln2, &l.qkv, &l.out, &l.up, &l.down]);
        for (w, b) in self
            .pre_ln
            .iter()
            .chain(layers)
            .chain(self.post_ln.iter())
            .chain([&self.mm0, &self.mm2])
        {
            f(w);
            f(b);
        }
    }
}

/// A loaded projector on backend `B`.
pub struct Projector<B: Backend> {
    pub cfg: VisionConfig,
    pub file: Arc<Gguf>,
    w: Tower<B::W>,
    /// The learned position grid, `[pos_side²][width]`, kept on the host: it is interpolated
    /// to each image's grid there.
    pos: Vec<f32>,
}

/// A projector's hparams and its weights as `up` takes them, walked as [`Projector::load`]
/// walks them: the planner prices a projector through this with a backend's allocation rule.
/// The position grid stays on the host ([`VisionConfig::pos_grid_bytes`]).
pub fn upload_weights<U: Uploader>(
    up: &U,
    file: &Arc<Gguf>,
    n_embd: usize,
) -> Result<(VisionConfig, Vec<U::W>), VisionError>
where
    U::W: Clone,
{
    let (cfg, tower, _) = load_tower(up, file, n_embd)?;
    let mut out = Vec::new();
    tower.each(|w| out.push(w.clone()));
    Ok((cfg, out))
}

fn path_of(file: &Gguf) -> String {
    file.path().display().to_string()
}

fn key_u(file: &Gguf, key: &str) -> Result<usize, VisionError> {
    let v = file.get(key).ok_or_else(|| VisionError::MissingKey {
        path: path_of(file),
        key: key.into(),
    })?;
    match v.as_u64() {
        Some(n) if n > 0 && n < (1 << 24) => Ok(n as usize),
        _ => Err(VisionError::BadKey {
            path: path_of(file),
            key: key.into(),
            why: format!("{v:?} is not a positive count"),
        }),
    }
}

fn key_opt_u(file: &Gguf, key: &str) -> Result<Option<usize>, VisionError> {
    if file.get(key).is_none() {
        return Ok(None);
    }
    key_u(file, key).map(Some)
}

fn key_bool(file: &Gguf, key: &str) -> Result<Option<bool>, VisionError> {
    match file.get(key) {
        None => Ok(None),
        Some(v) => v.as_bool().map(Some).ok_or_else(|| VisionError::BadKey {
            path: path_of(file),
            key: key.into(),
            why: format!("{v:?} is not a boolean"),
        }),
    }
}

fn key_f32x3(file: &Gguf, key: &str) -> Result<[f32; 3], VisionError> {
    let bad = |why: String| VisionError::BadKey {
        path: path_of(file),
        key: key.into(),
        why,
    };
    let v = file.get(key).ok_or_else(|| VisionError::MissingKey {
        path: path_of(file),
        key: key.into(),
    })?;
    let a = v
        .as_array()
        .ok_or_else(|| bad(format!("{v:?} is not an array")))?;
    if a.len() < 3 {
        return Err(bad(format!(
            "{} values; one per RGB channel needed",
            a.len()
        )));
    }
    let mut out = [0f32; 3];
    for (o, x) in out.iter_mut().zip(a) {
        let f = x
            .as_f64()
            .filter(|f| f.is_finite())
            .ok_or_else(|| bad(format!("{x:?} is not a finite number")))?;
        *o = f as f32;
    }
    if key.ends_with("image_std") && out.iter().any(|&s| s <= 0.0) {
        return Err(bad(format!(
            "{out:?}: a standard deviation must be positive"
        )));
    }
    Ok(out)
}

impl VisionConfig {
    /// Reads and checks the hparams of a qwen3vl projector for a text model of width `n_embd`.
    pub fn from_gguf(file: &Gguf, n_embd: usize) -> Result<VisionConfig, VisionError> {
        let path = path_of(file);
        let arch = file.architecture();
        if arch != Some("clip") {
            return Err(VisionError::NotClip {
                path,
                found: arch.map(str::to_string),
            });
        }
        let pt = file
            .get_str("clip.projector_type")
            .or_else(|| file.get_str("clip.vision.projector_type"));
        if pt != Some("qwen3vl_merger") {
            return Err(VisionError::ProjectorType {
                path,
                found: pt.map(str::to_string),
            });
        }
        let bad = |key: &str, why: String| VisionError::BadKey {
            path: path.clone(),
            key: key.into(),
            why,
        };
        if key_bool(file, "clip.has_vision_encoder")? != Some(true) {
            return Err(bad(
                "clip.has_vision_encoder",
                "must be true: the file has no vision tower".into(),
            ));
        }
        // Without use_gelu llama.cpp runs the tower's MLP with gelu_quick (clip.cpp), which no
        // Qwen-VL checkpoint was trained with.
        if key_bool(file, "clip.use_gelu")? != Some(true) {
            return Err(bad(
                "clip.use_gelu",
                "must be true: Qwen3-VL towers use GELU (llama.cpp would fall back to gelu_quick)"
                    .into(),
            ));
        }
        if key_bool(file, "clip.use_silu")? == Some(true) {
            return Err(bad(
                "clip.use_silu",
                "is true: a Qwen3-VL tower uses GELU".into(),
            ));
        }
        let v = |k: &str| format!("clip.vision.{k}");
        let width = key_u(file, &v("embedding_length"))?;
        let n_head = key_u(file, &v("attention.head_count"))?;
        if let Some(kv) = key_opt_u(file, &v("attention.head_count_kv"))? {
            if kv != n_head {
                return Err(bad(
                    &v("attention.head_count_kv"),
                    format!("{kv} differs from head_count {n_head}: the tower has no GQA"),
                ));
            }
        }
        if !width.is_multiple_of(n_head) {
            return Err(bad(
                &v("attention.head_count"),
                format!("{n_head} does not divide embedding_length {width}"),
            ));
        }
        let head_dim = width / n_head;
        if let Some(hd) = key_opt_u(file, &v("attention.head_dim"))? {
            if hd != head_dim {
                return Err(bad(
                    &v("attention.head_dim"),
                    format!("{hd}, but embedding_length / head_count = {head_dim}"),
                ));
            }
        }
        if !head_dim.is_multiple_of(4) {
            return Err(bad(
                &v("attention.head_count"),
                format!("head width {head_dim} is not a multiple of 4 (the 2-D rotary splits it in four)"),
            ));
        }
        let eps_key = v("attention.layer_norm_epsilon");
        let eps = file
            .get(&eps_key)
            .ok_or_else(|| VisionError::MissingKey {
                path: path.clone(),
                key: eps_key.clone(),
            })?
            .as_f64()
            .filter(|e| e.is_finite() && *e > 0.0 && *e < 1.0)
            .ok_or_else(|| bad(&eps_key, "not a small positive number".into()))?
            as f32;
        let patch = key_u(file, &v("patch_size"))?;
        let image_size = key_u(file, &v("image_size"))?;
        let merge = key_opt_u(file, &v("spatial_merge_size"))?.unwrap_or(2);
        // llama.cpp's qwen3vl graph hard-codes the 2x2 merge (its reshapes and positions).
        if merge != 2 {
            return Err(bad(
                &v("spatial_merge_size"),
                format!("{merge}; the Qwen3-VL merger merges 2x2 patches"),
            ));
        }
        let proj_dim = key_u(file, &v("projection_dim"))?;
        let cfg = VisionConfig {
            width,
            n_head,
            head_dim,
            n_ff: key_u(file, &v("feed_forward_length"))?,
            n_layer: key_u(file, &v("block_count"))?,
            eps,
            patch,
            pos_side: 0,
            merge,
            proj_dim,
            mean: key_f32x3(file, &v("image_mean"))?,
            std: key_f32x3(file, &v("image_std"))?,
            min_tokens: DEFAULT_MIN_TOKENS,
            max_tokens: DEFAULT_MAX_TOKENS,
        };
        if let Some(t) = file
            .tensors()
            .iter()
            .find(|t| t.name.starts_with("v.deepstack."))
        {
            return Err(VisionError::Deepstack {
                path,
                name: t.name.clone(),
                width: proj_dim,
                n_embd,
            });
        }
        if proj_dim != n_embd {
            return Err(VisionError::WidthMismatch {
                path,
                proj: proj_dim,
                n_embd,
            });
        }
        if !image_size.is_multiple_of(patch) {
            return Err(bad(
                &v("image_size"),
                format!("{image_size} is not a whole number of {patch}-pixel patches"),
            ));
        }
        Ok(cfg)
    }

    /// Applies `--image-min-tokens` / `--image-max-tokens` over the projector's own limits, as
    /// llama.cpp's `set_limit_image_tokens` does (`None` keeps the projector's); a maximum
    /// under the minimum is refused as llama.cpp refuses it.
    pub fn set_token_limits(
        &mut self,
        min: Option<usize>,
        max: Option<usize>,
    ) -> Result<(), VisionError> {
        let min = min.unwrap_or(DEFAULT_MIN_TOKENS);
        let max = max.unwrap_or(DEFAULT_MAX_TOKENS);
        if max < min {
            return Err(VisionError::TokenLimits { min, max });
        }
        (self.min_tokens, self.max_tokens) = (min, max);
        Ok(())
    }

    /// Merged tokens of the largest image the size rule lets through: `max_tokens`, or more
    /// when a large `min_tokens` scales a thin image up, since the rule rounds each scaled side
    /// up and does not re-check the maximum (llama.cpp gives a 300 x 300-token-limited 512 px
    /// image 18 x 18 = 324 tokens). A side of `x = w·β/A` and `y = h·β/A` tokens with
    /// `x·y = M` becomes `⌈x⌉·⌈y⌉ < M + 1 + x + y`; the branch is taken only while the
    /// rounded area is under `M` tokens, which keeps `h/w` under `(M + ½)·A`, so
    /// `y ≤ √(M·(M + ½)·A)`.
    pub fn worst_case_tokens(&self) -> usize {
        let m = self.min_tokens as f64;
        let a = (self.patch * self.merge) as f64;
        let overshoot = m + 2.0 + (m * (m + 0.5) * a).sqrt();
        self.max_tokens.max(overshoot.ceil() as usize)
    }

    /// Patches in the largest image the size rule lets through (`merge²` per token).
    pub fn max_patches(&self) -> usize {
        self.worst_case_tokens()
            .saturating_mul(self.merge * self.merge)
    }

    /// The merged-token grid `(rows, cols)` of a worst-case image: exactly
    /// [`worst_case_tokens`](Self::worst_case_tokens) (an image of `cols·A x rows·A` pixels
    /// keeps its size under the rule when that is `max_tokens`), as square as the count's
    /// divisors allow.
    pub fn worst_case_grid(&self) -> (usize, usize) {
        let n = self.worst_case_tokens().max(1);
        let rows = (1..=n.isqrt())
            .rev()
            .find(|r| n.is_multiple_of(*r))
            .unwrap_or(1);
        (rows, n / rows)
    }

    /// Bytes of the learned position grid the projector keeps on the host as f32.
    pub fn pos_grid_bytes(&self) -> u64 {
        (self.pos_side as u64)
            .saturating_mul(self.pos_side as u64)
            .saturating_mul(self.width as u64)
            .saturating_mul(4)
    }

    /// The pixel size an image of `width x height` is brought to (model-vision.md §2).
    pub fn target_size(&self, width: usize, height: usize) -> (usize, usize) {
        let a = self.patch * self.merge;
        image::target_size(
            width,
            height,
            a,
            self.min_tokens * a * a,
            self.max_tokens * a * a,
        )
    }

    /// Decodes, sizes, resizes and normalizes an image file's bytes.
    pub fn prepare(&self, bytes: &[u8]) -> Result<Prepared, VisionError> {
        let img = image::decode(bytes)?;
        self.prepare_rgb(&img)
    }

    pub fn prepare_rgb(&self, img: &Rgb) -> Result<Prepared, VisionError> {
        let (tw, th) = self.target_size(img.width, img.height);
        let fitted = image::fit(img, tw, th)?;
        Ok(Prepared {
            width: tw,
            height: th,
            pixels: image::normalize(&fitted, self.mean, self.std),
        })
    }
}

/// Checks every tensor of the tower against the hparams and hands each weight to `up`; the
/// position grid is returned unread.
fn load_tower<U: Uploader>(
    up: &U,
    file: &Arc<Gguf>,
    n_embd: usize,
) -> Result<(VisionConfig, Tower<U::W>, WeightSource), VisionError> {
    let mut cfg = VisionConfig::from_gguf(file, n_embd)?;
    let path = path_of(file);

    let (w, ff, p) = (cfg.width as u64, cfg.n_ff as u64, cfg.patch as u64);
    let info = |name: &str| -> Result<TensorInfo, VisionError> {
        file.tensor(name)
            .cloned()
            .ok_or_else(|| VisionError::MissingTensor {
                path: path.clone(),
                name: name.into(),
            })
    };
    let check = |name: &str, expected: &[u64]| -> Result<TensorInfo, VisionError> {
        let t = info(name)?;
        if t.dims != expected {
            return Err(VisionError::BadShape {
                path: path.clone(),
                name: name.into(),
                found: t.dims.clone(),
                expected: expected.to_vec(),
            });
        }
        if !matches!(
            t.ty,
            GgmlType::F32 | GgmlType::F16 | GgmlType::BF16 | GgmlType::Q8_0
        ) {
            return Err(VisionError::BadType {
                path: path.clone(),
                name: name.into(),
                ty: t.ty,
            });
        }
        Ok(t)
    };
    let upload = |t: TensorInfo| -> Result<U::W, VisionError> {
        Ok(up.upload(&WeightSource {
            file: file.clone(),
            info: t,
            fold: None,
            inverse: None,
        })?)
    };
    let wb = |name: &str, dims: &[u64], bias: &[u64]| -> Result<Pair<U::W>, VisionError> {
        Ok((
            upload(check(&format!("{name}.weight"), dims)?)?,
            upload(check(&format!("{name}.bias"), bias)?)?,
        ))
    };
    let ln = |name: &str| wb(name, &[w], &[w]);
    let optional_ln = |name: &str| -> Result<Option<Pair<U::W>>, VisionError> {
        if file.tensor(&format!("{name}.weight")).is_none() {
            return Ok(None);
        }
        ln(name).map(Some)
    };
    // The conv kernels as matrices: one row of (channel, ky, kx) per output channel, the
    // layout of the host im2col's rows.
    let as_matrix = |mut t: TensorInfo| {
        t.dims = vec![3 * p * p, w];
        t
    };
    let k0 = as_matrix(check("v.patch_embd.weight", &[p, p, 3, w])?);
    let k1 = as_matrix(check("v.patch_embd.weight.1", &[p, p, 3, w])?);
    let patch_f16 = k0.ty != GgmlType::F32;
    if k1.ty != k0.ty {
        return Err(VisionError::BadType {
            path: path.clone(),
            name: "v.patch_embd.weight.1".into(),
            ty: k1.ty,
        });
    }
    let pos_info = info("v.position_embd.weight")?;
    let n_pos = pos_info.dims.get(1).copied().unwrap_or(0);
    let side = (n_pos as f64).sqrt().round() as u64;
    if pos_info.dims.len() != 2 || pos_info.dims[0] != w || side * side != n_pos || side < 2 {
        return Err(VisionError::BadShape {
            path: path.clone(),
            name: "v.position_embd.weight".into(),
            found: pos_info.dims.clone(),
            expected: vec![w, side.max(2) * side.max(2)],
        });
    }
    cfg.pos_side = side as usize;
    let pos = WeightSource {
        file: file.clone(),
        info: check("v.position_embd.weight", &[w, n_pos])?,
        fold: None,
        inverse: None,
    };
    let mut layers = Vec::with_capacity(cfg.n_layer);
    for il in 0..cfg.n_layer {
        let b = |s: &str| format!("v.blk.{il}.{s}");
        layers.push(Layer {
            ln1: ln(&b("ln1"))?,
            ln2: ln(&b("ln2"))?,
            qkv: wb(&b("attn_qkv"), &[w, 3 * w], &[3 * w])?,
            out: wb(&b("attn_out"), &[w, w], &[w])?,
            up: wb(&b("ffn_up"), &[w, ff], &[ff])?,
            down: wb(&b("ffn_down"), &[ff, w], &[w])?,
        });
    }
    let mm0_info = info("mm.0.weight")?;
    let mid = mm0_info.dims.get(1).copied().unwrap_or(0);
    let proj = cfg.proj_dim as u64;
    let tower = Tower {
        patch: [upload(k0)?, upload(k1)?],
        patch_f16,
        patch_bias: upload(check("v.patch_embd.bias", &[w])?)?,
        pre_ln: optional_ln("v.pre_ln")?,
        layers,
        post_ln: optional_ln("v.post_ln")?,
        mm0: wb("mm.0", &[4 * w, mid], &[mid])?,
        mm2: wb("mm.2", &[mid, proj], &[proj])?,
    };
    Ok((cfg, tower, pos))
}

impl<B: Backend> Projector<B> {
    /// Opens and uploads a projector for a text model of width `n_embd`.
    pub fn open(be: &B, path: impl AsRef<Path>, n_embd: usize) -> Result<Self, VisionError> {
        let p = path.as_ref();
        let file = Gguf::open(p).map_err(|source| VisionError::Gguf {
            path: p.display().to_string(),
            source,
        })?;
        Self::load(be, Arc::new(file), n_embd)
    }

    pub fn load(be: &B, file: Arc<Gguf>, n_embd: usize) -> Result<Self, VisionError> {
        let (cfg, w, pos) = load_tower(be, &file, n_embd)?;
        Ok(Projector {
            cfg,
            w,
            pos: pos.decoded()?,
            file,
        })
    }

    /// Sets `--image-min-tokens` / `--image-max-tokens` (`None` keeps the projector's own).
    pub fn set_token_limits(
        &mut self,
        min: Option<usize>,
        max: Option<usize>,
    ) -> Result<(), VisionError> {
        self.cfg.set_token_limits(min, max)
    }

    /// Every weight as uploaded (the boot ledger's projector line).
    pub fn each_weight(&self, f: impl FnMut(&B::W)) {
        self.w.each(f)
    }

    /// The tower over one prepared image: `[n_tokens, proj_dim]` embeddings in merged-token
    /// order (row-major over the merged grid).
    pub fn encode(&self, be: &B, img: &Prepared) -> B::T {
        let c = &self.cfg;
        let (gy, gx) = (img.height / c.patch, img.width / c.patch);
        let n = gy * gx;
        let cols = self.im2col(img);
        let x0 = be.from_host(&cols, n, 3 * c.patch * c.patch);
        // Both time halves of the Conv3D see the one frame; ggml adds the two products.
        let mut x = be.matmul(&self.w.patch[0], &x0);
        be.add_assign(&mut x, &be.matmul(&self.w.patch[1], &x0));
        be.add_bias(&mut x, &self.w.patch_bias);
        let pos = self.positions(gy, gx);
        be.add_assign(&mut x, &be.from_host(&pos, n, c.width));
        if let Some((w, b)) = &self.w.pre_ln {
            x = be.layer_norm(&x, w, b, c.eps);
        }
        let rope = crate::backend::vision_rope_table(gy, gx, c.head_dim, ROPE_THETA);
        for l in &self.w.layers {
            let h = be.layer_norm(&x, &l.ln1.0, &l.ln1.1, c.eps);
            let mut qkv = be.matmul(&l.qkv.0, &h);
            be.add_bias(&mut qkv, &l.qkv.1);
            let a = be.vision_attention(&qkv, c.n_head, c.head_dim, &rope);
            let mut o = be.matmul(&l.out.0, &a);
            be.add_bias(&mut o, &l.out.1);
            be.add_assign(&mut x, &o);
            let h = be.layer_norm(&x, &l.ln2.0, &l.ln2.1, c.eps);
            let mut u = be.matmul(&l.up.0, &h);
            be.add_bias(&mut u, &l.up.1);
            let mut d = be.matmul(&l.down.0, &be.gelu(&u));
            be.add_bias(&mut d, &l.down.1);
            be.add_assign(&mut x, &d);
        }
        if let Some((w, b)) = &self.w.post_ln {
            x = be.layer_norm(&x, w, b, c.eps);
        }
        // Four consecutive patches (one 2x2 block, in merge order) become one row.
        let merged = be.reshape(x, n / 4, 4 * c.width);
        let mut m = be.matmul(&self.w.mm0.0, &merged);
        be.add_bias(&mut m, &self.w.mm0.1);
        let mut out = be.matmul(&self.w.mm2.0, &be.gelu(&m));
        be.add_bias(&mut out, &self.w.mm2.1);
        out
    }

    /// The conv's im2col on the host, one row per patch in the tower's token order (2x2 merge
    /// blocks row-major, inside a block (0,0) (0,1) (1,0) (1,1)), each row `(channel, ky, kx)`
    /// as the kernel's rows; rounded to f16 when the kernel is stored in 16 bits, as ggml
    /// builds im2col in the kernel's type.
    fn im2col(&self, img: &Prepared) -> Vec<f32> {
        let p = self.cfg.patch;
        let (w, h) = (img.width, img.height);
        let plane = w * h;
        let mut out = Vec::with_capacity(3 * plane);
        for (py, px) in merge_order(h / p, w / p) {
            for ch in 0..3 {
                for ky in 0..p {
                    let at = ch * plane + (py * p + ky) * w + px * p;
                    out.extend_from_slice(&img.pixels[at..at + p]);
                }
            }
        }
        if self.w.patch_f16 {
            for v in &mut out {
                *v = half::f16::from_f32(*v).to_f32();
            }
        }
        out
    }

    /// The learned position grid resized bilinear with aligned corners to `gy x gx` (ggml's
    /// `ggml_interpolate`, in its f32 order of operations), in token order.
    fn positions(&self, gy: usize, gx: usize) -> Vec<f32> {
        let (s, e) = (self.cfg.pos_side, self.cfg.width);
        let at = |x: usize, y: usize| &self.pos[(y * s + x) * e..(y * s + x + 1) * e];
        let mut out = Vec::with_capacity(gy * gx * e);
        let same = gy == s && gx == s;
        let sf = |n_out: usize| (n_out as f32 - 1.0) / (s as f32 - 1.0);
        let (sf0, sf1) = (sf(gx), sf(gy));
        let corner = |i: usize, sf: f32| {
            let v = i as f32 / sf;
            let i0 = (v.floor() as i64).clamp(0, s as i64 - 1) as usize;
            let i1 = (v.floor() as i64 + 1).clamp(0, s as i64 - 1) as usize;
            let d = (v - i0 as f32).clamp(0.0, 1.0);
            (i0, i1, d)
        };
        for (py, px) in merge_order(gy, gx) {
            if same {
                out.extend_from_slice(at(px, py));
                continue;
            }
            let (y0, y1, dy) = corner(py, sf1);
            let (x0, x1, dx) = corner(px, sf0);
            let (a, b, c, d) = (at(x0, y0), at(x1, y0), at(x0, y1), at(x1, y1));
            for k in 0..e {
                out.push(
                    a[k] * (1.0 - dx) * (1.0 - dy)
                        + b[k] * dx * (1.0 - dy)
                        + c[k] * (1.0 - dx) * dy
                        + d[k] * dx * dy,
                );
            }
        }
        out
    }
}

/// llama.cpp's default media marker: where a prompt's image goes.
pub const MEDIA_MARKER: &str = "<__media__>";
/// The text tokens mtmd wraps a Qwen-VL image in (ordinary vocabulary entries).
pub const VISION_START: &str = "<|vision_start|>";
pub const VISION_END: &str = "<|vision_end|>";

/// One piece of a prompt with images: text token ids, or the index of an image.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Piece {
    Text(Vec<u32>),
    Image(usize),
}

/// Tokenizes a prompt as mtmd does: each marker becomes `<|vision_start|>`, the image,
/// `<|vision_end|>`, and the text between markers is tokenized with special tokens parsed.
/// The prompt must hold exactly `n_images` markers.
pub fn tokenize_with_media(
    tok: &crate::tokenizer::Tokenizer,
    prompt: &str,
    n_images: usize,
) -> Result<Vec<Piece>, MediaError> {
    tokenize_with_marker(tok, prompt, MEDIA_MARKER, n_images)
}

/// [`tokenize_with_media`] with another marker (llama-server draws a random one per process,
/// so that no text a user writes can become an image).
pub fn tokenize_with_marker(
    tok: &crate::tokenizer::Tokenizer,
    prompt: &str,
    marker: &str,
    n_images: usize,
) -> Result<Vec<Piece>, MediaError> {
    let n_markers = prompt.matches(marker).count();
    if n_markers != n_images {
        return Err(MediaError::MarkerCount {
            markers: n_markers,
            images: n_images,
        });
    }
    for t in [VISION_START, VISION_END] {
        if tok.token_id(t).is_none() {
            return Err(MediaError::NoWrapperToken(t));
        }
    }
    let wrapped = prompt.replace(marker, &format!("{VISION_START}{marker}{VISION_END}"));
    let mut out = Vec::new();
    for (i, text) in wrapped.split(marker).enumerate() {
        if i > 0 {
            out.push(Piece::Image(i - 1));
        }
        if !text.is_empty() {
            out.push(Piece::Text(tok.encode(text, i == 0, true)?));
        }
    }
    Ok(out)
}

#[derive(Debug, thiserror::Error)]
pub enum MediaError {
    #[error("the prompt has {markers} {MEDIA_MARKER} marker(s) for {images} image(s): give one marker per image")]
    MarkerCount { markers: usize, images: usize },
    #[error("the text model's vocabulary has no {0} token, which a Qwen-VL image needs around it")]
    NoWrapperToken(&'static str),
    #[error(transparent)]
    Tokenizer(#[from] crate::tokenizer::TokenizerError),
}

/// Patch coordinates `(row, col)` of a `gy x gx` grid in the tower's token order.
fn merge_order(gy: usize, gx: usize) -> impl Iterator<Item = (usize, usize)> {
    (0..gy).step_by(2).flat_map(move |y| {
        (0..gx)
            .step_by(2)
            .flat_map(move |x| [(y, x), (y, x + 1), (y + 1, x), (y + 1, x + 1)])
    })
}

#[cfg(test)]
mod tests {
    #[test]
    fn merge_order_is_blocks_then_quads() {
        let v: Vec<_> = super::merge_order(2, 4).collect();
        assert_eq!(
            v,
            [
                (0, 0),
                (0, 1),
                (1, 0),
                (1, 1),
                (0, 2),
                (0, 3),
                (1, 2),
                (1, 3)
            ]
        );
    }
}
