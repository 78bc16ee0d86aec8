//! The CUDA kernel sources (`cuda/*.cu`, one op each, ported from `shaders/*.wgsl`) and their
//! compilation with NVRTC.
//!
//! A *module* is one `.cu` file compiled with a set of `-D` defines (the cache dtypes of
//! `attn_split`, the head size of `gdn_step` / `gdn_chunk_scan`); the other files are compiled
//! as they are, each holding its per-dtype variants as separate `extern "C"` entry points.
//! `#include "common.cuh"` is replaced by that file's text here, so NVRTC needs no include path
//! and no CUDA header at run time.
//!
//! The device compiles a module the first time one of its kernels runs, for its own
//! architecture (a cubin when NVRTC knows the architecture, else PTX for the newest one NVRTC
//! knows, which the driver then compiles). `tests/cuda_kernels.rs` compiles every module for
//! sm_86 and sm_90 without a GPU (NVRTC to PTX, then `ptxas`), failing on any warning.
//!
//! This module needs only NVRTC (`libnvrtc.so.12`), not the driver.

use std::ffi::{c_char, c_int, CStr, CString};
use std::fmt;

use cudarc::nvrtc::{result, sys};

use crate::tensor::GgmlType;

/// `cuda/common.cuh`: types, float conversions, the weight decoders.
pub const COMMON: &str = include_str!("../../../cuda/common.cuh");

/// One kernel file: its stem, source, and the entry points it defines.
pub struct KernelFile {
    pub name: &'static str,
    pub source: &'static str,
    pub entries: &'static [&'static str],
}

macro_rules! kernel_file {
    ($name:literal, [$($e:expr),* $(,)?]) => {
        KernelFile {
            name: $name,
            source: include_str!(concat!("../../../cuda/", $name, ".cu")),
            entries: &[$($e),*],
        }
    };
}

macro_rules! per_weight_type {
    ($name:literal) => {
        kernel_file!(
            $name,
            [
                concat!($name, "_f32"),
                concat!($name, "_f16"),
                concat!($name, "_bf16"),
                concat!($name, "_q8_0"),
                concat!($name, "_q4_0"),
                concat!($name, "_pq2_0"),
                concat!($name, "_ptq1_0"),
            ]
        )
    };
}

/// Every kernel file, in `cuda/`.
pub const FILES: &[KernelFile] = &[
    kernel_file!("add", ["add"]),
    kernel_file!("argmax", ["argmax"]),
    kernel_file!("attn_combine", ["attn_combine"]),
    kernel_file!("attn_prep", ["attn_prep"]),
    kernel_file!(
        "attn_split",
        [
            "attn_split_r1",
            "attn_split_r2",
            "attn_split_r4",
            "attn_split_r8"
        ]
    ),
    kernel_file!("concat_cols", ["concat_cols"]),
    per_weight_type!("embed"),
    kernel_file!("fwht", ["fwht"]),
    kernel_file!("fwht_stage", ["fwht_stage"]),
    kernel_file!("gdn_chunk_prep", ["gdn_chunk_prep"]),
    kernel_file!("gdn_chunk_scan", ["gdn_chunk_scan"]),
    kernel_file!("gdn_conv", ["gdn_conv"]),
    kernel_file!("gdn_gated_norm", ["gdn_gated_norm"]),
    kernel_file!("gdn_step", ["gdn_step"]),
    kernel_file!(
        "kv_store",
        [
            "kv_store_f32",
            "kv_store_f16",
            "kv_store_bf16",
            "kv_store_q8_0",
            "kv_store_q4_0"
        ]
    ),
    per_weight_type!("matmul_tiled"),
    per_weight_type!("matmul_vec"),
    kernel_file!("rms_norm", ["rms_norm"]),
    kernel_file!("swiglu", ["swiglu"]),
    kernel_file!("topk", ["topk"]),
];

/// The kernel file named `name`.
pub fn file(name: &str) -> &'static KernelFile {
    FILES
        .iter()
        .find(|f| f.name == name)
        .unwrap_or_else(|| panic!("no kernel file cuda/{name}.cu"))
}

/// The entry-point suffix of a weight decoder (`matmul_vec_<suffix>`), as common.cuh's
/// `FOR_EACH_WEIGHT_TYPE` names them.
pub fn weight_suffix(ty: GgmlType) -> &'static str {
    match ty {
        GgmlType::F32 => "f32",
        GgmlType::F16 => "f16",
        GgmlType::BF16 => "bf16",
        GgmlType::Q8_0 => "q8_0",
        GgmlType::Q4_0 => "q4_0",
        GgmlType::PQ2_0 | GgmlType::Q2_0Legacy => "pq2_0",
        GgmlType::PTQ1_0 => "ptq1_0",
        other => unreachable!("upload refuses {other}"),
    }
}

/// The dtype code of a KV cache type (`K_TYPE` / `V_TYPE` of attn_split, as the WGSL).
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

/// One compiled unit: a kernel file and its defines.
#[derive(Clone, Debug, PartialEq, Eq, Hash)]
pub struct ModuleKey {
    pub file: &'static str,
    pub defines: Vec<(&'static str, u32)>,
}

impl ModuleKey {
    pub fn plain(file: &'static str) -> ModuleKey {
        ModuleKey {
            file,
            defines: Vec::new(),
        }
    }
    pub fn with(file: &'static str, defines: &[(&'static str, u32)]) -> ModuleKey {
        ModuleKey {
            file,
            defines: defines.to_vec(),
        }
    }
}

impl fmt::Display for ModuleKey {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}.cu", self.file)?;
        for (i, (k, v)) in self.defines.iter().enumerate() {
            write!(f, "{}{k}={v}", if i == 0 { " -D" } else { ",-D" })?;
        }
        Ok(())
    }
}

/// Head sizes the compile test instantiates `gdn_step` with (the model's 128 and the op tests'
/// geometries); the backend compiles any other at first use the same way.
pub const GDN_D_CHECKED: &[u32] = &[16, 24, 32, 64, 128, 256];

/// Every module the compile test checks: each plain file once, `attn_split` for every (K, V)
/// cache dtype pair, and the GDN kernels for `GDN_D_CHECKED` (`gdn_chunk_scan` needs d % 16 == 0).
pub fn all_modules() -> Vec<ModuleKey> {
    let mut out = Vec::new();
    for f in FILES {
        match f.name {
            "attn_split" => {
                for k in 0..5 {
                    for v in 0..5 {
                        out.push(ModuleKey::with(f.name, &[("K_TYPE", k), ("V_TYPE", v)]));
                    }
                }
            }
            "gdn_step" | "gdn_chunk_scan" => {
                for &d in GDN_D_CHECKED {
                    if f.name == "gdn_chunk_scan" && d % 16 != 0 {
                        continue;
                    }
                    out.push(ModuleKey::with(f.name, &[("D", d)]));
                }
            }
            name => out.push(ModuleKey::plain(name)),
        }
    }
    out
}

/// The source NVRTC compiles for a file: `#include "common.cuh"` replaced by common.cuh, with
/// `#line` directives so that messages name the right file and line.
pub fn source(name: &str) -> String {
    let f = file(name);
    let mut out = String::with_capacity(COMMON.len() + f.source.len() + 128);
    let mut included = false;
    for (i, line) in f.source.lines().enumerate() {
        if line.trim() == "#include \"common.cuh\"" && !included {
            out.push_str("#line 1 \"common.cuh\"\n");
            out.push_str(COMMON);
            out.push_str(&format!("\n#line {} \"{}.cu\"\n", i + 2, f.name));
            included = true;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(included, "cuda/{}.cu does not include common.cuh", f.name);
    out
}

/// What NVRTC produces for a module.
#[derive(Copy, Clone, Debug, PartialEq, Eq)]
pub enum Target {
    /// PTX for `compute_XY` (XY = major * 10 + minor); the driver or `ptxas` assembles it.
    Ptx(u32),
    /// A cubin for `sm_XY`: nothing is left to the driver's JIT.
    Cubin(u32),
}

impl fmt::Display for Target {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Target::Ptx(a) => write!(f, "PTX compute_{a}"),
            Target::Cubin(a) => write!(f, "cubin sm_{a}"),
        }
    }
}

/// The NVRTC options of a module: the architecture, C++17, its defines. No fast math: `expf`,
/// `sqrtf` and division are the IEEE-accurate ones, as the CPU reference's.
pub fn options(key: &ModuleKey, target: Target) -> Vec<String> {
    let mut o = vec![
        match target {
            Target::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
            Target::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
        },
        "--std=c++17".to_string(),
    ];
    for (k, v) in &key.defines {
        o.push(format!("-D{k}={v}"));
    }
    o
}

/// A compiled module: PTX text (NUL-free) or a cubin, and NVRTC's log (warnings; empty when
/// clean).
pub struct Compiled {
    pub image: Vec<u8>,
    pub target: Target,
    pub log: String,
}

/// Whether NVRTC can be loaded (`libnvrtc.so.12` on the library path), without panicking when
/// it cannot.
pub fn nvrtc_present() -> bool {
    // SAFETY: only tries to dlopen the library by name.
    unsafe { sys::is_culib_present() }
}

/// Why NVRTC cannot be used here, or `None`.
pub fn nvrtc_missing() -> Option<String> {
    (!nvrtc_present()).then(|| {
        "NVRTC (libnvrtc.so.12) is not on the library path: install the CUDA toolkit, or \
         `pip install nvidia-cuda-nvrtc-cu12` and add its nvidia/cuda_nvrtc/lib to LD_LIBRARY_PATH"
            .to_string()
    })
}

/// NVRTC's (major, minor) version. Call only when `nvrtc_present()`.
pub fn nvrtc_version() -> (i32, i32) {
    let (mut major, mut minor): (c_int, c_int) = (0, 0);
    // SAFETY: two out-parameters.
    unsafe { sys::nvrtcVersion(&mut major, &mut minor) }
        .result()
        .expect("nvrtcVersion");
    (major, minor)
}

/// The `sm_XY` architectures NVRTC compiles for, as XY. Call only when `nvrtc_present()`.
pub fn supported_archs() -> Vec<u32> {
    let mut n: c_int = 0;
    // SAFETY: out-parameter, then a buffer of the size NVRTC reported.
    unsafe {
        sys::nvrtcGetNumSupportedArchs(&mut n)
            .result()
            .expect("nvrtcGetNumSupportedArchs");
        let mut v = vec![0 as c_int; n.max(0) as usize];
        sys::nvrtcGetSupportedArchs(v.as_mut_ptr())
            .result()
            .expect("nvrtcGetSupportedArchs");
        v.into_iter().map(|a| a as u32).collect()
    }
}

fn c_text(v: &[c_char]) -> String {
    if v.is_empty() {
        return String::new();
    }
    // SAFETY: NVRTC's logs and PTX are NUL-terminated.
    unsafe { CStr::from_ptr(v.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Compiles one module with NVRTC. `Err` carries the options and NVRTC's log. Call only when
/// `nvrtc_present()`.
pub fn compile(key: &ModuleKey, target: Target) -> Result<Compiled, String> {
    let src = CString::new(source(key.file)).expect("kernel source has no NUL");
    let name = CString::new(format!("{}.cu", key.file)).expect("no NUL");
    let opts = options(key, target);
    let prog = result::create_program(&src, Some(&name))
        .map_err(|e| format!("{key}: nvrtcCreateProgram: {e:?}"))?;
    // SAFETY: `prog` is a live program until destroy_program below; src and name outlive it.
    let out = unsafe {
        let compiled = result::compile_program(prog, &opts);
        let log = result::get_program_log(prog)
            .map(|l| c_text(&l))
            .unwrap_or_default();
        let image = match compiled {
            Err(e) => Err(format!(
                "{key}: NVRTC failed ({e:?}) with {opts:?}:\n{}",
                log.trim_end()
            )),
            Ok(()) => match target {
                Target::Ptx(_) => result::get_ptx(prog)
                    .map(|p| c_text(&p).into_bytes())
                    .map_err(|e| format!("{key}: nvrtcGetPTX: {e:?}")),
                Target::Cubin(_) => {
                    let mut size = 0usize;
                    sys::nvrtcGetCUBINSize(prog, &mut size)
                        .result()
                        .and_then(|()| {
                            let mut bin = vec![0u8; size];
                            sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut c_char)
                                .result()
                                .map(|()| bin)
                        })
                        .map_err(|e| format!("{key}: nvrtcGetCUBIN: {e:?}"))
                }
            },
        };
        let _ = result::destroy_program(prog);
        image.map(|image| Compiled {
            image,
            target,
            log: log.trim().to_string(),
        })
    };
    out
}
