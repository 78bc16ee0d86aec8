//! qwen35 hyperparameters from GGUF metadata (model-qwen35.md §1), validated once at load.
//!
//! [`Config::from_gguf`] is the one validation pass every path runs before it allocates for a
//! model: each count, dimension and float of the metadata is range-checked (positive, finite,
//! divisibility, products in checked arithmetic), then the tensor table is walked as the loader
//! walks it and must be exactly what the config implies (see `weights::validate_table`), and the
//! `prism.hadamard.*` fold is checked against the tensors. Every refusal names the key or tensor.

use super::{weights, ModelError};
use crate::backend::{AttnParams, GdnParams};
use crate::gguf::{Gguf, Value};

/// llama.cpp's `LLAMA_MAX_LAYERS`: its per-layer hyperparameter arrays hold this many entries,
/// and a larger `block_count` is refused there too.
pub const MAX_LAYERS: usize = 512;

/// llama.cpp keeps every count and dimension of the header in a `uint32_t`.
const MAX_COUNT: u64 = u32::MAX as u64;

#[derive(Clone, Debug, PartialEq)]
pub struct Config {
    pub arch: String,
    pub n_vocab: usize,
    pub n_embd: usize,
    pub n_ff: usize,
    /// All blocks in the file, trunk plus MTP (`block_count`).
    pub n_layer_all: usize,
    /// Trunk blocks: `n_layer_all - n_nextn`.
    pub n_layer: usize,
    pub n_nextn: usize,
    pub n_head: usize,
    pub n_head_kv: usize,
    pub head_dim: usize,
    pub n_rot: usize,
    pub rope_base: f32,
    pub rope_sections: [i32; 4],
    pub eps: f32,
    pub context_length: usize,
    pub full_attention_interval: usize,
    /// Per trunk layer: true for Gated DeltaNet, false for full attention.
    pub recurrent: Vec<bool>,
    pub ssm_conv: usize,
    pub ssm_state: usize,
    pub ssm_n_k: usize,
    pub ssm_n_v: usize,
    pub ssm_inner: usize,
    pub tied_output: bool,
}

struct Keys<'a> {
    g: &'a Gguf,
    arch: &'a str,
}

impl Keys<'_> {
    fn key(&self, k: &str) -> String {
        format!("{}.{k}", self.arch)
    }
    fn bad(&self, k: &str, why: impl Into<String>) -> ModelError {
        ModelError::BadKey {
            key: self.key(k),
            why: why.into(),
        }
    }
    /// An optional count: an unsigned integer of at most u32 range, as llama.cpp stores it.
    fn u(&self, k: &str) -> Result<Option<usize>, ModelError> {
        let key = self.key(k);
        match self.g.get(&key) {
            None => Ok(None),
            Some(v) => match v.as_u64() {
                Some(x) if x <= MAX_COUNT => Ok(Some(x as usize)),
                Some(x) => Err(self.bad(k, format!("{x} is out of range (at most {MAX_COUNT})"))),
                None => Err(self.bad(
                    k,
                    match v.as_i64() {
                        Some(x) => format!("{x} is negative"),
                        None => format!(
                            "expected an unsigned integer, found {}",
                            v.value_type().name()
                        ),
                    },
                )),
            },
        }
    }
    fn req(&self, k: &str) -> Result<usize, ModelError> {
        self.u(k)?
            .ok_or_else(|| ModelError::MissingKey(self.key(k)))
    }
    /// A required count that must be at least 1.
    fn positive(&self, k: &str) -> Result<usize, ModelError> {
        let v = self.req(k)?;
        if v == 0 {
            return Err(self.bad(k, "must be at least 1, found 0"));
        }
        Ok(v)
    }
    fn f(&self, k: &str) -> Result<Option<f32>, ModelError> {
        let key = self.key(k);
        match self.g.get(&key) {
            None => Ok(None),
            Some(v) => v.as_f64().map(|x| Some(x as f32)).ok_or_else(|| {
                self.bad(
                    k,
                    format!("expected a number, found {}", v.value_type().name()),
                )
            }),
        }
    }
    /// A float that must be finite and positive (after narrowing to f32, as it is used).
    fn positive_f(&self, k: &str, v: f32) -> Result<f32, ModelError> {
        if !v.is_finite() || v <= 0.0 {
            return Err(self.bad(k, format!("{v} must be a finite number above 0")));
        }
        Ok(v)
    }
}

/// `a * b (+ c)` for sizes derived from the header, refused by name when the result does not
/// fit llama.cpp's u32 range (so that no later, unchecked product can wrap).
fn derived(
    keys: &Keys,
    k: &str,
    what: &str,
    terms: &[usize],
    plus: usize,
) -> Result<usize, ModelError> {
    let prod = terms
        .iter()
        .try_fold(1u64, |acc, &t| acc.checked_mul(t as u64))
        .and_then(|p| p.checked_add(plus as u64))
        .filter(|&p| p <= MAX_COUNT);
    prod.map(|p| p as usize).ok_or_else(|| {
        keys.bad(
            k,
            format!(
                "{what} = {terms:?}{} overflows u32",
                if plus > 0 {
                    format!(" + {plus}")
                } else {
                    String::new()
                }
            ),
        )
    })
}

impl Config {
    /// The validated config of a qwen35 file: the metadata, the tensor table and the fold, in
    /// one pass that allocates nothing sized by the file before it has been checked.
    pub fn from_gguf(g: &Gguf) -> Result<Config, ModelError> {
        let cfg = Self::from_metadata(g)?;
        weights::validate_table(g, &cfg)?;
        Ok(cfg)
    }

    /// The metadata alone, range-checked; the tensor table is checked by `from_gguf`.
    fn from_metadata(g: &Gguf) -> Result<Config, ModelError> {
        let arch = g
            .architecture()
            .ok_or_else(|| ModelError::MissingKey("general.architecture".into()))?;
        if arch != "qwen35" {
            return Err(ModelError::UnsupportedArch(arch.to_string()));
        }
        let k = Keys { g, arch };

        // The layer count sizes per-layer vectors below: bound it first, by llama.cpp's limit
        // and by the tensor table (every layer has tensors of its own).
        let n_layer_all = k.positive("block_count")?;
        if n_layer_all > MAX_LAYERS {
            return Err(k.bad(
                "block_count",
                format!("{n_layer_all} exceeds llama.cpp's limit of {MAX_LAYERS} layers"),
            ));
        }
        if n_layer_all > g.tensors().len() {
            return Err(k.bad(
                "block_count",
                format!(
                    "{n_layer_all} layers, but the file has only {} tensors",
                    g.tensors().len()
                ),
            ));
        }
        let n_embd = k.positive("embedding_length")?;
        let n_ff = k.positive("feed_forward_length")?;
        let n_head = k.positive("attention.head_count")?;
        let n_head_kv = k.positive("attention.head_count_kv")?;
        let key_len = match k.u("attention.key_length")? {
            Some(v) => v,
            None if n_embd % n_head == 0 => n_embd / n_head,
            None => {
                return Err(k.bad(
                    "attention.head_count",
                    format!(
                        "{n_head} does not divide embedding_length {n_embd} and attention.key_length is absent"
                    ),
                ))
            }
        };
        if key_len == 0 {
            return Err(k.bad("attention.key_length", "must be at least 1, found 0"));
        }
        let val_len = k.u("attention.value_length")?.unwrap_or(key_len);
        let eps_key = "attention.layer_norm_rms_epsilon";
        let eps = k
            .f(eps_key)?
            .ok_or_else(|| ModelError::MissingKey(k.key(eps_key)))?;
        let eps = k.positive_f(eps_key, eps)?;
        if eps >= 1.0 {
            return Err(k.bad(eps_key, format!("{eps} must be below 1")));
        }
        let rope_base =
            k.positive_f("rope.freq_base", k.f("rope.freq_base")?.unwrap_or(10000.0))?;
        let n_rot = k.u("rope.dimension_count")?.unwrap_or(key_len);
        let context_length = k.positive("context_length")?;
        let interval = k.u("full_attention_interval")?.unwrap_or(4);
        let n_nextn = k.u("nextn_predict_layers")?.unwrap_or(0);
        let ssm_conv = k.req("ssm.conv_kernel")?;
        let ssm_state = k.positive("ssm.state_size")?;
        let ssm_n_k = k.req("ssm.group_count")?;
        let ssm_n_v = k.req("ssm.time_step_rank")?;
        let ssm_inner = k.req("ssm.inner_size")?;

        // llama.cpp requires the sections (get_key_or_arr with required = true): an array of
        // exactly four, or one value for all four.
        let sec = "rope.dimension_sections";
        let sections = g
            .get(&k.key(sec))
            .ok_or_else(|| ModelError::MissingKey(k.key(sec)))?;
        let items: Vec<&Value> = match sections {
            Value::Array(_, items) if items.len() == 4 => items.iter().collect(),
            Value::Array(_, items) => {
                return Err(k.bad(sec, format!("{} entries, expected 4", items.len())))
            }
            v => vec![v; 4],
        };
        let mut rope_sections = [0i32; 4];
        for (i, v) in items.into_iter().enumerate() {
            rope_sections[i] = match v.as_i64() {
                Some(x) if (0..=i32::MAX as i64).contains(&x) => x as i32,
                Some(x) => {
                    return Err(k.bad(sec, format!("entry {i} = {x} must be in 0..={}", i32::MAX)))
                }
                None => {
                    return Err(k.bad(
                        sec,
                        format!(
                            "entry {i} is a {}, expected an integer",
                            v.value_type().name()
                        ),
                    ))
                }
            };
        }

        if key_len != val_len {
            return Err(k.bad(
                "attention.value_length",
                format!("key_length {key_len} != value_length {val_len} (qwen35 requires equal)"),
            ));
        }
        if n_head % n_head_kv != 0 {
            return Err(k.bad(
                "attention.head_count_kv",
                format!("{n_head_kv} does not divide head_count {n_head}"),
            ));
        }
        if n_rot == 0 || n_rot > key_len || n_rot % 2 != 0 {
            return Err(k.bad(
                "rope.dimension_count",
                format!("{n_rot} must be even and in 1..={key_len}"),
            ));
        }
        if n_nextn >= n_layer_all {
            return Err(k.bad(
                "nextn_predict_layers",
                format!("{n_nextn} must be less than block_count {n_layer_all}"),
            ));
        }
        if n_nextn > 1 {
            return Err(k.bad(
                "nextn_predict_layers",
                format!("{n_nextn}: only one MTP layer is supported (as in llama.cpp)"),
            ));
        }
        if interval == 0 {
            return Err(k.bad("full_attention_interval", "must be at least 1"));
        }
        if ssm_n_k == 0 || ssm_n_v == 0 || ssm_n_v % ssm_n_k != 0 {
            return Err(k.bad(
                "ssm.time_step_rank",
                format!("n_v {ssm_n_v} must be a positive multiple of group_count {ssm_n_k}"),
            ));
        }
        let inner = derived(
            &k,
            "ssm.inner_size",
            "time_step_rank × state_size",
            &[ssm_n_v, ssm_state],
            0,
        )?;
        if ssm_inner != inner {
            return Err(k.bad(
                "ssm.inner_size",
                format!("{ssm_inner} != time_step_rank {ssm_n_v} × state_size {ssm_state}"),
            ));
        }
        if ssm_conv < 2 {
            return Err(k.bad("ssm.conv_kernel", format!("{ssm_conv} must be at least 2")));
        }
        // Every width the loader and the forward pass compute from the header, in checked
        // arithmetic: the tensor shapes are then compared against values that cannot have
        // wrapped.
        derived(
            &k,
            "attention.head_count",
            "2 × head_count × key_length",
            &[2, n_head, key_len],
            0,
        )?;
        derived(
            &k,
            "attention.head_count_kv",
            "head_count_kv × key_length",
            &[n_head_kv, key_len],
            0,
        )?;
        let qk = derived(
            &k,
            "ssm.group_count",
            "2 × group_count × state_size",
            &[2, ssm_n_k, ssm_state],
            0,
        )?;
        let conv_dim = derived(
            &k,
            "ssm.inner_size",
            "conv channels 2 × group_count × state_size + inner_size",
            &[qk],
            ssm_inner,
        )?;
        derived(
            &k,
            "ssm.conv_kernel",
            "conv_kernel × conv channels",
            &[ssm_conv, conv_dim],
            0,
        )?;
        derived(
            &k,
            "ssm.state_size",
            "state_size² × time_step_rank",
            &[ssm_state, ssm_state, ssm_n_v],
            0,
        )?;
        derived(
            &k,
            "embedding_length",
            "2 × embedding_length",
            &[2, n_embd],
            0,
        )?;

        let n_layer = n_layer_all - n_nextn;
        let rl = "attention.recurrent_layers";
        let recurrent = match g.get(&k.key(rl)) {
            // llama.cpp (get_key_or_arr over n_layer_all): one entry per block, or one value
            // for all of them; the MTP block is never a trunk GDN layer whatever it says.
            Some(Value::Array(_, items)) => {
                if items.len() != n_layer_all {
                    return Err(k.bad(
                        rl,
                        format!(
                            "{} entries, expected one per block ({n_layer_all})",
                            items.len()
                        ),
                    ));
                }
                items[..n_layer]
                    .iter()
                    .map(|v| v.as_bool().or(v.as_i64().map(|x| x != 0)))
                    .collect::<Option<Vec<bool>>>()
                    .ok_or_else(|| k.bad(rl, "expected a bool array"))?
            }
            Some(v) => {
                let all = v
                    .as_bool()
                    .or(v.as_i64().map(|x| x != 0))
                    .ok_or_else(|| k.bad(rl, "expected a bool array"))?;
                vec![all; n_layer]
            }
            None => (0..n_layer).map(|i| (i + 1) % interval != 0).collect(),
        };

        let embd = g
            .tensor("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        if embd.dims.len() != 2 || embd.dims[0] != n_embd as u64 || embd.dims[1] == 0 {
            return Err(ModelError::BadShape {
                name: "token_embd.weight".into(),
                expected: format!("[{n_embd}, n_vocab]"),
                found: embd.dims.clone(),
            });
        }
        if embd.dims[1] > i32::MAX as u64 {
            return Err(ModelError::BadShape {
                name: "token_embd.weight".into(),
                expected: format!("[{n_embd}, n_vocab] with n_vocab a llama_token (i32)"),
                found: embd.dims.clone(),
            });
        }
        let n_vocab = embd.dims[1] as usize;
        let tied_output = g.tensor("output.weight").is_none();
        Ok(Config {
            arch: arch.to_string(),
            n_vocab,
            n_embd,
            n_ff,
            n_layer_all,
            n_layer,
            n_nextn,
            n_head,
            n_head_kv,
            head_dim: key_len,
            n_rot,
            rope_base,
            rope_sections,
            eps,
            context_length,
            full_attention_interval: interval,
            recurrent,
            ssm_conv,
            ssm_state,
            ssm_n_k,
            ssm_n_v,
            ssm_inner,
            tied_output,
        })
    }

    /// The `is_recr(il)` rule (or the file's explicit per-layer list).
    pub fn is_recurrent(&self, il: usize) -> bool {
        il < self.n_layer && self.recurrent[il]
    }

    pub fn attn_params(&self) -> AttnParams {
        AttnParams {
            n_head: self.n_head,
            n_head_kv: self.n_head_kv,
            head_dim: self.head_dim,
            n_rot: self.n_rot,
            rope_base: self.rope_base,
            rope_sections: self.rope_sections,
            eps: self.eps,
            scale: 1.0 / (self.head_dim as f32).sqrt(),
        }
    }

    pub fn gdn_params(&self) -> GdnParams {
        GdnParams {
            n_k: self.ssm_n_k,
            n_v: self.ssm_n_v,
            d: self.ssm_state,
            d_conv: self.ssm_conv,
            eps: self.eps,
        }
    }

    pub fn has_mtp(&self) -> bool {
        self.n_nextn > 0
    }
}
