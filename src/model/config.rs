//! qwen35 hyperparameters from GGUF metadata (model-qwen35.md §1), validated once at load.

use super::ModelError;
use crate::backend::{AttnParams, GdnParams};
use crate::gguf::Gguf;

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
    fn u(&self, k: &str) -> Result<Option<usize>, ModelError> {
        let key = self.key(k);
        match self.g.get(&key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .map(|x| Some(x as usize))
                .ok_or_else(|| ModelError::BadKey {
                    key,
                    why: format!(
                        "expected an unsigned integer, found {}",
                        v.value_type().name()
                    ),
                }),
        }
    }
    fn req(&self, k: &str) -> Result<usize, ModelError> {
        self.u(k)?
            .ok_or_else(|| ModelError::MissingKey(self.key(k)))
    }
    fn f(&self, k: &str) -> Result<Option<f32>, ModelError> {
        let key = self.key(k);
        match self.g.get(&key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(|x| Some(x as f32))
                .ok_or_else(|| ModelError::BadKey {
                    key,
                    why: format!("expected a number, found {}", v.value_type().name()),
                }),
        }
    }
}

impl Config {
    pub fn from_gguf(g: &Gguf) -> Result<Config, ModelError> {
        let arch = g
            .architecture()
            .ok_or_else(|| ModelError::MissingKey("general.architecture".into()))?;
        if arch != "qwen35" {
            return Err(ModelError::UnsupportedArch(arch.to_string()));
        }
        let k = Keys { g, arch };
        let bad = |key: &str, why: String| ModelError::BadKey {
            key: format!("{arch}.{key}"),
            why,
        };

        let n_embd = k.req("embedding_length")?;
        let n_ff = k.req("feed_forward_length")?;
        let n_layer_all = k.req("block_count")?;
        let n_head = k.req("attention.head_count")?;
        let n_head_kv = k.req("attention.head_count_kv")?;
        let key_len = k
            .u("attention.key_length")?
            .unwrap_or(n_embd.checked_div(n_head).unwrap_or(0));
        let val_len = k.u("attention.value_length")?.unwrap_or(key_len);
        let eps = k
            .f("attention.layer_norm_rms_epsilon")?
            .ok_or_else(|| ModelError::MissingKey(k.key("attention.layer_norm_rms_epsilon")))?;
        let rope_base = k.f("rope.freq_base")?.unwrap_or(10000.0);
        let n_rot = k.u("rope.dimension_count")?.unwrap_or(key_len);
        let context_length = k.req("context_length")?;
        let interval = k.u("full_attention_interval")?.unwrap_or(4);
        let n_nextn = k.u("nextn_predict_layers")?.unwrap_or(0);
        let ssm_conv = k.req("ssm.conv_kernel")?;
        let ssm_state = k.req("ssm.state_size")?;
        let ssm_n_k = k.req("ssm.group_count")?;
        let ssm_n_v = k.req("ssm.time_step_rank")?;
        let ssm_inner = k.req("ssm.inner_size")?;

        // llama.cpp requires the sections (get_key_or_arr with required = true).
        let sec_key = k.key("rope.dimension_sections");
        let sections = g
            .get(&sec_key)
            .ok_or_else(|| ModelError::MissingKey(sec_key.clone()))?;
        let rope_sections = match sections.as_array() {
            Some(items) if items.len() <= 4 && items.iter().all(|v| v.as_i64().is_some()) => {
                let mut s = [0i32; 4];
                for (i, v) in items.iter().enumerate() {
                    s[i] = v.as_i64().unwrap() as i32;
                }
                s
            }
            _ => {
                return Err(ModelError::BadKey {
                    key: sec_key,
                    why: "expected an integer array of at most 4 entries".into(),
                })
            }
        };

        if n_embd == 0 || n_head == 0 || n_head_kv == 0 || n_layer_all == 0 {
            return Err(bad(
                "embedding_length",
                "zero-sized model dimensions".into(),
            ));
        }
        if key_len != val_len {
            return Err(bad(
                "attention.value_length",
                format!("key_length {key_len} != value_length {val_len} (qwen35 requires equal)"),
            ));
        }
        if n_head % n_head_kv != 0 {
            return Err(bad(
                "attention.head_count_kv",
                format!("{n_head_kv} does not divide head_count {n_head}"),
            ));
        }
        if n_rot == 0 || n_rot > key_len || n_rot % 2 != 0 {
            return Err(bad(
                "rope.dimension_count",
                format!("{n_rot} must be even and in 1..={key_len}"),
            ));
        }
        if n_nextn >= n_layer_all {
            return Err(bad(
                "nextn_predict_layers",
                format!("{n_nextn} must be less than block_count {n_layer_all}"),
            ));
        }
        if n_nextn > 1 {
            return Err(bad(
                "nextn_predict_layers",
                format!("{n_nextn}: only one MTP layer is supported (as in llama.cpp)"),
            ));
        }
        if interval == 0 {
            return Err(bad("full_attention_interval", "must be at least 1".into()));
        }
        if ssm_n_k == 0 || ssm_n_v == 0 || ssm_n_v % ssm_n_k != 0 {
            return Err(bad(
                "ssm.time_step_rank",
                format!("n_v {ssm_n_v} must be a positive multiple of group_count {ssm_n_k}"),
            ));
        }
        if ssm_inner != ssm_n_v * ssm_state {
            return Err(bad(
                "ssm.inner_size",
                format!("{ssm_inner} != time_step_rank {ssm_n_v} × state_size {ssm_state}"),
            ));
        }
        if ssm_conv < 2 {
            return Err(bad(
                "ssm.conv_kernel",
                format!("{ssm_conv} must be at least 2"),
            ));
        }
        let n_layer = n_layer_all - n_nextn;
        let recurrent = match g.get(&k.key("attention.recurrent_layers")) {
            Some(v) => {
                let items = v.as_array().ok_or_else(|| {
                    bad("attention.recurrent_layers", "expected a bool array".into())
                })?;
                if items.len() < n_layer {
                    return Err(bad(
                        "attention.recurrent_layers",
                        format!("{} entries for {n_layer} layers", items.len()),
                    ));
                }
                items[..n_layer]
                    .iter()
                    .map(|v| v.as_bool().or(v.as_i64().map(|x| x != 0)))
                    .collect::<Option<Vec<bool>>>()
                    .ok_or_else(|| {
                        bad("attention.recurrent_layers", "expected a bool array".into())
                    })?
            }
            None => (0..n_layer).map(|i| (i + 1) % interval != 0).collect(),
        };

        let embd = g
            .tensor("token_embd.weight")
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?;
        if embd.dims.len() != 2 || embd.dims[0] as usize != n_embd {
            return Err(ModelError::BadShape {
                name: "token_embd.weight".into(),
                expected: format!("[{n_embd}, n_vocab]"),
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
