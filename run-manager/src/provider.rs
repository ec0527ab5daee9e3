//! The provider loop: register, long-poll for leases, run each attempt, repeat.

use std::time::{Duration, Instant};

use crate::attempt::{run_attempt, AttemptConfig, AttemptResult};
use crate::coordinator::client::{retry, AdminClient, ProviderClient};
use crate::error::{Error, Result};
use crate::proto::{
    acquire_lease_response, AcquireLeaseRequest, AcquireLeaseResponse, ArtifactInfo, GetRunRequest,
    GetRunResponse, LaunchMode, ListArtifactsRequest, RegisterRequest, RegisterResponse,
};
use crate::shutdown::{signalled, Shutdown};
use crate::version::{CLIENT_VERSION, PROTOCOL_VERSION};

/// Job states after which a job never runs again.
pub const TERMINAL_JOB_STATES: [&str; 3] = ["succeeded", "failed", "cancelled"];

/// How this provider presents itself and how long it keeps going.
#[derive(Debug, Clone)]
pub struct ProviderConfig {
    pub name: String,
    pub launch_mode: LaunchMode,
    /// `--native-client-version`, sent with Register when set.
    pub native_client_version: Option<String>,
    /// Long-poll wait per AcquireLease, seconds.
    pub poll_wait: u32,
    /// Stop after this many attempts (0 = no limit).
    pub max_jobs: u32,
    /// Stop after this long without a lease.
    pub idle_timeout: Option<Duration>,
    /// Heartbeat interval override (default: the coordinator's).
    pub heartbeat_override: Option<Duration>,
    pub attempt: AttemptConfig,
}

/// When the loop ends (besides `max_jobs`, idle timeout and signals).
pub enum Until {
    /// Keep serving.
    Forever,
    /// Stop when every job of this run reached a terminal state (`--local`).
    RunDone {
        admin: Box<AdminClient>,
        run_id: String,
    },
}

/// Register this provider; the response carries the lease TTL and heartbeat interval.
pub async fn register(client: &ProviderClient, cfg: &ProviderConfig) -> Result<RegisterResponse> {
    let req = RegisterRequest {
        client_version: CLIENT_VERSION.to_string(),
        protocol_version: PROTOCOL_VERSION.to_string(),
        launch_mode: cfg.launch_mode as i32,
        capabilities: Some(cfg.attempt.policy.capabilities.clone()),
        name: cfg.name.clone(),
        native_client_version: cfg.native_client_version.clone().unwrap_or_default(),
    };
    retry(&cfg.attempt.rpc, "Register", || {
        let mut c = client.clone();
        let r = req.clone();
        async move { c.register(r).await }
    })
    .await
}

/// The heartbeat interval to use: the override, else the coordinator's, and
/// never more than a third of the lease TTL (so one lost heartbeat is not fatal).
pub fn heartbeat_interval(reg: &RegisterResponse, override_: Option<Duration>) -> Duration {
    let asked = override_
        .unwrap_or_else(|| Duration::from_secs(u64::from(reg.heartbeat_interval_seconds.max(1))));
    let ttl_third = Duration::from_secs_f64(f64::from(reg.lease_ttl_seconds.max(1)) / 3.0);
    asked.min(ttl_third).max(Duration::from_millis(100))
}

/// The admin view of one run: the run and all its jobs (every page).
pub(crate) async fn get_run(admin: &mut AdminClient, run_id: &str) -> Result<GetRunResponse> {
    let mut all = GetRunResponse::default();
    let mut page_token = String::new();
    loop {
        let page = admin
            .get_run(GetRunRequest {
                run_id: run_id.to_string(),
                page_size: 0,
                page_token: page_token.clone(),
            })
            .await
            .map_err(|status| Error::Rpc {
                call: "GetRun",
                status,
            })?
            .into_inner();
        all.run = page.run;
        all.jobs.extend(page.jobs);
        if page.next_page_token.is_empty() || page.next_page_token == page_token {
            return Ok(all);
        }
        page_token = page.next_page_token;
    }
}

/// A job's artifacts (every page): its SUCCEEDED attempt's, or with
/// `all_attempts` every attempt's records, newest attempt first.
pub(crate) async fn list_artifacts(
    admin: &mut AdminClient,
    run_id: &str,
    job_id: &str,
    all_attempts: bool,
) -> Result<Vec<ArtifactInfo>> {
    let mut all = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = admin
            .list_artifacts(ListArtifactsRequest {
                run_id: run_id.to_string(),
                job_id: job_id.to_string(),
                all_attempts,
                page_size: 0,
                page_token: page_token.clone(),
            })
            .await
            .map_err(|status| Error::Rpc {
                call: "ListArtifacts",
                status,
            })?
            .into_inner();
        all.extend(page.artifacts);
        if page.next_page_token.is_empty() || page.next_page_token == page_token {
            return Ok(all);
        }
        page_token = page.next_page_token;
    }
}

async fn run_done(admin: &mut AdminClient, run_id: &str) -> Result<bool> {
    let resp = get_run(admin, run_id).await?;
    Ok(!resp.jobs.is_empty()
        && resp
            .jobs
            .iter()
            .all(|j| TERMINAL_JOB_STATES.contains(&j.state.as_str())))
}

/// Register, then lease and run jobs until `until`, `max_jobs`, the idle
/// timeout or a signal ends it. Returns the attempts it ran.
pub async fn run_loop(
    client: &ProviderClient,
    cfg: &ProviderConfig,
    mut until: Until,
    shutdown: &mut Shutdown,
) -> Result<Vec<AttemptResult>> {
    let reg = register(client, cfg).await?;
    let mut attempt_cfg = cfg.attempt.clone();
    attempt_cfg.heartbeat_interval = heartbeat_interval(&reg, cfg.heartbeat_override);
    tracing::info!(
        provider_id = %reg.provider_id,
        backend = %cfg.attempt.policy.capabilities.backend,
        lease_ttl_s = reg.lease_ttl_seconds,
        heartbeat_s = attempt_cfg.heartbeat_interval.as_secs_f64(),
        "registered with the coordinator"
    );
    let mut provider_id = reg.provider_id;
    let mut results = Vec::new();
    let mut idle_since = Instant::now();
    loop {
        if let Until::RunDone { admin, run_id } = &mut until {
            if run_done(admin, run_id).await? {
                return Ok(results);
            }
        }
        if cfg.max_jobs > 0 && results.len() >= cfg.max_jobs as usize {
            tracing::info!(attempts = results.len(), "reached `--max-jobs`; stopping");
            return Ok(results);
        }
        let resp = match acquire(client, cfg, &provider_id, shutdown).await {
            Ok(r) => r,
            // The coordinator forgot this registration (e.g. restarted on a new database): register again.
            Err(Error::Rpc { status, .. }) if status.code() == tonic::Code::NotFound => {
                tracing::warn!(
                    "coordinator does not know this provider ({}); registering again",
                    status.message()
                );
                provider_id = register(client, cfg).await?.provider_id;
                continue;
            }
            Err(e) => return Err(e),
        };
        match resp.result {
            Some(acquire_lease_response::Result::Lease(lease)) => {
                let mut result = run_attempt(client, &attempt_cfg, lease, shutdown).await?;
                idle_since = Instant::now();
                let stop = result.stop.take();
                results.push(result);
                if let Some(e) = stop {
                    return Err(e);
                }
            }
            Some(acquire_lease_response::Result::NoWork(nw)) => {
                if no_work(cfg, &until, idle_since, nw.retry_after_seconds, shutdown).await? {
                    return Ok(results);
                }
            }
            Some(acquire_lease_response::Result::UpgradeRequired(up)) => {
                return Err(Error::UpgradeRequired {
                    have: cfg
                        .native_client_version
                        .clone()
                        .unwrap_or_else(|| CLIENT_VERSION.to_string()),
                    required: up.required_client_version,
                    message: up.message,
                });
            }
            None => {
                return Err(Error::Internal(
                    "AcquireLease answered with no result".into(),
                ));
            }
        }
    }
}

/// AcquireLease (a long poll, retried per the policy), unless a shutdown signal comes first.
async fn acquire(
    client: &ProviderClient,
    cfg: &ProviderConfig,
    provider_id: &str,
    shutdown: &mut Shutdown,
) -> Result<AcquireLeaseResponse> {
    let req = AcquireLeaseRequest {
        provider_id: provider_id.to_string(),
        wait_seconds: cfg.poll_wait,
    };
    tokio::select! {
        r = retry(&cfg.attempt.rpc, "AcquireLease", || {
            let mut c = client.clone();
            let r = req.clone();
            async move { c.acquire_lease(r).await }
        }) => r,
        sig = signalled(shutdown) => Err(Error::Interrupted(sig)),
    }
}

/// No lease this time: true to stop after `--idle-timeout` without one (an
/// error while the run still has jobs), else pause as the coordinator asked.
async fn no_work(
    cfg: &ProviderConfig,
    until: &Until,
    idle_since: Instant,
    retry_after_seconds: u32,
    shutdown: &mut Shutdown,
) -> Result<bool> {
    if let Some(limit) = cfg.idle_timeout {
        if idle_since.elapsed() >= limit {
            return match until {
                Until::RunDone { run_id, .. } => Err(Error::Usage(format!(
                    "no lease for {}s while run `{run_id}` still has unfinished jobs: this provider cannot take them\nhint: check the run's `required_features`, `max_local_ranks` and `checkpoint_policy` against this machine (`--device`, launch mode)",
                    limit.as_secs()
                ))),
                Until::Forever => {
                    tracing::info!(idle_s = limit.as_secs(), "no work within `--idle-timeout`; stopping");
                    Ok(true)
                }
            };
        }
    }
    let pause = Duration::from_secs(u64::from(retry_after_seconds.min(60)));
    tracing::debug!(retry_after_s = pause.as_secs(), "no work");
    if !pause.is_zero() {
        let pause = match until {
            // The embedded coordinator is ours alone: look again soon.
            Until::RunDone { .. } => pause.min(Duration::from_millis(500)),
            Until::Forever => pause,
        };
        tokio::select! {
            _ = tokio::time::sleep(pause) => {}
            sig = signalled(shutdown) => return Err(Error::Interrupted(sig)),
        }
    }
    Ok(false)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn heartbeat_interval_respects_ttl() {
        let reg = RegisterResponse {
            provider_id: "p".into(),
            lease_ttl_seconds: 30,
            heartbeat_interval_seconds: 20,
        };
        assert_eq!(heartbeat_interval(&reg, None), Duration::from_secs(10));
        assert_eq!(
            heartbeat_interval(&reg, Some(Duration::from_secs(2))),
            Duration::from_secs(2)
        );
        let zero = RegisterResponse::default();
        assert!(heartbeat_interval(&zero, None) >= Duration::from_millis(100));
    }
}
