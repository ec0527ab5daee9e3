//! What an attempt's helper tasks tell its supervisor (`crate::attempt`): the
//! heartbeat task's directives and lost leases (`crate::attempt::heartbeat`) and the
//! upload queue's failures (`crate::artifacts::upload`) arrive as one [`Signal`] stream.
//!
//! Not an operating-system signal: SIGINT/SIGTERM are `crate::shutdown`'s.
//! Both senders import these types from here, so neither imports the other.

use crate::lease_lost::LeaseLost;

/// What the heartbeat task and the upload queue tell the attempt's supervisor.
#[derive(Debug, Clone)]
pub enum Signal {
    Cancel,
    CheckpointNow,
    /// The lease is lost: stale (ABORTED) or this provider's token refused.
    Lost(LeaseLost),
    /// An upload failed for good (`crate::artifacts::upload`).
    Upload(UploadFailure),
}

/// Why an upload did not happen.
#[derive(Debug, Clone)]
pub enum UploadFailure {
    /// The coordinator refused it (or failed it the same way too often).
    Refused { name: String, status: tonic::Status },
    /// The file could not be read, or no longer has the verified bytes.
    Local { name: String, message: String },
    /// Stale, token refused, or the lease expired while the coordinator was unavailable.
    Lost(LeaseLost),
}

impl std::fmt::Display for UploadFailure {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            UploadFailure::Refused { name, status } => write!(
                f,
                "the coordinator refused artifact `{name}`: {} ({:?})",
                status.message(),
                status.code()
            ),
            UploadFailure::Local { name, message } => {
                write!(f, "artifact `{name}` was not uploaded: {message}")
            }
            UploadFailure::Lost(LeaseLost::Stale(m)) => write!(f, "lease lost: {m}"),
            UploadFailure::Lost(LeaseLost::Refused { call, status }) => write!(
                f,
                "the coordinator refused this provider's token on `{call}`: {}",
                status.message()
            ),
        }
    }
}
