//! Command-line interface (clap derive). Flags take CLI > env > default.

use std::path::PathBuf;

use clap::Parser;

use crate::env_vars;

/// Join a dflash coordinator and run DFlash2 draft-training jobs on this machine.
#[derive(Debug, Parser)]
#[command(name = "run-manager", version = crate::version::CLIENT_VERSION, long_version = crate::version::LONG_VERSION)]
pub struct Cli {
    /// Coordinator address (`http://host:port`).
    #[arg(long, env = env_vars::COORDINATOR)]
    pub coordinator: Option<String>,

    /// Bearer token that identifies this provider to the coordinator.
    #[arg(long, env = env_vars::PROVIDER_TOKEN, hide_env_values = true)]
    pub token: Option<String>,

    /// Directory for job state: checkpoints, captured features, exports.
    #[arg(long, env = env_vars::WORK_DIR, default_value = "./dflash-work")]
    pub work_dir: PathBuf,
}
