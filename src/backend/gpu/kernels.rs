//! The kernels of the two GPU backends, named once. A [`Kernel`] is a typed key: the op and
//! the specialisation compiled into it (weight or cache dtype, head size, query tile). Its
//! [`Spec`] says which source file implements it (`shaders/<file>.wgsl`, `cuda/<file>.cu`,
//! one entry point `main` / `<file>`) and the constants compiled into it. The host code in
//! this module's siblings reads the same constants, so a tile size or a workgroup size is
//! written in one place: [`consts`].
//!
//! The constants reach the kernels as text the device prepends to the source: `const NAME:
//! u32 = Vu;` in WGSL, `#define NAME Vu` in CUDA C++. No kernel file defines them itself.

use crate::tensor::GgmlType;

/// Every constant shared by the host and the kernels.
pub mod consts {
    /// Largest head_dim the attention kernels hold in shared memory (`attn_prep`).
    pub const MAX_HD: u32 = 512;
    /// Positions scored per tile in `attn_split`, its workgroup size; chunks are multiples
    /// of it.
    pub const TILE: u32 = 64;
    /// Groups `attn_split` aims for before it stops splitting the positions (host only).
    pub const TARGET_GROUPS: usize = 512;
    /// Most query vectors per `attn_split` group, and most query elements it holds.
    pub const MAX_R: usize = 8;
    pub const MAX_Q: u32 = 2048;
    /// Most chunks per (row, head) `attn_combine` merges.
    pub const MAX_CHUNKS: u32 = 256;
    /// Positions a new cache holds before it first grows (the engine reserves the window).
    pub const INITIAL_CAPACITY: usize = 256;
    /// Keys scored per tile in `vision_attn`, its workgroup size.
    pub const VISION_TILE: u32 = 64;
    /// Most queries one `vision_attn` workgroup holds (its `R`, with `R * head_dim <= MAX_Q`).
    pub const VISION_MAX_R: usize = 16;
    /// Largest k of `topk_rows`.
    pub const TOPK_MAX: u32 = 64;
    /// Items one top-k thread scans per pass (host only).
    pub const TOPK_SEGMENT: usize = 1024;
    /// Width of the in-shared-memory FWHT; larger Hadamard blocks run as global stages.
    pub const FWHT_CHUNK: u32 = 1024;
    /// Tokens per chunk of the chunked Gated DeltaNet.
    pub const GDN_CHUNK: u32 = 64;
    /// State columns per workgroup of `gdn_step` and `gdn_chunk_scan`.
    pub const GDN_COL_BLOCK: u32 = 16;
    /// State rows each `gdn_step` thread group strides by.
    pub const GDN_STEP_ROWS: u32 = 8;
    /// Largest head size of the GDN kernels (`gdn_step` keeps d / 8 state values per thread
    /// in registers).
    pub const GDN_MAX_D: usize = 512;
    /// Tokens per workgroup of `gdn_conv`.
    pub const CONV_TOKENS: u32 = 16;
    /// Token rows up to which `matmul` runs the matvec kernel: one pass over the weight for
    /// up to this many tokens. Beyond it the tiled kernel reuses each decoded weight slice for
    /// `TILED_BN` tokens.
    pub const MATVEC_MAX_TOKENS: usize = 4;
    /// `matmul_tiled`: output rows and tokens per workgroup, and the K step.
    pub const TILED_BM: u32 = 64;
    pub const TILED_BN: u32 = 32;
    pub const TILED_BK: u32 = 32;
    /// Bound on each scratch buffer of one chunked GDN dispatch pair (`[U | W]` and P, a power
    /// of two below the 128 MiB storage binding minimum); longer inputs run in segments of
    /// whole chunks, the state carried between them.
    pub const GDN_SEGMENT_SCRATCH_BYTES: usize = 64 << 20;
    /// Workgroup memory of `gdn_chunk_prep`: the C×C matrix A plus gamma and beta.
    pub const GDN_PREP_SHARED_BYTES: u32 = (GDN_CHUNK * GDN_CHUNK + 2 * GDN_CHUNK) * 4;
}

use consts::*;

/// The weight decoder a kernel is built with (`TY` in matmul_vec, matmul_tiled, embed): the
/// codes of `shaders/decode.wgsl` and `cuda/common.cuh`.
pub fn weight_code(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::BF16 => 2,
        GgmlType::Q8_0 => 3,
        GgmlType::Q4_0 => 4,
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => 5,
        GgmlType::PTQ1_0 => 6,
        other => unreachable!("upload refuses {other}"),
    }
}

/// The number of weight decoders (`weight_code` values).
pub const WEIGHT_CODES: u32 = 7;

/// A KV cache dtype's code (`K_TYPE`, `V_TYPE` of attn_split, `KIND` of kv_store).
pub fn cache_code(ty: GgmlType) -> u32 {
    match ty {
        GgmlType::F32 => 0,
        GgmlType::F16 => 1,
        GgmlType::BF16 => 2,
        GgmlType::Q8_0 => 3,
        GgmlType::Q4_0 => 4,
        _ => unreachable!("KvTypes::check admits only cache dtypes"),
    }
}

/// The number of cache dtypes (`cache_code` values).
pub const CACHE_CODES: u32 = 5;

/// One kernel and its specialisation. The fields are the codes above, a head size or a
/// query tile, so that the key is small, `Copy` and hashable.
#[derive(Copy, Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum Kernel {
    Add,
    /// `x[r][c] += b[c]`: a bias on every row.
    AddBias,
    /// `y += s[row] * x`: a LoRA term with a scale per row.
    AddScaled,
    Argmax,
    AttnCombine,
    AttnPrep,
    /// `K_TYPE`, `V_TYPE` (cache codes) and `R`, the query vectors per tile.
    AttnSplit {
        k: u32,
        v: u32,
        r: u32,
    },
    ConcatCols,
    Embed {
        ty: u32,
    },
    Fwht,
    FwhtStage,
    GdnChunkPrep,
    GdnChunkScan {
        d: u32,
    },
    GdnConv,
    GdnGatedNorm,
    GdnStep {
        d: u32,
    },
    /// ggml's GELU through its f16 table.
    Gelu,
    KvStore {
        kind: u32,
    },
    MatmulTiled {
        ty: u32,
    },
    MatmulVec {
        ty: u32,
    },
    /// The f16 matvec with native f16 loads, on a device that has them (wgpu SHADER_F16).
    MatmulVecF16,
    LayerNorm,
    RmsNorm,
    Swiglu,
    Topk,
    /// The vision tower's attention over all keys, `R` queries per workgroup.
    VisionAttn {
        r: u32,
    },
    /// The vision tower's rotary of q and k, into head-major copies.
    VisionRope,
}

/// What a device needs to build a kernel: its source file's stem, its workgroup size, and
/// the constants compiled into it (the workgroup size among them, as `WG`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Spec {
    pub file: &'static str,
    pub wg: u32,
    pub defines: Vec<(&'static str, u32)>,
}

impl Kernel {
    pub fn spec(&self) -> Spec {
        let (file, wg, mut defines): (&'static str, u32, Vec<(&'static str, u32)>) = match *self {
            Kernel::Add => ("add", 256, vec![]),
            Kernel::AddBias => ("add_bias", 256, vec![]),
            Kernel::AddScaled => ("add_scaled", 256, vec![]),
            Kernel::Argmax => ("argmax", 256, vec![]),
            Kernel::AttnCombine => ("attn_combine", 64, vec![("MAX_CHUNKS", MAX_CHUNKS)]),
            Kernel::AttnPrep => ("attn_prep", 64, vec![("MAX_HD", MAX_HD)]),
            Kernel::AttnSplit { k, v, r } => (
                "attn_split",
                TILE,
                vec![("K_TYPE", k), ("V_TYPE", v), ("R", r), ("MAX_Q", MAX_Q)],
            ),
            Kernel::ConcatCols => ("concat_cols", 256, vec![]),
            Kernel::Embed { ty } => ("embed", 64, vec![("TY", ty)]),
            Kernel::Fwht => ("fwht", 256, vec![("FWHT_CHUNK", FWHT_CHUNK)]),
            Kernel::FwhtStage => ("fwht_stage", 256, vec![]),
            Kernel::GdnChunkPrep => ("gdn_chunk_prep", 256, vec![("C", GDN_CHUNK)]),
            Kernel::GdnChunkScan { d } => (
                "gdn_chunk_scan",
                // One thread per (token, 4-column group).
                GDN_CHUNK * GDN_COL_BLOCK / 4,
                vec![("D", d), ("C", GDN_CHUNK), ("CB", GDN_COL_BLOCK)],
            ),
            Kernel::GdnConv => ("gdn_conv", 64, vec![("TB", CONV_TOKENS)]),
            Kernel::GdnGatedNorm => ("gdn_gated_norm", 64, vec![]),
            Kernel::GdnStep { d } => (
                "gdn_step",
                GDN_COL_BLOCK * GDN_STEP_ROWS,
                vec![("D", d), ("CB", GDN_COL_BLOCK), ("R", GDN_STEP_ROWS)],
            ),
            Kernel::Gelu => ("gelu", 256, vec![]),
            Kernel::KvStore { kind } => ("kv_store", 64, vec![("KIND", kind)]),
            Kernel::LayerNorm => ("layer_norm", 256, vec![]),
            Kernel::MatmulTiled { ty } => (
                "matmul_tiled",
                256,
                vec![
                    ("TY", ty),
                    ("BM", TILED_BM),
                    ("BN", TILED_BN),
                    ("BK", TILED_BK),
                ],
            ),
            Kernel::MatmulVec { ty } => (
                "matmul_vec",
                64,
                vec![("TY", ty), ("NT", MATVEC_MAX_TOKENS as u32)],
            ),
            Kernel::MatmulVecF16 => ("matmul_vec_f16", 64, vec![("NT", MATVEC_MAX_TOKENS as u32)]),
            Kernel::RmsNorm => ("rms_norm", 256, vec![]),
            Kernel::Swiglu => ("swiglu", 256, vec![]),
            Kernel::Topk => ("topk", 64, vec![("KMAX", TOPK_MAX)]),
            Kernel::VisionAttn { r } => {
                ("vision_attn", VISION_TILE, vec![("R", r), ("MAX_Q", MAX_Q)])
            }
            Kernel::VisionRope => ("vision_rope", 256, vec![]),
        };
        defines.insert(0, ("WG", wg));
        Spec { file, wg, defines }
    }

    /// Every specialisation a compile check should build: each kernel once per weight or
    /// cache code, `attn_split` for every (K, V, R), the GDN kernels for `gdn_d`.
    pub fn all(gdn_d: &[u32]) -> Vec<Kernel> {
        let mut out = vec![
            Kernel::Add,
            Kernel::AddBias,
            Kernel::AddScaled,
            Kernel::Argmax,
            Kernel::AttnCombine,
            Kernel::AttnPrep,
            Kernel::ConcatCols,
            Kernel::Fwht,
            Kernel::FwhtStage,
            Kernel::GdnChunkPrep,
            Kernel::GdnConv,
            Kernel::GdnGatedNorm,
            Kernel::Gelu,
            Kernel::LayerNorm,
            Kernel::MatmulVecF16,
            Kernel::RmsNorm,
            Kernel::Swiglu,
            Kernel::Topk,
            Kernel::VisionRope,
        ];
        let mut r = 1;
        while r as usize <= VISION_MAX_R {
            out.push(Kernel::VisionAttn { r });
            r *= 2;
        }
        for ty in 0..WEIGHT_CODES {
            out.extend([
                Kernel::Embed { ty },
                Kernel::MatmulTiled { ty },
                Kernel::MatmulVec { ty },
            ]);
        }
        for kind in 0..CACHE_CODES {
            out.push(Kernel::KvStore { kind });
        }
        for k in 0..CACHE_CODES {
            for v in 0..CACHE_CODES {
                for r in [1, 2, 4, 8] {
                    out.push(Kernel::AttnSplit { k, v, r });
                }
            }
        }
        for &d in gdn_d {
            out.push(Kernel::GdnStep { d });
            if d % GDN_COL_BLOCK == 0 {
                out.push(Kernel::GdnChunkScan { d });
            }
        }
        out
    }
}

impl std::fmt::Display for Kernel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let s = self.spec();
        write!(f, "{}", s.file)?;
        for (i, (k, v)) in s.defines.iter().filter(|(k, _)| *k != "WG").enumerate() {
            write!(f, "{}{k}={v}", if i == 0 { "[" } else { "," })?;
        }
        if s.defines.len() > 1 {
            write!(f, "]")?;
        }
        Ok(())
    }
}

/// The defines of a spec as lines of WGSL (`const NAME: u32 = Vu;`).
pub fn wgsl_consts(spec: &Spec) -> String {
    spec.defines
        .iter()
        .map(|(k, v)| format!("const {k}: u32 = {v}u;\n"))
        .collect()
}

/// The defines of a spec as CUDA C++ (`#define NAME Vu`).
pub fn cuda_defines(spec: &Spec) -> String {
    spec.defines
        .iter()
        .map(|(k, v)| format!("#define {k} {v}u\n"))
        .collect()
}
