//! How an attempt ends: the [`RunEnd`] the supervisor reaches, what it
//! reports ([`outcome_of`]: outcome, message, and whether the run-manager must
//! stop), and the FinishAttempt that reports it ([`conclude`], [`finish`]).
//! A lost lease reports nothing ([`abandon`]).

use tokio::time::Instant;

use super::config::AttemptConfig;
use crate::artifacts::fetch::FetchError;
use crate::artifacts::verify::LocalArtifact;
use crate::coordinator::client::{retry_until, ProviderClient, RetryPolicy};
use crate::error::{Error, Result};
use crate::lease_lost::LeaseLost;
use crate::proto::{AttemptOutcome, FinishAttemptRequest, Lease};
use crate::signal::UploadFailure;
use crate::worker::process;

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
pub(super) enum RunEnd {
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

/// Send the FinishAttempt that `end` calls for (none for a lost lease).
pub(super) async fn conclude(
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
pub(super) fn outcome_of(
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
                process::signal_name(sig)
            ),
            Some(Error::Interrupted(sig)),
        ),
        RunEnd::Lost(lost) => return Err(lost),
    })
}

/// An attempt whose lease was lost: logged, no FinishAttempt; a refused token stops the run-manager.
pub(super) fn abandon(job_id: &str, lost: LeaseLost) -> AttemptResult {
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
pub(super) async fn finish(
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

/// What a failed upload makes of the attempt.
pub(super) fn failed_upload(failure: UploadFailure) -> RunEnd {
    match failure {
        UploadFailure::Lost(lost) => RunEnd::Lost(lost),
        refused @ UploadFailure::Refused { .. } => RunEnd::Failed(refused.to_string()),
        local @ UploadFailure::Local { .. } => RunEnd::Retryable(local.to_string()),
    }
}

/// What inputs that could not be made local make of the attempt: the worker
/// never starts without them; another try may find them.
pub(super) fn failed_inputs(e: FetchError) -> RunEnd {
    match e {
        FetchError::Lost(lost) => RunEnd::Lost(lost),
        FetchError::Unusable(m) => RunEnd::Retryable(m),
    }
}
