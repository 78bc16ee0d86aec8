//! llama-server's flag table: every option its `common/arg.cpp` registers for the server, with
//! every spelling, the `LLAMA_ARG_*` variable and what tern does with it.
//!
//! Each spelling is one of:
//! - honoured: rewritten to tern's own spelling (the [`Settings`](super::Settings) field and YAML
//!   key), which clap then parses;
//! - accepted with a one-line warning that says why it changes nothing here;
//! - refused with a message that names it.
//!
//! The same table serves the command line ([`rewrite`]), the environment ([`from_env`]) and the
//! YAML keys ([`yaml_key`]), so a flag behaves the same from all three. `tests/flags.rs` walks
//! the list that `cargo xtask llama-flags` extracts from llama.cpp's arg.cpp
//! (`fixtures/llama-server-flags.json`) against this table.

use std::collections::BTreeMap;
use std::fmt;

/// Whether an option takes a value.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Arg {
    /// A switch (`--metrics`), or a boolean with negative spellings (`--slots`/`--no-slots`).
    Switch,
    /// `--ctx-size N`.
    Value,
}

/// What tern does with a spelling.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum How {
    /// Sets this setting (tern's long flag name and YAML key): to the value, or to true for a
    /// switch.
    Set(&'static str),
    /// Sets this boolean setting to false (a negative spelling).
    Clear(&'static str),
    /// Sets this setting to a fixed value (`--log-jsonl` is `--log-format json`).
    SetTo(&'static str, &'static str),
    /// clap's own `--help` / `--version`.
    Clap(&'static str),
    /// Accepted; changes nothing here, for this reason.
    Warn(&'static str),
    /// Refused, for this reason.
    Refuse(&'static str),
}

impl How {
    pub fn class(self) -> Class {
        match self {
            How::Set(_) | How::Clear(_) | How::SetTo(..) | How::Clap(_) => Class::Honoured,
            How::Warn(_) => Class::Warned,
            How::Refuse(_) => Class::Refused,
        }
    }
}

/// The three outcomes a llama-server flag can have.
#[derive(Copy, Clone, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Class {
    Honoured,
    Warned,
    Refused,
}

/// One llama-server option.
#[derive(Copy, Clone, Debug)]
pub struct Opt {
    /// The positive spellings, as arg.cpp lists them.
    pub names: &'static [&'static str],
    /// The negative spellings of a boolean (`--no-slots`).
    pub neg: &'static [&'static str],
    pub arg: Arg,
    /// arg.cpp's environment variable (a negative spelling also reads `LLAMA_ARG_NO_*`).
    pub env: Option<&'static str>,
    pub how: How,
    /// What a negative spelling does.
    pub how_neg: How,
}

impl Opt {
    /// The spelling used in messages: the longest.
    pub fn name(&self) -> &'static str {
        self.names
            .iter()
            .copied()
            .max_by_key(|n| n.len())
            .unwrap_or("")
    }
}

const NONE: How = How::Refuse("");

const fn val(names: &'static [&'static str], env: Option<&'static str>, key: &'static str) -> Opt {
    Opt {
        names,
        neg: &[],
        arg: Arg::Value,
        env,
        how: How::Set(key),
        how_neg: NONE,
    }
}

const fn switch(
    names: &'static [&'static str],
    env: Option<&'static str>,
    key: &'static str,
) -> Opt {
    Opt {
        names,
        neg: &[],
        arg: Arg::Switch,
        env,
        how: How::Set(key),
        how_neg: NONE,
    }
}

const fn pair(
    names: &'static [&'static str],
    neg: &'static [&'static str],
    env: Option<&'static str>,
    key: &'static str,
) -> Opt {
    Opt {
        names,
        neg,
        arg: Arg::Switch,
        env,
        how: How::Set(key),
        how_neg: How::Clear(key),
    }
}

const fn pair_how(
    names: &'static [&'static str],
    neg: &'static [&'static str],
    env: Option<&'static str>,
    how: How,
    how_neg: How,
) -> Opt {
    Opt {
        names,
        neg,
        arg: Arg::Switch,
        env,
        how,
        how_neg,
    }
}

const fn other(
    names: &'static [&'static str],
    arg: Arg,
    env: Option<&'static str>,
    how: How,
) -> Opt {
    Opt {
        names,
        neg: &[],
        arg,
        env,
        how,
        how_neg: NONE,
    }
}

const V: Arg = Arg::Value;
const S: Arg = Arg::Switch;

const fn warn(why: &'static str) -> How {
    How::Warn(why)
}

const fn refuse(why: &'static str) -> How {
    How::Refuse(why)
}

const NO_PINNING: How = warn(
    "tern does not pin threads or set their priority; the pool size is --threads / --threads-batch",
);
const NO_LOOKUP: How = refuse(
    "tern has no lookup decoding (its drafter is the model's MTP head, --spec-type draft-mtp)",
);
const NO_SHIFT: How = warn("qwen35's recurrent layers cannot shift, so llama.cpp disables context shift for this model too");
const ONE_CHECKPOINT: How =
    warn("tern keeps one prompt checkpoint per slot, at the end of the last prompt");
const NO_HOST_CACHE: How = warn(
    "tern keeps no host-memory prompt cache; each slot keeps its own state until it is reused",
);
const FIXED_CHAIN: How = refuse(
    "tern's sampler chain is fixed in llama.cpp's default order (penalties, DRY, top-n-sigma, top-k, typical, top-p, min-p, XTC, temperature)",
);
const NO_DRY: How = refuse("a server-wide DRY default is not implemented; requests set dry_*");
const NO_XTC: How = refuse("a server-wide XTC default is not implemented; requests set xtc_*");
const NO_MIROSTAT: How =
    refuse("a server-wide Mirostat default is not implemented; requests set mirostat*");
const NO_DYNATEMP: How =
    refuse("a server-wide dynamic-temperature default is not implemented; requests set dynatemp_*");
const NO_ADAPTIVE: How = refuse("tern has no adaptive-p sampler");
const NO_GRAMMAR: How = refuse(
    "a server-wide grammar is not implemented; requests set grammar, json_schema or response_format",
);
const NO_RERANK: How = refuse("tern has no reranking (it serves embeddings with --embeddings)");
const NO_EMBEDDINGS_WARN: How =
    warn("requests set embd_normalize (default 2, L2); a server-wide default is not implemented");
const NO_ROPE: How = refuse("tern runs the model's own RoPE; RoPE/YaRN scaling is not implemented");
const MMPROJ_ON_BACKEND: How =
    warn("the projector runs where the model runs (--backend), on the engine's thread");
const NO_MTMD_BATCH: How =
    warn("each image is encoded whole, once, and its rows go to the model in --ubatch-size pieces");
const NO_VIDEO: How = warn("tern reads images only: requests with video parts get a 400");
const NO_MEDIA_PATH: How =
    warn("file:// URLs are never read: requests send images inline as data: URLs");
const NO_DOWNLOAD: How =
    refuse("downloads are not supported; give the model's path with --model (-m)");
const NO_DOWNLOAD_MMPROJ: How =
    refuse("downloads are not supported; give the projector's path with --mmproj (-mm)");
const NEVER_DOWNLOADS: How = warn("tern never downloads anything");
const ONE_DEVICE: How = refuse("tern runs on the one device its backend picks (--backend cpu|wgpu|cuda); choosing or splitting devices is not supported");
const NO_MOE: How = warn("qwen35 has no Mixture-of-Experts weights");
const NO_DRAFT_MODEL: How =
    warn("tern has no separate draft model: the MTP head runs with the model's own settings");
const NO_NGRAM: How =
    warn("only llama.cpp's n-gram drafters read it; tern drafts with the MTP head");
const NO_TOOLS: How = refuse("tern has no built-in agent tools, MCP client or MCP proxy");
const NO_ROUTER: How = refuse("tern serves one model: there is no router mode");
const PRESET: How =
    refuse("a preset that downloads a model; downloads are not supported, give --model");
const REMOVED: How = refuse(
    "the argument has been removed from llama.cpp; use --spec-draft-n-max / --spec-draft-n-min",
);
const REMOVED_NGRAM: How =
    refuse("the argument has been removed from llama.cpp; tern has no n-gram drafter either");

/// Every option llama-server accepts, in arg.cpp's order.
pub const OPTIONS: &[Opt] = &[
    other(&["-h", "--help", "--usage"], S, None, How::Clap("--help")),
    other(&["--version"], S, None, How::Clap("--version")),
    other(&["-cl", "--cache-list"], S, None, refuse("tern keeps no cache of downloaded models: it never downloads one")),
    other(&["--completion-bash"], S, None, refuse("tern's completion scripts come from `tern completions bash|zsh|fish`")),
    val(&["-t", "--threads"], Some("LLAMA_ARG_THREADS"), "threads"),
    val(&["-tb", "--threads-batch"], None, "threads-batch"),
    other(&["-C", "--cpu-mask"], V, None, NO_PINNING),
    other(&["-Cr", "--cpu-range"], V, None, NO_PINNING),
    other(&["--cpu-strict"], V, None, NO_PINNING),
    other(&["--prio"], V, None, NO_PINNING),
    other(&["--poll"], V, None, warn("tern's thread pool has no polling level")),
    other(&["-Cb", "--cpu-mask-batch"], V, None, NO_PINNING),
    other(&["-Crb", "--cpu-range-batch"], V, None, NO_PINNING),
    other(&["--cpu-strict-batch"], V, None, NO_PINNING),
    other(&["--prio-batch"], V, None, NO_PINNING),
    other(&["--poll-batch"], V, None, warn("tern's thread pool has no polling level")),
    other(&["-lcs", "--lookup-cache-static"], V, None, NO_LOOKUP),
    other(&["-lcd", "--lookup-cache-dynamic"], V, None, NO_LOOKUP),
    val(&["-c", "--ctx-size"], Some("LLAMA_ARG_CTX_SIZE"), "ctx-size"),
    val(&["--kv-unified-per-slot"], Some("LLAMA_ARG_KV_UNIFIED_PER_SLOT"), "kv-unified-per-slot"),
    val(&["-n", "--predict", "--n-predict"], Some("LLAMA_ARG_N_PREDICT"), "n-predict"),
    val(&["-b", "--batch-size"], Some("LLAMA_ARG_BATCH"), "batch-size"),
    val(&["-ub", "--ubatch-size"], Some("LLAMA_ARG_UBATCH"), "ubatch-size"),
    other(&["--keep"], V, None, warn("it only matters to context shift, which qwen35's recurrent layers rule out (llama.cpp disables it for this model too)")),
    other(&["--swa-full"], S, Some("LLAMA_ARG_SWA_FULL"), warn("qwen35 has no sliding-window attention")),
    other(&["-ctxcp", "--ctx-checkpoints", "--swa-checkpoints"], V, Some("LLAMA_ARG_CTX_CHECKPOINTS"), ONE_CHECKPOINT),
    other(&["-cms", "--checkpoint-min-step"], V, Some("LLAMA_ARG_CHECKPOINT_MIN_SPACING_NT"), ONE_CHECKPOINT),
    other(&["-cram", "--cache-ram"], V, Some("LLAMA_ARG_CACHE_RAM"), NO_HOST_CACHE),
    pair_how(
        &["-kvu", "--kv-unified"],
        &["-no-kvu", "--no-kv-unified"],
        Some("LLAMA_ARG_KV_UNIFIED"),
        refuse("tern gives each slot a fixed window of ctx-size / parallel tokens (llama.cpp's --no-kv-unified); one pool shared by all slots is not implemented"),
        warn("each slot already has its own window of ctx-size / parallel tokens"),
    ),
    pair_how(&["--cache-idle-slots"], &["--no-cache-idle-slots"], Some("LLAMA_ARG_CACHE_IDLE_SLOTS"), NO_HOST_CACHE, NO_HOST_CACHE),
    pair_how(&["--context-shift"], &["--no-context-shift"], Some("LLAMA_ARG_CONTEXT_SHIFT"), NO_SHIFT, NO_SHIFT),
    val(&["-fa", "--flash-attn"], Some("LLAMA_ARG_FLASH_ATTN"), "flash-attn"),
    pair_how(&["--perf"], &["--no-perf"], Some("LLAMA_ARG_PERF"), warn("tern has no libllama performance counters; every response carries its timings"), warn("tern has no libllama performance counters to turn off")),
    pair_how(&["-e", "--escape"], &["--no-escape"], None, warn("llama-server reads no prompt from its command line, so there is nothing to unescape"), warn("llama-server reads no prompt from its command line, so there is nothing to unescape")),
    val(&["-r", "--reverse-prompt"], None, "reverse-prompt"),
    switch(&["-sp", "--special"], None, "special"),
    pair_how(&["--warmup"], &["--no-warmup"], None, warn("tern always runs its warm-up step"), warn("tern's warm-up step measures the compute buffers the boot ledger checks, so it always runs")),
    other(&["--spm-infill"], S, None, warn("tern has no /infill endpoint")),
    other(&["--samplers"], V, None, FIXED_CHAIN),
    val(&["-s", "--seed"], None, "seed"),
    other(&["--sampler-seq", "--sampling-seq"], V, None, FIXED_CHAIN),
    switch(&["--ignore-eos"], None, "ignore-eos"),
    val(&["--temp", "--temperature"], Some("LLAMA_ARG_TEMPERATURE"), "temp"),
    val(&["--top-k"], Some("LLAMA_ARG_TOP_K"), "top-k"),
    val(&["--top-p"], Some("LLAMA_ARG_TOP_P"), "top-p"),
    val(&["--min-p"], Some("LLAMA_ARG_MIN_P"), "min-p"),
    other(&["--top-nsigma", "--top-n-sigma"], V, None, refuse("a server-wide top-n-sigma default is not implemented; requests set top_n_sigma")),
    other(&["--xtc-probability"], V, None, NO_XTC),
    other(&["--xtc-threshold"], V, None, NO_XTC),
    other(&["--typical", "--typical-p"], V, None, refuse("a server-wide typical-p default is not implemented; requests set typical_p")),
    val(&["--repeat-last-n"], None, "repeat-last-n"),
    val(&["--repeat-penalty"], Some("LLAMA_ARG_REPEAT_PENALTY"), "repeat-penalty"),
    val(&["--presence-penalty"], Some("LLAMA_ARG_PRESENCE_PENALTY"), "presence-penalty"),
    val(&["--frequency-penalty"], Some("LLAMA_ARG_FREQUENCY_PENALTY"), "frequency-penalty"),
    other(&["--dry-multiplier"], V, None, NO_DRY),
    other(&["--dry-base"], V, None, NO_DRY),
    other(&["--dry-allowed-length"], V, None, NO_DRY),
    other(&["--dry-penalty-last-n"], V, None, NO_DRY),
    other(&["--dry-sequence-breaker"], V, None, NO_DRY),
    other(&["--adaptive-target"], V, None, NO_ADAPTIVE),
    other(&["--adaptive-decay"], V, None, NO_ADAPTIVE),
    other(&["--dynatemp-range"], V, None, NO_DYNATEMP),
    other(&["--dynatemp-exp"], V, None, NO_DYNATEMP),
    other(&["--mirostat"], V, None, NO_MIROSTAT),
    other(&["--mirostat-lr"], V, None, NO_MIROSTAT),
    other(&["--mirostat-ent"], V, None, NO_MIROSTAT),
    other(&["-l", "--logit-bias"], V, None, refuse("tern has no logit bias")),
    other(&["--grammar"], V, None, NO_GRAMMAR),
    other(&["--grammar-file"], V, None, NO_GRAMMAR),
    other(&["-j", "--json-schema"], V, None, NO_GRAMMAR),
    other(&["-jf", "--json-schema-file"], V, None, NO_GRAMMAR),
    other(&["-bs", "--backend-sampling"], S, Some("LLAMA_ARG_BACKEND_SAMPLING"), warn("tern samples on the host; a greedy pick is already made on the device")),
    val(&["--pooling"], Some("LLAMA_ARG_POOLING"), "pooling"),
    other(&["--rope-scaling"], V, Some("LLAMA_ARG_ROPE_SCALING_TYPE"), NO_ROPE),
    other(&["--rope-scale"], V, Some("LLAMA_ARG_ROPE_SCALE"), NO_ROPE),
    other(&["--rope-freq-base"], V, Some("LLAMA_ARG_ROPE_FREQ_BASE"), NO_ROPE),
    other(&["--rope-freq-scale"], V, Some("LLAMA_ARG_ROPE_FREQ_SCALE"), NO_ROPE),
    other(&["--yarn-orig-ctx"], V, Some("LLAMA_ARG_YARN_ORIG_CTX"), NO_ROPE),
    other(&["--yarn-ext-factor"], V, Some("LLAMA_ARG_YARN_EXT_FACTOR"), NO_ROPE),
    other(&["--yarn-attn-factor"], V, Some("LLAMA_ARG_YARN_ATTN_FACTOR"), NO_ROPE),
    other(&["--yarn-beta-slow"], V, Some("LLAMA_ARG_YARN_BETA_SLOW"), NO_ROPE),
    other(&["--yarn-beta-fast"], V, Some("LLAMA_ARG_YARN_BETA_FAST"), NO_ROPE),
    pair_how(
        &["-kvo", "--kv-offload"],
        &["-nkvo", "--no-kv-offload"],
        Some("LLAMA_ARG_KV_OFFLOAD"),
        warn("the KV cache always lives with the weights on the backend's device"),
        refuse("tern cannot keep the KV cache in host memory beside a device backend; use --backend cpu to run everything on the CPU"),
    ),
    pair(&["--repack"], &["-nr", "--no-repack"], Some("LLAMA_ARG_REPACK"), "repack"),
    other(&["--no-host"], S, Some("LLAMA_ARG_NO_HOST"), warn("tern has no host buffer types to bypass")),
    val(&["-ctk", "--cache-type-k"], Some("LLAMA_ARG_CACHE_TYPE_K"), "cache-type-k"),
    val(&["-ctv", "--cache-type-v"], Some("LLAMA_ARG_CACHE_TYPE_V"), "cache-type-v"),
    other(&["-dt", "--defrag-thold"], V, Some("LLAMA_ARG_DEFRAG_THOLD"), warn("deprecated in llama.cpp and no longer necessary to specify")),
    val(&["-np", "--parallel"], Some("LLAMA_ARG_N_PARALLEL"), "parallel"),
    pair_how(
        &["-cb", "--cont-batching"],
        &["-nocb", "--no-cont-batching"],
        Some("LLAMA_ARG_CONT_BATCHING"),
        warn("tern always batches the busy slots together"),
        warn("tern always batches the busy slots together; it cannot be turned off"),
    ),
    val(&["-mm", "--mmproj"], Some("LLAMA_ARG_MMPROJ"), "mmproj"),
    other(&["-mmu", "--mmproj-url"], V, Some("LLAMA_ARG_MMPROJ_URL"), NO_DOWNLOAD_MMPROJ),
    pair_how(&["--mmproj-auto"], &["--no-mmproj", "--no-mmproj-auto"], Some("LLAMA_ARG_MMPROJ_AUTO"), warn("tern never fetches a projector by itself; give one with --mmproj"), warn("tern never fetches a projector by itself")),
    pair_how(&["--mmproj-offload"], &["--no-mmproj-offload"], Some("LLAMA_ARG_MMPROJ_OFFLOAD"), MMPROJ_ON_BACKEND, MMPROJ_ON_BACKEND),
    other(&["-mmdev", "--mmproj-device"], V, Some("MTMD_BACKEND_DEVICE"), MMPROJ_ON_BACKEND),
    val(&["--image-min-tokens"], Some("LLAMA_ARG_IMAGE_MIN_TOKENS"), "image-min-tokens"),
    val(&["--image-max-tokens"], Some("LLAMA_ARG_IMAGE_MAX_TOKENS"), "image-max-tokens"),
    other(&["--mtmd-batch-max-tokens"], V, Some("LLAMA_ARG_MTMD_BATCH_MAX_TOKENS"), NO_MTMD_BATCH),
    other(&["--video-fps"], V, Some("LLAMA_ARG_VIDEO_FPS"), NO_VIDEO),
    other(&["--video-timestamp-interval"], V, Some("LLAMA_ARG_VIDEO_TIMESTAMP_INTERVAL"), NO_VIDEO),
    other(&["--video-ffmpeg-dir"], V, Some("LLAMA_ARG_VIDEO_FFMPEG_DIR"), NO_VIDEO),
    other(&["--rpc"], V, Some("LLAMA_ARG_RPC"), refuse("tern has no RPC backend")),
    other(&["-lm", "--load-mode"], V, Some("LLAMA_ARG_LOAD_MODE"), warn("tern memory-maps the model file and reads it once at load")),
    other(&["-lzm", "--lazy-mode"], V, Some("LLAMA_ARG_LAZY_MODE"), warn("tern keeps every tensor resident")),
    other(&["--numa"], V, Some("LLAMA_ARG_NUMA"), warn("tern does no NUMA placement")),
    other(&["-dev", "--device"], V, Some("LLAMA_ARG_DEVICE"), ONE_DEVICE),
    other(&["--list-devices"], S, None, refuse("tern has no device list; `--backend auto` logs the device it takes and why it passed over the others")),
    other(&["-ot", "--override-tensor"], V, Some("LLAMA_ARG_OVERRIDE_TENSOR"), refuse("tern places every tensor on the backend's device; per-tensor overrides are not supported")),
    other(&["-cmoe", "--cpu-moe"], S, Some("LLAMA_ARG_CPU_MOE"), NO_MOE),
    other(&["-ncmoe", "--n-cpu-moe"], V, Some("LLAMA_ARG_N_CPU_MOE"), NO_MOE),
    other(&["-ncffn", "--n-cpu-ffn"], V, Some("LLAMA_ARG_N_CPU_FFN"), refuse("tern cannot keep FFN weights on the CPU beside a device backend; use --backend cpu to run everything on the CPU")),
    val(&["-ngl", "--gpu-layers", "--n-gpu-layers"], Some("LLAMA_ARG_N_GPU_LAYERS"), "n-gpu-layers"),
    other(&["-sm", "--split-mode"], V, Some("LLAMA_ARG_SPLIT_MODE"), warn("tern runs on one device, so there is nothing to split")),
    other(&["-ts", "--tensor-split"], V, Some("LLAMA_ARG_TENSOR_SPLIT"), ONE_DEVICE),
    other(&["-mg", "--main-gpu"], V, Some("LLAMA_ARG_MAIN_GPU"), ONE_DEVICE),
    other(&["-fit", "--fit"], V, Some("LLAMA_ARG_FIT"), warn("tern never shrinks a shape by itself: its planner refuses a shape that does not fit and names the cheapest changes (`tern fit`)")),
    val(&["-fitt", "--fit-target"], Some("LLAMA_ARG_FIT_TARGET"), "margin-mib"),
    other(&["-fitc", "--fit-ctx"], V, Some("LLAMA_ARG_FIT_CTX"), warn("tern never shrinks the context to fit: its planner refuses a shape that does not fit")),
    other(&["--check-tensors"], S, None, warn("tern checks the tensor table and types at load; the data itself is not scanned")),
    other(&["--override-kv"], V, None, refuse("tern reads the model's metadata as the file has it; overrides are not supported")),
    pair_how(&["--op-offload"], &["--no-op-offload"], None, warn("every op already runs on the backend's device"), warn("tern runs every op on the backend's device; host ops are not supported")),
    val(&["--lora"], None, "lora"),
    val(&["--lora-scaled"], None, "lora-scaled"),
    other(&["--control-vector"], V, None, refuse("tern cannot apply control vectors")),
    other(&["--control-vector-scaled"], V, None, refuse("tern cannot apply control vectors")),
    other(&["--control-vector-layer-range"], V, None, refuse("tern cannot apply control vectors")),
    val(&["-a", "--alias"], Some("LLAMA_ARG_ALIAS"), "alias"),
    val(&["--tags"], Some("LLAMA_ARG_TAGS"), "tags"),
    val(&["-m", "--model"], Some("LLAMA_ARG_MODEL"), "model"),
    other(&["-mu", "--model-url"], V, Some("LLAMA_ARG_MODEL_URL"), NO_DOWNLOAD),
    other(&["-dr", "--docker-repo"], V, Some("LLAMA_ARG_DOCKER_REPO"), NO_DOWNLOAD),
    other(&["-hf", "-hfr", "--hf-repo"], V, Some("LLAMA_ARG_HF_REPO"), NO_DOWNLOAD),
    other(&["-hff", "--hf-file"], V, Some("LLAMA_ARG_HF_FILE"), NO_DOWNLOAD),
    other(&["-hft", "--hf-token"], V, Some("HF_TOKEN"), NEVER_DOWNLOADS),
    other(&["--embd-normalize"], V, None, NO_EMBEDDINGS_WARN),
    val(&["--host"], Some("LLAMA_ARG_HOST"), "host"),
    val(&["--port"], Some("LLAMA_ARG_PORT"), "port"),
    other(&["--reuse-port"], S, Some("LLAMA_ARG_REUSE_PORT"), refuse("tern binds its port for itself; SO_REUSEPORT is not supported")),
    other(&["--path"], V, Some("LLAMA_ARG_STATIC_PATH"), refuse("tern serves no static files")),
    val(&["--cors-origins"], Some("LLAMA_ARG_CORS_ORIGINS"), "cors-origins"),
    val(&["--cors-methods"], Some("LLAMA_ARG_CORS_METHODS"), "cors-methods"),
    val(&["--cors-headers"], Some("LLAMA_ARG_CORS_HEADERS"), "cors-headers"),
    pair(&["--cors-credentials"], &["--no-cors-credentials"], Some("LLAMA_ARG_CORS_CREDENTIALS"), "cors-credentials"),
    val(&["--api-prefix"], Some("LLAMA_ARG_API_PREFIX"), "api-prefix"),
    val(&["--ui-config", "--webui-config"], Some("LLAMA_ARG_UI_CONFIG"), "ui-config"),
    val(&["--ui-config-file", "--webui-config-file"], Some("LLAMA_ARG_UI_CONFIG_FILE"), "ui-config-file"),
    pair_how(&["--ui-mcp-proxy", "--webui-mcp-proxy"], &["--no-ui-mcp-proxy", "--no-webui-mcp-proxy"], Some("LLAMA_ARG_UI_MCP_PROXY"), NO_TOOLS, warn("tern has no MCP proxy to turn off")),
    other(&["--tools"], V, Some("LLAMA_ARG_TOOLS"), NO_TOOLS),
    other(&["--tools-runtime"], V, Some("LLAMA_ARG_TOOLS_RUNTIME"), NO_TOOLS),
    other(&["--mcp-servers-config"], V, Some("LLAMA_ARG_MCP_SERVERS_CONFIG"), NO_TOOLS),
    other(&["--mcp-servers-json"], V, Some("LLAMA_ARG_MCP_SERVERS_JSON"), NO_TOOLS),
    pair_how(&["-ag", "--agent"], &["-no-ag", "--no-agent"], Some("LLAMA_ARG_AGENT"), NO_TOOLS, warn("tern has no agent tools to turn off")),
    pair(&["--ui", "--webui"], &["--no-ui", "--no-webui"], Some("LLAMA_ARG_UI"), "webui"),
    switch(&["--embedding", "--embeddings"], Some("LLAMA_ARG_EMBEDDINGS"), "embeddings"),
    other(&["--rerank", "--reranking"], S, Some("LLAMA_ARG_RERANKING"), NO_RERANK),
    val(&["--api-key"], Some("LLAMA_API_KEY"), "api-key"),
    val(&["--api-key-file"], Some("LLAMA_ARG_API_KEY_FILE"), "api-key-file"),
    other(&["--ssl-key-file"], V, Some("LLAMA_ARG_SSL_KEY_FILE"), refuse("tern serves plain HTTP; terminate TLS in front of it")),
    other(&["--ssl-cert-file"], V, Some("LLAMA_ARG_SSL_CERT_FILE"), refuse("tern serves plain HTTP; terminate TLS in front of it")),
    val(&["--chat-template-kwargs"], Some("LLAMA_ARG_CHAT_TEMPLATE_KWARGS"), "chat-template-kwargs"),
    val(&["-to", "--timeout"], Some("LLAMA_ARG_TIMEOUT"), "timeout"),
    val(&["--sse-ping-interval"], Some("LLAMA_ARG_SSE_PING_INTERVAL"), "sse-ping-interval"),
    val(&["--threads-http"], Some("LLAMA_ARG_THREADS_HTTP"), "threads-http"),
    pair(&["--cache-prompt"], &["--no-cache-prompt"], Some("LLAMA_ARG_CACHE_PROMPT"), "cache-prompt"),
    other(&["--cache-reuse"], V, Some("LLAMA_ARG_CACHE_REUSE"), warn("qwen35's recurrent layers cannot shift the cache, so llama.cpp disables chunked reuse for this model too; tern reuses each slot's common prefix (--cache-prompt)")),
    switch(&["--metrics"], Some("LLAMA_ARG_ENDPOINT_METRICS"), "metrics"),
    switch(&["--props"], Some("LLAMA_ARG_ENDPOINT_PROPS"), "props"),
    pair(&["--slots"], &["--no-slots"], Some("LLAMA_ARG_ENDPOINT_SLOTS"), "slots"),
    other(&["--slot-save-path"], V, None, refuse("tern cannot save or restore slot caches")),
    other(&["--media-path"], V, None, NO_MEDIA_PATH),
    other(&["--models-dir"], V, Some("LLAMA_ARG_MODELS_DIR"), NO_ROUTER),
    other(&["--models-preset"], V, Some("LLAMA_ARG_MODELS_PRESET"), NO_ROUTER),
    other(&["--models-max"], V, Some("LLAMA_ARG_MODELS_MAX"), NO_ROUTER),
    pair_how(&["--models-autoload"], &["--no-models-autoload"], Some("LLAMA_ARG_MODELS_AUTOLOAD"), NO_ROUTER, warn("tern serves one model: there is no router to autoload")),
    pair_how(
        &["--jinja"],
        &["--no-jinja"],
        Some("LLAMA_ARG_JINJA"),
        warn("tern always renders the chat template with Jinja (llama-server's default too)"),
        refuse("tern renders chat templates with Jinja only; llama.cpp's legacy formatter is not implemented"),
    ),
    val(&["--reasoning-format"], Some("LLAMA_ARG_THINK"), "reasoning-format"),
    val(&["-rea", "--reasoning"], Some("LLAMA_ARG_REASONING"), "reasoning"),
    val(&["--reasoning-effort"], Some("LLAMA_ARG_REASONING_EFFORT"), "reasoning-effort"),
    val(&["--reasoning-budget"], Some("LLAMA_ARG_THINK_BUDGET"), "reasoning-budget"),
    val(&["--reasoning-budget-message"], Some("LLAMA_ARG_THINK_BUDGET_MESSAGE"), "reasoning-budget-message"),
    pair(&["--reasoning-preserve"], &["--no-reasoning-preserve"], Some("LLAMA_ARG_REASONING_PRESERVE"), "reasoning-preserve"),
    val(&["--chat-template"], Some("LLAMA_ARG_CHAT_TEMPLATE"), "chat-template"),
    val(&["--chat-template-file"], Some("LLAMA_ARG_CHAT_TEMPLATE_FILE"), "chat-template-file"),
    pair(&["--skip-chat-parsing"], &["--no-skip-chat-parsing"], Some("LLAMA_ARG_SKIP_CHAT_PARSING"), "skip-chat-parsing"),
    pair_how(
        &["--prefill-assistant"],
        &["--no-prefill-assistant"],
        Some("LLAMA_ARG_PREFILL_ASSISTANT"),
        refuse("tern does not continue a final assistant message yet: it treats it as complete (llama.cpp's --no-prefill-assistant)"),
        warn("tern already treats a final assistant message as complete"),
    ),
    other(&["-sps", "--slot-prompt-similarity"], V, None, warn("tern gives a request the free slot that reuses the longest prefix of its prompt")),
    switch(&["--lora-init-without-apply"], None, "lora-init-without-apply"),
    other(&["--sleep-idle-seconds"], V, None, refuse("tern keeps the model loaded; idle sleep is not supported")),
    switch(&["--log-disable"], None, "log-disable"),
    val(&["--log-file"], Some("LLAMA_ARG_LOG_FILE"), "log-file"),
    pair_how(&["--log-jsonl"], &["--no-log-jsonl"], Some("LLAMA_ARG_LOG_JSONL"), How::SetTo("log-format", "json"), How::SetTo("log-format", "text")),
    other(&["--log-prompts-dir"], V, None, refuse("tern writes no prompt files; -v logs each chat prompt")),
    val(&["--log-colors"], Some("LLAMA_ARG_LOG_COLORS"), "log-colors"),
    switch(&["-v", "--verbose", "--log-verbose"], None, "verbose"),
    other(&["--offline"], S, Some("LLAMA_ARG_OFFLINE"), NEVER_DOWNLOADS),
    val(&["-lv", "--verbosity", "--log-verbosity"], Some("LLAMA_ARG_LOG_VERBOSITY"), "log-verbosity"),
    pair(&["--log-prefix"], &["--no-log-prefix"], Some("LLAMA_ARG_LOG_PREFIX"), "log-prefix"),
    pair(&["--log-timestamps"], &["--no-log-timestamps"], Some("LLAMA_ARG_LOG_TIMESTAMPS"), "log-timestamps"),
    other(&["--spec-draft-hf", "-hfd", "-hfrd", "--hf-repo-draft"], V, Some("LLAMA_ARG_SPEC_DRAFT_HF_REPO"), refuse("downloads are not supported, and tern drafts with the model's own MTP head (--spec-type draft-mtp)")),
    other(&["--spec-draft-threads", "-td", "--threads-draft"], V, None, NO_DRAFT_MODEL),
    other(&["--spec-draft-threads-batch", "-tbd", "--threads-batch-draft"], V, None, NO_DRAFT_MODEL),
    other(&["--spec-draft-cpu-mask", "-Cd", "--cpu-mask-draft"], V, None, NO_DRAFT_MODEL),
    other(&["--spec-draft-cpu-range", "-Crd", "--cpu-range-draft"], V, None, NO_DRAFT_MODEL),
    other(&["--spec-draft-cpu-strict", "--cpu-strict-draft"], V, None, NO_DRAFT_MODEL),
    other(&["--spec-draft-prio", "--prio-draft"], V, None, NO_DRAFT_MODEL),
    other(&["--spec-draft-poll", "--poll-draft"], V, None, NO_DRAFT_MODEL),
    other(&["--spec-draft-cpu-mask-batch", "-Cbd", "--cpu-mask-batch-draft"], V, None, NO_DRAFT_MODEL),
    other(&["--spec-draft-cpu-strict-batch", "--cpu-strict-batch-draft"], V, None, NO_DRAFT_MODEL),
    other(&["--spec-draft-prio-batch", "--prio-batch-draft"], V, None, NO_DRAFT_MODEL),
    other(&["--spec-draft-poll-batch", "--poll-batch-draft"], V, None, NO_DRAFT_MODEL),
    val(&["--spec-draft-type-k", "-ctkd", "--cache-type-k-draft"], Some("LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_K"), "spec-draft-type-k"),
    val(&["--spec-draft-type-v", "-ctvd", "--cache-type-v-draft"], Some("LLAMA_ARG_SPEC_DRAFT_CACHE_TYPE_V"), "spec-draft-type-v"),
    other(&["--spec-draft-override-tensor", "-otd", "--override-tensor-draft"], V, None, refuse("tern has no separate draft model, and per-tensor overrides are not supported")),
    other(&["--spec-draft-cpu-moe", "-cmoed", "--cpu-moe-draft"], S, Some("LLAMA_ARG_SPEC_DRAFT_CPU_MOE"), NO_MOE),
    other(&["--spec-draft-n-cpu-moe", "--spec-draft-ncmoe", "-ncmoed", "--n-cpu-moe-draft"], V, Some("LLAMA_ARG_SPEC_DRAFT_N_CPU_MOE"), NO_MOE),
    val(&["--spec-draft-n-max"], Some("LLAMA_ARG_SPEC_DRAFT_N_MAX"), "spec-draft-n-max"),
    val(&["--spec-draft-n-min"], Some("LLAMA_ARG_SPEC_DRAFT_N_MIN"), "spec-draft-n-min"),
    other(&["--spec-synth-len"], V, Some("LLAMA_ARG_SPEC_SYNTH_LEN"), refuse("tern has no synthetic-acceptance benchmark mode")),
    other(&["--spec-synth-rates"], V, Some("LLAMA_ARG_SPEC_SYNTH_RATES"), refuse("tern has no synthetic-acceptance benchmark mode")),
    other(&["--spec-draft-p-split", "--draft-p-split"], V, Some("LLAMA_ARG_SPEC_DRAFT_P_SPLIT"), warn("tern's MTP drafter drafts one sequence: there is no draft tree to split")),
    val(&["--spec-draft-p-min", "--draft-p-min"], Some("LLAMA_ARG_SPEC_DRAFT_P_MIN"), "spec-draft-p-min"),
    pair_how(&["--spec-draft-backend-sampling"], &["--no-spec-draft-backend-sampling"], Some("LLAMA_ARG_SPEC_DRAFT_BACKEND_SAMPLING"), warn("the MTP drafter already picks its drafts on the backend's device"), warn("the MTP drafter always picks its drafts on the backend's device")),
    other(&["--spec-draft-device", "-devd", "--device-draft"], V, None, ONE_DEVICE),
    other(&["--spec-draft-ngl", "-ngld", "--gpu-layers-draft", "--n-gpu-layers-draft"], V, Some("LLAMA_ARG_N_GPU_LAYERS_DRAFT"), NO_DRAFT_MODEL),
    other(&["--spec-draft-model", "-md", "--model-draft"], V, Some("LLAMA_ARG_SPEC_DRAFT_MODEL"), refuse("tern drafts with the model's own MTP head (--spec-type draft-mtp); a separate draft model is not supported")),
    val(&["--spec-type"], Some("LLAMA_ARG_SPEC_TYPE"), "spec-type"),
    other(&["--spec-ngram-mod-n-min"], V, None, NO_NGRAM),
    other(&["--spec-ngram-mod-n-max"], V, None, NO_NGRAM),
    other(&["--spec-ngram-mod-n-match"], V, None, NO_NGRAM),
    other(&["--spec-ngram-simple-size-n"], V, None, NO_NGRAM),
    other(&["--spec-ngram-simple-size-m"], V, None, NO_NGRAM),
    other(&["--spec-ngram-simple-min-hits"], V, None, NO_NGRAM),
    other(&["--spec-ngram-map-k-size-n"], V, None, NO_NGRAM),
    other(&["--spec-ngram-map-k-size-m"], V, None, NO_NGRAM),
    other(&["--spec-ngram-map-k-min-hits"], V, None, NO_NGRAM),
    other(&["--spec-ngram-map-k4v-size-n"], V, None, NO_NGRAM),
    other(&["--spec-ngram-map-k4v-size-m"], V, None, NO_NGRAM),
    other(&["--spec-ngram-map-k4v-min-hits"], V, None, NO_NGRAM),
    other(&["--draft", "--draft-n", "--draft-max"], V, Some("LLAMA_ARG_DRAFT_MAX"), REMOVED),
    other(&["--draft-min", "--draft-n-min"], V, Some("LLAMA_ARG_DRAFT_MIN"), REMOVED),
    other(&["--spec-ngram-size-n"], V, None, REMOVED_NGRAM),
    other(&["--spec-ngram-size-m"], V, None, REMOVED_NGRAM),
    other(&["--spec-ngram-min-hits"], V, None, REMOVED_NGRAM),
    other(&["--embd-gemma-default"], S, None, PRESET),
    other(&["--fim-qwen-1.5b-default"], S, None, PRESET),
    other(&["--fim-qwen-3b-default"], S, None, PRESET),
    other(&["--fim-qwen-7b-default"], S, None, PRESET),
    other(&["--fim-qwen-7b-spec"], S, None, PRESET),
    other(&["--fim-qwen-14b-spec"], S, None, PRESET),
    other(&["--fim-qwen-30b-default"], S, None, PRESET),
    other(&["--gpt-oss-20b-default"], S, None, PRESET),
    other(&["--gpt-oss-120b-default"], S, None, PRESET),
    other(&["--vision-gemma-4b-default"], S, None, PRESET),
    other(&["--vision-gemma-12b-default"], S, None, PRESET),
    other(&["--spec-default"], S, None, refuse("it arms llama.cpp's n-gram drafter, which tern does not have; tern drafts with the MTP head (--spec-type draft-mtp)")),
];

/// The option a spelling belongs to, and whether the spelling is a negative one.
pub fn lookup(spelling: &str) -> Option<(&'static Opt, bool)> {
    OPTIONS.iter().find_map(|o| {
        if o.names.contains(&spelling) {
            Some((o, false))
        } else if o.neg.contains(&spelling) {
            Some((o, true))
        } else {
            None
        }
    })
}

/// Where a setting or a warning came from.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Origin {
    Flag(String),
    Env(String),
    File { path: String, key: String },
}

impl fmt::Display for Origin {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Origin::Flag(s) => write!(f, "{s}"),
            Origin::Env(v) => write!(f, "environment {v}"),
            Origin::File { path, key } => write!(f, "config {path}: key `{key}`"),
        }
    }
}

/// A flag accepted without effect, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Note {
    pub origin: Origin,
    pub why: String,
}

impl fmt::Display for Note {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: ignored: {}", self.origin, self.why)
    }
}

#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
pub enum FlagError {
    #[error("{origin}: not supported: {why}")]
    Refused { origin: Origin, why: String },
    #[error("{flag} needs a value")]
    MissingValue { flag: String },
    #[error("{flag} takes no value (got {value:?})")]
    UnexpectedValue { flag: String, value: String },
    #[error("environment {var}={value:?}: {why}")]
    Env {
        var: String,
        value: String,
        why: String,
    },
}

/// The command line after [`rewrite`]: what clap reads, the warnings met on the way, and how
/// the user spelled each setting (`n-gpu-layers` → `-ngl`), for messages.
#[derive(Clone, Debug, Default)]
pub struct Rewritten {
    pub args: Vec<String>,
    pub notes: Vec<Note>,
    pub spellings: BTreeMap<String, String>,
}

/// llama.cpp's truthy and falsy words for boolean values (`common_arg_utils`).
pub fn parse_bool(s: &str) -> Option<bool> {
    match s.trim().to_ascii_lowercase().as_str() {
        "1" | "true" | "on" | "enabled" | "yes" => Some(true),
        "0" | "false" | "off" | "disabled" | "no" => Some(false),
        _ => None,
    }
}

/// Rewrites llama-server's spellings in `args` (the arguments after the subcommand) to tern's:
/// multi-letter short forms (`-np`), aliases (`--gpu-layers`), underscores (`--ctx_size`, as
/// llama.cpp accepts them) and negative booleans (`--no-slots` is `--slots=false`). Warned
/// flags are dropped with a note; a refused flag is an error naming it. Arguments the table
/// does not know (tern's own flags, typos) pass through for clap to judge.
pub fn rewrite<S: AsRef<str>>(args: &[S]) -> Result<Rewritten, FlagError> {
    let mut out = Rewritten::default();
    let mut seen: BTreeMap<&'static str, String> = BTreeMap::new();
    let mut it = args.iter().map(|a| a.as_ref().to_string()).peekable();
    while let Some(raw) = it.next() {
        if raw == "--" {
            out.args.push(raw);
            out.args.extend(it.by_ref());
            break;
        }
        let (mut name, inline) = match raw.split_once('=') {
            Some((n, v)) if n.starts_with('-') => (n.to_string(), Some(v.to_string())),
            _ => (raw.clone(), None),
        };
        if name.starts_with("--") {
            name = name.replace('_', "-");
        }
        let Some((opt, negative)) = lookup(&name) else {
            out.args.push(match inline {
                Some(v) => format!("{name}={v}"),
                None => name,
            });
            continue;
        };
        let how = if negative { opt.how_neg } else { opt.how };
        let value = match opt.arg {
            Arg::Value => match inline {
                Some(v) => Some(v),
                None => match it.next() {
                    Some(v) => Some(v),
                    None => return Err(FlagError::MissingValue { flag: name }),
                },
            },
            Arg::Switch => {
                if let Some(v) = inline {
                    // `--metrics=false` and the like: tern's booleans take a value.
                    if parse_bool(&v).is_none() {
                        return Err(FlagError::UnexpectedValue {
                            flag: name,
                            value: v,
                        });
                    }
                    Some(v)
                } else {
                    None
                }
            }
        };
        let origin = Origin::Flag(match &value {
            Some(v) if opt.arg == Arg::Value => format!("{name} {v}"),
            _ => name.clone(),
        });
        match how {
            How::Clap(to) => out.args.push(to.to_string()),
            How::Warn(why) => out.notes.push(Note {
                origin,
                why: why.to_string(),
            }),
            How::Refuse(why) => {
                return Err(FlagError::Refused {
                    origin,
                    why: why.to_string(),
                })
            }
            How::Set(key) | How::Clear(key) | How::SetTo(key, _) => {
                let v = match (how, opt.arg, value) {
                    (How::SetTo(_, fixed), _, _) => fixed.to_string(),
                    (How::Clear(_), _, Some(v)) => (!parse_bool(&v).unwrap_or(true)).to_string(),
                    (How::Clear(_), _, None) => "false".to_string(),
                    (_, Arg::Switch, Some(v)) => v,
                    (_, Arg::Switch, None) => "true".to_string(),
                    (_, Arg::Value, Some(v)) => v,
                    (_, Arg::Value, None) => unreachable!("a value option always has one"),
                };
                // llama.cpp keeps the last of a repeated flag and says so (arg.cpp); tern's
                // list-valued settings (--lora-scaled, --reverse-prompt) take every one.
                let repeatable = matches!(key, "lora" | "lora-scaled" | "reverse-prompt");
                if !repeatable {
                    if let Some(prev) = seen.insert(key, name.clone()) {
                        out.notes.push(Note {
                            origin: Origin::Flag(name.clone()),
                            why: format!("an earlier {prev} is overridden: the last value is used"),
                        });
                        let flag = format!("--{key}");
                        if let Some(i) = out
                            .args
                            .iter()
                            .position(|a| a.split('=').next() == Some(flag.as_str()))
                        {
                            out.args.remove(i);
                        }
                    }
                }
                out.spellings.insert(key.to_string(), name.clone());
                if key == "lora" {
                    // `--lora FILE[,FILE]` joins the `--lora-scaled` list at scale 1, in its
                    // place, so the adapters keep llama-server's ids (command-line order).
                    let scaled: Vec<String> = v.split(',').map(|f| format!("{f}:1")).collect();
                    out.spellings.insert("lora-scaled".into(), name.clone());
                    out.args.push(format!("--lora-scaled={}", scaled.join(",")));
                    continue;
                }
                out.args.push(format!("--{key}={v}"));
            }
        }
    }
    Ok(out)
}

/// What a llama-server environment variable contributes.
#[derive(Clone, Debug, Default)]
pub struct FromEnv {
    /// Arguments for clap, one setting at a time: (variable, `--key=value`).
    pub args: Vec<(String, String)>,
    pub notes: Vec<Note>,
}

/// Reads every variable of the table from `get` (`LLAMA_ARG_*`, `LLAMA_API_KEY`, `HF_TOKEN`,
/// and `LLAMA_ARG_NO_*` for negative booleans), as llama.cpp does: a switch takes a truthy
/// value, a boolean a truthy or falsy one.
pub fn from_env(get: &dyn Fn(&str) -> Option<String>) -> Result<FromEnv, FlagError> {
    let mut out = FromEnv::default();
    for opt in OPTIONS {
        let Some(var) = opt.env else { continue };
        let neg_var = var.replace("LLAMA_ARG_", "LLAMA_ARG_NO_");
        let (var, value, negative) = match (opt.neg.is_empty(), get(&neg_var)) {
            (false, Some(v)) => (neg_var, v, true),
            _ => match get(var) {
                Some(v) => (var.to_string(), v, false),
                None => continue,
            },
        };
        let bad = |why: &str| FlagError::Env {
            var: var.clone(),
            value: value.clone(),
            why: why.to_string(),
        };
        // Which spelling the variable stands for.
        let (how, arg_value) = match opt.arg {
            Arg::Value => (opt.how, Some(value.clone())),
            Arg::Switch => {
                let b = if negative {
                    false
                } else {
                    parse_bool(&value).ok_or_else(|| {
                        bad("expected a boolean (1/0, true/false, on/off, enabled/disabled)")
                    })?
                };
                if opt.neg.is_empty() {
                    // A plain switch: only a truthy value sets it (llama.cpp's handler_void).
                    if !b {
                        continue;
                    }
                    (opt.how, None)
                } else if b {
                    (opt.how, None)
                } else {
                    (opt.how_neg, None)
                }
            }
        };
        let origin = Origin::Env(var.clone());
        match how {
            How::Warn(why) => out.notes.push(Note {
                origin,
                why: why.to_string(),
            }),
            How::Refuse(why) => {
                return Err(FlagError::Refused {
                    origin,
                    why: why.to_string(),
                })
            }
            How::Clap(_) => {}
            How::Set(key) => out.args.push((
                var.clone(),
                format!("--{key}={}", arg_value.unwrap_or_else(|| "true".into())),
            )),
            How::Clear(key) => out.args.push((var.clone(), format!("--{key}=false"))),
            How::SetTo(key, v) => out.args.push((var.clone(), format!("--{key}={v}"))),
        }
    }
    Ok(out)
}

/// What a YAML key that is not a setting of its own means.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum YamlKey {
    /// Another spelling of this setting (`temperature` is `temp`).
    Rename(&'static str),
    /// Sets this setting to this value (`log-jsonl: true` is `log-format: json`).
    SetTo(&'static str, &'static str),
    /// A boolean's negative spelling (`no-slots: true` is `slots: false`).
    Negate(&'static str),
    Warn(&'static str),
    Refuse(&'static str),
    Unknown,
}

/// A YAML key (a flag name without its dashes) that is not one of the settings' own keys.
/// `truthy` is the key's value when it is a boolean: `jinja: false` is `--no-jinja`.
pub fn yaml_key(key: &str, truthy: Option<bool>) -> YamlKey {
    // Unlike the command line, a file's keys are spelled one way: with dashes.
    for opt in OPTIONS {
        let pos = opt.names.iter().any(|n| n.trim_start_matches('-') == key);
        let neg = opt.neg.iter().any(|n| n.trim_start_matches('-') == key);
        if !pos && !neg {
            continue;
        }
        // `jinja: false` reads as the negative spelling, `no-jinja: false` as the positive.
        let negative = neg ^ (truthy == Some(false) && opt.arg == Arg::Switch);
        let how = if negative && !opt.neg.is_empty() {
            opt.how_neg
        } else {
            opt.how
        };
        return match how {
            How::Set(k) if neg => YamlKey::Negate(k),
            How::Set(k) => YamlKey::Rename(k),
            How::Clear(k) => YamlKey::Negate(k),
            How::SetTo(k, v) => YamlKey::SetTo(k, v),
            How::Warn(w) => YamlKey::Warn(w),
            How::Refuse(r) => YamlKey::Refuse(r),
            How::Clap(_) => YamlKey::Refuse("it is a command-line action, not a setting"),
        };
    }
    YamlKey::Unknown
}
