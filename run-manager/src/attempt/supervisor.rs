//! The attempt's loop: [`run_attempt`] admits the lease (`super::admit`), then
//! a [`Supervisor`] holds everything an attempt shares across worker starts
//! (client, config, lease, job directory, heartbeat channels, shutdown, resume
//! checkpoint), makes the inputs and the resume checkpoint local, and runs one
//! worker start per [`Supervisor::run_once`], restarting after a crash; the
//! uploads drain before the attempt concludes (`super::finish`).
//!
//! How a worker is started and signalled (native or container) is
//! `crate::worker::launch`'s; heartbeats are `super::heartbeat`'s; artifact
//! checks are `crate::artifacts::verify`'s, uploads `crate::artifacts::upload`'s,
//! the downloads `crate::artifacts::fetch`'s (the resume checkpoint:
//! `crate::artifacts::resume`; a graph job's inputs: `crate::artifacts::inputs`).

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use super::admit::{admit, refuse, Admission};
use super::config::{lease_ttl, AttemptConfig};
use super::finish::{conclude, failed_inputs, failed_upload, AttemptResult, RunEnd};
use super::heartbeat::{apply_progress, heartbeat_task, Pace};
use crate::artifacts::fetch::Fetcher;
use crate::artifacts::transfer::LeaseClock;
use crate::artifacts::upload::{UploadQueue, Uploader};
use crate::artifacts::verify::{self, LocalArtifact};
use crate::coordinator::client::ProviderClient;
use crate::error::{Error, Result};
use crate::lease_lost::LeaseLost;
use crate::proto::{Artifact, HeartbeatRequest, Lease, Phase};
use crate::shutdown::{next_signal, signalled, Shutdown};
use crate::signal::{Signal, UploadFailure};
use crate::worker::events::{ArtifactEvent, WorkerEvent};
use crate::worker::jobdir::{GraphInfo, JobSpecFile};
use crate::worker::launch::{Launch, Launcher};
use crate::worker::process;

/// How long events still in the pipe are read after the worker exited.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the log relay may take to finish after the worker exited.
const LOG_FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// Run one lease to its end. Errors are returned for failures of the
/// run-manager itself (e.g. it cannot write the job directory) and when
/// FinishAttempt finds this provider's token refused.
pub async fn run_attempt(
    client: &ProviderClient,
    cfg: &AttemptConfig,
    lease: Lease,
    shutdown: &mut Shutdown,
) -> Result<AttemptResult> {
    tracing::info!(run_id = %lease.run_id, job_id = %lease.job_id, attempt = lease.attempt, "lease acquired");
    let admission = match admit(cfg, &lease) {
        Ok(a) => a,
        Err(refusal) => return refuse(client, cfg, &lease, refusal).await,
    };
    let job_dir = create_job_dir(&cfg.work_dir, &lease.job_id)?;
    let (mut sup, hb_task) = Supervisor::start(client, cfg, &lease, admission, job_dir, shutdown);
    let end = match sup.run().await {
        Ok(end) => Ok(sup.drain(end).await),
        Err(e) => Err(e),
    };
    let local_artifacts = std::mem::take(&mut sup.local_artifacts);
    let until = sup.clock.expires_at();
    // Dropping the progress sender ends the heartbeat task; abort it in case it is mid-RPC.
    drop(sup);
    hb_task.abort();
    let mut result = conclude(client, cfg, until, &lease, end?).await?;
    result.local_artifacts = local_artifacts;
    Ok(result)
}

/// `<work-dir>/jobs/<job_id>`, created and resolved to its canonical path.
fn create_job_dir(work_dir: &Path, job_id: &str) -> Result<PathBuf> {
    let job_dir = work_dir.join("jobs").join(job_id);
    std::fs::create_dir_all(&job_dir)
        .map_err(Error::io("cannot create job directory", &job_dir))?;
    job_dir
        .canonicalize()
        .map_err(Error::io("cannot resolve job directory", &job_dir))
}

/// Await `fut` unless CANCEL, a lost lease, a failed upload or a shutdown
/// signal comes first (CHECKPOINT_NOW has no worker to reach here and is dropped).
async fn interruptible<T>(
    signals: &mut mpsc::Receiver<Signal>,
    shutdown: &mut Shutdown,
    fut: impl std::future::Future<Output = T>,
) -> std::result::Result<T, RunEnd> {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            v = &mut fut => return Ok(v),
            Some(s) = signals.recv() => match s {
                Signal::Cancel => return Err(RunEnd::Cancelled),
                Signal::Lost(lost) => return Err(RunEnd::Lost(lost)),
                Signal::Upload(failure) => return Err(failed_upload(failure)),
                Signal::CheckpointNow => {}
            },
            sig = signalled(shutdown) => return Err(RunEnd::Signalled(sig)),
        }
    }
}

/// Everything one attempt shares across its worker starts.
struct Supervisor<'a> {
    client: &'a ProviderClient,
    cfg: &'a AttemptConfig,
    lease: &'a Lease,
    job_dir: PathBuf,
    launcher: Launcher,
    /// The lease's inputs, fetched into the job directory before the first start.
    inputs: Vec<Artifact>,
    /// Rewritten (restart, resume checkpoint) before every start.
    spec_file: JobSpecFile,
    /// The next heartbeat: the worker's latest progress.
    progress: watch::Sender<HeartbeatRequest>,
    /// Directives from the heartbeat task, failures from the upload queue.
    signals: mpsc::Receiver<Signal>,
    shutdown: &'a mut Shutdown,
    /// Verified artifacts, uploaded in order.
    queue: UploadQueue,
    clock: LeaseClock,
    /// Checkpoint a (re)started worker resumes from (its `manifest.json`), and its step.
    resume: Option<(PathBuf, u64)>,
    cancel_requested: bool,
    /// Set once the lease is lost (the worker is then killed, nothing more reported).
    lost: Option<LeaseLost>,
    /// Set once an upload failed for good (the worker is then killed).
    upload_failure: Option<UploadFailure>,
    shutdown_signal: Option<i32>,
    local_artifacts: Vec<LocalArtifact>,
}

/// What one worker run said and what was asked of it.
#[derive(Default)]
struct WorkerRun {
    saw_done: bool,
    /// The last `error` event: its message and whether it is retryable.
    error_event: Option<(String, bool)>,
    /// When a worker asked to stop is killed.
    kill_at: Option<Instant>,
}

impl<'a> Supervisor<'a> {
    /// Start the heartbeat task and the upload queue of an admitted lease;
    /// returns the supervisor and the heartbeat task (it ends when the supervisor is dropped).
    fn start(
        client: &'a ProviderClient,
        cfg: &'a AttemptConfig,
        lease: &'a Lease,
        admission: Admission,
        job_dir: PathBuf,
        shutdown: &'a mut Shutdown,
    ) -> (Self, tokio::task::JoinHandle<()>) {
        let clock = LeaseClock::start(lease_ttl(lease));
        let initial = HeartbeatRequest {
            lease_id: lease.lease_id.clone(),
            phase: Phase::Starting as i32,
            committed_step: lease.resume_checkpoint.as_ref().map_or(0, |c| c.step),
            ..Default::default()
        };
        let (progress, progress_rx) = watch::channel(initial);
        let (signal_tx, signals) = mpsc::channel(16);
        let pace = Pace {
            interval: cfg.heartbeat_interval,
            backoff: cfg.rpc.backoff,
            clock: clock.clone(),
        };
        let hb_task = tokio::spawn(heartbeat_task(
            client.clone(),
            progress_rx,
            signal_tx.clone(),
            pace,
        ));
        let uploader = Uploader {
            client: client.clone(),
            lease_id: lease.lease_id.clone(),
            job_id: lease.job_id.clone(),
            clock: clock.clone(),
            backoff: cfg.rpc.backoff,
            retries: cfg.rpc.retries,
        };
        let mut spec_file = JobSpecFile::new(
            lease,
            admission.spec,
            &job_dir,
            &cfg.policy.capabilities,
            admission.local_ranks,
            admission.downgrades,
        );
        spec_file.graph = GraphInfo::new(lease, &admission.inputs, &job_dir);
        let sup = Supervisor {
            client,
            cfg,
            lease,
            job_dir,
            launcher: admission.launcher,
            inputs: admission.inputs,
            spec_file,
            progress,
            signals,
            shutdown,
            queue: UploadQueue::start(uploader, signal_tx),
            clock,
            resume: None,
            cancel_requested: false,
            lost: None,
            upload_failure: None,
            shutdown_signal: None,
            local_artifacts: Vec::new(),
        };
        (sup, hb_task)
    }

    /// Make the inputs and the resume checkpoint local and prepare the launch
    /// once (for every rank), then start the worker, restarting it after a
    /// crash (with backoff) until it ends some other way or the budget is spent.
    async fn run(&mut self) -> Result<RunEnd> {
        // Heartbeats keep the lease alive while the inputs and the checkpoint download.
        let mut fetcher = Fetcher {
            client: self.client.clone(),
            lease: self.lease,
            job_dir: &self.job_dir,
            clock: self.clock.clone(),
            backoff: self.cfg.rpc.backoff,
            retries: self.cfg.rpc.retries,
        };
        let inputs = fetcher.inputs(&self.inputs);
        match interruptible(&mut self.signals, self.shutdown, inputs).await {
            Ok(Ok(_)) => {}
            Ok(Err(e)) => return Ok(failed_inputs(e)),
            Err(end) => return Ok(end),
        }
        match interruptible(&mut self.signals, self.shutdown, fetcher.resume()).await {
            Ok(Ok(resume)) => self.resume = resume,
            Ok(Err(lost)) => return Ok(RunEnd::Lost(lost)),
            Err(end) => return Ok(end),
        }
        // Docker: pull the image once per attempt (heartbeats keep the lease alive meanwhile).
        let prepare = self.launcher.prepare(&self.lease.job_id);
        match interruptible(&mut self.signals, self.shutdown, prepare).await {
            Ok(Ok(())) => {}
            // Another provider (or a later try) may reach the registry: RETRYABLE.
            Ok(Err(m)) => return Ok(RunEnd::Crashed(m)),
            Err(end) => return Ok(end),
        }
        let mut restarts = 0u32;
        loop {
            let why = match self.run_once(restarts).await? {
                RunEnd::Crashed(why) => why,
                end => return Ok(end),
            };
            restarts += 1;
            if restarts > self.cfg.max_restarts {
                return Ok(RunEnd::Crashed(format!(
                    "worker failed {restarts} time(s); last: {why}"
                )));
            }
            let delay = self.cfg.restart_backoff.delay(restarts - 1);
            let from = match &self.resume {
                Some((_, step)) => format!("checkpoint at step {step}"),
                None => "the beginning".to_string(),
            };
            tracing::warn!(
                job_id = %self.lease.job_id, restart = restarts, max_restarts = self.cfg.max_restarts,
                delay_ms = delay.as_millis() as u64, "worker {why}; restarting from {from}"
            );
            // Wait out the backoff, but still obey CANCEL, a lost lease and signals.
            let backoff = tokio::time::sleep(delay);
            if let Err(end) = interruptible(&mut self.signals, self.shutdown, backoff).await {
                return Ok(end);
            }
        }
    }

    /// Start the worker once (`restart` earlier starts in this attempt) and
    /// supervise it until it exits.
    async fn run_once(&mut self, restart: u32) -> Result<RunEnd> {
        let resume = self.resume.clone();
        self.spec_file.restart = restart;
        self.spec_file.resume_checkpoint = resume.as_ref().map(|r| r.0.clone());
        self.spec_file.resume_step = resume.as_ref().map_or(0, |r| r.1);
        self.spec_file.write()?;
        let resume_path = resume.as_ref().map(|r| r.0.as_path());
        let started = self
            .launcher
            .start(self.lease, &self.job_dir, restart, resume_path);
        let (mut launch, mut output) = match started.await {
            Ok(s) => s,
            // A worker that cannot even start is a crash like any other: the
            // job itself is fine, and another provider may run it.
            Err(e) => return Ok(RunEnd::Crashed(e.to_string())),
        };
        let mut run = WorkerRun::default();
        let status = self
            .supervise(&mut launch, &mut output.events, &mut run)
            .await?;
        // Events written just before exit may still be in the pipe: handle
        // them like live ones (bounded, in case a grandchild keeps stdout open).
        let drain_until = Instant::now() + DRAIN_TIMEOUT;
        while let Ok(Some(ev)) = tokio::time::timeout_at(drain_until, output.events.recv()).await {
            self.on_event(ev, &mut run).await;
        }
        output.logs.finish(LOG_FLUSH_TIMEOUT).await;
        launch.cleanup().await;
        let how = launch.describe_exit(&status);
        tracing::info!(job_id = %self.lease.job_id, pid = launch.pid(), "worker {how}");
        Ok(self.verdict(&status, how, &run))
    }

    /// Relay events, directives and signals to and from a running worker until it exits.
    async fn supervise(
        &mut self,
        launch: &mut Launch,
        events: &mut mpsc::Receiver<WorkerEvent>,
        run: &mut WorkerRun,
    ) -> Result<ExitStatus> {
        loop {
            let kill_at = run.kill_at;
            let kill_due = async move {
                match kill_at {
                    Some(t) => tokio::time::sleep_until(t).await,
                    None => std::future::pending().await,
                }
            };
            tokio::select! {
                st = launch.wait() => {
                    return st.map_err(|e| Error::Internal(format!("waiting for the worker failed: {e}")));
                }
                Some(ev) = events.recv() => self.on_event(ev, run).await,
                Some(s) = self.signals.recv() => self.on_directive(s, launch, run),
                sig = signalled(self.shutdown), if self.shutdown_signal.is_none() => {
                    tracing::warn!(job_id = %self.lease.job_id, "received {}: asking the worker to checkpoint and stop (SIGTERM)", process::signal_name(sig));
                    self.shutdown_signal = Some(sig);
                    self.stop_worker(launch, run);
                }
                _ = kill_due => {
                    tracing::warn!(job_id = %self.lease.job_id, grace_s = self.cfg.grace.as_secs_f64(), "worker did not exit after SIGTERM; killing it");
                    launch.kill();
                    run.kill_at = None;
                }
            }
        }
    }

    /// Handle one worker event, live or drained after exit.
    async fn on_event(&mut self, ev: WorkerEvent, run: &mut WorkerRun) {
        let job_id = &self.lease.job_id;
        match ev {
            WorkerEvent::Progress(p) => self.progress.send_modify(|req| apply_progress(req, &p)),
            WorkerEvent::Artifact(a) => self.on_artifact(&a).await,
            WorkerEvent::Done => run.saw_done = true,
            WorkerEvent::Stopped { committed_step } => {
                tracing::info!(job_id = %job_id, committed_step = committed_step.unwrap_or(0), "worker stopped after committing a checkpoint");
            }
            WorkerEvent::Error { message, retryable } => {
                tracing::error!(job_id = %job_id, retryable, "worker reported: {message}");
                run.error_event = Some((message, retryable));
            }
        }
    }

    /// Verify one artifact and queue its upload. A verified checkpoint (its
    /// `manifest.json`, with the files it lists in place) is what the next
    /// start resumes from, and its step the heartbeat's `committed_step`,
    /// whether or not its upload has happened yet. Nothing is queued once the
    /// lease is lost or an upload failed.
    async fn on_artifact(&mut self, a: &ArtifactEvent) {
        if self.lost.is_some() || self.upload_failure.is_some() {
            return;
        }
        let job_id = &self.lease.job_id;
        let verified = match verify::verify(&self.job_dir, a).await {
            Ok(v) => v,
            Err(message) => {
                tracing::error!(job_id = %job_id, artifact = %a.name, "{message}");
                return;
            }
        };
        let (item, local) = match verify::upload_item(&self.job_dir, a, &verified).await {
            Ok(x) => x,
            Err(message) => {
                tracing::error!(job_id = %job_id, artifact = %a.name, "{message}");
                return;
            }
        };
        tracing::info!(job_id = %job_id, artifact = %a.name, kind = %a.kind, sha256 = %verified.sha256, listed_files = local.len().saturating_sub(1), "artifact verified; queued for upload");
        self.local_artifacts.extend(local);
        self.queue.push(item);
        if a.kind == "checkpoint" {
            self.progress
                .send_modify(|req| req.committed_step = req.committed_step.max(a.step));
            self.resume = Some((verified.path, a.step));
        }
    }

    /// Wait for the queued uploads (heartbeats go on meanwhile) before the
    /// attempt may end: a lost lease or a new shutdown signal stops waiting;
    /// a failed upload turns a success into its failure.
    async fn drain(&mut self, end: RunEnd) -> RunEnd {
        if matches!(end, RunEnd::Lost(_)) || self.upload_failure.is_some() {
            return end;
        }
        let job_id = &self.lease.job_id;
        let drained = {
            let pending = self.queue.drain();
            tokio::pin!(pending);
            loop {
                tokio::select! {
                    r = &mut pending => break r,
                    Some(s) = self.signals.recv() => if let Signal::Lost(lost) = s {
                        return RunEnd::Lost(lost);
                    },
                    sig = next_signal(self.shutdown) => {
                        tracing::warn!(job_id = %job_id, "received {} while uploading artifacts; not waiting for them", process::signal_name(sig));
                        return match end {
                            RunEnd::Signalled(first) => RunEnd::Signalled(first),
                            _ => RunEnd::Signalled(sig),
                        };
                    }
                }
            }
        };
        match (end, drained) {
            (end, Ok(())) => end,
            (RunEnd::Succeeded, Err(failure)) => failed_upload(failure),
            (_, Err(UploadFailure::Lost(lost))) => RunEnd::Lost(lost),
            (end, Err(failure)) => {
                tracing::error!(job_id = %job_id, "{failure}");
                end
            }
        }
    }

    /// Act on a directive from the coordinator.
    fn on_directive(&mut self, s: Signal, launch: &mut Launch, run: &mut WorkerRun) {
        let job_id = &self.lease.job_id;
        match s {
            Signal::Cancel => {
                if !self.cancel_requested {
                    tracing::info!(job_id = %job_id, "CANCEL from the coordinator: asking the worker to checkpoint and stop (SIGTERM)");
                    self.cancel_requested = true;
                    self.stop_worker(launch, run);
                }
            }
            Signal::CheckpointNow => {
                tracing::info!(job_id = %job_id, "CHECKPOINT_NOW from the coordinator (SIGUSR1)");
                launch.checkpoint();
            }
            Signal::Lost(lost) | Signal::Upload(UploadFailure::Lost(lost)) => {
                log_lost(job_id, &lost);
                self.lost = Some(lost);
                launch.kill();
            }
            Signal::Upload(failure) => {
                tracing::error!(job_id = %job_id, "{failure}; killing the worker");
                self.upload_failure = Some(failure);
                launch.kill();
            }
        }
    }

    /// SIGTERM the worker and arm the kill for when the grace period is over.
    fn stop_worker(&self, launch: &Launch, run: &mut WorkerRun) {
        launch.terminate(self.cfg.grace);
        run.kill_at = Some(Instant::now() + launch.kill_after(self.cfg.grace));
    }

    /// How the attempt stands after a worker run that ended with `status`.
    fn verdict(&mut self, status: &ExitStatus, how: String, run: &WorkerRun) -> RunEnd {
        if let Some(lost) = self.lost.take() {
            return RunEnd::Lost(lost);
        }
        if let Some(failure) = &self.upload_failure {
            return failed_upload(failure.clone());
        }
        if let Some(sig) = self.shutdown_signal {
            return RunEnd::Signalled(sig);
        }
        if self.cancel_requested {
            return RunEnd::Cancelled;
        }
        if run.saw_done && status.success() {
            return RunEnd::Succeeded;
        }
        if let Some((message, false)) = &run.error_event {
            return RunEnd::Failed(message.clone());
        }
        RunEnd::Crashed(match (&run.error_event, run.saw_done) {
            (Some((m, _)), _) => format!("{how} after a retryable error: {m}"),
            (None, true) => format!("{how} after `done`"),
            (None, false) if status.success() => "exited 0 without a `done` event".to_string(),
            (None, false) => how,
        })
    }
}

/// Say why a live worker is about to be killed.
fn log_lost(job_id: &str, lost: &LeaseLost) {
    match lost {
        LeaseLost::Stale(_) => {
            tracing::warn!(job_id = %job_id, "lease is stale: killing the worker")
        }
        LeaseLost::Refused { call, status } => {
            tracing::error!(job_id = %job_id, call, code = ?status.code(), "the coordinator refused this provider's token: killing the worker")
        }
    }
}
