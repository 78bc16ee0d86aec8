//! `cargo xtask gpu-kit`: what a machine with an NVIDIA GPU and driver but no Rust toolchain
//! needs to check both GPU backends in one call, built here without a GPU, into one folder
//! (`target/gpu-kit/`, ignored by git, carried to the device by the device tool):
//!
//! - `kit.tar.xz`: the release `tern` and `xtask` binaries and the test binaries whose cuda and
//!   wgpu instances the check runs, all built with `--features cuda` and stripped; and this
//!   machine's Vulkan loader and libGLdispatch (which NVIDIA's Vulkan driver links), used there
//!   only where the machine has none. One solid archive: the binaries share most of their code,
//!   which the compressor's window then stores once.
//! - `gpu-check.sh` (a copy of `xtask/gpu-check.sh`): the check itself.
//! - `kit.env`: the directory the tests were compiled in (their `CARGO_MANIFEST_DIR`, under which
//!   they read fixtures/, shaders/ and cuda/), the commit, the test binaries.
//! - `tree.sha256`: those files' hashes. The fixtures are not copied into the kit: the device
//!   tool sends the repository's tree with every call, so they are there already, and a second
//!   copy would take twice their share of the call's 64 MiB. The script points the build
//!   directory at that copy of the tree and checks it against these hashes.

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};

use anyhow::{anyhow, bail, Context, Result};
use serde_json::Value;
use sha2::{Digest, Sha256};

/// The test binaries whose `cuda` and `wgpu` instances the check runs (issue #12, part 5).
pub const TESTS: [&str; 12] = [
    "ops_basic",
    "ops_f16",
    "ops_matmul",
    "ops_attention",
    "ops_gdn",
    "ops_vision",
    "golden",
    "perplexity",
    "engine",
    "speculative",
    "batch",
    "boot_ledger",
];

/// Every kernel through the machine's own NVRTC and ptxas (a CUDA 13 toolkit there, 12.9 wheels
/// in CI): run once, after the others.
pub const KERNELS_TEST: &str = "cuda_kernels";

/// The issue's limit for the whole kit; the device tool's is 64 MiB for the kit and the tree.
const MAX_KIT_BYTES: u64 = 60 << 20;

/// Libraries the check may need on a machine that has the NVIDIA driver but no Vulkan loader.
const VULKAN_LIBS: [&str; 2] = ["libvulkan.so.1", "libGLdispatch.so.0"];

pub fn run(root: &Path, out: &Path) -> Result<()> {
    let t0 = std::time::Instant::now();
    let mut test_args: Vec<String> = ["test", "--release", "--features", "cuda", "--no-run"]
        .iter()
        .map(|s| s.to_string())
        .collect();
    for t in TESTS.iter().chain([&KERNELS_TEST]) {
        test_args.push("--test".into());
        test_args.push(t.to_string());
    }
    let mut exes = cargo_executables(root, &test_args, "test")?;
    exes.extend(cargo_executables(
        root,
        &["build", "--release", "--features", "cuda", "--bin", "tern"].map(String::from),
        "bin",
    )?);
    exes.extend(cargo_executables(
        root,
        &["build", "--release", "-p", "xtask", "--features", "cuda"].map(String::from),
        "bin",
    )?);

    let wanted: Vec<&str> = ["tern", "xtask", KERNELS_TEST]
        .into_iter()
        .chain(TESTS)
        .collect();
    let mut manifest_dir = None;
    let stage = out.with_extension("staging");
    if stage.exists() {
        std::fs::remove_dir_all(&stage).with_context(|| format!("clearing {}", stage.display()))?;
    }
    std::fs::create_dir_all(stage.join("lib"))?;
    let mut staged = Vec::new();
    for name in &wanted {
        let exe = exes
            .iter()
            .find(|e| e.name == *name)
            .ok_or_else(|| anyhow!("cargo built no executable for `{name}`"))?;
        // The tests read their fixtures under the directory they were compiled in; every
        // artifact must agree on it.
        if exe.kind == "test" {
            match &manifest_dir {
                None => manifest_dir = Some(exe.manifest_dir.clone()),
                Some(d) if *d == exe.manifest_dir => {}
                Some(d) => bail!(
                    "test binaries from two packages ({} and {})",
                    d.display(),
                    exe.manifest_dir.display()
                ),
            }
        }
        let dst = stage.join(name);
        let st = Command::new("strip")
            .arg("--strip-all")
            .arg("-o")
            .arg(&dst)
            .arg(&exe.path)
            .status()
            .context("running `strip` (binutils): unstripped binaries do not fit the kit")?;
        if !st.success() {
            bail!("strip {} failed ({st})", exe.path.display());
        }
        staged.push(((*name).to_string(), size(&exe.path)?, size(&dst)?));
    }
    let manifest_dir = manifest_dir.ok_or_else(|| anyhow!("no test binary was built"))?;
    for lib in VULKAN_LIBS {
        match find_system_lib(lib) {
            Some(p) => {
                std::fs::copy(&p, stage.join("lib").join(lib))
                    .with_context(|| format!("copying {}", p.display()))?;
                staged.push((format!("lib/{lib}"), size(&p)?, size(&p)?));
            }
            None => eprintln!(
                "gpu-kit: warning: {lib} is not on this machine (apt-get install libvulkan1 \
                 libglvnd0): the kit will carry none, and a device without it gets no wgpu"
            ),
        }
    }

    if out.exists() {
        std::fs::remove_dir_all(out).with_context(|| format!("clearing {}", out.display()))?;
    }
    std::fs::create_dir_all(out)?;
    pack(&stage, &out.join("kit.tar.xz"))?;
    std::fs::remove_dir_all(&stage)?;

    let script = out.join("gpu-check.sh");
    std::fs::copy(root.join("xtask/gpu-check.sh"), &script)
        .context("copying xtask/gpu-check.sh into the kit")?;
    std::fs::set_permissions(&script, std::os::unix::fs::PermissionsExt::from_mode(0o755))?;
    std::fs::write(out.join("tree.sha256"), tree_hashes(&manifest_dir)?)?;
    let built_at = manifest_dir
        .to_str()
        .ok_or_else(|| anyhow!("the build directory is not UTF-8"))?;
    let env = format!(
        "# Written by `cargo xtask gpu-kit`; read by gpu-check.sh.\n\
         KIT_BUILT_AT={}\nKIT_GIT={}\nKIT_BUILT_UTC={}\nKIT_TESTS={}\nKIT_KERNELS_TEST={}\n",
        shell_quote(built_at),
        shell_quote(&git_describe(root)),
        shell_quote(&utc_now()),
        shell_quote(&TESTS.join(" ")),
        shell_quote(KERNELS_TEST),
    );
    std::fs::write(out.join("kit.env"), env)?;

    println!("binaries (built, then stripped into kit.tar.xz):");
    for (name, built, stripped) in &staged {
        println!(
            "  {name:<22} {:>6.1} MiB -> {:>5.1} MiB",
            mib(*built),
            mib(*stripped)
        );
    }
    let mut total = 0;
    println!("{}:", out.display());
    let mut files: Vec<PathBuf> = std::fs::read_dir(out)?
        .map(|e| e.map(|e| e.path()))
        .collect::<Result<_, _>>()?;
    files.sort();
    for f in &files {
        let n = size(f)?;
        total += n;
        println!(
            "  {:<16} {:>8.2} MiB",
            f.file_name().unwrap().to_string_lossy(),
            mib(n)
        );
    }
    println!("  total            {:>8.2} MiB", mib(total));
    if total > MAX_KIT_BYTES {
        bail!(
            "the kit is {:.1} MiB, over its {} MiB",
            mib(total),
            MAX_KIT_BYTES >> 20
        );
    }
    println!(
        "built in {:.0} s. Run it with the device tool (cuda/README.md):\n  \
         run(command=\"bash target/gpu-kit/gpu-check.sh\", carry=[\"target/gpu-kit\"], timeout_s=570)",
        t0.elapsed().as_secs_f64()
    );
    Ok(())
}

struct Executable {
    name: String,
    kind: String,
    path: PathBuf,
    manifest_dir: PathBuf,
}

/// Runs cargo with `--message-format=json` and returns the executables it reports for targets
/// of `kind` ("test" or "bin"). Cargo's own progress and errors go to the terminal.
fn cargo_executables(root: &Path, args: &[String], kind: &str) -> Result<Vec<Executable>> {
    let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".to_string());
    eprintln!("gpu-kit: cargo {}", args.join(" "));
    let mut child = Command::new(&cargo)
        .args(args)
        .arg("--message-format=json")
        .current_dir(root)
        .stdout(Stdio::piped())
        .spawn()
        .with_context(|| format!("running {cargo}"))?;
    let mut found = Vec::new();
    for line in BufReader::new(child.stdout.take().expect("piped")).lines() {
        let line = line?;
        let Ok(msg) = serde_json::from_str::<Value>(&line) else {
            continue;
        };
        match msg["reason"].as_str() {
            Some("compiler-message") => {
                if let Some(r) = msg["message"]["rendered"].as_str() {
                    eprint!("{r}");
                }
            }
            Some("compiler-artifact") => {
                let (Some(exe), Some(manifest)) =
                    (msg["executable"].as_str(), msg["manifest_path"].as_str())
                else {
                    continue;
                };
                let kinds = msg["target"]["kind"].as_array();
                if !kinds.is_some_and(|k| k.iter().any(|v| v == kind)) {
                    continue;
                }
                found.push(Executable {
                    name: msg["target"]["name"]
                        .as_str()
                        .unwrap_or_default()
                        .to_string(),
                    kind: kind.to_string(),
                    path: PathBuf::from(exe),
                    manifest_dir: Path::new(manifest)
                        .parent()
                        .ok_or_else(|| anyhow!("manifest path {manifest} has no directory"))?
                        .to_path_buf(),
                });
            }
            _ => {}
        }
    }
    let st = child.wait()?;
    if !st.success() {
        bail!("cargo {} failed ({st})", args.join(" "));
    }
    Ok(found)
}

/// `tar | xz` of `dir`'s contents into `dst`: names sorted and owners and times fixed, so the
/// same binaries give the same archive; `xz -9` with a window larger than all the binaries
/// together, so that the code they share is stored once.
fn pack(dir: &Path, dst: &Path) -> Result<()> {
    let mut tar = Command::new("tar")
        .args([
            "--sort=name",
            "--mtime=@0",
            "--owner=0",
            "--group=0",
            "--numeric-owner",
            "-C",
        ])
        .arg(dir)
        .args(["-cf", "-", "."])
        .stdout(Stdio::piped())
        .spawn()
        .context("running tar")?;
    let out = std::fs::File::create(dst)?;
    let xz = Command::new("xz")
        .args(["-9", "--threads=1", "--lzma2=preset=9,dict=128MiB", "-c"])
        .stdin(tar.stdout.take().expect("piped"))
        .stdout(out)
        .status()
        .context("running xz (xz-utils)")?;
    let t = tar.wait()?;
    if !t.success() || !xz.success() {
        bail!("packing {} failed (tar {t}, xz {xz})", dir.display());
    }
    Ok(())
}

/// `sha256sum`-format lines for the tracked files under fixtures/, shaders/ and cuda/ (less their
/// notes in Markdown): what the tests read from their build directory.
fn tree_hashes(root: &Path) -> Result<String> {
    let out = Command::new("git")
        .args([
            "ls-files",
            "-z",
            "--",
            "fixtures",
            "shaders",
            "cuda",
            ":(exclude)*.md",
        ])
        .current_dir(root)
        .output()
        .context("running git ls-files")?;
    if !out.status.success() {
        bail!(
            "git ls-files failed: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let mut lines = String::new();
    for rel in out.stdout.split(|&b| b == 0).filter(|p| !p.is_empty()) {
        let rel = std::str::from_utf8(rel)?;
        let mut f =
            std::fs::File::open(root.join(rel)).with_context(|| format!("reading {rel}"))?;
        let mut h = Sha256::new();
        let mut buf = vec![0u8; 1 << 20];
        loop {
            let n = f.read(&mut buf)?;
            if n == 0 {
                break;
            }
            h.update(&buf[..n]);
        }
        let digest: String = h.finalize().iter().map(|b| format!("{b:02x}")).collect();
        lines.push_str(&format!("{digest}  {rel}\n"));
    }
    if lines.is_empty() {
        bail!(
            "git lists no fixtures, shaders or kernels under {}",
            root.display()
        );
    }
    Ok(lines)
}

/// The file the dynamic loader would open for `soname`, from `ldconfig -p`.
fn find_system_lib(soname: &str) -> Option<PathBuf> {
    let out = Command::new("ldconfig").arg("-p").output().ok()?;
    String::from_utf8_lossy(&out.stdout).lines().find_map(|l| {
        let l = l.trim();
        let (name, rest) = l.split_once(' ')?;
        if name != soname || !rest.contains("x86-64") {
            return None;
        }
        let path = rest.rsplit("=> ").next()?;
        std::fs::canonicalize(path).ok()
    })
}

fn git_describe(root: &Path) -> String {
    let git = |args: &[&str]| {
        Command::new("git")
            .args(args)
            .current_dir(root)
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    };
    let head = git(&["rev-parse", "--short=12", "HEAD"]).unwrap_or_else(|| "unknown".into());
    match git(&["status", "--porcelain", "--untracked-files=no"]) {
        Some(s) if !s.is_empty() => format!("{head} (with uncommitted changes)"),
        _ => head,
    }
}

fn utc_now() -> String {
    Command::new("date")
        .args(["-u", "+%Y-%m-%dT%H:%M:%SZ"])
        .output()
        .ok()
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
        .filter(|s| !s.is_empty())
        .unwrap_or_else(|| "unknown".into())
}

/// A single-quoted shell word.
fn shell_quote(s: &str) -> String {
    format!("'{}'", s.replace('\'', r"'\''"))
}

fn size(p: &Path) -> Result<u64> {
    Ok(std::fs::metadata(p)
        .with_context(|| format!("reading {}", p.display()))?
        .len())
}

fn mib(n: u64) -> f64 {
    n as f64 / (1u64 << 20) as f64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn shell_quote_survives_the_shell() {
        let tricky = "/work/it's here/$HOME `x`";
        let out = Command::new("sh")
            .arg("-c")
            .arg(format!("printf %s {}", shell_quote(tricky)))
            .output()
            .unwrap();
        assert_eq!(String::from_utf8_lossy(&out.stdout), tricky);
    }

    #[test]
    fn the_script_parses() {
        let out = Command::new("bash")
            .arg("-n")
            .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("gpu-check.sh"))
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "gpu-check.sh: {}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}
