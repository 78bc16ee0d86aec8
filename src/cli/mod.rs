//! The command-line edge: the subcommands' implementations, the rewrite of llama-server's
//! spellings before clap, the settings resolved from their sources, logging, and how errors
//! are printed. `src/main.rs` parses and dispatches.
//!
//! A subcommand that takes the settings (`serve`, `generate`, `fit`, `config`; any new one
//! that flattens [`Settings`]) gets llama-server's whole flag table: list its name where
//! `main` calls [`prepare_args`], hold `config: Option<PathBuf>` and a flattened
//! [`Settings`], and call [`resolve`] with the notes `prepare_args` returned.

pub mod config;
pub mod fit;
pub mod generate;
pub mod logging;
pub mod progress;
pub mod verify;

use std::ffi::OsString;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use crate::config::flags::Rewritten;
use crate::config::{Resolved, Settings, Sources};

/// `tern serve [--config FILE.yaml] [flags]`.
#[derive(clap::Args, Debug, Clone)]
pub struct ServeArgs {
    /// YAML config file; the environment (LLAMA_ARG_*) and flags override its keys.
    #[arg(long, value_name = "FILE.yaml")]
    pub config: Option<PathBuf>,
    #[command(flatten)]
    pub settings: Settings,
}

/// The arguments (program name first), with llama-server's spellings rewritten to tern's for
/// the subcommands in `settings_commands` (see [`crate::config::flags::rewrite`]): what clap
/// parses, and what the rewrite noted (the warnings of flags that change nothing, how each
/// flag was spelled), for [`resolve`]. A refused flag is an error naming it.
pub fn prepare_args(
    args: impl IntoIterator<Item = OsString>,
    settings_commands: &[&str],
) -> Result<(Vec<String>, Rewritten)> {
    let args: Vec<String> = args
        .into_iter()
        .enumerate()
        .map(|(i, a)| {
            a.into_string()
                .map_err(|a| anyhow::anyhow!("argument {i} ({a:?}) is not valid UTF-8"))
        })
        .collect::<Result<_>>()?;
    let Some(cmd) = args.get(1) else {
        return Ok((args, Rewritten::default()));
    };
    if !settings_commands.contains(&cmd.as_str()) {
        return Ok((args, Rewritten::default()));
    }
    let mut rw = crate::config::flags::rewrite(&args[2..])?;
    let mut out = args[..2].to_vec();
    out.append(&mut rw.args);
    Ok((out, rw))
}

/// The environment as llama.cpp reads it.
pub fn env_var(name: &str) -> Option<String> {
    std::env::var(name).ok()
}

/// The settings of a command: the config file (when given), then the environment, then the
/// flags, validated; and every warning collected on the way (not yet printed: logging is set
/// up from these settings).
pub fn resolve(config: Option<&Path>, flags: &Settings, given: Rewritten) -> Result<Resolved> {
    let sources = sources(config, flags, given)?;
    Ok(sources.resolve()?)
}

/// The settings of a command by source, before they are merged.
pub fn sources(config: Option<&Path>, flags: &Settings, given: Rewritten) -> Result<Sources> {
    Ok(Sources::gather(config, &env_var, flags.clone(), given)?)
}

/// Starts logging from the settings and logs the warnings.
pub fn start_logging(r: &Resolved) -> Result<()> {
    logging::init(&r.settings)?;
    warn_notes(&r.notes);
    Ok(())
}

/// Each accepted flag that changes nothing, as one warning line.
pub fn warn_notes(notes: &[crate::config::Note]) {
    for n in notes {
        tracing::warn!(target: "tern::flags", "{n}");
    }
}

/// `tern serve`: resolve, log, boot, serve.
pub fn serve(args: &ServeArgs, given: Rewritten) -> Result<()> {
    let r = resolve(args.config.as_deref(), &args.settings, given)?;
    start_logging(&r)?;
    crate::server::run(r.settings)
}

/// Prints an error for the command line: the message and its causes, one per line, and never
/// a backtrace, whatever `RUST_BACKTRACE` says.
pub fn print_error(e: &anyhow::Error) {
    eprintln!("error: {e}");
    let mut last = e.to_string();
    for cause in e.chain().skip(1) {
        let c = cause.to_string();
        // thiserror messages often repeat their source's; print each text once.
        if !last.contains(&c) {
            eprintln!("  caused by: {c}");
        }
        last = c;
    }
}

/// `tern completions SHELL`: the completion script on stdout.
pub fn completions(shell: clap_complete::Shell, cmd: &mut clap::Command) -> Result<()> {
    let name = cmd.get_name().to_string();
    let mut out = std::io::stdout().lock();
    clap_complete::generate(shell, cmd, name, &mut out);
    std::io::Write::flush(&mut out).context("cannot write the completion script")
}
