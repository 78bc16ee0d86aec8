//! The CUDA kernel sources (`cuda/*.cu`, one op each, ported from `shaders/*.wgsl`) and their
//! compilation with NVRTC.
//!
//! A module is one [`Kernel`]: its file with its constants (`backend::gpu::kernels`, the same
//! table the WGSL and the host read) written as `#define`s at the top, and one entry point
//! named after the file. `#include "common.cuh"` is replaced by that file's text here, so NVRTC
//! needs no include path and no CUDA header at run time.
//!
//! The device compiles a module the first time its kernel runs, for its own architecture (a
//! cubin when NVRTC knows the architecture, else PTX for the newest one NVRTC knows, which the
//! driver then compiles). `tests/cuda_kernels.rs` compiles every module for sm_86 and sm_90
//! without a GPU (NVRTC to PTX, then `ptxas`), failing on any warning.
//!
//! This module needs only NVRTC (`libnvrtc.so.12`), not the driver.

use std::ffi::{c_char, c_int, CStr, CString};
use std::fmt;

use super::nvrtc_lib::{result, sys};

use super::device::VEC_WARPS;
use crate::backend::gpu::kernels::{cuda_defines, Kernel};

/// `cuda/common.cuh`: types, float conversions, the weight decoders.
pub const COMMON: &str = include_str!("../../../cuda/common.cuh");

macro_rules! kernel_files {
    ($($name:literal),* $(,)?) => {
        /// Every kernel file in `cuda/`, by stem.
        pub const FILES: &[(&str, &str)] = &[
            $(($name, include_str!(concat!("../../../cuda/", $name, ".cu")))),*
        ];
    };
}

kernel_files!(
    "add",
    "add_bias",
    "add_scaled",
    "argmax",
    "attn_combine",
    "attn_prep",
    "attn_split",
    "concat_cols",
    "embed",
    "fwht",
    "fwht_stage",
    "gdn_chunk_prep",
    "gdn_chunk_scan",
    "gdn_conv",
    "gdn_gated_norm",
    "gdn_step",
    "gelu",
    "kv_store",
    "layer_norm",
    "matmul_tiled",
    "matmul_vec",
    "rms_norm",
    "swiglu",
    "topk",
    "vision_attn",
    "vision_rope",
);

/// The text of `cuda/<stem>.cu`.
pub fn file(stem: &str) -> &'static str {
    FILES
        .iter()
        .find(|(n, _)| *n == stem)
        .map(|(_, s)| *s)
        .unwrap_or_else(|| panic!("no kernel file cuda/{stem}.cu"))
}

/// Head sizes the compile test instantiates the GDN kernels with (the model's 128 and the op
/// tests' geometries); the backend compiles any other at first use the same way.
pub const GDN_D_CHECKED: &[u32] = &[16, 24, 32, 64, 128, 256];

/// Every module the compile test checks: each CUDA kernel of `Kernel::all` (the wgpu-only
/// native-f16 matvec aside).
pub fn all_modules() -> Vec<Kernel> {
    Kernel::all(GDN_D_CHECKED)
        .into_iter()
        .filter(|k| *k != Kernel::MatmulVecF16)
        .collect()
}

/// The source NVRTC compiles for a kernel: its constants as `#define`s, then its file with
/// `#include "common.cuh"` replaced by common.cuh, with `#line` directives so that messages
/// name the right file and line.
pub fn source(kernel: Kernel) -> String {
    let spec = kernel.spec();
    let f = file(spec.file);
    let mut out = String::with_capacity(COMMON.len() + f.len() + 512);
    out.push_str(&format!(
        "// {kernel}: constants of backend::gpu::kernels\n"
    ));
    out.push_str(&cuda_defines(&spec));
    if let Kernel::MatmulVec { .. } = kernel {
        out.push_str(&format!("#define WARPS {VEC_WARPS}u\n"));
    }
    out.push_str(&format!("#line 1 \"{}.cu\"\n", spec.file));
    let mut included = false;
    for (i, line) in f.lines().enumerate() {
        if line.trim() == "#include \"common.cuh\"" && !included {
            out.push_str("#line 1 \"common.cuh\"\n");
            out.push_str(COMMON);
            out.push_str(&format!("\n#line {} \"{}.cu\"\n", i + 2, spec.file));
            included = true;
        } else {
            out.push_str(line);
            out.push('\n');
        }
    }
    assert!(
        included,
        "cuda/{}.cu does not include common.cuh",
        spec.file
    );
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

/// The NVRTC options of a module: the architecture and C++17 (its constants are in its
/// source). No fast math: `expf`, `sqrtf` and division are the IEEE-accurate ones, as the CPU
/// reference's.
pub fn options(target: Target) -> Vec<String> {
    vec![
        match target {
            Target::Ptx(a) => format!("--gpu-architecture=compute_{a}"),
            Target::Cubin(a) => format!("--gpu-architecture=sm_{a}"),
        },
        "--std=c++17".to_string(),
    ]
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
    super::nvrtc_lib::missing()
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
pub fn compile(key: Kernel, target: Target) -> Result<Compiled, String> {
    let src = CString::new(source(key)).expect("kernel source has no NUL");
    let name = CString::new(format!("{}.cu", key.spec().file)).expect("no NUL");
    let opts = options(target);
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
