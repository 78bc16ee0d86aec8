//! Serve settings: one schema for the flags and the YAML config (`--config tern.yaml`).
//!
//! [`Settings`] is both the clap argument group and the serde struct, so a flag and a config
//! key cannot drift apart: the YAML keys are the flag names without the dashes
//! (`ctx-size`, `cache-type-k`, `spec-draft-n-max`, ...), as llama-server spells them
//! (server-contract.md), plus tern's own `backend`, `device-mib` and `margin-mib`. Every field
//! is optional so that the merge is simple and total: the file first, then the flags
//! ([`Settings::merge`]). Unknown keys and bad values are errors that name the key.
//!
//! Relative paths in a config file (`model`, `mmproj`, `chat-template-file`, the adapters of
//! `lora-scaled`) are relative to the file's directory; relative paths in flags are relative
//! to the working directory.

use std::cell::RefCell;
use std::fmt;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Deserializer, Serialize, Serializer};

use crate::plan::{BackendKind, FlashAttn, KvType, Shape, SpecType};

#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("config {}: {source}", path.display())]
    Read {
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// A YAML error: `key` is the path of the offending key (`cache-type-v`,
    /// `lora-scaled[1]`), empty when the document itself is malformed.
    #[error("config {}: {}{message}", path.display(), if key.is_empty() { String::new() } else { format!("key `{key}`: ") })]
    Yaml {
        path: PathBuf,
        key: String,
        message: String,
    },
    #[error("{key}: {why}")]
    Invalid { key: &'static str, why: String },
    #[error("no model: pass --model FILE or set `model:` in the config")]
    NoModel,
    #[error("cannot write the settings as YAML: {0}")]
    Serialize(String),
}

/// `--reasoning-format deepseek|none`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum ReasoningFormat {
    Deepseek,
    None,
}

/// `--reasoning auto|on|off`.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "kebab-case")]
pub enum Reasoning {
    Auto,
    On,
    Off,
}

/// `--lora-scaled FILE:SCALE`: one token, so a scale never reaches the engine without its
/// adapter. `SCALE` 0 is legal (inert but present).
#[derive(Clone, Debug, PartialEq)]
pub struct LoraScaled {
    pub path: PathBuf,
    pub scale: f32,
}

impl FromStr for LoraScaled {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        let (file, scale) = s
            .rsplit_once(':')
            .ok_or_else(|| format!("{s:?} is not FILE:SCALE"))?;
        if file.is_empty() {
            return Err(format!("{s:?} has no file before the ':'"));
        }
        let scale: f32 = scale
            .trim()
            .parse()
            .map_err(|_| format!("{s:?}: scale {scale:?} is not a number"))?;
        if !scale.is_finite() {
            return Err(format!("{s:?}: scale must be finite"));
        }
        Ok(LoraScaled {
            path: PathBuf::from(file),
            scale,
        })
    }
}

impl fmt::Display for LoraScaled {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.path.display(), self.scale)
    }
}

impl<'de> Deserialize<'de> for LoraScaled {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        let s = String::deserialize(d)?;
        s.parse().map_err(serde::de::Error::custom)
    }
}

impl Serialize for LoraScaled {
    fn serialize<S: Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        s.serialize_str(&self.to_string())
    }
}

/// The serve settings, as flags and as YAML keys. `None` = not set here (a default applies
/// later, or the other source sets it).
#[derive(Clone, Debug, Default, PartialEq, clap::Args, Serialize, Deserialize)]
#[serde(deny_unknown_fields, rename_all = "kebab-case")]
pub struct Settings {
    /// GGUF model file.
    #[arg(long, short = 'm')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub model: Option<PathBuf>,
    /// Model id served by /v1/models (default: the file name).
    #[arg(long, short = 'a')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub alias: Option<String>,
    /// Address to bind (default 127.0.0.1).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub host: Option<String>,
    /// Port to listen on (default 8080).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub port: Option<u16>,
    /// KV pool in tokens across all slots; each slot gets ctx-size / parallel (default 4096).
    #[arg(long, short = 'c')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ctx_size: Option<u64>,
    /// Slots decoded together (default 1).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub parallel: Option<u64>,
    /// K cache dtype (default f16).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_type_k: Option<KvType>,
    /// V cache dtype (default f16); q8_0/q4_0 need flash attention.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub cache_type_v: Option<KvType>,
    /// Flash attention (default auto).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flash_attn: Option<FlashAttn>,
    /// Logical batch (default 2048).
    #[arg(long, short = 'b')]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub batch_size: Option<u64>,
    /// Physical micro-batch (default 512): sizes the compute buffers.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub ubatch_size: Option<u64>,
    /// Accepted for llama-server compatibility; tern runs the whole model on its backend.
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub n_gpu_layers: Option<i64>,
    /// Use the model's Jinja chat template.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub jinja: Option<bool>,
    /// A chat template file instead of the model's.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub chat_template_file: Option<PathBuf>,
    /// Where thinking goes: deepseek = message.reasoning_content.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning_format: Option<ReasoningFormat>,
    /// Thinking on, off, or as the template decides.
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub reasoning: Option<Reasoning>,
    /// Serve /metrics (Prometheus); 501 otherwise.
    #[arg(long, num_args = 0..=1, default_missing_value = "true", value_name = "BOOL")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub metrics: Option<bool>,
    /// Vision projector GGUF.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub mmproj: Option<PathBuf>,
    /// LoRA adapter and its scale as one token, FILE:SCALE (repeatable).
    #[arg(long, value_name = "FILE:SCALE")]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub lora_scaled: Option<Vec<LoraScaled>>,
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub presence_penalty: Option<f32>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub temp: Option<f32>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_p: Option<f32>,
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub top_k: Option<i32>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_p: Option<f32>,
    /// Sampling seed; -1 = random.
    #[arg(long, allow_negative_numbers = true)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seed: Option<i64>,
    /// Speculative decoding: draft-mtp (the file's MTP head) or none (default).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_type: Option<SpecType>,
    /// Draft depth (default 3, llama.cpp's common.h); each slot keeps 1 + this many recurrent-state copies.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_draft_n_max: Option<u64>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_draft_n_min: Option<u64>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_draft_p_min: Option<f32>,
    /// Draft (MTP) K cache dtype (default f16).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_draft_type_k: Option<KvType>,
    /// Draft (MTP) V cache dtype (default f16).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub spec_draft_type_v: Option<KvType>,
    /// Require this key as a Bearer token.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub api_key: Option<String>,
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub log_verbosity: Option<u32>,
    /// Backend (default auto).
    #[arg(long, value_enum)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub backend: Option<BackendKind>,
    /// The device memory budget in MiB (the driver's free figure); required for wgpu, cuda
    /// and auto until tern queries them.
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub device_mib: Option<u64>,
    /// MiB kept free beyond the priced total (default 1024).
    #[arg(long)]
    #[serde(skip_serializing_if = "Option::is_none")]
    pub margin_mib: Option<u64>,
}

impl Settings {
    /// Reads and parses a YAML config file, resolving its relative paths against its
    /// directory, and validates it.
    pub fn load(path: impl AsRef<Path>) -> Result<Settings, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        let mut s = Settings::from_yaml(&text, path)?;
        if let Some(dir) = path.parent() {
            s.resolve_relative_to(dir);
        }
        s.validate()?;
        Ok(s)
    }

    /// Parses YAML text (`origin` names the source in errors). Unknown keys, duplicate keys,
    /// wrong types and bad enum values are errors naming the key.
    pub fn from_yaml(text: &str, origin: &Path) -> Result<Settings, ConfigError> {
        let key = RefCell::new(String::new());
        let r: Result<Settings, serde_saphyr::Error> =
            serde_saphyr::with_deserializer_from_str(text, |de| {
                serde_path_to_error::deserialize(de).map_err(|e| {
                    let p = e.path().to_string();
                    *key.borrow_mut() = if p == "." { String::new() } else { p };
                    e.into_inner()
                })
            });
        r.map_err(|e| ConfigError::Yaml {
            path: origin.to_path_buf(),
            key: key.into_inner(),
            message: e.to_string(),
        })
    }

    /// The settings as YAML (the keys that are set, in schema order). The API key is
    /// redacted.
    pub fn to_yaml(&self) -> Result<String, ConfigError> {
        let mut s = self.clone();
        if s.api_key.is_some() {
            s.api_key = Some("<redacted>".into());
        }
        let y = serde_saphyr::to_string(&s).map_err(|e| ConfigError::Serialize(e.to_string()))?;
        Ok(if y.trim() == "{}" { String::new() } else { y })
    }

    /// `self` (the file) overridden by every field `flags` sets.
    pub fn merge(self, flags: Settings) -> Settings {
        // Destructured without `..`, so a new field that is not merged does not compile.
        let Settings {
            model,
            alias,
            host,
            port,
            ctx_size,
            parallel,
            cache_type_k,
            cache_type_v,
            flash_attn,
            batch_size,
            ubatch_size,
            n_gpu_layers,
            jinja,
            chat_template_file,
            reasoning_format,
            reasoning,
            metrics,
            mmproj,
            lora_scaled,
            presence_penalty,
            temp,
            top_p,
            top_k,
            min_p,
            seed,
            spec_type,
            spec_draft_n_max,
            spec_draft_n_min,
            spec_draft_p_min,
            spec_draft_type_k,
            spec_draft_type_v,
            api_key,
            log_verbosity,
            backend,
            device_mib,
            margin_mib,
        } = flags;
        Settings {
            model: model.or(self.model),
            alias: alias.or(self.alias),
            host: host.or(self.host),
            port: port.or(self.port),
            ctx_size: ctx_size.or(self.ctx_size),
            parallel: parallel.or(self.parallel),
            cache_type_k: cache_type_k.or(self.cache_type_k),
            cache_type_v: cache_type_v.or(self.cache_type_v),
            flash_attn: flash_attn.or(self.flash_attn),
            batch_size: batch_size.or(self.batch_size),
            ubatch_size: ubatch_size.or(self.ubatch_size),
            n_gpu_layers: n_gpu_layers.or(self.n_gpu_layers),
            jinja: jinja.or(self.jinja),
            chat_template_file: chat_template_file.or(self.chat_template_file),
            reasoning_format: reasoning_format.or(self.reasoning_format),
            reasoning: reasoning.or(self.reasoning),
            metrics: metrics.or(self.metrics),
            mmproj: mmproj.or(self.mmproj),
            lora_scaled: lora_scaled.or(self.lora_scaled),
            presence_penalty: presence_penalty.or(self.presence_penalty),
            temp: temp.or(self.temp),
            top_p: top_p.or(self.top_p),
            top_k: top_k.or(self.top_k),
            min_p: min_p.or(self.min_p),
            seed: seed.or(self.seed),
            spec_type: spec_type.or(self.spec_type),
            spec_draft_n_max: spec_draft_n_max.or(self.spec_draft_n_max),
            spec_draft_n_min: spec_draft_n_min.or(self.spec_draft_n_min),
            spec_draft_p_min: spec_draft_p_min.or(self.spec_draft_p_min),
            spec_draft_type_k: spec_draft_type_k.or(self.spec_draft_type_k),
            spec_draft_type_v: spec_draft_type_v.or(self.spec_draft_type_v),
            api_key: api_key.or(self.api_key),
            log_verbosity: log_verbosity.or(self.log_verbosity),
            backend: backend.or(self.backend),
            device_mib: device_mib.or(self.device_mib),
            margin_mib: margin_mib.or(self.margin_mib),
        }
    }

    fn resolve_relative_to(&mut self, dir: &Path) {
        let fix = |p: &mut PathBuf| {
            if p.is_relative() {
                *p = dir.join(&*p);
            }
        };
        if let Some(p) = &mut self.model {
            fix(p);
        }
        if let Some(p) = &mut self.mmproj {
            fix(p);
        }
        if let Some(p) = &mut self.chat_template_file {
            fix(p);
        }
        for l in self.lora_scaled.iter_mut().flatten() {
            fix(&mut l.path);
        }
    }

    /// Value checks that the types alone do not make (ranges, pairs that must agree).
    pub fn validate(&self) -> Result<(), ConfigError> {
        let unit = |key: &'static str, v: Option<f32>| match v {
            Some(x) if !(0.0..=1.0).contains(&x) => Err(ConfigError::Invalid {
                key,
                why: format!("{x} is outside [0, 1]"),
            }),
            _ => Ok(()),
        };
        unit("top-p", self.top_p)?;
        unit("min-p", self.min_p)?;
        unit("spec-draft-p-min", self.spec_draft_p_min)?;
        if let Some(t) = self.temp {
            if !(t.is_finite() && t >= 0.0) {
                return Err(ConfigError::Invalid {
                    key: "temp",
                    why: format!("{t} must be a finite number >= 0"),
                });
            }
        }
        if let Some(p) = self.presence_penalty {
            if !p.is_finite() {
                return Err(ConfigError::Invalid {
                    key: "presence-penalty",
                    why: format!("{p} must be finite"),
                });
            }
        }
        if let Some(s) = self.seed {
            if !(-1..=u32::MAX as i64).contains(&s) {
                return Err(ConfigError::Invalid {
                    key: "seed",
                    why: format!("{s} must be -1 (random) or in 0..={}", u32::MAX),
                });
            }
        }
        for (key, v) in [
            ("ctx-size", self.ctx_size),
            ("parallel", self.parallel),
            ("batch-size", self.batch_size),
            ("ubatch-size", self.ubatch_size),
        ] {
            if v == Some(0) {
                return Err(ConfigError::Invalid {
                    key,
                    why: "must be at least 1".into(),
                });
            }
        }
        if let (Some(lo), Some(hi)) = (self.spec_draft_n_min, self.spec_draft_n_max) {
            if lo > hi {
                return Err(ConfigError::Invalid {
                    key: "spec-draft-n-min",
                    why: format!("{lo} exceeds spec-draft-n-max {hi}"),
                });
            }
        }
        if let (Some(c), Some(p)) = (self.ctx_size, self.parallel) {
            if p > 0 && c % p != 0 {
                return Err(ConfigError::Invalid {
                    key: "ctx-size",
                    why: format!(
                        "{c} does not divide evenly by parallel {p}; use a multiple of {p}, e.g. {}",
                        c - c % p
                    ),
                });
            }
        }
        Ok(())
    }

    /// The model file, required by everything that opens it.
    pub fn model_path(&self) -> Result<&Path, ConfigError> {
        self.model.as_deref().ok_or(ConfigError::NoModel)
    }

    /// The shape these settings price (defaults: [`Shape::default`]).
    pub fn shape(&self) -> Shape {
        let d = Shape::default();
        Shape {
            ctx_size: self.ctx_size.unwrap_or(d.ctx_size),
            parallel: self.parallel.unwrap_or(d.parallel),
            cache_type_k: self.cache_type_k.unwrap_or(d.cache_type_k),
            cache_type_v: self.cache_type_v.unwrap_or(d.cache_type_v),
            flash_attn: self.flash_attn.unwrap_or(d.flash_attn),
            spec: self.spec_type.unwrap_or(d.spec),
            draft_n_max: self.spec_draft_n_max.unwrap_or(d.draft_n_max),
            spec_draft_type_k: self.spec_draft_type_k.unwrap_or(d.spec_draft_type_k),
            spec_draft_type_v: self.spec_draft_type_v.unwrap_or(d.spec_draft_type_v),
            ubatch_size: self.ubatch_size.unwrap_or(d.ubatch_size),
            batch_size: self.batch_size.unwrap_or(d.batch_size),
            mmproj: self.mmproj.clone(),
            lora: self
                .lora_scaled
                .iter()
                .flatten()
                .map(|l| l.path.clone())
                .collect(),
            backend: self.backend.unwrap_or(d.backend),
            margin_mib: self.margin_mib.unwrap_or(d.margin_mib),
        }
    }
}
