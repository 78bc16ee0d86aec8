//! `tern config [--print] [--config F.yaml] [flags]`: the merged settings.

use std::io::Write;
use std::path::PathBuf;

use anyhow::Result;

use crate::config::Settings;

#[derive(clap::Args, Debug, Clone)]
pub struct ConfigArgs {
    /// YAML config file; flags override its keys.
    #[arg(long, value_name = "FILE.yaml")]
    pub config: Option<PathBuf>,
    /// Print the merged settings (file, then flags) as YAML.
    #[arg(long)]
    pub print: bool,
    #[command(flatten)]
    pub settings: Settings,
}

pub fn run(args: &ConfigArgs) -> Result<()> {
    run_to(args, &mut std::io::stdout().lock())
}

/// As [`run`], writing to `out`.
pub fn run_to(args: &ConfigArgs, out: &mut dyn Write) -> Result<()> {
    let merged = super::merged_settings(args.config.as_ref(), &args.settings)?;
    if args.print {
        out.write_all(merged.to_yaml()?.as_bytes())?;
    } else {
        eprintln!(
            "config ok{} (--print shows the merged settings)",
            args.config
                .as_ref()
                .map(|p| format!(": {}", p.display()))
                .unwrap_or_default()
        );
    }
    Ok(())
}
