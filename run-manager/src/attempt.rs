//! One job attempt: preflight, job directory, worker supervision with
//! restarts, heartbeats, artifact reports, and the FinishAttempt that ends it.
//!
//! Outcomes:
//! - worker emitted `done` and exited 0 -> SUCCEEDED;
//! - worker emitted `error` with `retryable: false` and exited -> FAILED
//!   (not restarted: another try would fail the same way);
//! - CANCEL directive -> SIGTERM (the worker checkpoints and exits) -> CANCELLED;
//! - worker crashed (non-zero exit, signal, or exit 0 without `done`) ->
//!   restarted from its last committed checkpoint after an exponential
//!   backoff, at most `max_restarts` times, then RETRYABLE;
//! - preflight refusal -> FAILED with the reason; version mismatch ->
//!   RETRYABLE (another provider may take it) and the run-manager exits 10;
//! - the run-manager itself got SIGINT/SIGTERM -> SIGTERM to the worker, wait
//!   for it, RETRYABLE so the job is requeued at once;
//! - the coordinator answered ABORTED (the lease is stale) -> the worker is
//!   killed and the attempt is abandoned without FinishAttempt;
//! - the coordinator refused this provider's token (UNAUTHENTICATED /
//!   PERMISSION_DENIED on a reopened Heartbeat stream, ReportArtifact or
//!   FinishAttempt: revoked, or rotated past its grace) -> the same, and the
//!   run-manager exits 1 ([`Error::TokenRefused`]).
//!
//! Structure: [`run_attempt`] admits the lease (or [`refuse`]s it, the one
//! way a lease is turned down), then a [`Supervisor`] holds everything an
//! attempt shares across worker starts (client, config, lease, job directory,
//! heartbeat channels, shutdown, resume checkpoint) and runs one start per
//! [`Supervisor::run_once`]. How a worker is started and signalled (native or
//! container) is `crate::launch`'s; heartbeats are `crate::heartbeat`'s;
//! artifact checks are `crate::artifact`'s.

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::artifact::{self, Reported, Reporter};
use crate::backoff::Backoff;
use crate::client::{retry, ProviderClient, RetryPolicy};
use crate::docker::DockerConfig;
use crate::error::{Error, Result};
use crate::events::{ArtifactEvent, WorkerEvent};
use crate::heartbeat::{apply_progress, heartbeat_task, HbSignal};
use crate::jobdir::{parse_spec, JobSpecFile};
use crate::launch::{Launch, Launcher};
use crate::lease_lost::LeaseLost;
use crate::paths::{check_id, path_from_file_uri};
use crate::policy::{preflight, Decision, Downgrade, PolicyContext};
use crate::proto::{AttemptOutcome, FinishAttemptRequest, HeartbeatRequest, Lease, Phase};
use crate::shutdown::{signalled, Shutdown};
use crate::worker::{self, describe_exit, WorkerCommand};

/// How long events still in the pipe are read after the worker exited.
const DRAIN_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the log relay may take to finish after the worker exited.
const LOG_FLUSH_TIMEOUT: Duration = Duration::from_secs(2);

/// How attempts are run on this provider.
#[derive(Debug, Clone)]
pub struct AttemptConfig {
    pub work_dir: PathBuf,
    pub worker: WorkerCommand,
    /// Docker launch mode: run each worker in a container (`worker` is then unused).
    pub docker: Option<DockerConfig>,
    pub policy: PolicyContext,
    /// Restarts of a crashed worker before the attempt ends RETRYABLE.
    pub max_restarts: u32,
    pub restart_backoff: Backoff,
    pub rpc: RetryPolicy,
    /// Heartbeat (and lease renewal) interval.
    pub heartbeat_interval: Duration,
    /// Time a worker has to exit after SIGTERM before it is killed.
    pub grace: Duration,
    /// Artifacts up to this size travel inline in ReportArtifact; larger ones
    /// (and all when 0) are reported by `file://` URI.
    pub inline_max_bytes: u64,
}

/// How an attempt ended.
#[derive(Debug)]
pub struct AttemptResult {
    pub job_id: String,
    /// None when the lease was lost and no FinishAttempt was sent.
    pub outcome: Option<AttemptOutcome>,
    pub message: String,
    /// Job state after FinishAttempt, as the coordinator reported it.
    pub job_state: Option<String>,
    /// Set when the run-manager must stop after this attempt (exit 10, signal, token refused).
    pub stop: Option<Error>,
}

/// Where the attempt stands after one worker run.
enum RunEnd {
    Succeeded,
    Failed(String),
    Cancelled,
    /// The worker crashed or ended without `done`; restart if the budget allows.
    Crashed(String),
    /// Stale or refused: no FinishAttempt.
    Lost(LeaseLost),
    Signalled(i32),
}

/// Why a lease is not run: the FinishAttempt to send, and whether the
/// run-manager must stop afterwards.
struct Refusal {
    outcome: AttemptOutcome,
    message: String,
    stop: Option<Error>,
}

impl Refusal {
    fn failed(message: String) -> Self {
        Refusal {
            outcome: AttemptOutcome::Failed,
            message,
            stop: None,
        }
    }
}

/// What the preflight admitted: everything a worker start needs but the job directory.
struct Admission {
    spec: serde_json::Value,
    local_ranks: u32,
    downgrades: Vec<Downgrade>,
    launcher: Launcher,
}

/// Preflight, spec and image checks, in that order; the first that fails refuses the lease.
fn admit(cfg: &AttemptConfig, lease: &Lease) -> std::result::Result<Admission, Refusal> {
    let (local_ranks, downgrades) = match preflight(lease, &cfg.policy) {
        Decision::Run {
            local_ranks,
            downgrades,
        } => (local_ranks, downgrades),
        Decision::Refuse { outcome, message } => {
            return Err(Refusal {
                outcome,
                message,
                stop: None,
            })
        }
        Decision::UpgradeRequired { required, message } => {
            let stop = Error::UpgradeRequired {
                required,
                have: cfg.policy.worker_version.clone(),
                message: message.clone(),
            };
            return Err(Refusal {
                outcome: AttemptOutcome::Retryable,
                message,
                stop: Some(stop),
            });
        }
    };
    for d in &downgrades {
        tracing::warn!(job_id = %lease.job_id, "downgrade: {} -> {} ({})", d.feature, d.replacement, d.reason);
    }
    let spec = parse_spec(&lease.spec_json)
        .and_then(|s| {
            check_id(&lease.job_id)
                .map(|_| s)
                .map_err(|e| e.to_string())
        })
        .map_err(Refusal::failed)?;
    let launcher =
        Launcher::for_lease(&cfg.worker, cfg.docker.as_ref(), lease).map_err(Refusal::failed)?;
    Ok(Admission {
        spec,
        local_ranks,
        downgrades,
        launcher,
    })
}

/// Turn the lease down: log why, send FinishAttempt, end the attempt.
async fn refuse(
    client: &ProviderClient,
    cfg: &AttemptConfig,
    lease: &Lease,
    r: Refusal,
) -> Result<AttemptResult> {
    tracing::error!(job_id = %lease.job_id, "refusing the lease: {}", r.message);
    let job_state = finish(client, &cfg.rpc, lease, r.outcome, &r.message).await?;
    Ok(AttemptResult {
        job_id: lease.job_id.clone(),
        outcome: Some(r.outcome),
        message: r.message,
        job_state,
        stop: r.stop,
    })
}

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
    let resume = lease_resume(&lease);
    let initial = HeartbeatRequest {
        lease_id: lease.lease_id.clone(),
        phase: Phase::Starting as i32,
        committed_step: resume.as_ref().map_or(0, |r| r.1),
        ..Default::default()
    };
    let (progress, progress_rx) = watch::channel(initial);
    let (hb_tx, signals) = mpsc::channel(16);
    let hb_task = tokio::spawn(heartbeat_task(
        client.clone(),
        progress_rx,
        hb_tx,
        cfg.heartbeat_interval,
        cfg.rpc.backoff,
    ));
    let spec_file = JobSpecFile::new(
        &lease,
        admission.spec,
        &job_dir,
        &cfg.policy.capabilities,
        admission.local_ranks,
        admission.downgrades,
    );
    let mut sup = Supervisor {
        client,
        cfg,
        lease: &lease,
        job_dir,
        launcher: admission.launcher,
        spec_file,
        progress,
        signals,
        shutdown,
        resume,
        cancel_requested: false,
        lost: None,
        shutdown_signal: None,
    };
    let end = sup.run().await;
    // Dropping the progress sender ends the heartbeat task; abort it in case it is mid-RPC.
    drop(sup);
    hb_task.abort();
    conclude(client, cfg, &lease, end?).await
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

/// The lease's resume checkpoint (its `manifest.json`) and step, when that
/// file is on this machine.
fn lease_resume(lease: &Lease) -> Option<(PathBuf, u64)> {
    let ckpt = lease.resume_checkpoint.as_ref()?;
    let job_id = &lease.job_id;
    match path_from_file_uri(&ckpt.uri) {
        Ok(p) if p.is_file() => {
            tracing::info!(job_id = %job_id, step = ckpt.step, "resuming from `{}`", p.display());
            Some((p, ckpt.step))
        }
        Ok(p) => {
            tracing::warn!(job_id = %job_id, "resume checkpoint `{}` is not on this machine; starting from the beginning", p.display());
            None
        }
        Err(e) => {
            tracing::warn!(job_id = %job_id, "cannot use resume checkpoint: {e}; starting from the beginning");
            None
        }
    }
}

/// Send the FinishAttempt that `end` calls for (none for a lost lease).
async fn conclude(
    client: &ProviderClient,
    cfg: &AttemptConfig,
    lease: &Lease,
    end: RunEnd,
) -> Result<AttemptResult> {
    let job_id = &lease.job_id;
    let (outcome, message, stop) = match end {
        RunEnd::Succeeded => (AttemptOutcome::Succeeded, String::new(), None),
        RunEnd::Failed(m) => (AttemptOutcome::Failed, m, None),
        RunEnd::Cancelled => (
            AttemptOutcome::Cancelled,
            "cancelled by the coordinator".to_string(),
            None,
        ),
        RunEnd::Crashed(m) => (AttemptOutcome::Retryable, m, None),
        RunEnd::Signalled(sig) => (
            AttemptOutcome::Retryable,
            format!(
                "the run-manager was stopped by {}",
                worker::signal_name(sig)
            ),
            Some(Error::Interrupted(sig)),
        ),
        RunEnd::Lost(lost) => return Ok(abandon(job_id, lost)),
    };
    let job_state = finish(client, &cfg.rpc, lease, outcome, &message).await?;
    tracing::info!(job_id = %job_id, outcome = ?outcome, job_state = job_state.as_deref().unwrap_or("?"), reason = %message, "attempt finished");
    Ok(AttemptResult {
        job_id: job_id.clone(),
        outcome: Some(outcome),
        message,
        job_state,
        stop,
    })
}

/// An attempt whose lease was lost: logged, no FinishAttempt; a refused token stops the run-manager.
fn abandon(job_id: &str, lost: LeaseLost) -> AttemptResult {
    let stop = lost.stop_error(job_id);
    let message = match &lost {
        LeaseLost::Stale(m) => {
            tracing::warn!(job_id = %job_id, "lease is stale (ABORTED): {m}; abandoning the attempt");
            m.clone()
        }
        LeaseLost::Refused { call, status } => {
            tracing::error!(job_id = %job_id, call, code = ?status.code(), "the coordinator refused this provider's token: {}; abandoning the attempt without FinishAttempt", status.message());
            status.message().to_string()
        }
    };
    AttemptResult {
        job_id: job_id.to_string(),
        outcome: None,
        message,
        job_state: None,
        stop,
    }
}

/// Send FinishAttempt; returns the job state, or None when the lease was
/// stale; a refused token is [`Error::TokenRefused`].
async fn finish(
    client: &ProviderClient,
    rpc: &RetryPolicy,
    lease: &Lease,
    outcome: AttemptOutcome,
    message: &str,
) -> Result<Option<String>> {
    let req = FinishAttemptRequest {
        lease_id: lease.lease_id.clone(),
        outcome: outcome as i32,
        message: message.chars().take(4096).collect(),
    };
    let res = retry(rpc, "FinishAttempt", || {
        let mut c = client.clone();
        let r = req.clone();
        async move { c.finish_attempt(r).await }
    })
    .await;
    match res {
        Ok(resp) => Ok(Some(resp.job_state)),
        Err(Error::Rpc { call, status }) => match LeaseLost::of(call, &status) {
            Some(LeaseLost::Stale(m)) => {
                tracing::warn!(job_id = %lease.job_id, "lease is no longer valid; the coordinator already moved on: {m}");
                Ok(None)
            }
            Some(lost) => {
                let stop = lost.stop_error(&lease.job_id);
                Err(stop.unwrap_or(Error::Rpc { call, status }))
            }
            None => Err(Error::Rpc { call, status }),
        },
        Err(e) => Err(e),
    }
}

/// Await `fut` unless CANCEL, a lost lease or a shutdown signal comes first
/// (CHECKPOINT_NOW has no worker to reach here and is dropped).
async fn interruptible<T>(
    signals: &mut mpsc::Receiver<HbSignal>,
    shutdown: &mut Shutdown,
    fut: impl std::future::Future<Output = T>,
) -> std::result::Result<T, RunEnd> {
    tokio::pin!(fut);
    loop {
        tokio::select! {
            v = &mut fut => return Ok(v),
            Some(s) = signals.recv() => match s {
                HbSignal::Cancel => return Err(RunEnd::Cancelled),
                HbSignal::Lost(lost) => return Err(RunEnd::Lost(lost)),
                HbSignal::CheckpointNow => {}
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
    /// Rewritten (restart, resume checkpoint) before every start.
    spec_file: JobSpecFile,
    /// The next heartbeat: the worker's latest progress.
    progress: watch::Sender<HeartbeatRequest>,
    /// Directives from the heartbeat task.
    signals: mpsc::Receiver<HbSignal>,
    shutdown: &'a mut Shutdown,
    /// Checkpoint a (re)started worker resumes from (its `manifest.json`), and its step.
    resume: Option<(PathBuf, u64)>,
    cancel_requested: bool,
    /// Set once the lease is lost (the worker is then killed, nothing more reported).
    lost: Option<LeaseLost>,
    shutdown_signal: Option<i32>,
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

impl Supervisor<'_> {
    /// Prepare the launch once, then start the worker, restarting it after a
    /// crash (with backoff) until it ends some other way or the budget is spent.
    async fn run(&mut self) -> Result<RunEnd> {
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
            // The worker has exited: a lease found lost leaves nothing to kill.
            self.on_event(ev, &mut run).await;
        }
        output.logs.finish(LOG_FLUSH_TIMEOUT).await;
        launch.cleanup().await;
        let how = describe_exit(&status);
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
                Some(ev) = events.recv() => {
                    if self.on_event(ev, run).await {
                        launch.kill();
                    }
                }
                Some(s) = self.signals.recv() => self.on_directive(s, launch, run),
                sig = signalled(self.shutdown), if self.shutdown_signal.is_none() => {
                    tracing::warn!(job_id = %self.lease.job_id, "received {}: asking the worker to checkpoint and stop (SIGTERM)", worker::signal_name(sig));
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

    /// Handle one worker event, live or drained after exit; true when
    /// reporting an artifact found the lease lost.
    async fn on_event(&mut self, ev: WorkerEvent, run: &mut WorkerRun) -> bool {
        let job_id = &self.lease.job_id;
        match ev {
            WorkerEvent::Progress(p) => self.progress.send_modify(|req| apply_progress(req, &p)),
            WorkerEvent::Artifact(a) => return self.on_artifact(&a).await,
            WorkerEvent::Done => run.saw_done = true,
            WorkerEvent::Stopped { committed_step } => {
                tracing::info!(job_id = %job_id, committed_step = committed_step.unwrap_or(0), "worker stopped after committing a checkpoint");
            }
            WorkerEvent::Error { message, retryable } => {
                tracing::error!(job_id = %job_id, retryable, "worker reported: {message}");
                run.error_event = Some((message, retryable));
            }
        }
        false
    }

    /// Verify and report one artifact. A verified checkpoint (its
    /// `manifest.json`) is what the next start resumes from, and its step the
    /// heartbeat's `committed_step`, even when the coordinator did not record
    /// it. Nothing is reported once the lease is lost; true when it turned out so.
    async fn on_artifact(&mut self, a: &ArtifactEvent) -> bool {
        if self.lost.is_some() {
            return false;
        }
        let verified = match artifact::verify(&self.job_dir, a).await {
            Ok(v) => v,
            Err(message) => {
                tracing::error!(job_id = %self.lease.job_id, artifact = %a.name, "{message}");
                return false;
            }
        };
        let reporter = Reporter {
            client: self.client,
            rpc: &self.cfg.rpc,
            lease: self.lease,
            inline_max_bytes: self.cfg.inline_max_bytes,
        };
        match reporter.report(a, &verified).await {
            Reported::Lost(lost) => {
                log_lost(&self.lease.job_id, &lost);
                self.lost = Some(lost);
                return true;
            }
            Reported::Unreadable => return false,
            Reported::Recorded | Reported::NotRecorded => {}
        }
        if a.kind == "checkpoint" {
            self.progress
                .send_modify(|req| req.committed_step = req.committed_step.max(a.step));
            self.resume = Some((verified.path, a.step));
        }
        false
    }

    /// Act on a directive from the coordinator.
    fn on_directive(&mut self, s: HbSignal, launch: &Launch, run: &mut WorkerRun) {
        let job_id = &self.lease.job_id;
        match s {
            HbSignal::Cancel => {
                if !self.cancel_requested {
                    tracing::info!(job_id = %job_id, "CANCEL from the coordinator: asking the worker to checkpoint and stop (SIGTERM)");
                    self.cancel_requested = true;
                    self.stop_worker(launch, run);
                }
            }
            HbSignal::CheckpointNow => {
                tracing::info!(job_id = %job_id, "CHECKPOINT_NOW from the coordinator (SIGUSR1)");
                launch.checkpoint();
            }
            HbSignal::Lost(lost) => {
                log_lost(job_id, &lost);
                self.lost = Some(lost);
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
