//! `tern config [--print [--explain]] [--config F.yaml] [flags]`: the merged settings.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;

use crate::config::flags::Rewritten;
use crate::config::Settings;

#[derive(clap::Args, Debug, Clone)]
pub struct ConfigArgs {
    /// YAML config file; the environment (LLAMA_ARG_*) and flags override its keys.
    #[arg(long, value_name = "FILE.yaml")]
    pub config: Option<PathBuf>,
    /// Print the merged settings (file, then environment, then flags) as YAML.
    #[arg(long)]
    pub print: bool,
    /// With --print: every key, where its value came from (flag, env VAR, file, default),
    /// and the warnings.
    #[arg(long)]
    pub explain: bool,
    #[command(flatten)]
    pub settings: Settings,
}

pub fn run(args: &ConfigArgs, given: Rewritten) -> Result<()> {
    run_with(args, given, &mut std::io::stdout().lock())
}

/// As [`run`], writing to `out`.
pub fn run_to(args: &ConfigArgs, out: &mut dyn Write) -> Result<()> {
    run_with(args, Rewritten::default(), out)
}

fn run_with(args: &ConfigArgs, given: Rewritten, out: &mut dyn Write) -> Result<()> {
    let sources = super::sources(args.config.as_deref(), &args.settings, given)?;
    let resolved = sources.resolve()?;
    if args.explain {
        out.write_all(sources.explain().as_bytes())?;
        for n in &resolved.notes[sources.notes.len()..] {
            writeln!(out, "# warning: {n}")?;
        }
    } else if args.print {
        out.write_all(resolved.settings.to_yaml()?.as_bytes())?;
        for n in &resolved.notes {
            eprintln!("warning: {n}");
        }
    } else {
        for n in &resolved.notes {
            eprintln!("warning: {n}");
        }
        eprintln!(
            "config ok{} (--print shows the merged settings, --explain where each came from)",
            args.config
                .as_ref()
                .map(|p| format!(": {}", p.display()))
                .unwrap_or_default()
        );
    }
    Ok(())
}
