//! The CUDA kernels checked without a GPU: every module the backend can build (each `cuda/*.cu`,
//! with every define set it is compiled with) goes through NVRTC to PTX for compute_86 (the
//! RTX 3090 the deployment runs on) and compute_90 (the H200s of the test machines), then through
//! `ptxas` to a cubin for sm_86 and sm_90. Any NVRTC or ptxas error or warning (double-precision
//! arithmetic included: the kernels compute in f32, as the WGSL) fails; the
//! registers, spills and shared memory of every kernel are printed. The runtime's own path (NVRTC
//! straight to a cubin) is compiled for sm_86 and sm_90 as well.
//!
//! NVRTC comes from `LD_LIBRARY_PATH` (the `nvidia-cuda-nvrtc-cu12` wheel's
//! `nvidia/cuda_nvrtc/lib`), ptxas from `$TERN_PTXAS` or the `PATH` (the `nvidia-cuda-nvcc-cu12`
//! wheel's `nvidia/cuda_nvcc/bin/ptxas`); `.ci/run` installs both. Where either is missing the
//! test prints why and passes, unless `TERN_REQUIRE_NVRTC=1` (CI), which makes it a failure.
#![cfg(feature = "cuda")]

mod scratch;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::Mutex;

use tern::backend::cuda::device::pick_target;
use tern::backend::cuda::kernels::{self, Target};
use tern::backend::gpu::Kernel;

/// The architectures the kernels are checked for: the RTX 3090 (sm_86) and the H200 (sm_90).
const ARCHS: [u32; 2] = [86, 90];

fn required() -> bool {
    std::env::var("TERN_REQUIRE_NVRTC").as_deref() == Ok("1")
}

/// Skips (or, when required, fails) with a reason.
fn unavailable(why: &str) {
    assert!(!required(), "TERN_REQUIRE_NVRTC=1 but {why}");
    eprintln!("skipped: {why} (see cuda/README.md)");
}

fn ptxas() -> Option<PathBuf> {
    let p = std::env::var_os("TERN_PTXAS")
        .map(PathBuf::from)
        .unwrap_or_else(|| PathBuf::from("ptxas"));
    Command::new(&p)
        .arg("--version")
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|_| p)
}

/// Runs work items on the machine's cores, collecting failures instead of stopping at the
/// first.
fn parallel<T: Sync>(items: &[T], f: impl Fn(&T) -> Result<String, String> + Sync) -> Vec<String> {
    let next = Mutex::new(0usize);
    let out = Mutex::new(Vec::new());
    let threads = std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(2)
        .min(8);
    std::thread::scope(|s| {
        for _ in 0..threads {
            s.spawn(|| loop {
                let i = {
                    let mut n = next.lock().unwrap();
                    let i = *n;
                    *n += 1;
                    i
                };
                let Some(item) = items.get(i) else { break };
                let r = f(item);
                out.lock().unwrap().push((i, r));
            });
        }
    });
    let mut out = out.into_inner().unwrap();
    out.sort_by_key(|(i, _)| *i);
    let mut failures = Vec::new();
    for (_, r) in out {
        match r {
            Ok(report) => print!("{report}"),
            Err(e) => failures.push(e),
        }
    }
    failures
}

/// `ptxas -v` output reduced to one line per kernel: registers, barriers, shared memory,
/// stack and spills.
fn summarize(verbose: &str) -> String {
    let mut out = String::new();
    let mut func = String::new();
    for line in verbose.lines() {
        let l = line.trim();
        if let Some(rest) = l.strip_prefix("ptxas info    : Compiling entry function '") {
            func = rest.split('\'').next().unwrap_or("").to_string();
        } else if l.contains("bytes spill stores") {
            if !l.contains(" 0 bytes spill stores") {
                out.push_str(&format!("      {func}: {l}\n"));
            }
        } else if let Some(rest) = l.strip_prefix("ptxas info    : Used ") {
            out.push_str(&format!("      {func}: {rest}\n"));
        }
    }
    out
}

fn check_ptx(key: Kernel, arch: u32, ptxas: &Path, dir: &Path) -> Result<String, String> {
    let what = format!("{key} compute_{arch}");
    let c = kernels::compile(key, Target::Ptx(arch))?;
    if !c.log.is_empty() {
        return Err(format!("{what}: NVRTC warnings:\n{}", c.log));
    }
    let ptx = String::from_utf8(c.image).map_err(|e| format!("{what}: PTX not UTF-8: {e}"))?;
    let spec = key.spec();
    if !ptx.contains(&format!(".entry {}(", spec.file)) {
        return Err(format!("{what}: no entry point {} in the PTX", spec.file));
    }
    let stem = format!(
        "{}{}_{arch}",
        spec.file,
        spec.defines
            .iter()
            .map(|(k, v)| format!("_{k}{v}"))
            .collect::<String>()
    );
    let ptx_path = dir.join(format!("{stem}.ptx"));
    std::fs::write(&ptx_path, &ptx).map_err(|e| format!("{what}: {e}"))?;
    let o = Command::new(ptxas)
        .arg(format!("-arch=sm_{arch}"))
        .arg("-v")
        .arg("--warning-as-error")
        .arg("--warn-on-double-precision-use")
        .arg(&ptx_path)
        .arg("-o")
        .arg(dir.join(format!("{stem}.cubin")))
        .output()
        .map_err(|e| format!("{what}: running ptxas: {e}"))?;
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&o.stdout),
        String::from_utf8_lossy(&o.stderr)
    );
    if !o.status.success() || text.to_lowercase().contains("warning") {
        return Err(format!("{what}: ptxas sm_{arch} failed:\n{text}"));
    }
    Ok(format!(
        "  {key} sm_{arch}: {} bytes of PTX, ptxas clean\n{}",
        ptx.len(),
        summarize(&text)
    ))
}

#[test]
fn every_kernel_compiles_for_sm86_and_sm90() {
    if let Some(why) = kernels::nvrtc_missing() {
        return unavailable(&why);
    }
    let Some(ptxas) = ptxas() else {
        return unavailable(
            "ptxas not found (set TERN_PTXAS, e.g. to the nvidia-cuda-nvcc-cu12 wheel's nvidia/cuda_nvcc/bin/ptxas)",
        );
    };
    let (major, minor) = kernels::nvrtc_version();
    println!("NVRTC {major}.{minor}, {}", ptxas.display());
    let dir = scratch::dir("cuda-kernels");
    let work: Vec<(Kernel, u32)> = kernels::all_modules()
        .into_iter()
        .flat_map(|k| ARCHS.map(|a| (k, a)))
        .collect();
    let failures = parallel(&work, |&(key, arch)| check_ptx(key, arch, &ptxas, &dir));
    let _ = std::fs::remove_dir_all(&dir);
    assert!(
        failures.is_empty(),
        "{} of {} compilations failed:\n{}",
        failures.len(),
        work.len(),
        failures.join("\n")
    );
    println!("{} module compilations clean", work.len());
}

/// The path the backend takes on a device: NVRTC straight to a cubin for the device's
/// architecture, one variant of every file.
#[test]
fn runtime_cubins_compile() {
    if let Some(why) = kernels::nvrtc_missing() {
        return unavailable(&why);
    }
    let archs = kernels::supported_archs();
    let mut work = Vec::new();
    let mut seen = std::collections::BTreeSet::new();
    for key in kernels::all_modules() {
        if seen.insert(key.spec().file) {
            for a in ARCHS {
                assert!(archs.contains(&a), "NVRTC cannot compile for sm_{a}");
                work.push((key, a));
            }
        }
    }
    let failures = parallel(&work, |&(key, arch)| {
        let c = kernels::compile(key, Target::Cubin(arch))?;
        if !c.log.is_empty() {
            return Err(format!("{key} sm_{arch}: NVRTC warnings:\n{}", c.log));
        }
        // An ELF image.
        if !c.image.starts_with(b"\x7fELF") {
            return Err(format!("{key} sm_{arch}: not a cubin"));
        }
        Ok(format!(
            "  {key} sm_{arch}: cubin {} bytes\n",
            c.image.len()
        ))
    });
    assert!(failures.is_empty(), "{}", failures.join("\n"));
}

/// Every `.cu` file in `cuda/` is a registered kernel file and every registered one exists; each
/// includes common.cuh; the include is replaced with line markers that keep messages right.
#[test]
fn kernel_files_are_registered() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("cuda");
    let mut on_disk: Vec<String> = std::fs::read_dir(&dir)
        .unwrap()
        .filter_map(|e| {
            let n = e.unwrap().file_name().to_string_lossy().into_owned();
            n.strip_suffix(".cu").map(str::to_string)
        })
        .collect();
    on_disk.sort();
    let mut registered: Vec<String> = kernels::FILES.iter().map(|f| f.0.to_string()).collect();
    registered.sort();
    assert_eq!(on_disk, registered, "cuda/*.cu and kernels::FILES differ");
    let mut used: Vec<&str> = kernels::all_modules()
        .into_iter()
        .map(|k| k.spec().file)
        .collect();
    used.sort();
    used.dedup();
    assert_eq!(
        on_disk, used,
        "a kernel file no kernel uses, or a kernel without a file"
    );
    for key in kernels::all_modules() {
        let spec = key.spec();
        let src = kernels::source(key);
        assert!(
            !src.lines().any(|l| l.trim_start().starts_with("#include")),
            "{key}: unresolved include"
        );
        assert!(src.contains("#line 1 \"common.cuh\""), "{key}");
        assert!(
            src.contains(&format!("{}(", spec.file)),
            "{key}: entry {} not named in the source",
            spec.file
        );
        // The constants come from the kernel table, never from the file itself.
        for (name, _) in &spec.defines {
            assert!(
                !kernels::file(spec.file).contains(&format!("#define {name} ")),
                "cuda/{}.cu defines {name} itself",
                spec.file
            );
        }
    }
}

/// A device NVRTC knows gets a cubin; a newer one PTX for the newest architecture below it; an
/// older one than any NVRTC knows nothing.
#[test]
fn target_choice() {
    let archs = [75, 80, 86, 89, 90];
    assert_eq!(pick_target(86, &archs), Some(Target::Cubin(86)));
    assert_eq!(pick_target(90, &archs), Some(Target::Cubin(90)));
    assert_eq!(pick_target(120, &archs), Some(Target::Ptx(90)));
    assert_eq!(pick_target(87, &archs), Some(Target::Ptx(86)));
    assert_eq!(pick_target(70, &archs), None);
}
