//! Coordinator clients (provider and admin) with bearer-token auth, and the
//! retry loop for UNAVAILABLE.

use std::future::Future;
use std::time::Duration;

use tonic::metadata::{Ascii, MetadataValue};
use tonic::service::interceptor::InterceptedService;
use tonic::transport::{Channel, Endpoint};

use crate::backoff::{jitter_fraction, Backoff};
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
pub type ProviderClient = ProviderServiceClient<InterceptedService<Channel, Auth>>;
/// Admin-service client (used by `--local` and the tests).
pub type AdminClient = AdminServiceClient<InterceptedService<Channel, Auth>>;

/// Normalize a coordinator address: `host:port` gets `http://`; `https://` is refused for now.
pub fn normalize_address(addr: &str) -> Result<String> {
    let addr = addr.trim();
    if addr.is_empty() {
        return Err(Error::Usage("the coordinator address is empty".into()));
    }
    if addr.starts_with("https://") {
        return Err(Error::Usage(format!(
            "coordinator address `{addr}` uses TLS, which this build does not support yet\nhint: reach the coordinator over a tunnel and pass `http://HOST:PORT`"
        )));
    }
    if addr.starts_with("http://") {
        Ok(addr.to_string())
    } else if addr.contains("://") {
        Err(Error::Usage(format!(
            "coordinator address `{addr}` must be `http://HOST:PORT` or `HOST:PORT`"
        )))
    } else {
        Ok(format!("http://{addr}"))
    }
}

/// A lazily connecting channel: connection failures surface as UNAVAILABLE
/// on the first call, where [`retry`] handles them.
pub fn channel(addr: &str) -> Result<Channel> {
    let url = normalize_address(addr)?;
    let endpoint = Endpoint::from_shared(url.clone())
        .map_err(|e| Error::Usage(format!("bad coordinator address `{url}`: {e}")))?
        .connect_timeout(Duration::from_secs(10))
        .tcp_nodelay(true)
        // Keep long-polls and heartbeat streams alive through NATs.
        .http2_keep_alive_interval(Duration::from_secs(30))
        .keep_alive_while_idle(true);
    Ok(endpoint.connect_lazy())
}

/// Provider client for `addr` with `token`.
pub fn provider_client(addr: &str, token: &str) -> Result<ProviderClient> {
    Ok(
        ProviderServiceClient::with_interceptor(channel(addr)?, Auth::new(token)?)
            .max_decoding_message_size(16 << 20),
    )
}

/// Admin client for `addr` with the admin `token`.
pub fn admin_client(addr: &str, token: &str) -> Result<AdminClient> {
    Ok(
        AdminServiceClient::with_interceptor(channel(addr)?, Auth::new(token)?)
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

/// Whether a status is worth retrying: the coordinator is down or restarting.
pub fn is_transient(status: &tonic::Status) -> bool {
    status.code() == tonic::Code::Unavailable
}

/// Run `f` until it succeeds, fails with a non-transient status, or the
/// retries are spent. `call` names the RPC in logs and errors.
pub async fn retry<T, F, Fut>(policy: &RetryPolicy, call: &'static str, mut f: F) -> Result<T>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = std::result::Result<tonic::Response<T>, tonic::Status>>,
{
    let mut n = 0u32;
    loop {
        match f().await {
            Ok(resp) => return Ok(resp.into_inner()),
            Err(status) if is_transient(&status) && n < policy.retries => {
                let delay = policy.backoff.jittered(n, 0.2, jitter_fraction());
                tracing::warn!(call, code = ?status.code(), retry_in_ms = delay.as_millis() as u64, "coordinator unavailable: {}", status.message());
                tokio::time::sleep(delay).await;
                n += 1;
            }
            Err(status) => return Err(Error::Rpc { call, status }),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::atomic::{AtomicU32, Ordering};

    #[test]
    fn addresses() {
        assert_eq!(
            normalize_address("127.0.0.1:5").expect("ok"),
            "http://127.0.0.1:5"
        );
        assert_eq!(normalize_address(" http://h:1 ").expect("ok"), "http://h:1");
        assert!(normalize_address("https://h:1").is_err());
        assert!(normalize_address("ftp://h:1").is_err());
        assert!(normalize_address("").is_err());
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
}
