//! Logging for the commands, on `tracing`: text or JSON lines, to stderr and optionally also
//! to a file, gated by llama.cpp's verbosity levels.
//!
//! llama.cpp's thresholds map onto tracing's levels: 0 output only (nothing is logged), 1
//! errors, 2 warnings, 3 info (the default), 4 "more info" = debug (the full memory ledger,
//! each chat prompt), 5 and up (and `-v`) everything. `--log-disable` logs nothing.

use std::io::IsTerminal;
use std::sync::Mutex;

use anyhow::{Context, Result};
use tracing::level_filters::LevelFilter;
use tracing_subscriber::layer::SubscriberExt;
use tracing_subscriber::{fmt, Layer, Registry};

use crate::config::{LogColors, LogFormat, Settings};

/// The level a llama.cpp verbosity threshold lets through.
pub fn level_of(verbosity: u32) -> LevelFilter {
    match verbosity {
        0 => LevelFilter::OFF,
        1 => LevelFilter::ERROR,
        2 => LevelFilter::WARN,
        3 => LevelFilter::INFO,
        4 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    }
}

/// The level the settings ask for.
pub fn level(s: &Settings) -> LevelFilter {
    if s.log_disable == Some(true) {
        LevelFilter::OFF
    } else if s.verbose == Some(true) {
        LevelFilter::TRACE
    } else {
        level_of(s.log_verbosity.unwrap_or(3))
    }
}

type Boxed = Box<dyn Layer<Registry> + Send + Sync>;

fn layer<W>(json: bool, ansi: bool, time: bool, prefix: bool, w: W) -> Boxed
where
    W: for<'a> fmt::MakeWriter<'a> + Send + Sync + 'static,
{
    if json {
        return fmt::layer()
            .json()
            .flatten_event(true)
            .with_current_span(false)
            .with_span_list(false)
            .with_target(true)
            .with_writer(w)
            .boxed();
    }
    let l = fmt::layer()
        .with_ansi(ansi)
        .with_target(false)
        .with_level(prefix)
        .with_writer(w);
    if time {
        l.boxed()
    } else {
        l.without_time().boxed()
    }
}

/// Installs the process's subscriber from the settings. Only tern's own events are logged.
/// Called once, at the command-line edge.
pub fn init(s: &Settings) -> Result<()> {
    let lvl = level(s);
    let json = s.log_format == Some(LogFormat::Json);
    let time = s.log_timestamps.unwrap_or(true);
    let prefix = s.log_prefix.unwrap_or(true);
    let ansi = match s.log_colors.unwrap_or(LogColors::Auto) {
        LogColors::On => true,
        LogColors::Off => false,
        LogColors::Auto => std::io::stderr().is_terminal(),
    };
    let mut layers: Vec<Boxed> = Vec::new();
    // Logs go to stderr in both formats (llama.cpp's --log-jsonl uses stdout, but stdout is
    // `tern generate`'s output).
    layers.push(layer(json, ansi && !json, time, prefix, std::io::stderr));
    if let Some(path) = &s.log_file {
        let f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("cannot open the log file {}", path.display()))?;
        layers.push(layer(json, false, time, prefix, Mutex::new(f)));
    }
    let only_tern = tracing_subscriber::filter::filter_fn(|m| m.target().starts_with("tern"));
    let subscriber = Registry::default().with(layers.with_filter(lvl).with_filter(only_tern));
    tracing::subscriber::set_global_default(subscriber)
        .context("cannot install the logger (already installed)")?;
    Ok(())
}
