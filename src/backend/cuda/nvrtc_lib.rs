//! NVRTC, loaded by tern rather than through cudarc's `nvrtc` module, so that a machine with
//! CUDA 13 alone finds it.
//!
//! cudarc 0.19 built with the `cuda-12090` bindings looks for `libnvrtc.so`, `libnvrtc.so.12`
//! and older majors only. A CUDA 13 machine (the 580 driver; NVRTC 13 from the toolkit, or
//! pip's `nvidia-cuda-nvrtc`, whose library is `nvidia/cu13/lib/libnvrtc.so.13` with no
//! unversioned link) has none of those, and cudarc offers no way to name another file. The calls
//! `kernels.rs` makes (create, compile, log, PTX, cubin, destroy, version, supported
//! architectures) have the same C signatures in NVRTC 12 and 13, so this module loads whichever
//! is present and exposes them under cudarc's names (`sys`, `result`): `kernels.rs` changes its
//! `use` line only.
//!
//! Where it looks, in order:
//! 1. `TERN_NVRTC_LIB`: the path of a libnvrtc shared library; only that file is tried.
//! 2. `libnvrtc.so.12`, `libnvrtc.so.13`, `libnvrtc.so` on the loader's search path
//!    (`LD_LIBRARY_PATH`, the ld.so cache). 12 first: it is the version of the bindings and of
//!    CI's wheel, and its cubins load on CUDA 12 and 13 drivers alike.
//!
//! NVRTC opens its `libnvrtc-builtins.so.X.Y` by name at the first compile. Loaded from a
//! directory that is not on the search path, it does not find them (seen with the 13.0.88
//! wheel: "failed to open libnvrtc-builtins.so.13.0"). So the builtins beside the file that
//! `TERN_NVRTC_LIB` names are loaded first: the loader then answers NVRTC's request with the
//! library already loaded under that soname.
//!
//! Result codes are kept as plain integers, not an enum: a newer NVRTC may return a code that
//! the 12.9 bindings do not list.

#![allow(non_camel_case_types, non_snake_case)]

use std::ffi::{c_char, c_int, c_void, CStr, CString};
use std::fmt;
use std::path::{Path, PathBuf};
use std::sync::OnceLock;

use libloading::Library;

/// The environment variable that names the NVRTC library file to load.
pub const ENV: &str = "TERN_NVRTC_LIB";

/// The names tried on the loader's search path when `TERN_NVRTC_LIB` is unset.
pub const NAMES: [&str; 3] = ["libnvrtc.so.12", "libnvrtc.so.13", "libnvrtc.so"];

type Version = unsafe extern "C" fn(*mut c_int, *mut c_int) -> sys::nvrtcResult;
type IntOut = unsafe extern "C" fn(*mut c_int) -> sys::nvrtcResult;
type Create = unsafe extern "C" fn(
    *mut sys::nvrtcProgram,
    *const c_char,
    *const c_char,
    c_int,
    *const *const c_char,
    *const *const c_char,
) -> sys::nvrtcResult;
type Compile =
    unsafe extern "C" fn(sys::nvrtcProgram, c_int, *const *const c_char) -> sys::nvrtcResult;
type Destroy = unsafe extern "C" fn(*mut sys::nvrtcProgram) -> sys::nvrtcResult;
type SizeOut = unsafe extern "C" fn(sys::nvrtcProgram, *mut usize) -> sys::nvrtcResult;
type BufOut = unsafe extern "C" fn(sys::nvrtcProgram, *mut c_char) -> sys::nvrtcResult;

/// The entry points tern uses, resolved once at load so that a missing one is a load error
/// that names it rather than a failure at the first compile.
struct Api {
    version: Version,
    num_archs: IntOut,
    archs: IntOut,
    create: Create,
    compile: Compile,
    destroy: Destroy,
    log_size: SizeOut,
    log: BufOut,
    ptx_size: SizeOut,
    ptx: BufOut,
    cubin_size: SizeOut,
    cubin: BufOut,
}

struct Loaded {
    api: Api,
    from: String,
    // Kept open for the life of the process: the function pointers in `api` point into it, and
    // NVRTC reaches the builtins by soname only while they stay loaded.
    _lib: Library,
    _builtins: Vec<Library>,
}

fn loaded() -> Result<&'static Loaded, &'static str> {
    static NVRTC: OnceLock<Result<Loaded, String>> = OnceLock::new();
    NVRTC
        .get_or_init(|| match std::env::var_os(ENV) {
            Some(path) => load_path(Path::new(&path)),
            None => load_by_name(),
        })
        .as_ref()
        .map_err(String::as_str)
}

fn load_path(path: &Path) -> Result<Loaded, String> {
    let mut builtins = Vec::new();
    for b in builtins_beside(path) {
        // SAFETY: NVRTC's builtins library has no initialisers that depend on the caller.
        let lib = unsafe { Library::new(&b) }.map_err(|e| {
            format!(
                "{ENV}={}: loading {}: {}",
                path.display(),
                b.display(),
                dl(&e)
            )
        })?;
        builtins.push(lib);
    }
    // SAFETY: loading NVRTC runs only its own initialisers.
    let lib = unsafe { Library::new(path) }
        .map_err(|e| format!("{ENV}={}: {}", path.display(), dl(&e)))?;
    let api = resolve(&lib).map_err(|e| format!("{ENV}={}: {e}", path.display()))?;
    Ok(Loaded {
        api,
        from: path.display().to_string(),
        _lib: lib,
        _builtins: builtins,
    })
}

fn load_by_name() -> Result<Loaded, String> {
    let mut tried = Vec::new();
    for name in NAMES {
        // SAFETY: as in load_path.
        match unsafe { Library::new(name) } {
            Ok(lib) => {
                let api = resolve(&lib).map_err(|e| format!("{name}: {e}"))?;
                return Ok(Loaded {
                    api,
                    from: name.to_string(),
                    _lib: lib,
                    _builtins: Vec::new(),
                });
            }
            Err(e) => tried.push(format!("{name}: {}", dl(&e))),
        }
    }
    Err(format!(
        "NVRTC is not on the library path ({}): install the CUDA toolkit, or pip's \
         nvidia-cuda-nvrtc-cu12 (lib dir nvidia/cuda_nvrtc/lib) or nvidia-cuda-nvrtc 13 \
         (nvidia/cu13/lib) and add its lib dir to LD_LIBRARY_PATH, or set {ENV} to the \
         library file",
        tried.join("; ")
    ))
}

/// libloading's message with the loader's own (`dlerror`), which it keeps as the source.
fn dl(e: &libloading::Error) -> String {
    match std::error::Error::source(e) {
        Some(s) => format!("{e}: {s}"),
        None => e.to_string(),
    }
}

/// The `libnvrtc-builtins.so.*` files in the directory of `lib`, sorted; NVRTC 13 wheels also
/// carry `.alt.` variants, which the default library does not open.
pub fn builtins_beside(lib: &Path) -> Vec<PathBuf> {
    let dir = match lib.parent() {
        Some(d) if !d.as_os_str().is_empty() => d,
        _ => Path::new("."),
    };
    let mut found: Vec<PathBuf> = std::fs::read_dir(dir)
        .map(|rd| {
            rd.filter_map(|e| e.ok().map(|e| e.path()))
                .filter(|p| {
                    p.file_name().and_then(|n| n.to_str()).is_some_and(|n| {
                        n.starts_with("libnvrtc-builtins.so.") && !n.contains(".alt.")
                    })
                })
                .collect()
        })
        .unwrap_or_default();
    found.sort();
    found
}

fn resolve(lib: &Library) -> Result<Api, String> {
    fn sym<T: Copy>(lib: &Library, name: &str) -> Result<T, String> {
        // SAFETY: each `T` below is the C signature NVRTC 12 and 13 declare for `name`.
        unsafe { lib.get::<T>(name) }
            .map(|s| *s)
            .map_err(|e| format!("missing {name}: {}", dl(&e)))
    }
    Ok(Api {
        version: sym(lib, "nvrtcVersion")?,
        num_archs: sym(lib, "nvrtcGetNumSupportedArchs")?,
        archs: sym(lib, "nvrtcGetSupportedArchs")?,
        create: sym(lib, "nvrtcCreateProgram")?,
        compile: sym(lib, "nvrtcCompileProgram")?,
        destroy: sym(lib, "nvrtcDestroyProgram")?,
        log_size: sym(lib, "nvrtcGetProgramLogSize")?,
        log: sym(lib, "nvrtcGetProgramLog")?,
        ptx_size: sym(lib, "nvrtcGetPTXSize")?,
        ptx: sym(lib, "nvrtcGetPTX")?,
        cubin_size: sym(lib, "nvrtcGetCUBINSize")?,
        cubin: sym(lib, "nvrtcGetCUBIN")?,
    })
}

/// Why NVRTC cannot be loaded here (everything tried, with the loader's messages), or `None`.
pub fn missing() -> Option<String> {
    loaded().err().map(str::to_string)
}

/// The file or name NVRTC was loaded from, or `None` when it could not be.
pub fn loaded_from() -> Option<&'static str> {
    loaded().ok().map(|l| l.from.as_str())
}

fn api() -> Result<&'static Api, NvrtcError> {
    loaded()
        .map(|l| &l.api)
        .map_err(|_| NvrtcError(sys::NOT_LOADED))
}

/// An NVRTC result code other than success.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct NvrtcError(pub sys::nvrtcResult);

impl fmt::Debug for NvrtcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl fmt::Display for NvrtcError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(&self.0, f)
    }
}

impl std::error::Error for NvrtcError {}

/// The raw entry points, under cudarc's `nvrtc::sys` names.
pub mod sys {
    use super::*;

    pub type nvrtcProgram = *mut c_void;

    /// `nvrtcResult`: 0 is success.
    #[repr(transparent)]
    #[derive(Clone, Copy, PartialEq, Eq)]
    pub struct nvrtcResult(pub c_int);

    /// Not an NVRTC code: what these functions return when NVRTC could not be loaded
    /// (`missing()` says why).
    pub const NOT_LOADED: nvrtcResult = nvrtcResult(-1);

    const NAMES: [&str; 18] = [
        "NVRTC_SUCCESS",
        "NVRTC_ERROR_OUT_OF_MEMORY",
        "NVRTC_ERROR_PROGRAM_CREATION_FAILURE",
        "NVRTC_ERROR_INVALID_INPUT",
        "NVRTC_ERROR_INVALID_PROGRAM",
        "NVRTC_ERROR_INVALID_OPTION",
        "NVRTC_ERROR_COMPILATION",
        "NVRTC_ERROR_BUILTIN_OPERATION_FAILURE",
        "NVRTC_ERROR_NO_NAME_EXPRESSIONS_AFTER_COMPILATION",
        "NVRTC_ERROR_NO_LOWERED_NAMES_BEFORE_COMPILATION",
        "NVRTC_ERROR_NAME_EXPRESSION_NOT_VALID",
        "NVRTC_ERROR_INTERNAL_ERROR",
        "NVRTC_ERROR_TIME_FILE_WRITE_FAILED",
        "NVRTC_ERROR_NO_PCH_CREATE_ATTEMPTED",
        "NVRTC_ERROR_PCH_CREATE_HEAP_EXHAUSTED",
        "NVRTC_ERROR_PCH_CREATE",
        "NVRTC_ERROR_CANCELLED",
        "NVRTC_ERROR_TIME_TRACE_FILE_WRITE_FAILED",
    ];

    impl fmt::Debug for nvrtcResult {
        fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
            match usize::try_from(self.0).ok().and_then(|i| NAMES.get(i)) {
                Some(name) => f.write_str(name),
                None if *self == NOT_LOADED => f.write_str("NVRTC not loaded"),
                None => write!(f, "NVRTC error {}", self.0),
            }
        }
    }

    impl nvrtcResult {
        pub fn result(self) -> Result<(), NvrtcError> {
            if self.0 == 0 {
                Ok(())
            } else {
                Err(NvrtcError(self))
            }
        }
    }

    /// Whether NVRTC could be loaded (the first call loads it).
    ///
    /// # Safety
    /// Loading runs the library's initialisers; unsafe to match cudarc's signature.
    pub unsafe fn is_culib_present() -> bool {
        loaded().is_ok()
    }

    /// # Safety
    /// Two writable `c_int`s.
    pub unsafe fn nvrtcVersion(major: *mut c_int, minor: *mut c_int) -> nvrtcResult {
        match api() {
            Ok(a) => (a.version)(major, minor),
            Err(e) => e.0,
        }
    }

    /// # Safety
    /// A writable `c_int`.
    pub unsafe fn nvrtcGetNumSupportedArchs(n: *mut c_int) -> nvrtcResult {
        match api() {
            Ok(a) => (a.num_archs)(n),
            Err(e) => e.0,
        }
    }

    /// # Safety
    /// Room for as many `c_int`s as `nvrtcGetNumSupportedArchs` reported.
    pub unsafe fn nvrtcGetSupportedArchs(archs: *mut c_int) -> nvrtcResult {
        match api() {
            Ok(a) => (a.archs)(archs),
            Err(e) => e.0,
        }
    }

    /// # Safety
    /// A live program and a writable `usize`.
    pub unsafe fn nvrtcGetCUBINSize(prog: nvrtcProgram, size: *mut usize) -> nvrtcResult {
        match api() {
            Ok(a) => (a.cubin_size)(prog, size),
            Err(e) => e.0,
        }
    }

    /// # Safety
    /// A live program and room for as many bytes as `nvrtcGetCUBINSize` reported.
    pub unsafe fn nvrtcGetCUBIN(prog: nvrtcProgram, cubin: *mut c_char) -> nvrtcResult {
        match api() {
            Ok(a) => (a.cubin)(prog, cubin),
            Err(e) => e.0,
        }
    }
}

/// Result-returning wrappers, under cudarc's `nvrtc::result` names.
pub mod result {
    use super::*;

    /// A program from CUDA C++ source. `src` and `name` must outlive it.
    pub fn create_program(
        src: &CStr,
        name: Option<&CStr>,
    ) -> Result<sys::nvrtcProgram, NvrtcError> {
        let a = api()?;
        let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
        // SAFETY: an out-parameter and NUL-terminated strings; no headers.
        unsafe {
            (a.create)(
                &mut prog,
                src.as_ptr(),
                name.map_or(std::ptr::null(), CStr::as_ptr),
                0,
                std::ptr::null(),
                std::ptr::null(),
            )
        }
        .result()?;
        Ok(prog)
    }

    /// Compiles `prog` with `options` (an option holding a NUL is `NVRTC_ERROR_INVALID_OPTION`).
    ///
    /// # Safety
    /// `prog` comes from `create_program` and has not been destroyed.
    pub unsafe fn compile_program<O: AsRef<str>>(
        prog: sys::nvrtcProgram,
        options: &[O],
    ) -> Result<(), NvrtcError> {
        let a = api()?;
        let owned = options
            .iter()
            .map(|o| CString::new(o.as_ref()))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|_| NvrtcError(sys::nvrtcResult(5)))?;
        let ptrs: Vec<*const c_char> = owned.iter().map(|c| c.as_ptr()).collect();
        (a.compile)(prog, ptrs.len() as c_int, ptrs.as_ptr()).result()
    }

    /// # Safety
    /// As `compile_program`; `prog` is not used afterwards.
    pub unsafe fn destroy_program(prog: sys::nvrtcProgram) -> Result<(), NvrtcError> {
        let a = api()?;
        let mut p = prog;
        (a.destroy)(&mut p).result()
    }

    unsafe fn text(
        prog: sys::nvrtcProgram,
        size: SizeOut,
        get: BufOut,
    ) -> Result<Vec<c_char>, NvrtcError> {
        let mut n = 0usize;
        size(prog, &mut n).result()?;
        let mut v = vec![0 as c_char; n];
        get(prog, v.as_mut_ptr()).result()?;
        Ok(v)
    }

    /// The compile log, NUL-terminated.
    ///
    /// # Safety
    /// As `compile_program`.
    pub unsafe fn get_program_log(prog: sys::nvrtcProgram) -> Result<Vec<c_char>, NvrtcError> {
        let a = api()?;
        text(prog, a.log_size, a.log)
    }

    /// The PTX of a program compiled for a virtual architecture, NUL-terminated.
    ///
    /// # Safety
    /// As `compile_program`, after a successful compile.
    pub unsafe fn get_ptx(prog: sys::nvrtcProgram) -> Result<Vec<c_char>, NvrtcError> {
        let a = api()?;
        text(prog, a.ptx_size, a.ptx)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn builtins_beside_takes_the_default_builtins_only() {
        let dir = std::env::temp_dir().join(format!("tern-nvrtc-lib-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for f in [
            "libnvrtc.so.13",
            "libnvrtc.alt.so.13",
            "libnvrtc-builtins.so.13.0",
            "libnvrtc-builtins.alt.so.13.0",
            "libother.so",
        ] {
            std::fs::write(dir.join(f), b"").unwrap();
        }
        let found = builtins_beside(&dir.join("libnvrtc.so.13"));
        std::fs::remove_dir_all(&dir).unwrap();
        assert_eq!(found, vec![dir.join("libnvrtc-builtins.so.13.0")]);
    }

    #[test]
    fn result_codes_print_by_name() {
        assert_eq!(
            format!("{:?}", NvrtcError(sys::nvrtcResult(6))),
            "NVRTC_ERROR_COMPILATION"
        );
        assert_eq!(
            format!("{:?}", NvrtcError(sys::nvrtcResult(99))),
            "NVRTC error 99"
        );
        assert_eq!(
            format!("{:?}", NvrtcError(sys::NOT_LOADED)),
            "NVRTC not loaded"
        );
        assert!(sys::nvrtcResult(0).result().is_ok());
    }
}
