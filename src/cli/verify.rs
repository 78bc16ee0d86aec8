//! `tern verify --model F [--sha256 HEX --bytes N] [--mmproj F --mmproj-sha256 HEX
//! --mmproj-bytes N] [--manifest F.json]`: byte count and sha256 of each file, streamed (never
//! mapped whole), with a progress bar when stderr is a terminal.
//!
//! A manifest is a JSON object with a `files` (or `fixtures`, as `fixtures/manifest.json`)
//! array of `{"file", "sha256", "bytes"}` entries (a `twin` / `twin_sha256` pair counts as one
//! more, optional entry: a derived file that may not be present). With `--model`/`--mmproj` the entry whose `file` is the file's name pins it;
//! with the manifest alone every entry is checked, relative to the manifest's directory.

use std::fs::File;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use anyhow::{anyhow, bail, Context, Result};
use sha2::{Digest, Sha256};

use super::progress::bytes_bar;
use crate::plan::count;

#[derive(clap::Args, Debug, Clone, Default)]
pub struct VerifyArgs {
    /// The model file.
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// The model's expected sha256 (64 hex digits).
    #[arg(long, value_name = "HEX")]
    pub sha256: Option<String>,
    /// The model's expected size in bytes.
    #[arg(long, value_name = "N")]
    pub bytes: Option<u64>,
    /// The projector file.
    #[arg(long)]
    pub mmproj: Option<PathBuf>,
    #[arg(long, value_name = "HEX")]
    pub mmproj_sha256: Option<String>,
    #[arg(long, value_name = "N")]
    pub mmproj_bytes: Option<u64>,
    /// A JSON manifest of expected sizes and digests.
    #[arg(long, value_name = "F.json")]
    pub manifest: Option<PathBuf>,
}

/// What a file is expected to be.
#[derive(Clone, Debug, Default, PartialEq)]
pub struct Expect {
    pub sha256: Option<String>,
    pub bytes: Option<u64>,
    /// A manifest's derived twin: checked when present, skipped (and said so) when absent.
    pub optional: bool,
}

/// A file's measured size and digest.
#[derive(Clone, Debug, PartialEq)]
pub struct Measured {
    pub bytes: u64,
    pub sha256: String,
}

pub fn run(args: &VerifyArgs) -> Result<()> {
    run_to(args, &mut std::io::stdout().lock())
}

/// As [`run`], writing one line per file to `out`. Any failure is an error after every file
/// has been checked.
pub fn run_to(args: &VerifyArgs, out: &mut dyn Write) -> Result<()> {
    let manifest = match &args.manifest {
        Some(p) => Some((p.clone(), read_manifest(p)?)),
        None => None,
    };
    let mut jobs: Vec<(PathBuf, Expect)> = Vec::new();
    let explicit = [
        (&args.model, &args.sha256, args.bytes, "--sha256"),
        (
            &args.mmproj,
            &args.mmproj_sha256,
            args.mmproj_bytes,
            "--mmproj-sha256",
        ),
    ];
    for (path, sha, bytes, flag) in explicit {
        match path {
            Some(p) => {
                let mut e = Expect {
                    sha256: sha.as_deref().map(|h| parse_hex(h, flag)).transpose()?,
                    bytes,
                    optional: false,
                };
                if e.sha256.is_none() && e.bytes.is_none() {
                    if let Some((mp, entries)) = &manifest {
                        e = lookup(entries, p).ok_or_else(|| {
                            anyhow!(
                                "{}: not listed in the manifest {}",
                                p.display(),
                                mp.display()
                            )
                        })?;
                    }
                }
                e.optional = false;
                jobs.push((p.clone(), e));
            }
            None if sha.is_some() || bytes.is_some() => {
                bail!("{flag} / its byte count were given without the file they pin")
            }
            None => {}
        }
    }
    if jobs.is_empty() {
        let Some((mp, entries)) = &manifest else {
            bail!("nothing to verify: pass --model, --mmproj or --manifest");
        };
        let dir = mp.parent().unwrap_or(Path::new("."));
        for (name, e) in entries {
            jobs.push((dir.join(name), e.clone()));
        }
        if jobs.is_empty() {
            bail!("{}: the manifest lists no files", mp.display());
        }
    }

    let mut failed = Vec::new();
    for (path, expect) in &jobs {
        if expect.optional && !path.exists() {
            writeln!(
                out,
                "skipped  {} (an optional twin, not present)",
                path.display()
            )?;
            continue;
        }
        match check(path, expect) {
            Ok(m) => {
                let pinned = match (&expect.sha256, expect.bytes) {
                    (Some(_), _) => "ok      ",
                    (None, Some(_)) => "size ok ",
                    (None, None) => "unpinned",
                };
                writeln!(
                    out,
                    "{pinned} {}  {} B  sha256 {}",
                    path.display(),
                    count(m.bytes),
                    m.sha256
                )?;
            }
            Err(e) => {
                writeln!(out, "FAILED   {e:#}")?;
                failed.push(format!("{e:#}"));
            }
        }
    }
    out.flush()?;
    if !failed.is_empty() {
        bail!(
            "{} of {} files failed verification: {}",
            failed.len(),
            jobs.len(),
            failed.join("; ")
        );
    }
    Ok(())
}

/// Measures `path` (streaming) and checks it against `expect`. Errors name the file.
pub fn check(path: &Path, expect: &Expect) -> Result<Measured> {
    let md = std::fs::metadata(path).with_context(|| format!("{}", path.display()))?;
    if !md.is_file() {
        bail!("{}: not a regular file", path.display());
    }
    if let Some(want) = expect.bytes {
        let have = md.len();
        if have < want {
            bail!(
                "{}: short file: {} of {} bytes ({} missing; an unfinished download?)",
                path.display(),
                count(have),
                count(want),
                count(want - have)
            );
        }
        if have > want {
            bail!(
                "{}: {} bytes, expected {} ({} too many)",
                path.display(),
                count(have),
                count(want),
                count(have - want)
            );
        }
    }
    let m = measure(path)?;
    if let Some(want) = expect.bytes {
        if m.bytes != want {
            bail!(
                "{}: read {} bytes, expected {} (the file changed while it was read?)",
                path.display(),
                count(m.bytes),
                count(want)
            );
        }
    }
    if let Some(want) = &expect.sha256 {
        if &m.sha256 != want {
            bail!(
                "{}: sha256 mismatch: the file has {}, expected {}",
                path.display(),
                m.sha256,
                want
            );
        }
    }
    Ok(m)
}

/// Streams the file through sha256 in 1 MiB reads, with a progress bar on a terminal.
pub fn measure(path: &Path) -> Result<Measured> {
    let mut f = File::open(path).with_context(|| format!("{}", path.display()))?;
    let len = f
        .metadata()
        .with_context(|| format!("{}", path.display()))?
        .len();
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| path.display().to_string());
    let bar = bytes_bar(len, &format!("sha256 {name}"));
    let mut h = Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut total = 0u64;
    loop {
        let n = match f.read(&mut buf) {
            Ok(0) => break,
            Ok(n) => n,
            Err(e) if e.kind() == std::io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e).with_context(|| format!("{}: read failed", path.display())),
        };
        h.update(&buf[..n]);
        total += n as u64;
        bar.inc(n as u64);
    }
    bar.finish_and_clear();
    let digest = h.finalize();
    let mut hex = String::with_capacity(64);
    for b in digest {
        use std::fmt::Write as _;
        let _ = write!(hex, "{b:02x}");
    }
    Ok(Measured {
        bytes: total,
        sha256: hex,
    })
}

fn parse_hex(h: &str, what: &str) -> Result<String> {
    let h = h.trim().to_ascii_lowercase();
    if h.len() != 64 || !h.bytes().all(|c| c.is_ascii_hexdigit()) {
        bail!("{what} {h:?}: expected a full sha256, 64 hex digits");
    }
    Ok(h)
}

/// The manifest's entries as (file name, expectation).
pub fn read_manifest(path: &Path) -> Result<Vec<(String, Expect)>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("manifest {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("manifest {}: not JSON", path.display()))?;
    let list = v
        .get("files")
        .or_else(|| v.get("fixtures"))
        .and_then(|l| l.as_array())
        .ok_or_else(|| {
            anyhow!(
                "manifest {}: expected a \"files\" (or \"fixtures\") array",
                path.display()
            )
        })?;
    let mut out = Vec::new();
    for (i, e) in list.iter().enumerate() {
        let field = |k: &str| e.get(k).filter(|x| !x.is_null());
        let name = field("file")
            .and_then(|x| x.as_str())
            .ok_or_else(|| anyhow!("manifest {}: entry {i} has no \"file\"", path.display()))?;
        let sha = match field("sha256") {
            Some(x) => Some(parse_hex(
                x.as_str().unwrap_or_default(),
                &format!("manifest entry {name:?} sha256"),
            )?),
            None => None,
        };
        let bytes = match field("bytes") {
            Some(x) => Some(x.as_u64().ok_or_else(|| {
                anyhow!("manifest entry {name:?}: bytes is not a non-negative integer")
            })?),
            None => None,
        };
        out.push((
            name.to_string(),
            Expect {
                sha256: sha,
                bytes,
                optional: false,
            },
        ));
        if let (Some(twin), Some(tsha)) = (
            field("twin").and_then(|x| x.as_str()),
            field("twin_sha256").and_then(|x| x.as_str()),
        ) {
            out.push((
                twin.to_string(),
                Expect {
                    sha256: Some(parse_hex(tsha, &format!("manifest entry {twin:?} sha256"))?),
                    bytes: None,
                    optional: true,
                },
            ));
        }
    }
    Ok(out)
}

fn lookup(entries: &[(String, Expect)], file: &Path) -> Option<Expect> {
    let name = file.file_name()?.to_str()?;
    entries
        .iter()
        .find(|(n, _)| Path::new(n).file_name().and_then(|x| x.to_str()) == Some(name))
        .map(|(_, e)| e.clone())
}
