//! Project tasks: `cargo xtask <task>`.

mod fixtures;
mod fold;
mod rng;
mod vocab;

use std::path::PathBuf;

use anyhow::{bail, Result};

const USAGE: &str = "usage: cargo xtask fixtures [--bench] [--out DIR]
  fixtures          write the tiny golden-test GGUFs, their twins and manifest.json to fixtures/
  fixtures --bench  write fixtures/bench/bench-0.8b-{q8_0,pq2_0}.gguf (large, not committed)";

fn workspace_root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).parent().unwrap().to_path_buf()
}

fn main() -> Result<()> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    match args.first().map(String::as_str) {
        Some("fixtures") => {
            let mut bench = false;
            let mut out = workspace_root().join("fixtures");
            let mut it = args[1..].iter();
            while let Some(a) = it.next() {
                match a.as_str() {
                    "--bench" => bench = true,
                    "--out" => match it.next() {
                        Some(d) => out = PathBuf::from(d),
                        None => bail!("--out needs a directory\n{USAGE}"),
                    },
                    other => bail!("unknown option {other}\n{USAGE}"),
                }
            }
            if bench {
                fixtures::write_bench(&out)
            } else {
                fixtures::write_tiny(&out)
            }
        }
        _ => {
            eprintln!("{USAGE}");
            std::process::exit(2)
        }
    }
}
