//! The command line: `tollgate [serve] [--config FILE]...`.

use std::path::PathBuf;

use clap::{Parser, Subcommand};

#[derive(Debug, Parser)]
#[command(
    name = "tollgate",
    version,
    about = "One token bucket per client, enforced once at the edge."
)]
pub struct Cli {
    /// TOML file layered over the defaults (repeatable; later files win).
    #[arg(long = "config", global = true, value_name = "FILE")]
    pub config: Vec<PathBuf>,

    #[command(subcommand)]
    pub command: Option<Command>,
}

#[derive(Debug, Subcommand)]
pub enum Command {
    /// Start the gateway (the default).
    Serve,
}
