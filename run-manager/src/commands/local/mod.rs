//! `run-manager --local [--spec FILE]`: the embedded default.
//!
//! Starts the Python coordinator as a child process on 127.0.0.1 (port 0,
//! SQLite and its artifact store under `<work-dir>/coordinator/`: `embedded`),
//! creates a provider token and one run through the admin API (`submit`), runs
//! that run's jobs on this machine until the run is done, prints a summary (job
//! states, artifacts with sha256 from ListArtifacts, and where each file is on
//! this machine: `summary`) and stops the coordinator.

pub mod embedded;
pub mod submit;
pub mod summary;

use tokio::sync::watch;

use crate::cli::Cli;
use crate::coordinator::client::{admin_client, provider_client};
use crate::coordinator::transport::Target;
use crate::error::{Error, Result};
use crate::proto::RunSpec;
use crate::provider::{run_loop, ProviderConfig, Until};
use crate::setup::{prepare_work_dir, provider_config};
use embedded::{find_python, EmbeddedCoordinator};
use submit::{submit, RunSpecFile};
use summary::{local_files, Summary};

/// Run `--local`.
pub async fn run(cli: &Cli, shutdown: &mut watch::Receiver<Option<i32>>) -> Result<()> {
    let spec = match &cli.spec {
        Some(p) => RunSpecFile::load(p)?,
        None => RunSpecFile::parse("{}").map_err(Error::Internal)?,
    };
    let run_spec = spec.to_run_spec()?;
    let work_dir = prepare_work_dir(&cli.work_dir)?;
    // Check the flags (worker, device) before starting anything.
    let cfg = provider_config(cli, &work_dir)?;
    let jobs_dir = work_dir.join("jobs");
    std::fs::create_dir_all(&jobs_dir).map_err(Error::io("cannot create", &jobs_dir))?;

    let python = find_python(cli.python.as_deref());
    let coordinator = EmbeddedCoordinator::start(&python, &work_dir.join("coordinator")).await?;
    let outcome = drive(
        &coordinator,
        run_spec,
        &spec.approve_native_versions,
        &cfg,
        shutdown,
    )
    .await;
    coordinator.stop().await;
    let summary = outcome?;
    if cli.json {
        let text =
            serde_json::to_string_pretty(&summary).map_err(|e| Error::Internal(e.to_string()))?;
        println!("{text}");
    } else {
        print!("{}", summary.to_text());
    }
    for hint in summary.export_hints() {
        eprintln!("{hint}");
    }
    match summary.failed() {
        0 => Ok(()),
        failed => Err(Error::JobsFailed {
            run_id: summary.run_id.clone(),
            failed,
            total: summary.jobs.len(),
        }),
    }
}

/// Submit the run to the embedded coordinator, run its jobs here until it is
/// done, and fetch its summary.
async fn drive(
    coordinator: &EmbeddedCoordinator,
    run_spec: RunSpec,
    approve: &[String],
    cfg: &ProviderConfig,
    shutdown: &mut watch::Receiver<Option<i32>>,
) -> Result<Summary> {
    // Plaintext on loopback: the embedded coordinator listens on 127.0.0.1 only.
    let target = Target::loopback(&coordinator.address)?;
    let mut admin = admin_client(&target, &coordinator.admin_token)?;
    let (token, run) = submit(&mut admin, &cfg.name, run_spec, approve).await?;
    tracing::info!(run_id = %run.run_id, jobs = run.job_states.values().sum::<u32>(), "created run");
    let provider = provider_client(&target, &token)?;
    let until = Until::RunDone {
        admin: Box::new(admin.clone()),
        run_id: run.run_id.clone(),
    };
    let results = run_loop(&provider, cfg, until, shutdown).await?;
    Summary::fetch(&mut admin, &run.run_id, &local_files(&results)).await
}
