//! `run-manager --coordinator URL --token TOKEN`: serve a remote coordinator.

use tokio::sync::watch;

use crate::cli::Cli;
use crate::client::provider_client;
use crate::error::{Error, Result};
use crate::provider::{run_loop, Until};
use crate::setup::{prepare_work_dir, provider_config};

/// Join the coordinator named on the command line and run its jobs.
pub async fn run(cli: &Cli, shutdown: &mut watch::Receiver<Option<i32>>) -> Result<()> {
    let addr = cli.coordinator.as_deref().ok_or_else(|| {
        Error::Usage(
            "no coordinator given\nhint: pass `--coordinator http://HOST:PORT` (or set `DFLASH_COORDINATOR`), or `--local` to run one here".into(),
        )
    })?;
    let token = cli.token.as_deref().ok_or_else(|| {
        Error::Usage("no provider token given\nhint: pass `--token` or set `DFLASH_PROVIDER_TOKEN`; the coordinator's admin creates one with `dflash-coordinator providers create NAME`".into())
    })?;
    let work_dir = prepare_work_dir(&cli.work_dir)?;
    let cfg = provider_config(cli, &work_dir)?;
    let client = provider_client(addr, token)?;
    let results = run_loop(&client, &cfg, Until::Forever, shutdown).await?;
    tracing::info!(attempts = results.len(), "run-manager stopping");
    Ok(())
}
