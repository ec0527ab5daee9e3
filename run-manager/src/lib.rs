//! run-manager: joins a dflash coordinator, enforces launch policy, runs the
//! DFlash2 worker as a child process and relays its progress.
//!
//! `main.rs` only parses arguments, builds the runtime and maps exit codes;
//! everything else lives in this library so tests can call it. Nothing here
//! needs or links Python: the native client, the worker launcher that embeds
//! it, is the `dflash-native-client` crate (`native-client/`).

pub mod attempt;
pub mod backoff;
pub mod cli;
pub mod client;
pub mod commands;
pub mod device;
pub mod docker;
pub mod env_vars;
pub mod error;
pub mod events;
pub mod jobdir;
pub mod logging;
pub mod paths;
pub mod policy;
pub mod proto;
pub mod provider;
pub mod setup;
pub mod version;
pub mod worker;

pub use error::{Error, Result};

use tokio::signal::unix::{signal, SignalKind};
use tokio::sync::watch;

/// Watch SIGINT and SIGTERM; the receiver turns `Some(signal)` on the first one.
pub fn shutdown_signals() -> Result<watch::Receiver<Option<i32>>> {
    let (tx, rx) = watch::channel(None);
    let mut int = signal(SignalKind::interrupt())
        .map_err(|e| Error::Internal(format!("cannot watch SIGINT: {e}")))?;
    let mut term = signal(SignalKind::terminate())
        .map_err(|e| Error::Internal(format!("cannot watch SIGTERM: {e}")))?;
    tokio::spawn(async move {
        loop {
            let sig = tokio::select! {
                _ = int.recv() => libc::SIGINT,
                _ = term.recv() => libc::SIGTERM,
            };
            tracing::warn!(
                "received {}; stopping after the worker",
                worker::signal_name(sig)
            );
            if tx.send(Some(sig)).is_err() {
                return;
            }
        }
    });
    Ok(rx)
}

/// Run the mode the command line asks for.
pub async fn run(cli: cli::Cli) -> Result<()> {
    let mut shutdown = shutdown_signals()?;
    if cli.local {
        commands::local::run(&cli, &mut shutdown).await
    } else {
        commands::join::run(&cli, &mut shutdown).await
    }
}
