//! run-manager: joins a dflash coordinator, enforces launch policy, runs the
//! DFlash2 worker as a child process and relays its progress.
//!
//! `main.rs` only parses arguments, builds the runtime and maps exit codes;
//! everything else lives in this library so tests can call it. Nothing here
//! needs or links Python: the native client, the worker launcher that embeds
//! it, is the `dflash-native-client` crate (`native-client/`).

pub mod artifact;
pub mod attempt;
pub mod backoff;
pub mod cert;
pub mod channel;
pub mod checkpoint;
pub mod cli;
pub mod client;
pub mod commands;
pub mod device;
pub mod docker;
pub mod env_vars;
pub mod error;
pub mod events;
pub mod fetch;
pub mod graph;
pub mod heartbeat;
pub mod jobdir;
pub mod launch;
pub mod lease_lost;
pub mod lockdown;
pub mod logging;
pub mod paths;
pub mod policy;
pub mod proto;
pub mod provider;
pub mod ranks;
pub mod resume;
pub mod setup;
pub mod shutdown;
pub mod signal;
pub mod tls_fault;
pub mod token;
pub mod transfer;
pub mod transport;
pub mod upload;
pub mod version;
pub mod worker;
pub mod worker_env;

pub use error::{Error, Result};
pub use shutdown::shutdown_signals;

/// Run the mode the command line asks for.
pub async fn run(cli: cli::Cli) -> Result<()> {
    let mut shutdown = shutdown_signals()?;
    if cli.local {
        commands::local::run(&cli, &mut shutdown).await
    } else {
        commands::join::run(&cli, &mut shutdown).await
    }
}
