//! One job attempt: preflight, job directory, the resume checkpoint, worker
//! supervision with restarts, heartbeats, artifact uploads, and the
//! FinishAttempt that ends it.
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
//! - a graph job's inputs (`crate::graph`): a wrong list (an unsafe name, a
//!   malformed sha256, one name listed with two contents, a name that is the
//!   run-manager's own) -> FAILED naming the input, before anything is
//!   fetched; an input that cannot be downloaded (refused, e.g. NOT_FOUND, or
//!   bytes that do not hash right) -> RETRYABLE with the reason, the worker
//!   never started;
//! - the run-manager itself got SIGINT/SIGTERM -> SIGTERM to the worker, wait
//!   for it, RETRYABLE so the job is requeued at once;
//! - the coordinator answered ABORTED (the lease is stale) -> the worker is
//!   killed and the attempt is abandoned without FinishAttempt;
//! - the coordinator refused this provider's token (UNAUTHENTICATED /
//!   PERMISSION_DENIED on a reopened Heartbeat stream, an artifact transfer or
//!   FinishAttempt: revoked, or rotated past its grace) -> the same, and the
//!   run-manager exits 1 ([`Error::TokenRefused`]);
//! - the coordinator refused an upload (INVALID_ARGUMENT, ALREADY_EXISTS,
//!   RESOURCE_EXHAUSTED, FAILED_PRECONDITION, NOT_FOUND) -> the worker is
//!   killed, FAILED with the refusal; an artifact that cannot be read any more
//!   -> RETRYABLE; the coordinator unavailable until the lease would expire ->
//!   abandoned like a stale lease.
//!
//! Uploads run on `crate::upload`'s queue, in announcement order, while the
//! worker runs; FinishAttempt goes only once the queue has drained (heartbeats
//! keep the lease alive meanwhile), so a SUCCEEDED attempt's artifacts are
//! all recorded.
//!
//! Structure: [`run_attempt`] admits the lease (or [`refuse`]s it, the one
//! way a lease is turned down), then a [`Supervisor`] holds everything an
//! attempt shares across worker starts (client, config, lease, job directory,
//! heartbeat channels, shutdown, resume checkpoint) and runs one start per
//! [`Supervisor::run_once`]. How a worker is started and signalled (native or
//! container) is `crate::launch`'s; heartbeats are `crate::heartbeat`'s;
//! artifact checks are `crate::artifact`'s, uploads `crate::upload`'s, the
//! downloads `crate::fetch`'s (the resume checkpoint: `crate::resume`; a graph
//! job's inputs: `crate::graph`).

use std::path::{Path, PathBuf};
use std::process::ExitStatus;
use std::time::Duration;

use tokio::sync::{mpsc, watch};
use tokio::time::Instant;

use crate::artifact::{self, LocalArtifact};
use crate::backoff::Backoff;
use crate::client::{retry_until, ProviderClient, RetryPolicy};
use crate::docker::DockerConfig;
use crate::error::{Error, Result};
use crate::events::{ArtifactEvent, WorkerEvent};
use crate::fetch::{FetchError, Fetcher};
use crate::graph;
use crate::heartbeat::{apply_progress, heartbeat_task, Pace};
use crate::jobdir::{parse_spec, GraphInfo, JobSpecFile};
use crate::launch::{Launch, Launcher};
use crate::lease_lost::LeaseLost;
use crate::paths::check_id;
use crate::policy::{preflight, Decision, Downgrade, PolicyContext};
use crate::proto::{
    Artifact, AttemptOutcome, FinishAttemptRequest, HeartbeatRequest, Lease, Phase,
};
use crate::ranks::RankPlan;
use crate::shutdown::{next_signal, signalled, Shutdown};
use crate::signal::{Signal, UploadFailure};
use crate::transfer::LeaseClock;
use crate::upload::{UploadQueue, Uploader};
use crate::worker::{self, WorkerCommand};

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
}

/// Lease TTL assumed when a lease names none.
const DEFAULT_LEASE_TTL: Duration = Duration::from_secs(60);

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
    /// The verified artifacts and where they are on this machine.
    pub local_artifacts: Vec<LocalArtifact>,
}

/// Where the attempt stands after one worker run.
enum RunEnd {
    Succeeded,
    Failed(String),
    Cancelled,
    /// The worker crashed or ended without `done`; restart if the budget allows.
    Crashed(String),
    /// RETRYABLE without a restart (an artifact could not be uploaded from here).
    Retryable(String),
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
    /// The lease's inputs, checked, each once (`graph::plan`).
    inputs: Vec<Artifact>,
}

/// Preflight, spec, inputs and image checks, in that order; the first that fails refuses the lease.
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
    let inputs = graph::plan(lease).map_err(Refusal::failed)?;
    let plan = RankPlan {
        world: local_ranks,
        cpu: cfg.policy.capabilities.backend == "cpu",
    };
    let launcher = Launcher::for_lease(&cfg.worker, cfg.docker.as_ref(), lease, plan)
        .map_err(Refusal::failed)?;
    Ok(Admission {
        spec,
        local_ranks,
        downgrades,
        launcher,
        inputs,
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
    let until = tokio::time::Instant::now() + lease_ttl(lease);
    let job_state = finish(client, &cfg.rpc, until, lease, r.outcome, &r.message).await?;
    Ok(AttemptResult {
        job_id: lease.job_id.clone(),
        outcome: Some(r.outcome),
        message: r.message,
        job_state,
        stop: r.stop,
        local_artifacts: Vec::new(),
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

/// How long the lease lives without a heartbeat.
fn lease_ttl(lease: &Lease) -> Duration {
    match lease.ttl_seconds {
        0 => DEFAULT_LEASE_TTL,
        s => Duration::from_secs(u64::from(s)),
    }
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

/// Send the FinishAttempt that `end` calls for (none for a lost lease).
async fn conclude(
    client: &ProviderClient,
    cfg: &AttemptConfig,
    until: Instant,
    lease: &Lease,
    end: RunEnd,
) -> Result<AttemptResult> {
    let job_id = &lease.job_id;
    let (outcome, message, stop) = match outcome_of(end) {
        Ok(o) => o,
        Err(lost) => return Ok(abandon(job_id, lost)),
    };
    let job_state = finish(client, &cfg.rpc, until, lease, outcome, &message).await?;
    tracing::info!(job_id = %job_id, outcome = ?outcome, job_state = job_state.as_deref().unwrap_or("?"), reason = %message, "attempt finished");
    Ok(AttemptResult {
        job_id: job_id.clone(),
        outcome: Some(outcome),
        message,
        job_state,
        stop,
        local_artifacts: Vec::new(),
    })
}

/// The outcome, message and stop error `end` reports; Err for a lost lease (nothing is reported).
fn outcome_of(
    end: RunEnd,
) -> std::result::Result<(AttemptOutcome, String, Option<Error>), LeaseLost> {
    Ok(match end {
        RunEnd::Succeeded => (AttemptOutcome::Succeeded, String::new(), None),
        RunEnd::Failed(m) => (AttemptOutcome::Failed, m, None),
        RunEnd::Cancelled => (
            AttemptOutcome::Cancelled,
            "cancelled by the coordinator".to_string(),
            None,
        ),
        RunEnd::Crashed(m) | RunEnd::Retryable(m) => (AttemptOutcome::Retryable, m, None),
        RunEnd::Signalled(sig) => (
            AttemptOutcome::Retryable,
            format!(
                "the run-manager was stopped by {}",
                worker::signal_name(sig)
            ),
            Some(Error::Interrupted(sig)),
        ),
        RunEnd::Lost(lost) => return Err(lost),
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
        local_artifacts: Vec::new(),
    }
}

/// Send FinishAttempt (UNAVAILABLE retried until `until`, when the lease
/// would expire); returns the job state, or None when the lease was stale; a
/// refused token is [`Error::TokenRefused`].
async fn finish(
    client: &ProviderClient,
    rpc: &RetryPolicy,
    until: Instant,
    lease: &Lease,
    outcome: AttemptOutcome,
    message: &str,
) -> Result<Option<String>> {
    let req = FinishAttemptRequest {
        lease_id: lease.lease_id.clone(),
        outcome: outcome as i32,
        message: message.chars().take(4096).collect(),
    };
    let res = retry_until(rpc, until, "FinishAttempt", || {
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

/// What a failed upload makes of the attempt.
fn failed_upload(failure: UploadFailure) -> RunEnd {
    match failure {
        UploadFailure::Lost(lost) => RunEnd::Lost(lost),
        refused @ UploadFailure::Refused { .. } => RunEnd::Failed(refused.to_string()),
        local @ UploadFailure::Local { .. } => RunEnd::Retryable(local.to_string()),
    }
}

/// What inputs that could not be made local make of the attempt: the worker
/// never starts without them; another try may find them.
fn failed_inputs(e: FetchError) -> RunEnd {
    match e {
        FetchError::Lost(lost) => RunEnd::Lost(lost),
        FetchError::Unusable(m) => RunEnd::Retryable(m),
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
        let verified = match artifact::verify(&self.job_dir, a).await {
            Ok(v) => v,
            Err(message) => {
                tracing::error!(job_id = %job_id, artifact = %a.name, "{message}");
                return;
            }
        };
        let (item, local) = match artifact::upload_item(&self.job_dir, a, &verified).await {
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
                        tracing::warn!(job_id = %job_id, "received {} while uploading artifacts; not waiting for them", worker::signal_name(sig));
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fetch::testing::{fetcher, input, tmp};
    use crate::transfer::testing::FakeStore;

    fn config() -> AttemptConfig {
        let quick = Backoff::doubling(Duration::from_millis(1), Duration::from_millis(2));
        AttemptConfig {
            work_dir: std::env::temp_dir(),
            worker: WorkerCommand {
                program: PathBuf::from("true"),
                args: vec![],
            },
            docker: None,
            policy: PolicyContext {
                launch_mode: crate::proto::LaunchMode::Native,
                capabilities: crate::proto::DeviceCapabilities {
                    backend: "cpu".into(),
                    device_count: 1,
                    features: vec!["cpu".into(), crate::device::JOB_GRAPH_FEATURE.into()],
                    ..Default::default()
                },
                worker_version: crate::version::CLIENT_VERSION.into(),
                declared_native_version: None,
            },
            max_restarts: 0,
            restart_backoff: quick,
            rpc: RetryPolicy {
                retries: 1,
                backoff: quick,
            },
            heartbeat_interval: Duration::from_secs(1),
            grace: Duration::from_secs(1),
        }
    }

    fn graph_lease(inputs: Vec<Artifact>) -> Lease {
        Lease {
            lease_id: "lease-1".into(),
            run_id: "run-1".into(),
            job_id: "capture-1".into(),
            attempt: 1,
            spec_json: r#"{"stages": ["capture"]}"#.into(),
            checkpoint_policy: "durable".into(),
            required_features: vec![crate::device::JOB_GRAPH_FEATURE.into()],
            required_client_version: crate::version::CLIENT_VERSION.into(),
            kind: "capture".into(),
            shard_count: 2,
            inputs,
            ..Default::default()
        }
    }

    #[test]
    fn a_graph_lease_is_admitted_with_its_inputs_once_and_wrong_inputs_fail_it() {
        let cfg = config();
        let train = input("data/train.jsonl", b"train");
        let lease = graph_lease(vec![train.clone(), train.clone()]);
        let admitted = admit(&cfg, &lease)
            .map_err(|r| r.message)
            .expect("admitted");
        assert_eq!(admitted.inputs, vec![train.clone()]);
        let conflicting = graph_lease(vec![train.clone(), input("data/train.jsonl", b"other")]);
        let Err(refusal) = admit(&cfg, &conflicting) else {
            panic!("admitted")
        };
        assert_eq!(refusal.outcome, AttemptOutcome::Failed);
        assert!(
            refusal.message.contains("input `data/train.jsonl`"),
            "{}",
            refusal.message
        );
        assert!(refusal.stop.is_none());
    }

    #[tokio::test]
    async fn an_input_that_cannot_be_downloaded_ends_the_attempt_retryable() {
        let dir = tmp("attempt-inputs");
        let store = FakeStore::default();
        let lease = graph_lease(vec![input("data/train.jsonl", b"never offered")]);
        let planned = graph::plan(&lease).expect("plan");
        let err = fetcher(&store, &lease, &dir)
            .inputs(&planned)
            .await
            .expect_err("not found");
        let (outcome, message, stop) = outcome_of(failed_inputs(err)).expect("not lost");
        assert_eq!(outcome, AttemptOutcome::Retryable);
        assert!(
            message.contains("input `data/train.jsonl`") && message.contains("NotFound"),
            "{message}"
        );
        assert!(stop.is_none());
        let lost = failed_inputs(FetchError::Lost(LeaseLost::Stale("gone".into())));
        assert!(matches!(outcome_of(lost), Err(LeaseLost::Stale(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
