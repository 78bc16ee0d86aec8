//! `tern fit --model F [shape flags | --config F.yaml] [--device-mib N | --backend B] [--json]`:
//! prices the shape from the GGUF header and sets it against the device budget.

use std::io::Write;
use std::path::PathBuf;

use anyhow::{bail, Context, Result};

use crate::config::flags::Rewritten;
use crate::config::Settings;
use crate::plan::{self, mib, Budget};

#[derive(clap::Args, Debug, Clone)]
pub struct FitArgs {
    /// YAML config file; the environment (LLAMA_ARG_*) and flags override its keys.
    #[arg(long, value_name = "FILE.yaml")]
    pub config: Option<PathBuf>,
    /// Print a JSON object instead of the table.
    #[arg(long)]
    pub json: bool,
    #[command(flatten)]
    pub settings: Settings,
}

pub fn run(args: &FitArgs, given: Rewritten) -> Result<()> {
    let r = super::resolve(args.config.as_deref(), &args.settings, given)?;
    super::start_logging(&r)?;
    report(&r.settings, args.json, &mut std::io::stdout().lock())
}

/// As [`run`], writing the table (or JSON) to `out`. A shape that does not fit is an error
/// (non-zero exit) after the report is written.
pub fn run_to(args: &FitArgs, out: &mut dyn Write) -> Result<()> {
    let r = super::resolve(args.config.as_deref(), &args.settings, Rewritten::default())?;
    report(&r.settings, args.json, out)
}

fn report(s: &Settings, json: bool, out: &mut dyn Write) -> Result<()> {
    let model = s.model_path()?;
    let opened = plan::boot::open_model(Some(model))?;
    let mut shape = s.shape();
    let trained = crate::model::Config::from_gguf(&opened.file)
        .map(|c| c.context_length as u64)
        .with_context(|| format!("{} is not a loadable qwen35 model", opened.path))?;
    shape.ctx_size = plan::boot::settle_pool(
        s.ctx_size.or(s
            .kv_unified_per_slot
            .map(|n| n.saturating_mul(shape.parallel))),
        shape.parallel,
        trained,
    );
    let budget = Budget::resolve(shape.backend, s.device_mib)?;
    let fit = plan::fit(&opened.file, &shape, &budget)
        .with_context(|| format!("cannot price {}", model.display()))?;
    if json {
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
