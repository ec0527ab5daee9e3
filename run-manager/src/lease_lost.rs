//! Why an attempt's lease is lost to this provider, decided once from a
//! coordinator status, for the Heartbeat stream, artifact uploads and downloads, and
//! FinishAttempt alike.
//!
//! - ABORTED: the lease is stale (it expired, or its provider was revoked while
//!   a Heartbeat stream authenticated before the revocation was open).
//! - UNAUTHENTICATED / PERMISSION_DENIED: the coordinator no longer accepts this
//!   provider's token (revoked, or rotated and its grace period over). No call
//!   of this provider can succeed any more, and the coordinator re-leases the
//!   job elsewhere, so the worker must stop now rather than train on unseen.
//!
//! Either way the worker is killed and no FinishAttempt is sent; a refused
//! token also stops the run-manager (exit 1, [`crate::Error::TokenRefused`]).

/// How a lease was lost mid-attempt.
#[derive(Debug, Clone)]
pub enum LeaseLost {
    /// ABORTED, with the coordinator's message.
    Stale(String),
    /// The coordinator refused this provider's credentials on `call`.
    Refused {
        call: &'static str,
        status: tonic::Status,
    },
}

impl LeaseLost {
    /// The loss `status` (from `call`) means, or None when it is some other failure.
    pub fn of(call: &'static str, status: &tonic::Status) -> Option<Self> {
        match status.code() {
            tonic::Code::Aborted => Some(LeaseLost::Stale(status.message().to_string())),
            tonic::Code::Unauthenticated | tonic::Code::PermissionDenied => {
                Some(LeaseLost::Refused {
                    call,
                    status: status.clone(),
                })
            }
            _ => None,
        }
    }

    /// The error that stops the run-manager after this loss (None: a stale
    /// lease, after which it asks for more work).
    pub fn stop_error(&self, job_id: &str) -> Option<crate::Error> {
        match self {
            LeaseLost::Stale(_) => None,
            LeaseLost::Refused { call, status } => Some(crate::Error::TokenRefused {
                job_id: job_id.to_string(),
                call,
                status: status.clone(),
            }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn aborted_is_stale_and_refused_credentials_stop_the_run_manager() {
        let stale = LeaseLost::of("Heartbeat", &tonic::Status::aborted("expired"));
        assert!(matches!(&stale, Some(LeaseLost::Stale(m)) if m == "expired"));
        assert!(stale.and_then(|l| l.stop_error("j")).is_none());
        for status in [
            tonic::Status::unauthenticated("this provider's token was revoked"),
            tonic::Status::permission_denied("no"),
        ] {
            let lost = LeaseLost::of("UploadArtifact", &status).expect("lost");
            let err = lost.stop_error("job-1").expect("stops");
            assert_eq!(err.exit_code(), crate::error::EXIT_USER);
            assert!(err.to_string().contains("`job-1`"), "{err}");
            assert!(err.to_string().contains("`UploadArtifact`"), "{err}");
        }
        for status in [
            tonic::Status::unavailable("down"),
            tonic::Status::resource_exhausted("retry after 3 s"),
            tonic::Status::invalid_argument("bad"),
        ] {
            assert!(LeaseLost::of("Heartbeat", &status).is_none(), "{status:?}");
        }
    }
}
