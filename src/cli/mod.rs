//! The implementations of the `fit`, `config` and `verify` subcommands. Each takes its parsed
//! clap arguments and returns `anyhow::Result`; `src/main.rs` only dispatches to them.

pub mod boot;
pub mod config;
pub mod fit;
pub mod progress;
pub mod verify;

use std::path::PathBuf;

use anyhow::{Context, Result};

use crate::config::Settings;

/// The settings a command runs with: the config file (when given), then the flags.
pub fn merged_settings(config: Option<&PathBuf>, flags: &Settings) -> Result<Settings> {
    let file = match config {
        Some(p) => Settings::load(p)?,
        None => Settings::default(),
    };
    let merged = file.merge(flags.clone());
    merged
        .validate()
        .context("the merged settings (config file, then flags)")?;
    Ok(merged)
}
