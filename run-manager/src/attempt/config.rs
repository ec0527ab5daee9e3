//! How attempts are run on this provider ([`AttemptConfig`], from the command
//! line: `crate::setup`), and the lease TTL assumed when a lease names none.

use std::path::PathBuf;
use std::time::Duration;

use crate::backoff::Backoff;
use crate::coordinator::client::RetryPolicy;
use crate::policy::PolicyContext;
use crate::proto::Lease;
use crate::worker::docker::DockerConfig;
use crate::worker::process::WorkerCommand;

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

/// How long the lease lives without a heartbeat.
pub(super) fn lease_ttl(lease: &Lease) -> Duration {
    match lease.ttl_seconds {
        0 => DEFAULT_LEASE_TTL,
        s => Duration::from_secs(u64::from(s)),
    }
}
