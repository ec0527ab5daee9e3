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
//!   killed and the attempt is abandoned without FinishAttempt.

use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, watch};
use tokio_stream::wrappers::ReceiverStream;

use crate::backoff::Backoff;
use crate::client::{retry, ProviderClient, RetryPolicy};
use crate::docker::{self, Container, DockerConfig};
use crate::error::{Error, Result};
use crate::events::{ArtifactEvent, Progress, WorkerEvent};
use crate::jobdir::{hash_file, parse_spec, JobSpecFile};
use crate::paths::{check_id, file_uri, path_from_file_uri, resolve_inside};
use crate::policy::{preflight, Decision, PolicyContext};
use crate::proto::{
    Artifact, AttemptOutcome, Directive, FinishAttemptRequest, HeartbeatRequest, Lease, Phase,
    ReportArtifactRequest,
};
use crate::worker::{self, describe_exit, LogTags, WorkerCommand};

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
    /// None when the lease went stale and no FinishAttempt was sent.
    pub outcome: Option<AttemptOutcome>,
    pub message: String,
    /// Job state after FinishAttempt, as the coordinator reported it.
    pub job_state: Option<String>,
    /// Set when the run-manager must stop after this attempt (exit 10, signal).
    pub stop: Option<Error>,
}

/// Signals from the heartbeat task to the supervisor.
#[derive(Debug, Clone, PartialEq)]
enum HbSignal {
    Cancel,
    CheckpointNow,
    Aborted(String),
}

/// Map a worker phase name to the proto enum.
pub fn phase_from_name(name: &str) -> Phase {
    match name {
        "starting" => Phase::Starting,
        "prepare" => Phase::Prepare,
        "check" => Phase::Check,
        "capture" => Phase::Capture,
        "train" => Phase::Train,
        "export" => Phase::Export,
        "evaluate" => Phase::Evaluate,
        "finishing" => Phase::Finishing,
        _ => Phase::Unspecified,
    }
}

fn apply_progress(req: &mut HeartbeatRequest, p: &Progress) {
    req.phase = phase_from_name(&p.phase) as i32;
    req.step = p.step;
    req.total_steps = p.total_steps;
    req.metrics = p.metrics.iter().map(|(k, v)| (k.clone(), *v)).collect();
    if let Some(c) = p.committed_step {
        req.committed_step = c;
    }
}

/// Keeps one Heartbeat stream open while the attempt runs: sends the latest
/// progress every `interval` (renewing the lease) and soon after it changes,
/// forwards CANCEL / CHECKPOINT_NOW, reports ABORTED, and reopens the stream
/// with backoff when the coordinator drops it. Ends when `progress`'s sender
/// is dropped.
async fn heartbeat_task(
    mut client: ProviderClient,
    mut progress: watch::Receiver<HeartbeatRequest>,
    out: mpsc::Sender<HbSignal>,
    interval: Duration,
    backoff: Backoff,
) {
    let min_gap = interval.min(Duration::from_secs(1));
    let mut failures = 0u32;
    loop {
        let (tx, rx) = mpsc::channel::<HeartbeatRequest>(8);
        let first = progress.borrow_and_update().clone();
        if tx.send(first).await.is_err() {
            return;
        }
        let mut last_sent = Instant::now();
        match client
            .heartbeat(tonic::Request::new(ReceiverStream::new(rx)))
            .await
        {
            Err(status) => {
                if status.code() == tonic::Code::Aborted {
                    let _ = out
                        .send(HbSignal::Aborted(status.message().to_string()))
                        .await;
                    return;
                }
                tracing::warn!(code = ?status.code(), "heartbeat stream failed to open: {}", status.message());
                failures += 1;
            }
            Ok(resp) => {
                let mut inbound = resp.into_inner();
                let mut ticker = tokio::time::interval(interval);
                ticker.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
                ticker.tick().await;
                // A progress change inside `min_gap` of the last send is sent when the gap ends.
                let mut pending = false;
                loop {
                    let flush_at = tokio::time::Instant::from_std(last_sent + min_gap);
                    let send_now = tokio::select! {
                        _ = ticker.tick() => true,
                        changed = progress.changed() => {
                            if changed.is_err() { return; }
                            progress.borrow_and_update();
                            pending = true;
                            last_sent.elapsed() >= min_gap
                        }
                        _ = tokio::time::sleep_until(flush_at), if pending => true,
                        msg = inbound.message() => match msg {
                            Ok(Some(resp)) => {
                                failures = 0;
                                let signal = match Directive::try_from(resp.directive) {
                                    Ok(Directive::Cancel) => Some(HbSignal::Cancel),
                                    Ok(Directive::CheckpointNow) => Some(HbSignal::CheckpointNow),
                                    _ => None,
                                };
                                if let Some(s) = signal {
                                    if out.send(s).await.is_err() { return; }
                                }
                                false
                            }
                            Ok(None) => {
                                tracing::debug!("coordinator closed the heartbeat stream; reopening");
                                break;
                            }
                            Err(status) => {
                                if status.code() == tonic::Code::Aborted {
                                    let _ = out.send(HbSignal::Aborted(status.message().to_string())).await;
                                    return;
                                }
                                tracing::warn!(code = ?status.code(), "heartbeat stream broke: {}", status.message());
                                failures += 1;
                                break;
                            }
                        }
                    };
                    if send_now {
                        let req = progress.borrow().clone();
                        if tx.send(req).await.is_err() {
                            break;
                        }
                        last_sent = Instant::now();
                        pending = false;
                    }
                }
            }
        }
        let delay = backoff.delay(failures.saturating_sub(1));
        tokio::select! {
            _ = tokio::time::sleep(delay) => {}
            changed = progress.changed() => if changed.is_err() { return; }
        }
    }
}

/// Send FinishAttempt; returns the job state, or None when the lease was stale.
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
        Err(Error::Rpc { status, .. }) if status.code() == tonic::Code::Aborted => {
            tracing::warn!(job_id = %lease.job_id, "lease is no longer valid; the coordinator already moved on: {}", status.message());
            Ok(None)
        }
        Err(e) => Err(e),
    }
}

enum ArtifactOutcome {
    Reported,
    Rejected,
    Stale(String),
}

/// Verify an artifact the worker announced and report it to the coordinator.
async fn report_artifact(
    client: &ProviderClient,
    cfg: &AttemptConfig,
    lease: &Lease,
    job_dir: &Path,
    a: &ArtifactEvent,
) -> (ArtifactOutcome, Option<PathBuf>) {
    let job = &lease.job_id;
    let path = match resolve_inside(job_dir, Path::new(&a.path)) {
        Ok(p) => p,
        Err(e) => {
            tracing::error!(job_id = %job, artifact = %a.name, "refused artifact: {e}");
            return (ArtifactOutcome::Rejected, None);
        }
    };
    let p2 = path.clone();
    let hashed = tokio::task::spawn_blocking(move || hash_file(&p2)).await;
    let (sha, size) = match hashed {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => {
            tracing::error!(job_id = %job, artifact = %a.name, "cannot read artifact `{}`: {e}", path.display());
            return (ArtifactOutcome::Rejected, None);
        }
        Err(e) => {
            tracing::error!(job_id = %job, artifact = %a.name, "hashing artifact failed: {e}");
            return (ArtifactOutcome::Rejected, None);
        }
    };
    if sha != a.sha256 || size != a.size_bytes {
        tracing::error!(
            job_id = %job, artifact = %a.name,
            "refused artifact `{}`: the worker claimed sha256 `{}` and {} bytes, the file has sha256 `{sha}` and {size} bytes",
            path.display(), a.sha256, a.size_bytes
        );
        return (ArtifactOutcome::Rejected, None);
    }
    let inline = cfg.inline_max_bytes > 0 && size <= cfg.inline_max_bytes;
    let content = if inline {
        match tokio::fs::read(&path).await {
            Ok(b) => b,
            Err(e) => {
                tracing::error!(job_id = %job, artifact = %a.name, "cannot read artifact `{}`: {e}", path.display());
                return (ArtifactOutcome::Rejected, None);
            }
        }
    } else {
        Vec::new()
    };
    let req = ReportArtifactRequest {
        lease_id: lease.lease_id.clone(),
        artifact: Some(Artifact {
            name: a.name.clone(),
            kind: a.kind.clone(),
            sha256: sha.clone(),
            size_bytes: size,
            uri: if inline {
                String::new()
            } else {
                file_uri(&path)
            },
            step: a.step,
        }),
        content,
    };
    let res = retry(&cfg.rpc, "ReportArtifact", || {
        let mut c = client.clone();
        let r = req.clone();
        async move { c.report_artifact(r).await }
    })
    .await;
    match res {
        Ok(resp) => {
            let uri = resp.artifact.map(|a| a.uri).unwrap_or_default();
            tracing::info!(job_id = %job, artifact = %a.name, kind = %a.kind, sha256 = %sha, size_bytes = size, %uri, "artifact reported");
            (ArtifactOutcome::Reported, Some(path))
        }
        Err(Error::Rpc { status, .. }) if status.code() == tonic::Code::Aborted => {
            (ArtifactOutcome::Stale(status.message().to_string()), None)
        }
        // The file is verified: a restarted worker may still resume from it
        // even though the coordinator did not record it.
        Err(e) => {
            tracing::error!(job_id = %job, artifact = %a.name, "{e}");
            (ArtifactOutcome::Rejected, Some(path))
        }
    }
}

/// Where the attempt stands after one worker run.
enum RunEnd {
    Succeeded,
    Failed(String),
    Cancelled,
    /// The worker crashed or ended without `done`; restart if the budget allows.
    Crashed(String),
    Stale(String),
    Signalled(i32),
}

/// Mutable state shared across the worker runs of one attempt.
struct Supervision {
    /// Checkpoint a (re)started worker resumes from, and its step.
    resume: Option<(PathBuf, u64)>,
    cancel_requested: bool,
    stale: Option<String>,
    shutdown_signal: Option<i32>,
}

/// Run one lease to its end. Errors are only returned for failures of the
/// run-manager itself (e.g. it cannot write the job directory).
pub async fn run_attempt(
    client: &ProviderClient,
    cfg: &AttemptConfig,
    lease: Lease,
    shutdown: &mut watch::Receiver<Option<i32>>,
) -> Result<AttemptResult> {
    let job_id = lease.job_id.clone();
    tracing::info!(run_id = %lease.run_id, job_id = %job_id, attempt = lease.attempt, "lease acquired");
    let done = |outcome: Option<AttemptOutcome>,
                message: String,
                job_state: Option<String>,
                stop: Option<Error>| {
        AttemptResult {
            job_id: lease.job_id.clone(),
            outcome,
            message,
            job_state,
            stop,
        }
    };

    // Preflight.
    let (local_ranks, downgrades) = match preflight(&lease, &cfg.policy) {
        Decision::Run {
            local_ranks,
            downgrades,
        } => {
            for d in &downgrades {
                tracing::warn!(job_id = %job_id, "downgrade: {} -> {} ({})", d.feature, d.replacement, d.reason);
            }
            (local_ranks, downgrades)
        }
        Decision::Refuse { outcome, message } => {
            tracing::error!(job_id = %job_id, "refusing the lease: {message}");
            let state = finish(client, &cfg.rpc, &lease, outcome, &message).await?;
            return Ok(done(Some(outcome), message, state, None));
        }
        Decision::UpgradeRequired { required, message } => {
            tracing::error!(job_id = %job_id, "{message}");
            let state = finish(
                client,
                &cfg.rpc,
                &lease,
                AttemptOutcome::Retryable,
                &message,
            )
            .await?;
            let stop = Error::UpgradeRequired {
                required,
                have: cfg.policy.worker_version.clone(),
                message: message.clone(),
            };
            return Ok(done(
                Some(AttemptOutcome::Retryable),
                message,
                state,
                Some(stop),
            ));
        }
    };
    let spec = match parse_spec(&lease.spec_json).and_then(|s| {
        check_id(&lease.job_id)
            .map(|_| s)
            .map_err(|e| e.to_string())
    }) {
        Ok(s) => s,
        Err(message) => {
            tracing::error!(job_id = %job_id, "refusing the lease: {message}");
            let state = finish(client, &cfg.rpc, &lease, AttemptOutcome::Failed, &message).await?;
            return Ok(done(Some(AttemptOutcome::Failed), message, state, None));
        }
    };

    // Docker launch mode: the image this lease runs in.
    let image = match cfg
        .docker
        .as_ref()
        .map(|d| docker::image_for_lease(&lease, &d.repository))
    {
        None => None,
        Some(Ok(image)) => Some(image),
        Some(Err(message)) => {
            tracing::error!(job_id = %job_id, "refusing the lease: {message}");
            let state = finish(client, &cfg.rpc, &lease, AttemptOutcome::Failed, &message).await?;
            return Ok(done(Some(AttemptOutcome::Failed), message, state, None));
        }
    };

    // Job directory.
    let job_dir = cfg.work_dir.join("jobs").join(&lease.job_id);
    std::fs::create_dir_all(&job_dir)
        .map_err(Error::io("cannot create job directory", &job_dir))?;
    let job_dir = job_dir
        .canonicalize()
        .map_err(Error::io("cannot resolve job directory", &job_dir))?;
    let mut sup = Supervision {
        resume: None,
        cancel_requested: false,
        stale: None,
        shutdown_signal: None,
    };
    if let Some(ckpt) = &lease.resume_checkpoint {
        match path_from_file_uri(&ckpt.uri) {
            Ok(p) if p.is_file() => {
                tracing::info!(job_id = %job_id, step = ckpt.step, "resuming from `{}`", p.display());
                sup.resume = Some((p, ckpt.step));
            }
            Ok(p) => {
                tracing::warn!(job_id = %job_id, "resume checkpoint `{}` is not on this machine; starting from the beginning", p.display())
            }
            Err(e) => {
                tracing::warn!(job_id = %job_id, "cannot use resume checkpoint: {e}; starting from the beginning")
            }
        }
    }

    // Heartbeats.
    let initial = HeartbeatRequest {
        lease_id: lease.lease_id.clone(),
        phase: Phase::Starting as i32,
        committed_step: sup.resume.as_ref().map(|r| r.1).unwrap_or(0),
        ..Default::default()
    };
    let (progress_tx, progress_rx) = watch::channel(initial);
    let (hb_tx, mut hb_rx) = mpsc::channel(16);
    let hb_task = tokio::spawn(heartbeat_task(
        client.clone(),
        progress_rx,
        hb_tx,
        cfg.heartbeat_interval,
        cfg.rpc.backoff,
    ));

    let mut spec_file = JobSpecFile::new(
        &lease,
        spec,
        &job_dir,
        &cfg.policy.capabilities,
        local_ranks,
        downgrades,
    );
    let mut restarts = 0u32;
    // Docker: pull the image once per attempt (heartbeats keep the lease alive meanwhile).
    let mut pulled = match (&cfg.docker, &image) {
        (Some(d), Some(img)) => pull_image(d, img, &job_id, &mut hb_rx, shutdown).await,
        _ => None,
    };
    let end = loop {
        if let Some(end) = pulled.take() {
            break end;
        }
        spec_file.restart = restarts;
        spec_file.resume_checkpoint = sup.resume.as_ref().map(|r| r.0.clone());
        spec_file.resume_step = sup.resume.as_ref().map(|r| r.1).unwrap_or(0);
        spec_file.write()?;
        let end = run_worker_once(
            client,
            cfg,
            &lease,
            &job_dir,
            image.as_deref(),
            restarts,
            &progress_tx,
            &mut hb_rx,
            shutdown,
            &mut sup,
        )
        .await?;
        let RunEnd::Crashed(why) = end else { break end };
        restarts += 1;
        if restarts > cfg.max_restarts {
            break RunEnd::Crashed(format!("worker failed {restarts} time(s); last: {why}"));
        }
        let delay = cfg.restart_backoff.delay(restarts - 1);
        tracing::warn!(
            job_id = %job_id, restart = restarts, max_restarts = cfg.max_restarts, delay_ms = delay.as_millis() as u64,
            "worker {why}; restarting from {}",
            sup.resume.as_ref().map(|r| format!("checkpoint at step {}", r.1)).unwrap_or_else(|| "the beginning".into())
        );
        // Wait out the backoff, but still obey CANCEL, staleness and signals.
        let deadline = tokio::time::Instant::now() + delay;
        let interrupted = loop {
            tokio::select! {
                _ = tokio::time::sleep_until(deadline) => break None,
                Some(s) = hb_rx.recv() => match s {
                    HbSignal::Cancel => break Some(RunEnd::Cancelled),
                    HbSignal::Aborted(m) => break Some(RunEnd::Stale(m)),
                    HbSignal::CheckpointNow => {}
                },
                sig = wait_shutdown(shutdown) => break Some(RunEnd::Signalled(sig)),
            }
        };
        if let Some(e) = interrupted {
            break e;
        }
    };
    drop(progress_tx);
    hb_task.abort();

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
        RunEnd::Stale(m) => {
            tracing::warn!(job_id = %job_id, "lease is stale (ABORTED): {m}; abandoning the attempt");
            return Ok(done(None, m, None, None));
        }
    };
    let state = finish(client, &cfg.rpc, &lease, outcome, &message).await?;
    tracing::info!(job_id = %job_id, outcome = ?outcome, job_state = state.as_deref().unwrap_or("?"), reason = %message, "attempt finished");
    Ok(done(Some(outcome), message, state, stop))
}

/// Resolves when a shutdown signal has been received (never otherwise).
async fn wait_shutdown(shutdown: &mut watch::Receiver<Option<i32>>) -> i32 {
    loop {
        if let Some(sig) = *shutdown.borrow_and_update() {
            return sig;
        }
        if shutdown.changed().await.is_err() {
            // The sender is gone: no signal can arrive any more.
            std::future::pending::<()>().await;
        }
    }
}

/// Pull `image`, still obeying CANCEL, a stale lease and shutdown signals.
/// Returns how the attempt ends when it cannot go on, None when pulled.
async fn pull_image(
    d: &DockerConfig,
    image: &str,
    job_id: &str,
    hb_rx: &mut mpsc::Receiver<HbSignal>,
    shutdown: &mut watch::Receiver<Option<i32>>,
) -> Option<RunEnd> {
    tracing::info!(job_id = %job_id, %image, "pulling the image");
    let pull = docker::pull(d, image);
    tokio::pin!(pull);
    loop {
        tokio::select! {
            r = &mut pull => return match r {
                Ok(()) => None,
                // Another provider (or a later try) may reach the registry: RETRYABLE.
                Err(m) => Some(RunEnd::Crashed(m)),
            },
            Some(s) = hb_rx.recv() => match s {
                HbSignal::Cancel => return Some(RunEnd::Cancelled),
                HbSignal::Aborted(m) => return Some(RunEnd::Stale(m)),
                HbSignal::CheckpointNow => {}
            },
            sig = wait_shutdown(shutdown) => return Some(RunEnd::Signalled(sig)),
        }
    }
}

/// The `docker run` command for one worker start, and the container it names.
fn docker_command(
    d: &DockerConfig,
    image: &str,
    lease: &Lease,
    job_dir: &Path,
    restart: u32,
    resume: Option<&Path>,
) -> (WorkerCommand, Container) {
    let name = docker::container_name(&lease.job_id, lease.attempt, restart);
    // A resume checkpoint from elsewhere on this machine must be visible inside too.
    let extra_file = resume.filter(|p| !p.starts_with(job_dir)).filter(|p| {
        let ok = docker::check_mount_path(p).is_ok();
        if !ok {
            tracing::warn!(job_id = %lease.job_id, "cannot mount resume checkpoint `{}` into the container", p.display());
        }
        ok
    });
    let req = docker::RunRequest {
        name: &name,
        image,
        job_dir,
        run_id: &lease.run_id,
        job_id: &lease.job_id,
        attempt: lease.attempt,
        extra_file,
    };
    let args = docker::run_args(d, &req)
        .into_iter()
        .map(|a| a.to_string_lossy().into_owned())
        .collect();
    (
        WorkerCommand {
            program: d.program.clone(),
            args,
        },
        Container {
            program: d.program.clone(),
            name,
        },
    )
}

/// Start the worker once and supervise it until it exits.
#[allow(clippy::too_many_arguments)]
async fn run_worker_once(
    client: &ProviderClient,
    cfg: &AttemptConfig,
    lease: &Lease,
    job_dir: &Path,
    image: Option<&str>,
    restart: u32,
    progress_tx: &watch::Sender<HeartbeatRequest>,
    hb_rx: &mut mpsc::Receiver<HbSignal>,
    shutdown: &mut watch::Receiver<Option<i32>>,
    sup: &mut Supervision,
) -> Result<RunEnd> {
    let tags = LogTags {
        run_id: lease.run_id.clone(),
        job_id: lease.job_id.clone(),
        attempt: lease.attempt,
        rank: 0,
    };
    let job_id = &lease.job_id;
    let (command, container) = match (&cfg.docker, image) {
        (Some(d), Some(img)) => {
            let resume = sup.resume.as_ref().map(|r| r.0.as_path());
            let (c, k) = docker_command(d, img, lease, job_dir, restart, resume);
            // A container of this name left by a run-manager that died would block the start.
            k.remove().await;
            (c, Some(k))
        }
        _ => (cfg.worker.clone(), None),
    };
    // `docker stop` SIGKILLs after the grace period itself; allow it time to do so.
    let grace = match &container {
        Some(_) => cfg.grace + Duration::from_secs(10),
        None => cfg.grace,
    };
    let w = match worker::spawn(&command, job_dir, tags) {
        Ok(w) => w,
        // A worker that cannot even start will not start on a retry either,
        // but the job itself is fine: hand it back for another provider.
        Err(e) => return Ok(RunEnd::Crashed(e.to_string())),
    };
    let pid = w.pid;
    match &container {
        Some(k) => {
            tracing::info!(job_id = %job_id, pid, restart, container = %k.name, image = image.unwrap_or(""), "worker started: container `{}`", k.name)
        }
        None => {
            tracing::info!(job_id = %job_id, pid, restart, "worker started: {}", command.program.display())
        }
    }
    // Signals reach a container through docker, a native worker directly.
    let terminate = |container: &Option<Container>| match container {
        Some(k) => k.stop(cfg.grace),
        None => {
            let _ = worker::signal(pid, libc::SIGTERM);
        }
    };
    let kill = |container: &Option<Container>| {
        if let Some(k) = container {
            k.kill();
        }
        let _ = worker::kill_group(pid);
    };
    let mut w = w;
    let mut saw_done = false;
    let mut error_event: Option<(String, bool)> = None;
    let mut kill_at: Option<tokio::time::Instant> = None;
    let handle = |ev: WorkerEvent,
                  saw_done: &mut bool,
                  error_event: &mut Option<(String, bool)>|
     -> Option<ArtifactEvent> {
        match ev {
            WorkerEvent::Progress(p) => {
                progress_tx.send_modify(|req| apply_progress(req, &p));
                None
            }
            WorkerEvent::Artifact(a) => Some(a),
            WorkerEvent::Done => {
                *saw_done = true;
                None
            }
            WorkerEvent::Stopped { committed_step } => {
                tracing::info!(job_id = %job_id, committed_step = committed_step.unwrap_or(0), "worker stopped after committing a checkpoint");
                None
            }
            WorkerEvent::Error { message, retryable } => {
                tracing::error!(job_id = %job_id, retryable, "worker reported: {message}");
                *error_event = Some((message, retryable));
                None
            }
        }
    };

    let status = loop {
        let kill_sleep = async {
            match kill_at {
                Some(t) => tokio::time::sleep_until(t).await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            st = w.child.wait() => break st,
            Some(ev) = w.events.recv() => {
                if let Some(a) = handle(ev, &mut saw_done, &mut error_event) {
                    let (outcome, path) = report_artifact(client, cfg, lease, job_dir, &a).await;
                    match outcome {
                        ArtifactOutcome::Reported | ArtifactOutcome::Rejected => {}
                        ArtifactOutcome::Stale(m) => {
                            sup.stale = Some(m);
                            kill(&container);
                        }
                    }
                    if a.kind == "checkpoint" {
                        if let Some(p) = path {
                            sup.resume = Some((p, a.step));
                            progress_tx.send_modify(|req| req.committed_step = req.committed_step.max(a.step));
                        }
                    }
                }
            }
            Some(s) = hb_rx.recv() => match s {
                HbSignal::Cancel => {
                    if !sup.cancel_requested {
                        tracing::info!(job_id = %job_id, "CANCEL from the coordinator: asking the worker to checkpoint and stop (SIGTERM)");
                        sup.cancel_requested = true;
                        terminate(&container);
                        kill_at = Some(tokio::time::Instant::now() + grace);
                    }
                }
                HbSignal::CheckpointNow => {
                    tracing::info!(job_id = %job_id, "CHECKPOINT_NOW from the coordinator (SIGUSR1)");
                    match &container {
                        Some(k) => k.checkpoint(),
                        None => { let _ = worker::signal(pid, libc::SIGUSR1); }
                    }
                }
                HbSignal::Aborted(m) => {
                    tracing::warn!(job_id = %job_id, "lease is stale: killing the worker");
                    sup.stale = Some(m);
                    kill(&container);
                }
            },
            sig = wait_shutdown(shutdown), if sup.shutdown_signal.is_none() => {
                tracing::warn!(job_id = %job_id, "received {}: asking the worker to checkpoint and stop (SIGTERM)", worker::signal_name(sig));
                sup.shutdown_signal = Some(sig);
                terminate(&container);
                kill_at = Some(tokio::time::Instant::now() + grace);
            }
            _ = kill_sleep => {
                tracing::warn!(job_id = %job_id, grace_s = cfg.grace.as_secs_f64(), "worker did not exit after SIGTERM; killing it");
                kill(&container);
                kill_at = None;
            }
        }
    };
    let status =
        status.map_err(|e| Error::Internal(format!("waiting for the worker failed: {e}")))?;
    // Events written just before exit may still be in the pipe: drain them
    // (bounded, in case a grandchild keeps stdout open).
    let drain_until = tokio::time::Instant::now() + Duration::from_secs(5);
    while let Ok(Some(ev)) = tokio::time::timeout_at(drain_until, w.events.recv()).await {
        if let Some(a) = handle(ev, &mut saw_done, &mut error_event) {
            if sup.stale.is_none() {
                let (outcome, path) = report_artifact(client, cfg, lease, job_dir, &a).await;
                if let ArtifactOutcome::Stale(m) = outcome {
                    sup.stale = Some(m);
                }
                if a.kind == "checkpoint" {
                    if let Some(p) = path {
                        sup.resume = Some((p, a.step));
                    }
                }
            }
        }
    }
    w.finish_logs(Duration::from_secs(2)).await;
    if let Some(k) = &container {
        // `--rm` normally removed it already; a stopped or killed one may linger.
        k.remove().await;
    }
    let how = describe_exit(&status);
    tracing::info!(job_id = %job_id, pid, "worker {how}");

    if let Some(m) = sup.stale.take() {
        return Ok(RunEnd::Stale(m));
    }
    if let Some(sig) = sup.shutdown_signal {
        return Ok(RunEnd::Signalled(sig));
    }
    if sup.cancel_requested {
        return Ok(RunEnd::Cancelled);
    }
    if saw_done && status.success() {
        return Ok(RunEnd::Succeeded);
    }
    if let Some((message, false)) = &error_event {
        return Ok(RunEnd::Failed(message.clone()));
    }
    let why = match (&error_event, saw_done) {
        (Some((m, _)), _) => format!("{how} after a retryable error: {m}"),
        (None, true) => format!("{how} after `done`"),
        (None, false) if status.success() => "exited 0 without a `done` event".to_string(),
        (None, false) => how,
    };
    Ok(RunEnd::Crashed(why))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn phases_map_to_proto() {
        for (i, name) in crate::events::PHASES.iter().enumerate() {
            assert_eq!(phase_from_name(name) as i32, i as i32 + 1, "{name}");
        }
        assert_eq!(phase_from_name("nap"), Phase::Unspecified);
    }

    #[test]
    fn progress_updates_heartbeat_but_keeps_committed_step_when_absent() {
        let mut req = HeartbeatRequest {
            committed_step: 4,
            ..Default::default()
        };
        let mut p = Progress {
            phase: "train".into(),
            step: 7,
            total_steps: 10,
            ..Default::default()
        };
        p.metrics.insert("loss".into(), 1.5);
        apply_progress(&mut req, &p);
        assert_eq!(
            (req.phase, req.step, req.total_steps, req.committed_step),
            (Phase::Train as i32, 7, 10, 4)
        );
        assert_eq!(req.metrics.get("loss"), Some(&1.5));
        p.committed_step = Some(6);
        apply_progress(&mut req, &p);
        assert_eq!(req.committed_step, 6);
    }
}
