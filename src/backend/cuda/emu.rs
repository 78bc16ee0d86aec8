//! The CPU emulator of a CUDA device, for checking the backend where there is no GPU.
//!
//! Each module is the text NVRTC would compile (`kernels::source`, the same defines), built with
//! the host C++ compiler (`$CXX`, else `c++`) as a shared library with `cuda/emu/cuda_emu.h`
//! force-included: the CUDA built-ins become plain C++, each block's threads become fibers that
//! switch at `__syncthreads` and warp shuffles, and a launch runs all blocks to completion (over
//! the machine's cores) before it returns. Device pointers are host addresses. Libraries are
//! cached by content hash in `$TERN_CUDA_EMU_DIR` (default: the temp dir), so a test run
//! compiles each module once.
//!
//! The emulator runs the real host code and kernels; what it cannot show is the device's own
//! behaviour (timing, the hardware's exp/div rounding, memory-model effects beyond barriers).

use std::collections::HashMap;
use std::ffi::c_void;
use std::path::PathBuf;
use std::process::Command;
use std::sync::{Arc, Mutex};

use super::device::Arg;
use super::kernels;
use crate::backend::gpu::Kernel;
use crate::backend::BackendError;

const HEADER: &str = include_str!("../../../cuda/emu/cuda_emu.h");

type LaunchFn = unsafe extern "C" fn(
    entry: *const c_void,
    gx: u32,
    gy: u32,
    gz: u32,
    block: u32,
    ints: *const u64,
    n_ints: u32,
    floats: *const f32,
    n_floats: u32,
) -> i32;

fn unavailable(why: impl Into<String>) -> BackendError {
    BackendError::Unavailable("cuda (emulated)".into(), why.into())
}

/// Host memory standing in for a device allocation (256-byte aligned, as cuMemAlloc's).
pub struct HostMem {
    ptr: *mut u8,
    layout: std::alloc::Layout,
}

// SAFETY: a plain heap allocation owned by this value.
unsafe impl Send for HostMem {}
unsafe impl Sync for HostMem {}

impl HostMem {
    pub fn new(bytes: usize, zeroed: bool) -> Result<HostMem, String> {
        let layout =
            std::alloc::Layout::from_size_align(bytes.max(1), 256).map_err(|e| e.to_string())?;
        // SAFETY: a non-zero size.
        let ptr = unsafe {
            if zeroed {
                std::alloc::alloc_zeroed(layout)
            } else {
                std::alloc::alloc(layout)
            }
        };
        if ptr.is_null() {
            return Err("out of host memory".into());
        }
        Ok(HostMem { ptr, layout })
    }
    pub fn addr(&self) -> u64 {
        self.ptr as u64
    }
    pub fn len(&self) -> usize {
        self.layout.size()
    }
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

impl Drop for HostMem {
    fn drop(&mut self) {
        // SAFETY: allocated in `new` with this layout.
        unsafe { std::alloc::dealloc(self.ptr, self.layout) }
    }
}

struct Module {
    _lib: libloading::Library,
    launch: LaunchFn,
}

/// An emulated kernel: its module and entry point.
#[derive(Clone)]
pub struct EmuFn {
    module: Arc<Module>,
    entry: *const c_void,
    name: &'static str,
}

// SAFETY: the entry point is code in a library the `Arc<Module>` keeps loaded.
unsafe impl Send for EmuFn {}
unsafe impl Sync for EmuFn {}

pub struct Emu {
    cxx: String,
    dir: PathBuf,
    modules: Mutex<HashMap<Kernel, Arc<Module>>>,
}

/// FNV-1a over the parts that make a module: the cache key of its library.
fn fnv(parts: &[&[u8]]) -> u64 {
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for p in parts {
        for &b in *p {
            h ^= b as u64;
            h = h.wrapping_mul(0x0000_0100_0000_01b3);
        }
        h ^= 0xff;
        h = h.wrapping_mul(0x0000_0100_0000_01b3);
    }
    h
}

impl Emu {
    /// Finds the C++ compiler, or says why the emulator cannot run here.
    pub fn new() -> Result<Emu, BackendError> {
        if !cfg!(all(target_arch = "x86_64", target_os = "linux")) {
            return Err(unavailable(
                "the emulator's launch ABI is x86-64 Linux's (System V)",
            ));
        }
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".to_string());
        let ok = Command::new(&cxx)
            .arg("--version")
            .output()
            .map(|o| o.status.success())
            .unwrap_or(false);
        if !ok {
            return Err(unavailable(format!(
                "no C++ compiler ({cxx:?}; set CXX) to build the kernels for the CPU"
            )));
        }
        let dir = std::env::var_os("TERN_CUDA_EMU_DIR")
            .map(PathBuf::from)
            .unwrap_or_else(|| std::env::temp_dir().join("tern-cuda-emu"));
        std::fs::create_dir_all(&dir)
            .map_err(|e| unavailable(format!("{}: {e}", dir.display())))?;
        Ok(Emu {
            cxx,
            dir,
            modules: Mutex::new(HashMap::new()),
        })
    }

    pub fn compiler(&self) -> &str {
        &self.cxx
    }

    fn flags() -> Vec<String> {
        [
            "-std=c++17",
            "-O2",
            "-fPIC",
            "-shared",
            "-pthread",
            "-fno-strict-aliasing",
            "-ffp-contract=off",
            "-w",
            "-DTERN_CUDA_EMU=1",
        ]
        .iter()
        .map(|s| s.to_string())
        .collect()
    }

    fn build(&self, key: Kernel) -> Result<Module, String> {
        let src = kernels::source(key);
        let flags = Self::flags();
        let hash = fnv(&[
            HEADER.as_bytes(),
            src.as_bytes(),
            flags.join(" ").as_bytes(),
            self.cxx.as_bytes(),
        ]);
        let stem = format!("{}-{hash:016x}", key.spec().file);
        let so = self.dir.join(format!("{stem}.so"));
        if !so.exists() {
            let header = self
                .dir
                .join(format!("cuda_emu-{:016x}.h", fnv(&[HEADER.as_bytes()])));
            let tmp = std::process::id();
            let hdr_tmp = self.dir.join(format!("{stem}.{tmp}.h"));
            std::fs::write(&hdr_tmp, HEADER).map_err(|e| e.to_string())?;
            std::fs::rename(&hdr_tmp, &header).map_err(|e| e.to_string())?;
            let cu = self.dir.join(format!("{stem}.{tmp}.cu"));
            std::fs::write(&cu, &src).map_err(|e| e.to_string())?;
            let out = self.dir.join(format!("{stem}.{tmp}.so"));
            let o = Command::new(&self.cxx)
                .args(&flags)
                .arg("-include")
                .arg(&header)
                .arg("-x")
                .arg("c++")
                .arg(&cu)
                .arg("-o")
                .arg(&out)
                .output()
                .map_err(|e| format!("running {}: {e}", self.cxx))?;
            let _ = std::fs::remove_file(&cu);
            if !o.status.success() {
                return Err(format!(
                    "{key}: {} failed:\n{}",
                    self.cxx,
                    String::from_utf8_lossy(&o.stderr)
                ));
            }
            std::fs::rename(&out, &so).map_err(|e| e.to_string())?;
        }
        // SAFETY: a library built above from our own sources; its initialisers only set up
        // thread-locals.
        let lib = unsafe { libloading::Library::new(&so) }.map_err(|e| e.to_string())?;
        // SAFETY: the symbol is cuda_emu.h's tern_emu_launch, of type LaunchFn.
        let launch = unsafe { lib.get::<LaunchFn>(b"tern_emu_launch\0") }
            .map(|s| *s)
            .map_err(|e| e.to_string())?;
        Ok(Module { _lib: lib, launch })
    }

    /// The entry point of `key`'s module, building the module the first time.
    pub fn function(&self, key: Kernel) -> EmuFn {
        let entry = key.spec().file;
        let module = {
            let mut m = self.modules.lock().unwrap();
            match m.get(&key) {
                Some(x) => x.clone(),
                None => {
                    let x = Arc::new(
                        self.build(key)
                            .unwrap_or_else(|e| panic!("cuda emulator: {e}")),
                    );
                    m.insert(key, x.clone());
                    x
                }
            }
        };
        let sym = format!("{entry}\0");
        // SAFETY: only the address is taken; it is called through `launch` with the kernel's
        // arguments.
        let entry_ptr = unsafe { module._lib.get::<*const c_void>(sym.as_bytes()) }
            .map(|s| *s)
            .unwrap_or_else(|e| panic!("cuda emulator: {key} has no kernel {entry}: {e}"));
        EmuFn {
            module,
            entry: entry_ptr,
            name: entry,
        }
    }

    /// Runs one launch to completion.
    pub fn launch(&self, f: &EmuFn, grid: (u32, u32, u32), block: u32, args: &[Arg]) {
        let mut ints = Vec::new();
        let mut floats = Vec::new();
        for a in args {
            match *a {
                Arg::P(p) => ints.push(p),
                Arg::U(u) => ints.push(u as u64),
                Arg::F(x) => floats.push(x),
            }
        }
        // SAFETY: `entry` is the kernel's address in the module's library, which `launch`
        // calls with these arguments in the ABI's integer and float sequences; every pointer
        // among them is a live HostMem of the size the op checked.
        let rc = unsafe {
            (f.module.launch)(
                f.entry,
                grid.0,
                grid.1,
                grid.2,
                block,
                ints.as_ptr(),
                ints.len() as u32,
                floats.as_ptr(),
                floats.len() as u32,
            )
        };
        assert_eq!(rc, 0, "cuda emulator: cannot launch {}", f.name);
    }
}
