//! The library's error type and the exit codes it maps to.
//!
//! Exit codes (documented in `--help`):
//! 0 ok, 1 user error, 2 unexpected, 3 a `--local` job did not succeed,
//! 10 version upgrade required, 128+N stopped by signal N (130 SIGINT, 143 SIGTERM).
//!
//! Types only, so that every module can use them: the one import from the
//! crate is `crate::coordinator::tls_fault` (itself types only, importing nothing of the
//! crate), for the `hint:` and exit code of a call that failed on TLS.

use std::path::PathBuf;

use crate::coordinator::tls_fault::fault_of;

/// Exit code: success.
pub const EXIT_OK: u8 = 0;
/// Exit code: bad flags, bad spec, refused credentials and the like.
pub const EXIT_USER: u8 = 1;
/// Exit code: anything unexpected (a bug, an I/O failure, a crashed coordinator).
pub const EXIT_UNEXPECTED: u8 = 2;
/// Exit code: `--local` ran to the end but a job did not succeed.
pub const EXIT_JOB_FAILED: u8 = 3;
/// Exit code: the coordinator (or the preflight) demands another client version.
pub const EXIT_UPGRADE_REQUIRED: u8 = 10;

/// Everything the run-manager library can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// Bad input from the user (flags, spec file, environment).
    #[error("{0}")]
    Usage(String),
    /// The coordinator requires a different client version for the work it has.
    #[error("upgrade required: the run needs client version `{required}`, this is `{have}`: {message}\nhint: install dflash-worker `{required}`, or ask the run admin to approve `{have}` and pass `--native-client-version {have}`")]
    UpgradeRequired {
        required: String,
        have: String,
        message: String,
    },
    /// A coordinator call failed; `status` keeps the gRPC code so callers can
    /// tell UNAVAILABLE from INVALID_ARGUMENT.
    #[error("coordinator call `{call}` failed: {}", describe(status))]
    Rpc {
        call: &'static str,
        status: tonic::Status,
    },
    /// The coordinator refused this provider's token in the middle of an
    /// attempt (revoked, or rotated and its grace period over): the worker
    /// was stopped and no FinishAttempt sent; the coordinator re-leases the job.
    #[error(
        "job `{job_id}` abandoned and its worker stopped: {}",
        describe_refusal(call, status)
    )]
    TokenRefused {
        job_id: String,
        call: &'static str,
        status: tonic::Status,
    },
    /// A file-system operation failed.
    #[error("{context} `{}`: {source}", path.display())]
    Io {
        context: &'static str,
        path: PathBuf,
        #[source]
        source: std::io::Error,
    },
    /// The embedded coordinator (`--local`) could not be started or died.
    #[error("embedded coordinator: {0}")]
    Coordinator(String),
    /// A `--local` run ended with jobs that did not succeed.
    #[error("run `{run_id}`: {failed} of {total} job(s) did not succeed")]
    JobsFailed {
        run_id: String,
        failed: usize,
        total: usize,
    },
    /// The run-manager received SIGINT/SIGTERM and stopped (after its worker).
    #[error("stopped by signal {0}")]
    Interrupted(i32),
    /// Anything else that should not happen.
    #[error("{0}")]
    Internal(String),
}

/// `message (Code)` and a `hint:` line: the coordinator's own when its message
/// carries one (it knows best), else the TLS fault's, else one by code.
fn describe(status: &tonic::Status) -> String {
    let message = status.message();
    let (text, hint) = match message.split_once("\nhint:") {
        Some((text, theirs)) => (text, format!("\nhint:{theirs}")),
        None => (message, hint_for(status)),
    };
    format!("{text} ({:?}){hint}", status.code())
}

/// A refused token mid-attempt: the coordinator's message and hint, and ours
/// too (it names the flags that carry a new token), unless theirs was the only one.
fn describe_refusal(call: &str, status: &tonic::Status) -> String {
    let mut text = format!(
        "coordinator call `{call}` refused this provider: {}",
        describe(status)
    );
    if status.message().contains("\nhint:") {
        text.push_str(hint_for_code(status.code()));
    }
    text
}

/// Whether `status` is the coordinator's per-peer limit on failed
/// authentications (RESOURCE_EXHAUSTED with `retry after N s`), as opposed to
/// grpc's own RESOURCE_EXHAUSTED for an oversized message.
pub fn is_rate_limited(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::ResourceExhausted && status.message().contains("retry after")
}

/// The `hint:` line for a failed call: the TLS fault's own, else one by code.
fn hint_for(status: &tonic::Status) -> String {
    match fault_of(status) {
        Some(fault) => format!("\nhint: {}", fault.hint()),
        None => hint_for_code(status.code()).to_string(),
    }
}

fn hint_for_code(code: tonic::Code) -> &'static str {
    match code {
        tonic::Code::Unauthenticated => {
            "\nhint: check the provider token (`--token`, `--token-file`, `DFLASH_PROVIDER_TOKEN`): it may have been revoked, or rotated and its grace period ended; the coordinator's admin creates provider tokens"
        }
        tonic::Code::PermissionDenied => {
            "\nhint: this token may not make this call (provider vs admin token), or it may have been revoked or rotated: check `--token` / `--token-file`"
        }
        tonic::Code::Unavailable => "\nhint: is the coordinator running and reachable at `--coordinator`?",
        _ => "",
    }
}

impl Error {
    /// Build an [`Error::Io`] (helper for `map_err`).
    pub fn io(
        context: &'static str,
        path: impl Into<PathBuf>,
    ) -> impl FnOnce(std::io::Error) -> Error {
        let path = path.into();
        move |source| Error::Io {
            context,
            path,
            source,
        }
    }

    /// The process exit code this error maps to.
    pub fn exit_code(&self) -> u8 {
        match self {
            Error::Usage(_) => EXIT_USER,
            Error::UpgradeRequired { .. } => EXIT_UPGRADE_REQUIRED,
            // A TLS mismatch or refused certificate is configuration, like a bad flag.
            Error::Rpc { status, .. } if fault_of(status).is_some() => EXIT_USER,
            // Throttled after failed authentications: a token or certificate to fix.
            Error::Rpc { status, .. } if is_rate_limited(status) => EXIT_USER,
            Error::TokenRefused { .. } => EXIT_USER,
            Error::Rpc { status, .. } => match status.code() {
                tonic::Code::Unauthenticated
                | tonic::Code::PermissionDenied
                | tonic::Code::InvalidArgument
                | tonic::Code::FailedPrecondition
                | tonic::Code::NotFound => EXIT_USER,
                _ => EXIT_UNEXPECTED,
            },
            Error::JobsFailed { .. } => EXIT_JOB_FAILED,
            Error::Interrupted(sig) => u8::try_from(128 + sig).unwrap_or(EXIT_UNEXPECTED),
            Error::Io { .. } | Error::Coordinator(_) | Error::Internal(_) => EXIT_UNEXPECTED,
        }
    }
}

/// Result alias for the library.
pub type Result<T, E = Error> = std::result::Result<T, E>;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_codes_are_the_documented_ones() {
        assert_eq!(Error::Usage("x".into()).exit_code(), 1);
        let up = Error::UpgradeRequired {
            required: "9.9.9".into(),
            have: "0.1.0".into(),
            message: "m".into(),
        };
        assert_eq!(up.exit_code(), 10);
        assert!(up.to_string().contains("`9.9.9`"), "{up}");
        let unavailable = Error::Rpc {
            call: "Register",
            status: tonic::Status::unavailable("down"),
        };
        assert_eq!(unavailable.exit_code(), 2);
        assert!(unavailable.to_string().contains("hint:"));
        let unauth = Error::Rpc {
            call: "Register",
            status: tonic::Status::unauthenticated("no"),
        };
        assert_eq!(unauth.exit_code(), 1);
        // The coordinator's own hint replaces the generic one, after the code.
        let theirs = Error::Rpc {
            call: "Register",
            status: tonic::Status::unauthenticated(
                "the CNs disagree\nhint: use the right certificate",
            ),
        };
        assert_eq!(
            theirs.to_string(),
            "coordinator call `Register` failed: the CNs disagree (Unauthenticated)\nhint: use the right certificate"
        );
        assert_eq!(Error::Interrupted(2).exit_code(), 130);
        assert_eq!(Error::Interrupted(15).exit_code(), 143);
        assert_eq!(
            Error::JobsFailed {
                run_id: "r".into(),
                failed: 1,
                total: 1
            }
            .exit_code(),
            3
        );
    }

    #[test]
    fn rate_limit_is_a_user_error_with_the_coordinators_hint() {
        let limited = Error::Rpc {
            call: "Register",
            status: tonic::Status::resource_exhausted(
                "too many failed authentications from `127.0.0.1` (20 in 60 s); retry after 42 s\nhint: check the provider token (`--token`)",
            ),
        };
        assert_eq!(limited.exit_code(), EXIT_USER);
        assert_eq!(
            limited.to_string(),
            "coordinator call `Register` failed: too many failed authentications from `127.0.0.1` (20 in 60 s); retry after 42 s (ResourceExhausted)\nhint: check the provider token (`--token`)"
        );
        // grpc's own RESOURCE_EXHAUSTED (an oversized message) stays unexpected.
        let oversized = Error::Rpc {
            call: "UploadArtifact",
            status: tonic::Status::resource_exhausted("message larger than max"),
        };
        assert_eq!(oversized.exit_code(), EXIT_UNEXPECTED);
    }

    #[test]
    fn a_token_refused_mid_attempt_names_the_job_and_both_hints() {
        let refused = Error::TokenRefused {
            job_id: "job-1".into(),
            call: "Heartbeat",
            status: tonic::Status::unauthenticated(
                "this provider's token was revoked\nhint: ask the coordinator's admin for a new provider token",
            ),
        };
        assert_eq!(refused.exit_code(), EXIT_USER);
        let text = refused.to_string();
        assert!(text.starts_with("job `job-1` abandoned and its worker stopped: coordinator call `Heartbeat` refused this provider: this provider's token was revoked (Unauthenticated)\nhint: ask the coordinator's admin"), "{text}");
        assert!(
            text.contains("\nhint: check the provider token (`--token`, `--token-file`"),
            "{text}"
        );
        assert!(text.contains("revoked, or rotated"), "{text}");
        // Without a hint of the coordinator's, ours appears once.
        let bare = Error::TokenRefused {
            job_id: "j".into(),
            call: "FinishAttempt",
            status: tonic::Status::permission_denied("no"),
        };
        assert_eq!(bare.to_string().matches("hint:").count(), 1, "{bare}");
    }
}
