//! Coordinator clients (provider and admin) with bearer-token auth, and the
//! retry loop for UNAVAILABLE. Where they connect and how (TLS or plaintext)
//! is `transport::Target`; the channel, `channel::open`.

use std::future::Future;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;

use crate::backoff::{jitter_fraction, Backoff};
use crate::coordinator::channel::{self, Diagnosed};
use crate::coordinator::tls_fault::fault_of;
use crate::coordinator::transport::Target;
use crate::error::{Error, Result};
use crate::proto::admin_service_client::AdminServiceClient;
use crate::proto::provider_service_client::ProviderServiceClient;

/// Adds `authorization: Bearer <token>` to every call.
#[derive(Clone)]
pub struct Auth(MetadataValue<Ascii>);

impl Auth {
    /// Build the interceptor; a token with characters not allowed in a header is a user error.
    pub fn new(token: &str) -> Result<Self> {
        let value = format!("Bearer {}", token.trim());
        value
            .parse::<MetadataValue<Ascii>>()
            .map(Auth)
            .map_err(|_| Error::Usage("the token contains characters that cannot be sent in a header\nhint: copy the token exactly as the coordinator printed it".into()))
    }
}

impl tonic::service::Interceptor for Auth {
    fn call(
        &mut self,
        mut req: tonic::Request<()>,
    ) -> std::result::Result<tonic::Request<()>, tonic::Status> {
        req.metadata_mut().insert("authorization", self.0.clone());
        Ok(req)
    }
}

/// Provider-service client as the run-manager uses it.
pub type ProviderClient = ProviderServiceClient<InterceptedService<Diagnosed, Auth>>;
/// Admin-service client (used by `--local` and the tests).
pub type AdminClient = AdminServiceClient<InterceptedService<Diagnosed, Auth>>;

/// Provider client for `target` with `token`.
pub fn provider_client(target: &Target, token: &str) -> Result<ProviderClient> {
    Ok(
        ProviderServiceClient::with_interceptor(channel::open(target)?, Auth::new(token)?)
            .max_decoding_message_size(16 << 20),
    )
}

/// Admin client for `target` with the admin `token`.
pub fn admin_client(target: &Target, token: &str) -> Result<AdminClient> {
    Ok(
        AdminServiceClient::with_interceptor(channel::open(target)?, Auth::new(token)?)
            .max_decoding_message_size(16 << 20),
    )
}

/// How persistently to retry UNAVAILABLE.
#[derive(Debug, Clone, Copy)]
pub struct RetryPolicy {
    /// Retries after the first try (0 = no retry).
    pub retries: u32,
    pub backoff: Backoff,
}

/// Whether a status is worth retrying: the coordinator is down or restarting
/// (UNAVAILABLE), but not a TLS mismatch or refused certificate, which only a
/// configuration change fixes.
pub fn is_transient(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable && !fault_of(status).is_some_and(|f| f.permanent())
}

/// Run `f` until it succeeds, fails with a non-transient status, or the
/// retries are spent. `call` names the RPC in logs and errors.
pub async fn retry<T, F, Fut>(policy: &RetryPolicy, call: &'static str, f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
{
    retry_until(policy, tokio::time::Instant::now(), call, f).await
}

/// [`retry`], but keep retrying transient failures past the policy's
/// retries until `until` (e.g. when the lease would expire).
pub async fn retry_until<T, F, Fut>(
    policy: &RetryPolicy,
    until: tokio::time::Instant,
    call: &'static str,
    mut f: F,
) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
{
    let mut n = 0u32;
    loop {
        match f().await {
            Ok(resp) => return Ok(resp.into_inner()),
            Err(status)
                if is_transient(&status)
                    && (n < policy.retries || tokio::time::Instant::now() < until) =>
            {
                let delay = policy.backoff.jittered(n, 0.2, jitter_fraction());
                tracing::warn!(call, code = ?status.code(), retry_in_ms = delay.as_millis() as u64, "coordinator unavailable: {}", status.message());
                tokio::time::sleep(delay).await;
                n = n.saturating_add(1);
            }
            Err(status) => return Err(Error::Rpc { call, status }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};
    use std::time::Duration;

    #[test]
    fn tls_faults_that_cannot_heal_are_not_retried() {
        use crate::coordinator::tls_fault::TlsFault;
        let with = |fault: TlsFault| {
            let mut s = tonic::Status::unavailable(fault.to_string());
            s.set_source(std::sync::Arc::new(fault));
            s
        };
        assert!(is_transient(&tonic::Status::unavailable("down")));
        assert!(!is_transient(&with(TlsFault::TlsToPlaintext {
            authority: "h:1".into()
        })));
        assert!(is_transient(&with(TlsFault::ClosedInHandshake {
            detail: "eof".into(),
            client_cert: None
        })));
    }

    #[test]
    fn tokens_must_be_header_safe() {
        assert!(Auth::new("abc-123_XYZ").is_ok());
        assert!(Auth::new("bad\ntoken").is_err());
    }

    fn policy(retries: u32) -> RetryPolicy {
        RetryPolicy {
            retries,
            backoff: Backoff::doubling(Duration::from_millis(1), Duration::from_millis(2)),
        }
    }

    #[tokio::test]
    async fn retries_unavailable_then_succeeds() {
        let calls = AtomicU32::new(0);
        let got = retry(&policy(5), "Test", || {
            let n = calls.fetch_add(1, Ordering::SeqCst);
            async move {
                if n < 3 {
                    Err(tonic::Status::unavailable("down"))
                } else {
                    Ok(tonic::Response::new(n))
                }
            }
        })
        .await
        .expect("ok");
        assert_eq!(got, 3);
    }

    #[tokio::test]
    async fn does_not_retry_other_codes_and_stops_after_budget() {
        let calls = AtomicU32::new(0);
        let err = retry(&policy(5), "Test", || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<tonic::Response<()>, _>(tonic::Status::invalid_argument("bad")) }
        })
        .await
        .expect_err("fails");
        assert_eq!(calls.load(Ordering::SeqCst), 1);
        assert!(
            matches!(err, Error::Rpc { ref status, .. } if status.code() == tonic::Code::InvalidArgument)
        );

        let calls = AtomicU32::new(0);
        let err = retry(&policy(2), "Test", || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<tonic::Response<()>, _>(tonic::Status::unavailable("down")) }
        })
        .await
        .expect_err("fails");
        assert_eq!(calls.load(Ordering::SeqCst), 3);
        assert_eq!(err.exit_code(), 2);
    }

    #[tokio::test]
    async fn retry_until_outlasts_the_budget_until_the_deadline() {
        let calls = AtomicU32::new(0);
        let until = tokio::time::Instant::now() + Duration::from_millis(40);
        let err = retry_until(&policy(1), until, "Test", || {
            calls.fetch_add(1, Ordering::SeqCst);
            async { Err::<tonic::Response<()>, _>(tonic::Status::unavailable("down")) }
        })
        .await
        .expect_err("fails");
        assert!(calls.load(Ordering::SeqCst) > 5, "{calls:?}");
        assert!(tokio::time::Instant::now() >= until);
        assert_eq!(err.exit_code(), 2);
    }
}
