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
//! - a graph job's inputs (`crate::artifacts::inputs`): a wrong list (an unsafe name, a
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
//!   run-manager exits 1 ([`crate::Error::TokenRefused`]);
//! - the coordinator refused an upload (INVALID_ARGUMENT, ALREADY_EXISTS,
//!   RESOURCE_EXHAUSTED, FAILED_PRECONDITION, NOT_FOUND) -> the worker is
//!   killed, FAILED with the refusal; an artifact that cannot be read any more
//!   -> RETRYABLE; the coordinator unavailable until the lease would expire ->
//!   abandoned like a stale lease.
//!
//! Uploads run on `crate::artifacts::upload`'s queue, in announcement order, while the
//! worker runs; FinishAttempt goes only once the queue has drained (heartbeats
//! keep the lease alive meanwhile), so a SUCCEEDED attempt's artifacts are
//! all recorded.
//!
//! The pieces, in the order an attempt meets them:
//! - `supervisor`: [`run_attempt`], the attempt's loop: admit the lease, fetch
//!   what the worker needs, start the worker (again after a crash), relay its
//!   events and the coordinator's directives, drain the uploads, conclude;
//! - `admit`: the preflight, spec, inputs and image checks that admit a lease,
//!   or the refusal that turns it down (the one way a lease is turned down);
//! - `finish`: how an attempt ends: what each way of ending reports, and the
//!   FinishAttempt that says so (none for a lost lease);
//! - `heartbeat`: the task that keeps the lease alive and brings the
//!   coordinator's directives;
//! - `config`: [`AttemptConfig`], how attempts are run on this provider.

mod admit;
mod config;
mod finish;
pub mod heartbeat;
mod supervisor;

pub use config::AttemptConfig;
pub use finish::AttemptResult;
pub use supervisor::run_attempt;
