//! A lease's admission: the preflight, spec, inputs and image checks, in that
//! order, the first that fails refusing the lease ([`admit`]); and the refusal
//! itself ([`refuse`], the one way a lease is turned down: a FinishAttempt
//! saying why).

use super::config::{lease_ttl, AttemptConfig};
use super::finish::{finish, AttemptResult};
use crate::artifacts::inputs;
use crate::coordinator::client::ProviderClient;
use crate::error::{Error, Result};
use crate::paths::check_id;
use crate::policy::{preflight, Decision, Downgrade};
use crate::proto::{Artifact, AttemptOutcome, Lease};
use crate::worker::jobdir::parse_spec;
use crate::worker::launch::Launcher;
use crate::worker::ranks::RankPlan;

/// Why a lease is not run: the FinishAttempt to send, and whether the
/// run-manager must stop afterwards.
pub(super) struct Refusal {
    outcome: AttemptOutcome,
    message: String,
    stop: Option<Error>,
}

impl Refusal {
    fn failed(message: String) -> Self {
        Refusal {
            outcome: AttemptOutcome::Failed,
            message,
            stop: None,
        }
    }
}

/// What the preflight admitted: everything a worker start needs but the job directory.
pub(super) struct Admission {
    pub(super) spec: serde_json::Value,
    pub(super) local_ranks: u32,
    pub(super) downgrades: Vec<Downgrade>,
    pub(super) launcher: Launcher,
    /// The lease's inputs, checked, each once (`inputs::plan`).
    pub(super) inputs: Vec<Artifact>,
}

/// Preflight, spec, inputs and image checks, in that order; the first that fails refuses the lease.
pub(super) fn admit(cfg: &AttemptConfig, lease: &Lease) -> std::result::Result<Admission, Refusal> {
    let (local_ranks, downgrades) = match preflight(lease, &cfg.policy) {
        Decision::Run {
            local_ranks,
            downgrades,
        } => (local_ranks, downgrades),
        Decision::Refuse { outcome, message } => {
            return Err(Refusal {
                outcome,
                message,
                stop: None,
            })
        }
        Decision::UpgradeRequired { required, message } => {
            let stop = Error::UpgradeRequired {
                required,
                have: cfg.policy.worker_version.clone(),
                message: message.clone(),
            };
            return Err(Refusal {
                outcome: AttemptOutcome::Retryable,
                message,
                stop: Some(stop),
            });
        }
    };
    for d in &downgrades {
        tracing::warn!(job_id = %lease.job_id, "downgrade: {} -> {} ({})", d.feature, d.replacement, d.reason);
    }
    let spec = parse_spec(&lease.spec_json)
        .and_then(|s| {
            check_id(&lease.job_id)
                .map(|_| s)
                .map_err(|e| e.to_string())
        })
        .map_err(Refusal::failed)?;
    let inputs = inputs::plan(lease).map_err(Refusal::failed)?;
    let plan = RankPlan {
        world: local_ranks,
        cpu: cfg.policy.capabilities.backend == "cpu",
    };
    let launcher = Launcher::for_lease(&cfg.worker, cfg.docker.as_ref(), lease, plan)
        .map_err(Refusal::failed)?;
    Ok(Admission {
        spec,
        local_ranks,
        downgrades,
        launcher,
        inputs,
    })
}

/// Turn the lease down: log why, send FinishAttempt, end the attempt.
pub(super) async fn refuse(
    client: &ProviderClient,
    cfg: &AttemptConfig,
    lease: &Lease,
    r: Refusal,
) -> Result<AttemptResult> {
    tracing::error!(job_id = %lease.job_id, "refusing the lease: {}", r.message);
    let until = tokio::time::Instant::now() + lease_ttl(lease);
    let job_state = finish(client, &cfg.rpc, until, lease, r.outcome, &r.message).await?;
    Ok(AttemptResult {
        job_id: lease.job_id.clone(),
        outcome: Some(r.outcome),
        message: r.message,
        job_state,
        stop: r.stop,
        local_artifacts: Vec::new(),
    })
}

#[cfg(test)]
mod tests {
    use std::path::PathBuf;
    use std::time::Duration;

    use super::super::finish::{failed_inputs, outcome_of};
    use super::*;
    use crate::artifacts::fetch::testing::{fetcher, input, tmp};
    use crate::artifacts::fetch::FetchError;
    use crate::artifacts::transfer::testing::FakeStore;
    use crate::backoff::Backoff;
    use crate::coordinator::client::RetryPolicy;
    use crate::lease_lost::LeaseLost;
    use crate::policy::PolicyContext;
    use crate::worker::process::WorkerCommand;

    fn config() -> AttemptConfig {
        let quick = Backoff::doubling(Duration::from_millis(1), Duration::from_millis(2));
        AttemptConfig {
            work_dir: std::env::temp_dir(),
            worker: WorkerCommand {
                program: PathBuf::from("true"),
                args: vec![],
            },
            docker: None,
            policy: PolicyContext {
                launch_mode: crate::proto::LaunchMode::Native,
                capabilities: crate::proto::DeviceCapabilities {
                    backend: "cpu".into(),
                    device_count: 1,
                    features: vec!["cpu".into(), crate::device::JOB_GRAPH_FEATURE.into()],
                    ..Default::default()
                },
                worker_version: crate::version::CLIENT_VERSION.into(),
                declared_native_version: None,
            },
            max_restarts: 0,
            restart_backoff: quick,
            rpc: RetryPolicy {
                retries: 1,
                backoff: quick,
            },
            heartbeat_interval: Duration::from_secs(1),
            grace: Duration::from_secs(1),
        }
    }

    fn graph_lease(inputs: Vec<Artifact>) -> Lease {
        Lease {
            lease_id: "lease-1".into(),
            run_id: "run-1".into(),
            job_id: "capture-1".into(),
            attempt: 1,
            spec_json: r#"{"stages": ["capture"]}"#.into(),
            checkpoint_policy: "durable".into(),
            required_features: vec![crate::device::JOB_GRAPH_FEATURE.into()],
            required_client_version: crate::version::CLIENT_VERSION.into(),
            kind: "capture".into(),
            shard_count: 2,
            inputs,
            ..Default::default()
        }
    }

    #[test]
    fn a_graph_lease_is_admitted_with_its_inputs_once_and_wrong_inputs_fail_it() {
        let cfg = config();
        let train = input("data/train.jsonl", b"train");
        let lease = graph_lease(vec![train.clone(), train.clone()]);
        let admitted = admit(&cfg, &lease)
            .map_err(|r| r.message)
            .expect("admitted");
        assert_eq!(admitted.inputs, vec![train.clone()]);
        let conflicting = graph_lease(vec![train.clone(), input("data/train.jsonl", b"other")]);
        let Err(refusal) = admit(&cfg, &conflicting) else {
            panic!("admitted")
        };
        assert_eq!(refusal.outcome, AttemptOutcome::Failed);
        assert!(
            refusal.message.contains("input `data/train.jsonl`"),
            "{}",
            refusal.message
        );
        assert!(refusal.stop.is_none());
    }

    #[tokio::test]
    async fn an_input_that_cannot_be_downloaded_ends_the_attempt_retryable() {
        let dir = tmp("attempt-inputs");
        let store = FakeStore::default();
        let lease = graph_lease(vec![input("data/train.jsonl", b"never offered")]);
        let planned = inputs::plan(&lease).expect("plan");
        let err = fetcher(&store, &lease, &dir)
            .inputs(&planned)
            .await
            .expect_err("not found");
        let (outcome, message, stop) = outcome_of(failed_inputs(err)).expect("not lost");
        assert_eq!(outcome, AttemptOutcome::Retryable);
        assert!(
            message.contains("input `data/train.jsonl`") && message.contains("NotFound"),
            "{message}"
        );
        assert!(stop.is_none());
        let lost = failed_inputs(FetchError::Lost(LeaseLost::Stale("gone".into())));
        assert!(matches!(outcome_of(lost), Err(LeaseLost::Stale(_))));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
