//! `tern fit --model F [shape flags | --config F.yaml] [--device-mib N | --backend B] [--json]`:
//! prices the shape from the GGUF header and sets it against the device budget.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::config::Settings;
use crate::gguf::Gguf;
use crate::plan::{self, mib, Budget};

#[derive(clap::Args, Debug, Clone)]
pub struct FitArgs {
    /// YAML config file; flags override its keys.
    #[arg(long, value_name = "FILE.yaml")]
    pub config: Option<PathBuf>,
    /// Print a JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub settings: Settings,
}

pub fn run(args: &FitArgs) -> Result<()> {
    run_to(args, &mut std::io::stdout().lock())
}

/// As [`run`], writing the table (or JSON) to `out`. A shape that does not fit is an error
/// (non-zero exit) after the report is written.
pub fn run_to(args: &FitArgs, out: &mut dyn Write) -> Result<()> {
    let s = super::merged_settings(args.config.as_ref(), &args.settings)?;
    let model = s.model_path()?;
    let shape = s.shape();
    let budget = Budget::resolve(shape.backend, s.device_mib)?;
    let g = std::sync::Arc::new(Gguf::open(model)?);
    let fit = plan::fit(&g, &shape, &budget)
        .with_context(|| format!("cannot price {}", model.display()))?;
    if args.json {
        writeln!(out, "{}", serde_json::to_string_pretty(&fit.to_json())?)?;
    } else {
        out.write_all(fit.table().as_bytes())?;
    }
    out.flush()?;
    if !fit.verdict.fits {
        bail!(
            "the shape does not fit: it needs {} MiB and the budget is {} MiB",
            mib(fit.verdict.needed),
            mib(fit.verdict.budget)
        );
    }
    Ok(())
}
