//! run-manager: joins a dflash coordinator, enforces launch policy, runs the
//! DFlash2 worker as a child process and relays its progress.
//!
//! `main.rs` only parses arguments, builds the runtime and maps exit codes;
//! everything else lives in this library so tests can call it. Nothing here
//! needs or links Python: the native client, the worker launcher that embeds
//! it, is the `dflash-native-client` crate (`native-client/`).
//!
//! The folders are the architecture, each using only those above it in this list
//! and the shared modules at the root:
//! - `coordinator/`: the connection to the coordinator (target, TLS, channel,
//!   clients with their retries, certificates, the provider token);
//! - `worker/`: the worker as a process (command, environment, local ranks,
//!   docker, native or container launch), its event protocol and its job directory;
//! - `artifacts/`: what moves between the job directory and the coordinator
//!   (verification, checkpoints, uploads, downloads, the resume checkpoint, a
//!   graph job's inputs);
//! - `attempt/`: one lease from admission to FinishAttempt (the supervisor and
//!   its heartbeats);
//! - `provider`, `setup` and `commands/`: the provider loop, the configuration
//!   from the command line, and the two modes (`--local`, join), beside the
//!   hidden single upload `bench/artifacts.py` drives (`--upload-file`).
//!
//! At the root, besides those: the vocabulary every part speaks (`error`,
//! `env_vars`, `paths`, `version`, `backoff`, `proto`, `policy`, `device`,
//! `lease_lost`, `signal`, `shutdown`) and the shell (`cli`, `logging`, `lockdown`).

// The parts, each a folder (its `mod.rs` says what it holds):
pub mod artifacts;
pub mod attempt;
pub mod commands;
pub mod coordinator;
pub mod worker;

// The shared vocabulary the parts speak, and the shell around them.
pub mod backoff;
pub mod cli;
pub mod device;
pub mod env_vars;
pub mod error;
pub mod lease_lost;
pub mod lockdown;
pub mod logging;
pub mod paths;
pub mod policy;
pub mod proto;
pub mod provider;
pub mod setup;
pub mod shutdown;
pub mod signal;
pub mod version;

pub use error::{Error, Result};
pub use shutdown::shutdown_signals;

/// Run the mode the command line asks for.
pub async fn run(cli: cli::Cli) -> Result<()> {
    let mut shutdown = shutdown_signals()?;
    if let (Some(path), Some(lease)) = (&cli.upload_file, &cli.upload_lease) {
        return commands::upload::run(&cli, path, lease, cli.upload_name.as_deref()).await;
    }
    if cli.local {
        commands::local::run(&cli, &mut shutdown).await
    } else {
        commands::join::run(&cli, &mut shutdown).await
    }
}
