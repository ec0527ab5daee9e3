//! Launch policy: the run-manager's preflight before it starts a worker for a lease.
//!
//! The coordinator decides version compatibility and device eligibility; this
//! is the second line of defence on the provider's machine, so a coordinator
//! bug cannot make a provider run what it must not:
//!
//! - version: the worker's version must equal the run's
//!   `required_client_version`, or equal the `--native-client-version` this
//!   provider declared (the coordinator only leases such a run when the run
//!   admin approved that version). Otherwise: upgrade required (exit 10); the
//!   lease is handed back RETRYABLE so another provider can take it.
//! - checkpoints: `ephemeral` runs are refused in native mode (their
//!   checkpoints would live only on this machine): FAILED.
//! - ranks: off CUDA a job runs one local rank; a job wanting more is refused: FAILED.
//!   On CUDA a job wanting more ranks than GPUs is refused: FAILED. A CPU
//!   provider started with `--cpu-ranks N` (a test and development switch) runs
//!   up to N gloo ranks, like a CUDA provider with N GPUs.
//! - features: the backend's own name (`cuda`, `mps`, `cpu`) is a hard
//!   requirement (refused: FAILED). The CUDA-only speed features are
//!   downgraded when missing: `flash_attention_2` -> `sdpa`, `torch_compile`
//!   -> eager, `liger` -> plain PyTorch kernels; the worker reads the
//!   downgrades from `spec.json`. Any other missing feature is refused: FAILED.

use crate::proto::{AttemptOutcome, DeviceCapabilities, LaunchMode, Lease};

/// Features the worker can do without, and what it uses instead.
pub const DOWNGRADES: [(&str, &str); 3] = [
    ("flash_attention_2", "sdpa"),
    ("torch_compile", "eager"),
    ("liger", "torch"),
];

/// Feature names that are backends: required means "must run on this backend".
const BACKENDS: [&str; 3] = ["cuda", "mps", "cpu"];

/// What this provider is and runs, for the preflight.
#[derive(Debug, Clone)]
pub struct PolicyContext {
    pub launch_mode: LaunchMode,
    pub capabilities: DeviceCapabilities,
    /// Version of the worker this provider launches.
    pub worker_version: String,
    /// `--native-client-version`, when the provider declared one.
    pub declared_native_version: Option<String>,
}

/// A feature the worker must do without, and its replacement.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct Downgrade {
    pub feature: String,
    pub replacement: String,
    pub reason: String,
}

/// The preflight's verdict on one lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Decision {
    /// Launch with this many local ranks and these downgrades.
    Run {
        local_ranks: u32,
        downgrades: Vec<Downgrade>,
    },
    /// Do not launch; finish the attempt with `outcome` and `message`.
    Refuse {
        outcome: AttemptOutcome,
        message: String,
    },
    /// The worker's version is not acceptable for this run: hand the lease back
    /// (RETRYABLE) and stop with exit code 10.
    UpgradeRequired { required: String, message: String },
}

/// Decide whether and how to run `lease` here: the version gate, the
/// checkpoint policy, the ranks, then the features, the first refusal winning.
pub fn preflight(lease: &Lease, ctx: &PolicyContext) -> Decision {
    let caps = &ctx.capabilities;
    let checked = check_version(lease, ctx)
        .and_then(|()| check_checkpoint_policy(lease, ctx.launch_mode))
        .and_then(|()| local_ranks(lease, caps))
        .and_then(|local_ranks| Ok((local_ranks, feature_downgrades(lease, caps)?)));
    match checked {
        Ok((local_ranks, downgrades)) => Decision::Run {
            local_ranks,
            downgrades,
        },
        Err(decision) => decision,
    }
}

fn refuse(message: String) -> Decision {
    Decision::Refuse {
        outcome: AttemptOutcome::Failed,
        message,
    }
}

/// The run's client version must be this worker's, or the declared approved native version.
fn check_version(lease: &Lease, ctx: &PolicyContext) -> Result<(), Decision> {
    let version_ok = lease.required_client_version == ctx.worker_version
        || ctx.declared_native_version.as_deref() == Some(ctx.worker_version.as_str());
    if version_ok {
        return Ok(());
    }
    Err(Decision::UpgradeRequired {
        required: lease.required_client_version.clone(),
        message: format!(
            "run `{}` requires client version `{}` but this provider's worker is `{}` and no approved native version was declared",
            lease.run_id, lease.required_client_version, ctx.worker_version
        ),
    })
}

/// `durable` anywhere; `ephemeral` only where the checkpoints can outlive this disk.
fn check_checkpoint_policy(lease: &Lease, mode: LaunchMode) -> Result<(), Decision> {
    match (lease.checkpoint_policy.as_str(), mode) {
        ("ephemeral", LaunchMode::Native) => Err(refuse(format!(
            "run `{}` uses ephemeral checkpoints, which native mode refuses: they would exist only on this provider's disk and no other provider could resume the job\nhint: the run admin can switch the run to `durable` checkpoints",
            lease.run_id
        ))),
        ("durable" | "ephemeral", _) => Ok(()),
        (other, _) => Err(refuse(format!(
            "run `{}` has an unknown checkpoint policy `{}` (expected `durable` or `ephemeral`)",
            lease.run_id,
            other.chars().take(40).collect::<String>()
        ))),
    }
}

/// The local ranks to launch: up to the CUDA device count, one elsewhere.
fn local_ranks(lease: &Lease, caps: &DeviceCapabilities) -> Result<u32, Decision> {
    let wanted = lease.local_ranks.max(1);
    let cpu_ranks = caps.backend == "cpu"
        && caps
            .features
            .iter()
            .any(|f| f == crate::device::CPU_RANKS_FEATURE);
    if caps.backend == "cuda" || cpu_ranks {
        if wanted > caps.device_count {
            let what = if cpu_ranks {
                "CPU ranks (`--cpu-ranks`)"
            } else {
                "CUDA device(s)"
            };
            return Err(refuse(format!(
                "job `{}` wants {wanted} local ranks but this provider has {} {what}",
                lease.job_id, caps.device_count
            )));
        }
        return Ok(wanted);
    }
    // One local rank off CUDA: a multi-rank job would silently change its batch
    // and numerics if squeezed into one rank, so it is refused, not downgraded.
    if wanted > 1 {
        return Err(refuse(format!(
            "job `{}` wants {wanted} local ranks but `{}` providers run one local rank\n\
             hint: multi-rank runs need a CUDA provider; set `max_local_ranks` to 1 for other providers",
            lease.job_id, caps.backend
        )));
    }
    Ok(1)
}

/// Each required feature is offered, downgraded (see `DOWNGRADES`), or refuses the lease.
fn feature_downgrades(
    lease: &Lease,
    caps: &DeviceCapabilities,
) -> Result<Vec<Downgrade>, Decision> {
    let on_cuda = caps.backend == "cuda";
    let mut downgrades = Vec::new();
    for feature in &lease.required_features {
        let offered = feature == &caps.backend || caps.features.iter().any(|f| f == feature);
        if offered {
            continue;
        }
        if BACKENDS.contains(&feature.as_str()) {
            return Err(refuse(format!(
                "run `{}` requires the `{feature}` backend; this provider runs `{}`",
                lease.run_id, caps.backend
            )));
        }
        let Some((_, replacement)) = DOWNGRADES.iter().find(|(f, _)| f == feature) else {
            return Err(refuse(format!(
                "run `{}` requires feature `{}`, which this provider does not offer (it offers: {})",
                lease.run_id,
                feature.chars().take(64).collect::<String>(),
                caps.features.join(", ")
            )));
        };
        downgrades.push(Downgrade {
            feature: feature.clone(),
            replacement: (*replacement).to_string(),
            reason: if on_cuda {
                format!("`{feature}` is not available on this CUDA provider")
            } else {
                format!(
                    "`{feature}` needs CUDA; this provider runs `{}`",
                    caps.backend
                )
            },
        });
    }
    Ok(downgrades)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn caps(backend: &str, count: u32, features: &[&str]) -> DeviceCapabilities {
        DeviceCapabilities {
            backend: backend.into(),
            device_count: count,
            features: features.iter().map(|s| s.to_string()).collect(),
            ..Default::default()
        }
    }

    fn ctx(backend: &str) -> PolicyContext {
        let c = if backend == "cuda" {
            caps("cuda", 2, &["cuda", "torch_compile"])
        } else {
            caps(backend, 1, &[backend])
        };
        PolicyContext {
            launch_mode: LaunchMode::Native,
            capabilities: c,
            worker_version: "0.1.0".into(),
            declared_native_version: None,
        }
    }

    fn lease() -> Lease {
        Lease {
            lease_id: "l".into(),
            run_id: "r".into(),
            job_id: "j".into(),
            required_client_version: "0.1.0".into(),
            checkpoint_policy: "durable".into(),
            local_ranks: 1,
            ..Default::default()
        }
    }

    fn is_run(d: &Decision) -> bool {
        matches!(d, Decision::Run { .. })
    }

    #[test]
    fn plain_lease_runs() {
        assert_eq!(
            preflight(&lease(), &ctx("cpu")),
            Decision::Run {
                local_ranks: 1,
                downgrades: vec![]
            }
        );
    }

    #[test]
    fn version_gate() {
        let mut l = lease();
        l.required_client_version = "0.2.0".into();
        assert!(
            matches!(preflight(&l, &ctx("cpu")), Decision::UpgradeRequired { ref required, .. } if required == "0.2.0")
        );
        // A declared native version equal to the worker's is what the coordinator approved.
        let mut c = ctx("cpu");
        c.declared_native_version = Some("0.1.0".into());
        assert!(is_run(&preflight(&l, &c)));
        // A declared version that is not the worker's own does not count.
        c.declared_native_version = Some("0.2.0".into());
        assert!(matches!(
            preflight(&l, &c),
            Decision::UpgradeRequired { .. }
        ));
    }

    #[test]
    fn ephemeral_refused_in_native_mode_only() {
        let mut l = lease();
        l.checkpoint_policy = "ephemeral".into();
        let d = preflight(&l, &ctx("cpu"));
        assert!(
            matches!(d, Decision::Refuse { outcome: AttemptOutcome::Failed, ref message } if message.contains("ephemeral"))
        );
        let mut c = ctx("cuda");
        c.launch_mode = LaunchMode::Docker;
        assert!(is_run(&preflight(&l, &c)));
        l.checkpoint_policy = "sometimes".into();
        assert!(matches!(preflight(&l, &c), Decision::Refuse { .. }));
    }

    #[test]
    fn one_rank_off_cuda() {
        let mut l = lease();
        l.local_ranks = 4;
        for backend in ["mps", "cpu"] {
            assert!(matches!(
                preflight(&l, &ctx(backend)),
                Decision::Refuse { outcome: AttemptOutcome::Failed, ref message } if message.contains("one local rank")
            ));
        }
        l.local_ranks = 1;
        let Decision::Run { local_ranks, .. } = preflight(&l, &ctx("mps")) else {
            panic!()
        };
        assert_eq!(local_ranks, 1);
        l.local_ranks = 2;
        let Decision::Run { local_ranks, .. } = preflight(&l, &ctx("cuda")) else {
            panic!()
        };
        assert_eq!(local_ranks, 2);
        l.local_ranks = 3;
        assert!(matches!(
            preflight(&l, &ctx("cuda")),
            Decision::Refuse { .. }
        ));
        // `--cpu-ranks 2`: up to two gloo ranks on CPU, no more.
        let mut cpu2 = ctx("cpu");
        cpu2.capabilities = crate::device::with_cpu_ranks(cpu2.capabilities, 2);
        l.local_ranks = 2;
        assert!(matches!(
            preflight(&l, &cpu2),
            Decision::Run { local_ranks: 2, .. }
        ));
        l.local_ranks = 3;
        let Decision::Refuse { message, .. } = preflight(&l, &cpu2) else {
            panic!("3 ranks on `--cpu-ranks 2`")
        };
        assert!(message.contains("2 CPU ranks (`--cpu-ranks`)"), "{message}");
        l.local_ranks = 0;
        let Decision::Run { local_ranks, .. } = preflight(&l, &ctx("cpu")) else {
            panic!()
        };
        assert_eq!(local_ranks, 1);
    }

    #[test]
    fn cuda_features_off_cuda() {
        let mut l = lease();
        l.required_features = vec!["cuda".into()];
        let d = preflight(&l, &ctx("mps"));
        assert!(
            matches!(d, Decision::Refuse { outcome: AttemptOutcome::Failed, ref message } if message.contains("`cuda`"))
        );
        assert!(is_run(&preflight(&l, &ctx("cuda"))));

        l.required_features = vec![
            "flash_attention_2".into(),
            "torch_compile".into(),
            "liger".into(),
        ];
        let Decision::Run { downgrades, .. } = preflight(&l, &ctx("cpu")) else {
            panic!()
        };
        let got: Vec<(&str, &str)> = downgrades
            .iter()
            .map(|d| (d.feature.as_str(), d.replacement.as_str()))
            .collect();
        assert_eq!(
            got,
            vec![
                ("flash_attention_2", "sdpa"),
                ("torch_compile", "eager"),
                ("liger", "torch")
            ]
        );
        // On CUDA, torch_compile is offered and stays; the others are downgraded.
        let Decision::Run { downgrades, .. } = preflight(&l, &ctx("cuda")) else {
            panic!()
        };
        assert_eq!(downgrades.len(), 2);

        l.required_features = vec!["fp8".into()];
        assert!(matches!(
            preflight(&l, &ctx("cuda")),
            Decision::Refuse { .. }
        ));
    }
}
