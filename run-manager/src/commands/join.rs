//! `run-manager --coordinator URL --token-file FILE`: serve a remote coordinator.

use tokio::sync::watch;

use crate::cli::Cli;
use crate::coordinator::client::provider_client;
use crate::error::Result;
use crate::provider::{run_loop, Until};
use crate::setup::{coordinator_target, prepare_work_dir, provider_config, provider_token};

/// Join the coordinator named on the command line and run its jobs.
pub async fn run(cli: &Cli, shutdown: &mut watch::Receiver<Option<i32>>) -> Result<()> {
    let target = coordinator_target(cli)?;
    let (token, source) = provider_token(cli)?;
    let work_dir = prepare_work_dir(&cli.work_dir)?;
    let cfg = provider_config(cli, &work_dir)?;
    let client = provider_client(&target, &token)?;
    log_connection(&target, &source);
    let results = run_loop(&client, &cfg, Until::Forever, shutdown).await?;
    tracing::info!(attempts = results.len(), "run-manager stopping");
    Ok(())
}

fn log_connection(
    target: &crate::coordinator::transport::Target,
    source: &crate::coordinator::token::TokenSource,
) {
    let security = match &target.tls {
        None => "plaintext".to_string(),
        Some(tls) => {
            let roots = match &tls.ca {
                Some((p, _)) => format!("CA file `{}`", p.display()),
                None => "the system's CAs".into(),
            };
            match &tls.identity {
                Some(id) => format!(
                    "mutual TLS (verified against {roots}; client certificate `{}`, CN `{}`)",
                    id.cert_path.display(),
                    id.common_name.as_deref().unwrap_or("?")
                ),
                None => format!("TLS (verified against {roots})"),
            }
        }
    };
    tracing::info!(coordinator = %target.address.url(), "connecting over {security}; provider token from {source}");
}
