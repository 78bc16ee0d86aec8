//! The PrismML Hadamard fold (`prism.hadamard.*`, see docs/format-pq2_0.md §5).
//!
//! Folded weights are stored as `w_latent = H_blk(s ⊙ w)`: the sign vector `s` of the weight's
//! input width, then the normalized Sylvester–Walsh–Hadamard transform on each `block_size`-wide
//! block. Because `H_blk` is orthogonal and its own inverse, `<w_latent, H_blk(s ⊙ x)> = <w, x>`,
//! so a folded matmul runs on the stored weights once its input gets the same transform
//! (`forward_in_place`), and a folded embedding row is recovered as `s ⊙ H_blk(z)`
//! (`inverse_in_place`). The residual stream itself is never rotated.

use std::collections::{BTreeMap, BTreeSet};

use crate::gguf::{Gguf, Value};
use crate::tensor::GgmlType;

const PREFIX: &str = "prism.hadamard.";
const K_VERSION: &str = "prism.hadamard.version";
const K_BLOCK_SIZE: &str = "prism.hadamard.block_size";
const K_TRANSFORM: &str = "prism.hadamard.transform";
const K_AXIS: &str = "prism.hadamard.axis";
const K_SIGN_MODE: &str = "prism.hadamard.sign_mode";
const K_SIGN_WIDTHS: &str = "prism.hadamard.sign_widths";
const K_SIGN_VALUES: &str = "prism.hadamard.sign_values";
const K_WEIGHT_NAMES: &str = "prism.hadamard.weight_names";
const K_INVERSE_NAMES: &str = "prism.hadamard.inverse_weight_names";
const K_GDN_V_GROUPED: &str = "prism.hadamard.gdn_v_grouped";
const K_TIED_OUTPUT: &str = "prism.hadamard.tied_output";

pub const TRANSFORM: &str = "normalized-sylvester-walsh-hadamard";
pub const AXIS: &str = "input-last-dimension";
/// The only table whose rows are un-rotated after a lookup.
pub const INVERSE_NAME: &str = "token_embd.weight";
/// The architectures whose graphs apply the transforms; PrismML's fork whitelists the same.
pub const ARCHITECTURES: [&str; 2] = ["qwen35", "qwen35moe"];

/// Per-layer matmul weights (`blk.N.<kind>.weight`) whose input may carry the fold: exactly the
/// matmuls whose input is an activation vector the runtime can transform. Norms, convolutions,
/// `ssm_a`/`ssm_dt` and the embedding (a lookup, handled by the inverse rule) are not matmuls
/// over an activation and can never be folded.
const FOLDABLE_KINDS: [&str; 22] = [
    "attn_q",
    "attn_k",
    "attn_v",
    "attn_output",
    "attn_qkv",
    "attn_gate",
    "ffn_gate",
    "ffn_up",
    "ffn_down",
    "ssm_out",
    "ssm_alpha",
    "ssm_beta",
    "nextn.eh_proj",
    "nextn.shared_head_head",
    // qwen35moe: the router and the expert/shared-expert projections are matmuls over the same
    // activations and go through the fork's `build_lora_mm_id` fold as well.
    "ffn_gate_inp",
    "ffn_gate_inp_shexp",
    "ffn_gate_exps",
    "ffn_up_exps",
    "ffn_down_exps",
    "ffn_gate_shexp",
    "ffn_up_shexp",
    "ffn_down_shexp",
];

/// Whether `name` is a tensor kind the fold may apply to.
pub fn is_foldable_name(name: &str) -> bool {
    if name == "output.weight" {
        return true;
    }
    let Some(rest) = name.strip_prefix("blk.") else {
        return false;
    };
    let Some((layer, rest)) = rest.split_once('.') else {
        return false;
    };
    if layer.is_empty() || !layer.bytes().all(|b| b.is_ascii_digit()) {
        return false;
    }
    rest.strip_suffix(".weight")
        .is_some_and(|kind| FOLDABLE_KINDS.contains(&kind))
}

/// In-place normalized fast Walsh–Hadamard transform of a power-of-two-length vector: equal to
/// multiplying by `H[r][c] = (-1)^popcount(r & c) / sqrt(n)`.
///
/// The scale comes first and the butterflies run in natural order with `len = 1, 2, ..., n/2`,
/// as ggml's CPU `fwht` does, so the float results match it (for n = 1024 the scale 1/32 is
/// exact and the order would not matter anyway).
pub fn fwht_normalized(x: &mut [f32]) {
    let n = x.len();
    assert!(
        n.is_power_of_two(),
        "fwht_normalized: length {n} is not a power of two"
    );
    let scale = 1.0 / (n as f32).sqrt();
    for v in x.iter_mut() {
        *v *= scale;
    }
    let mut len = 1;
    while len < n {
        for pair in x.chunks_exact_mut(2 * len) {
            let (a, b) = pair.split_at_mut(len);
            for (u, v) in a.iter_mut().zip(b.iter_mut()) {
                let (p, q) = (*u, *v);
                *u = p + q;
                *v = p - q;
            }
        }
        len *= 2;
    }
}

/// `fwht_normalized` on each independent `block`-wide slice of `x`.
pub fn fwht_blockwise(x: &mut [f32], block: usize) {
    assert!(
        block > 0 && x.len().is_multiple_of(block),
        "fwht_blockwise: length {} is not a multiple of the block {block}",
        x.len()
    );
    for b in x.chunks_exact_mut(block) {
        fwht_normalized(b);
    }
}

#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum SignMode {
    /// `s` is read from `sign_values`, one ±1 vector per input width.
    Explicit,
    /// `s` is all +1.
    Identity,
}

/// Why a file's `prism.hadamard.*` metadata was refused. A missed or wrong transform still
/// loads and then produces garbage, so every inconsistency is fatal and names its cause.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum HadamardError {
    #[error(
        "prism.hadamard.* is only defined for architectures {ARCHITECTURES:?}, this file is {0:?}"
    )]
    UnsupportedArchitecture(Option<String>),
    #[error("{0} is missing (required once any prism.hadamard.* key is present)")]
    MissingKey(&'static str),
    #[error("{key} has type {found}, expected {expected}")]
    WrongType {
        key: &'static str,
        expected: &'static str,
        found: String,
    },
    #[error("prism.hadamard.version = {0}: tern understands versions 1 and 2")]
    UnsupportedVersion(i64),
    #[error("prism.hadamard.block_size = {0} is not a power of two")]
    BlockSizeNotPowerOfTwo(i64),
    #[error("prism.hadamard.transform = {0:?}, expected {TRANSFORM:?}")]
    UnsupportedTransform(String),
    #[error("prism.hadamard.axis = {0:?}, expected {AXIS:?}")]
    UnsupportedAxis(String),
    #[error("prism.hadamard.sign_mode = {0:?}, expected \"explicit\" or \"identity\"")]
    UnsupportedSignMode(String),
    #[error("prism.hadamard.sign_widths[{index}] = {width} is not a positive width")]
    BadSignWidth { index: usize, width: i64 },
    #[error("prism.hadamard.sign_widths lists width {0} twice")]
    DuplicateSignWidth(usize),
    #[error("prism.hadamard.sign_widths sum to {expected} but prism.hadamard.sign_values has {actual} entries")]
    SignLengthMismatch { expected: u64, actual: usize },
    #[error("prism.hadamard.sign_values[{index}] = {value} is not +1 or -1")]
    BadSignValue { index: usize, value: f64 },
    #[error("{key} names tensor {name:?}, which the file does not contain")]
    UnknownTensor { key: &'static str, name: String },
    #[error("prism.hadamard.weight_names: {0:?} is not a foldable matmul weight")]
    NotFoldable(String),
    #[error("prism.hadamard: tensor {name:?} has ne0 = {ne0}, not a multiple of block_size {block_size}")]
    NotBlockMultiple {
        name: String,
        ne0: u64,
        block_size: usize,
    },
    #[error("prism.hadamard: tensor {name:?} needs a sign vector of width {width}, and sign_widths has none")]
    MissingSignWidth { name: String, width: u64 },
    #[error("prism.hadamard.inverse_weight_names: {0:?} is not allowed (only {INVERSE_NAME:?} is un-rotated after lookup)")]
    BadInverseName(String),
    #[error("prism.hadamard.weight_names is empty, but tensor {name:?} is {ty}: ternary weights are stored folded and would be used without their transform")]
    NothingFolded { name: String, ty: GgmlType },
    #[error("prism.hadamard.tied_output is true but the file has its own output.weight")]
    TiedOutputWithOutput,
    #[error("GDN permutation: width {width} with {n_v} value heads in {n_k} key groups does not divide evenly")]
    BadGdnGeometry {
        width: usize,
        n_v: usize,
        n_k: usize,
    },
}

/// Parsed and validated `prism.hadamard.*` metadata.
#[derive(Clone, Debug)]
pub struct HadamardConfig {
    pub version: u32,
    pub block_size: usize,
    /// Folded `ssm_out` weights keep the grouped V-head column order; their input must be
    /// permuted from tiled to grouped first (`GdnPermutation`).
    pub gdn_v_grouped: bool,
    /// `prism.hadamard.tied_output` (version 2): the output projection reuses `token_embd`,
    /// whose rows are stored folded, so that matmul's input needs `forward_in_place` too.
    pub tied_output: bool,
    pub sign_mode: SignMode,
    signs: BTreeMap<usize, Vec<f32>>,
    /// Folded weight name -> its input width (ne0).
    folded: BTreeMap<String, usize>,
    inverse: BTreeSet<String>,
}

impl HadamardConfig {
    /// `Ok(None)` when the file has no `prism.hadamard.*` keys; otherwise the validated config,
    /// refusing anything the runtime could not apply exactly.
    pub fn from_gguf(g: &Gguf) -> Result<Option<HadamardConfig>, HadamardError> {
        if !g.metadata().iter().any(|(k, _)| k.starts_with(PREFIX)) {
            return Ok(None);
        }
        let arch = g.architecture();
        if !arch.is_some_and(|a| ARCHITECTURES.contains(&a)) {
            return Err(HadamardError::UnsupportedArchitecture(
                arch.map(str::to_string),
            ));
        }

        let version = int(g, K_VERSION)?;
        if !(1..=2).contains(&version) {
            return Err(HadamardError::UnsupportedVersion(version));
        }
        let block = int(g, K_BLOCK_SIZE)?;
        if block <= 0 || !(block as u64).is_power_of_two() {
            return Err(HadamardError::BlockSizeNotPowerOfTwo(block));
        }
        let block_size = block as usize;
        let transform = string(g, K_TRANSFORM)?;
        if transform != TRANSFORM {
            return Err(HadamardError::UnsupportedTransform(transform.to_string()));
        }
        let axis = string(g, K_AXIS)?;
        if axis != AXIS {
            return Err(HadamardError::UnsupportedAxis(axis.to_string()));
        }
        let sign_mode = match string(g, K_SIGN_MODE)? {
            "explicit" => SignMode::Explicit,
            "identity" => SignMode::Identity,
            other => return Err(HadamardError::UnsupportedSignMode(other.to_string())),
        };
        let gdn_v_grouped = optional_bool(g, K_GDN_V_GROUPED)?.unwrap_or(false);
        let tied_output = optional_bool(g, K_TIED_OUTPUT)?.unwrap_or(false);

        let signs = match sign_mode {
            SignMode::Explicit => parse_signs(g)?,
            // Identity files have nothing to multiply by; any sign arrays they carry are unused.
            SignMode::Identity => BTreeMap::new(),
        };

        // Checks shared by folded weights and inverse tables: the tensor exists, its rows split
        // into whole blocks, and there is a sign vector for its width.
        let check_tensor = |key: &'static str, name: &str| -> Result<usize, HadamardError> {
            let t = g.tensor(name).ok_or_else(|| HadamardError::UnknownTensor {
                key,
                name: name.to_string(),
            })?;
            let ne0 = t.ne0();
            if ne0 % block_size as u64 != 0 {
                return Err(HadamardError::NotBlockMultiple {
                    name: name.to_string(),
                    ne0,
                    block_size,
                });
            }
            if sign_mode == SignMode::Explicit && !signs.contains_key(&(ne0 as usize)) {
                return Err(HadamardError::MissingSignWidth {
                    name: name.to_string(),
                    width: ne0,
                });
            }
            Ok(ne0 as usize)
        };

        let mut folded = BTreeMap::new();
        for name in string_array(g, K_WEIGHT_NAMES)? {
            if !is_foldable_name(name) {
                return Err(HadamardError::NotFoldable(name.to_string()));
            }
            let width = check_tensor(K_WEIGHT_NAMES, name)?;
            folded.insert(name.to_string(), width);
        }

        let mut inverse = BTreeSet::new();
        if g.get(K_INVERSE_NAMES).is_some() {
            for name in string_array(g, K_INVERSE_NAMES)? {
                if name != INVERSE_NAME {
                    return Err(HadamardError::BadInverseName(name.to_string()));
                }
                check_tensor(K_INVERSE_NAMES, name)?;
                inverse.insert(name.to_string());
            }
        }

        // A fold that names nothing beside ternary weights: PrismML's ternary tensors are
        // stored folded, so they would be multiplied without their transform.
        if folded.is_empty() {
            if let Some(t) = g
                .tensors()
                .iter()
                .find(|t| is_ternary(t.ty) && !inverse.contains(&t.name))
            {
                return Err(HadamardError::NothingFolded {
                    name: t.name.clone(),
                    ty: t.ty,
                });
            }
        }
        if tied_output && g.tensor("output.weight").is_some() {
            return Err(HadamardError::TiedOutputWithOutput);
        }

        Ok(Some(HadamardConfig {
            version: version as u32,
            block_size,
            gdn_v_grouped,
            tied_output,
            sign_mode,
            signs,
            folded,
            inverse,
        }))
    }

    /// Whether `name` is stored folded: its matmul input needs `forward_in_place`.
    pub fn is_folded(&self, name: &str) -> bool {
        self.folded.contains_key(name)
    }

    /// Whether rows looked up from `name` need `inverse_in_place`.
    pub fn is_inverse(&self, name: &str) -> bool {
        self.inverse.contains(name)
    }

    /// Folded weight names, sorted.
    pub fn folded_names(&self) -> impl Iterator<Item = &str> {
        self.folded.keys().map(String::as_str)
    }

    /// Inverse-lookup table names, sorted.
    pub fn inverse_names(&self) -> impl Iterator<Item = &str> {
        self.inverse.iter().map(String::as_str)
    }

    /// The input width (ne0) of a folded weight.
    pub fn folded_width(&self, name: &str) -> Option<usize> {
        self.folded.get(name).copied()
    }

    /// Whether the folded weight `name` also needs the GDN tiled-to-grouped permutation on its
    /// input (before the signs and FWHT).
    pub fn needs_gdn_permutation(&self, name: &str) -> bool {
        self.gdn_v_grouped && name.ends_with(".ssm_out.weight") && self.is_folded(name)
    }

    /// The sign widths present, ascending.
    pub fn sign_widths(&self) -> impl Iterator<Item = usize> + '_ {
        self.signs.keys().copied()
    }

    /// The ±1 vector for inputs of `width`; `None` in identity mode (all +1) or for a width the
    /// file has no vector for.
    pub fn signs(&self, width: usize) -> Option<&[f32]> {
        self.signs.get(&width).map(Vec::as_slice)
    }

    fn apply_signs(&self, x: &mut [f32]) {
        if self.sign_mode == SignMode::Identity {
            return;
        }
        let s = self.signs(x.len()).unwrap_or_else(|| {
            panic!(
                "prism.hadamard: no sign vector for width {} (validated widths: {:?})",
                x.len(),
                self.signs.keys()
            )
        });
        for (v, s) in x.iter_mut().zip(s) {
            *v *= s;
        }
    }

    /// Forward rule on a folded matmul's input (x has the weight's ne0 width): `x ⊙ s`, then
    /// the blockwise normalized FWHT. The GDN permutation, where needed, comes before this.
    pub fn forward_in_place(&self, x: &mut [f32]) {
        self.apply_signs(x);
        fwht_blockwise(x, self.block_size);
    }

    /// Inverse rule after an embedding lookup: blockwise FWHT, then `⊙ s`.
    pub fn inverse_in_place(&self, z: &mut [f32]) {
        fwht_blockwise(z, self.block_size);
        self.apply_signs(z);
    }
}

/// The PrismML ternary layouts, which the fork only writes Hadamard-folded.
fn is_ternary(ty: GgmlType) -> bool {
    matches!(
        ty,
        GgmlType::PQ2_0 | GgmlType::PTQ1_0 | GgmlType::Q2_0Legacy
    )
}

fn type_name(v: &Value) -> String {
    match v {
        Value::Array(ty, _) => format!("array of {}", ty.name()),
        other => other.value_type().name().to_string(),
    }
}

fn required<'a>(g: &'a Gguf, key: &'static str) -> Result<&'a Value, HadamardError> {
    g.get(key).ok_or(HadamardError::MissingKey(key))
}

fn int(g: &Gguf, key: &'static str) -> Result<i64, HadamardError> {
    let v = required(g, key)?;
    match v {
        Value::Bool(_) => None,
        _ => v.as_i64(),
    }
    .ok_or_else(|| HadamardError::WrongType {
        key,
        expected: "integer",
        found: type_name(v),
    })
}

fn string<'a>(g: &'a Gguf, key: &'static str) -> Result<&'a str, HadamardError> {
    let v = required(g, key)?;
    v.as_str().ok_or_else(|| HadamardError::WrongType {
        key,
        expected: "string",
        found: type_name(v),
    })
}

fn optional_bool(g: &Gguf, key: &'static str) -> Result<Option<bool>, HadamardError> {
    match g.get(key) {
        None => Ok(None),
        Some(v) => v
            .as_bool()
            .map(Some)
            .ok_or_else(|| HadamardError::WrongType {
                key,
                expected: "bool",
                found: type_name(v),
            }),
    }
}

fn string_array<'a>(g: &'a Gguf, key: &'static str) -> Result<Vec<&'a str>, HadamardError> {
    let v = required(g, key)?;
    let wrong = || HadamardError::WrongType {
        key,
        expected: "array of string",
        found: type_name(v),
    };
    v.as_array()
        .ok_or_else(wrong)?
        .iter()
        .map(|e| e.as_str().ok_or_else(wrong))
        .collect()
}

fn int_array(g: &Gguf, key: &'static str) -> Result<Vec<i64>, HadamardError> {
    let v = required(g, key)?;
    let wrong = || HadamardError::WrongType {
        key,
        expected: "array of integer",
        found: type_name(v),
    };
    v.as_array()
        .ok_or_else(wrong)?
        .iter()
        .map(|e| match e {
            Value::Bool(_) => None,
            _ => e.as_i64(),
        })
        .collect::<Option<Vec<_>>>()
        .ok_or_else(wrong)
}

/// `sign_widths` and `sign_values` into one ±1 vector per width.
fn parse_signs(g: &Gguf) -> Result<BTreeMap<usize, Vec<f32>>, HadamardError> {
    let widths = int_array(g, K_SIGN_WIDTHS)?;
    let values_v = required(g, K_SIGN_VALUES)?;
    let values = values_v
        .as_array()
        .ok_or_else(|| HadamardError::WrongType {
            key: K_SIGN_VALUES,
            expected: "array of integer",
            found: type_name(values_v),
        })?;
    let mut total = 0u64;
    for (index, &w) in widths.iter().enumerate() {
        if w <= 0 {
            return Err(HadamardError::BadSignWidth { index, width: w });
        }
        total = total.saturating_add(w as u64);
    }
    if total != values.len() as u64 {
        return Err(HadamardError::SignLengthMismatch {
            expected: total,
            actual: values.len(),
        });
    }
    let mut signs = BTreeMap::new();
    let mut at = 0usize;
    for &w in &widths {
        let w = w as usize;
        let mut s = Vec::with_capacity(w);
        for (i, v) in values[at..at + w].iter().enumerate() {
            let index = at + i;
            // The fork writes i32; accept any integer or float width as long as it is ±1.
            let x = match v {
                Value::Bool(_) | Value::String(_) | Value::Array(..) => {
                    return Err(HadamardError::WrongType {
                        key: K_SIGN_VALUES,
                        expected: "array of integer",
                        found: format!("array containing {}", type_name(v)),
                    })
                }
                _ => v.as_f64().unwrap_or(f64::NAN),
            };
            if x != 1.0 && x != -1.0 {
                return Err(HadamardError::BadSignValue { index, value: x });
            }
            s.push(x as f32);
        }
        if signs.insert(w, s).is_some() {
            return Err(HadamardError::DuplicateSignWidth(w));
        }
        at += w;
    }
    Ok(signs)
}

/// The grouped permutation for a folded `ssm_out` when `gdn_v_grouped` is set: `hd` = d_v
/// (= ne0 / n_v), `nk` = n_k (ssm group count), `rep` = n_v / n_k.
/// `grouped[i + hd*(r + rep*k)] = tiled[i + hd*(k + nk*r)]`.
///
/// The converter reorders GDN V heads from the training ("grouped") order to llama.cpp's
/// "tiled" order everywhere except the folded `ssm_out` columns, where moving columns would
/// break the input-axis fold; so the activation is moved instead.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub struct GdnPermutation {
    pub hd: usize,
    pub nk: usize,
    pub rep: usize,
}

impl GdnPermutation {
    /// From the `ssm_out` input width, the V head count (`ssm_dt_rank`) and the key group count
    /// (`ssm_n_group`).
    pub fn new(width: usize, n_v: usize, n_k: usize) -> Result<GdnPermutation, HadamardError> {
        if n_v == 0 || n_k == 0 || !width.is_multiple_of(n_v) || !n_v.is_multiple_of(n_k) {
            return Err(HadamardError::BadGdnGeometry { width, n_v, n_k });
        }
        Ok(GdnPermutation {
            hd: width / n_v,
            nk: n_k,
            rep: n_v / n_k,
        })
    }

    /// Vector length the permutation acts on.
    pub fn len(&self) -> usize {
        self.hd * self.nk * self.rep
    }

    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// With one repeat or one group the two orders coincide.
    pub fn is_identity(&self) -> bool {
        self.rep <= 1 || self.nk <= 1
    }

    /// (grouped offset, tiled offset) of each head.
    fn heads(&self) -> impl Iterator<Item = (usize, usize)> + '_ {
        let (hd, nk, rep) = (self.hd, self.nk, self.rep);
        (0..nk).flat_map(move |k| (0..rep).map(move |r| (hd * (r + rep * k), hd * (k + nk * r))))
    }

    pub fn tiled_to_grouped(&self, tiled: &[f32], grouped: &mut [f32]) {
        assert!(
            tiled.len() == self.len() && grouped.len() == self.len(),
            "GdnPermutation: length mismatch"
        );
        for (g, t) in self.heads() {
            grouped[g..g + self.hd].copy_from_slice(&tiled[t..t + self.hd]);
        }
    }

    pub fn grouped_to_tiled(&self, grouped: &[f32], tiled: &mut [f32]) {
        assert!(
            tiled.len() == self.len() && grouped.len() == self.len(),
            "GdnPermutation: length mismatch"
        );
        for (g, t) in self.heads() {
            tiled[t..t + self.hd].copy_from_slice(&grouped[g..g + self.hd]);
        }
    }
}
