//! Turn the parsed command line into the provider's configuration: worker
//! command, versions, device capabilities, retry and restart policies, the
//! coordinator target (TLS) and the provider token.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::attempt::AttemptConfig;
use crate::backoff::Backoff;
use crate::cli::{Cli, LaunchModeArg};
use crate::coordinator::client::RetryPolicy;
use crate::coordinator::token;
use crate::coordinator::transport::{Target, TlsFiles};
use crate::device;
use crate::error::{Error, Result};
use crate::policy::PolicyContext;
use crate::proto::{DeviceCapabilities, LaunchMode};
use crate::provider::ProviderConfig;
use crate::version::CLIENT_VERSION;
use crate::worker::docker::{self, DockerConfig};
use crate::worker::process::WorkerCommand;

/// File name of the native client binary.
pub const NATIVE_CLIENT_NAME: &str = "dflash-native-client";

/// The native client installed next to the running binary.
pub fn native_client_next_to_exe() -> Result<PathBuf> {
    let exe = std::env::current_exe()
        .map_err(|e| Error::Internal(format!("cannot find this binary's path: {e}")))?;
    let dir = exe
        .parent()
        .ok_or_else(|| Error::Internal("this binary has no parent directory".into()))?;
    Ok(dir.join(NATIVE_CLIENT_NAME))
}

/// Parse `dflash-native-client 0.1.0 (...)` into `0.1.0`.
pub fn parse_version_output(out: &str) -> Option<String> {
    let mut words = out.split_whitespace();
    let name = words.next()?;
    if name != NATIVE_CLIENT_NAME {
        return None;
    }
    let v = words.next()?;
    let ok = !v.is_empty()
        && v.chars()
            .all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '+'));
    ok.then(|| v.to_string())
}

/// Ask a native client binary for its version (`PATH --version`).
pub fn probe_native_version(path: &Path) -> Result<String> {
    let out = Command::new(path).arg("--version").output().map_err(|e| {
        Error::Usage(format!(
            "cannot run native client `{}`: {e}\nhint: build it with `make install`, or pass `--native-client PATH`",
            path.display()
        ))
    })?;
    let text = String::from_utf8_lossy(&out.stdout);
    match parse_version_output(&text) {
        Some(v) if out.status.success() => Ok(v),
        _ => Err(Error::Usage(format!(
            "`{} --version` did not print `{NATIVE_CLIENT_NAME} <version>` (got `{}`)",
            path.display(),
            text.trim().chars().take(120).collect::<String>()
        ))),
    }
}

/// The launch mode `--launch-mode` resolves to on a machine with `caps`:
/// `auto` is Docker on Linux with CUDA GPUs, except with `--local` (the
/// one-machine default runs this environment's own worker: no image needed)
/// or when a native client, a worker command or a native client version was
/// given explicitly.
pub fn resolve_launch_mode(cli: &Cli, caps: &DeviceCapabilities) -> LaunchMode {
    match cli.launch_mode {
        LaunchModeArg::Native => LaunchMode::Native,
        LaunchModeArg::Docker => LaunchMode::Docker,
        LaunchModeArg::Auto => {
            let native_asked = cli.local
                || cli.native_client.is_some()
                || cli.worker_cmd.is_some()
                || cli.native_client_version.is_some();
            if cfg!(target_os = "linux") && caps.backend == "cuda" && !native_asked {
                LaunchMode::Docker
            } else {
                LaunchMode::Native
            }
        }
    }
}

/// Docker launch mode's configuration from the command line.
pub fn docker_config(
    cli: &Cli,
    caps: &DeviceCapabilities,
    work_dir: &Path,
) -> Result<DockerConfig> {
    if cli.native_client.is_some()
        || cli.worker_cmd.is_some()
        || cli.native_client_version.is_some()
    {
        return Err(Error::Usage(
            "`--native-client`, `--worker-cmd` and `--native-client-version` are for native launch mode, not `--launch-mode docker`\nhint: drop them, or pass `--launch-mode native`".into(),
        ));
    }
    let program = docker::find_docker(Some(&cli.docker))?;
    let jobs = work_dir.join("jobs");
    docker::check_mount_path(&jobs)
        .map_err(|e| Error::Usage(format!("docker launch mode: {e}")))?;
    let mut ro_mounts = Vec::new();
    for m in &cli.docker_mount {
        let real = m
            .canonicalize()
            .map_err(|e| Error::Usage(format!("`--docker-mount {}`: {e}", m.display())))?;
        docker::check_mount_path(&real)
            .map_err(|e| Error::Usage(format!("`--docker-mount`: {e}")))?;
        ro_mounts.push(real);
    }
    // SAFETY: getuid/getgid cannot fail and have no preconditions.
    let (uid, gid) = unsafe { (libc::getuid(), libc::getgid()) };
    let (user, chown) = docker::container_user(uid, gid);
    if chown.is_some() {
        tracing::info!(
            "running as root: containers run as uid {user}, which is handed each job directory"
        );
        // That uid reads a `--docker-mount` as "other": say so now, not as a worker's permission error.
        use std::os::unix::fs::PermissionsExt;
        for m in &ro_mounts {
            let mode = std::fs::metadata(m)
                .map(|md| md.permissions().mode())
                .unwrap_or(0);
            if mode & 0o005 != 0o005 {
                tracing::warn!("`--docker-mount {}` (mode {:o}) is not readable by the container's uid {user}\nhint: chmod -R a+rX it", m.display(), mode & 0o7777);
            }
        }
    }
    Ok(DockerConfig {
        program,
        repository: cli.image_repository.clone(),
        gpus: caps.backend == "cuda",
        user,
        chown,
        ro_mounts,
    })
}

/// The worker command and the version it counts as.
pub fn worker_command(cli: &Cli) -> Result<(WorkerCommand, String)> {
    if let Some(line) = &cli.worker_cmd {
        return Ok((WorkerCommand::parse(line)?, CLIENT_VERSION.to_string()));
    }
    let path = match &cli.native_client {
        Some(Some(p)) => p.clone(),
        Some(None) | None => native_client_next_to_exe()?,
    };
    let version = probe_native_version(&path)?;
    Ok((
        WorkerCommand {
            program: path,
            args: Vec::new(),
        },
        version,
    ))
}

fn host_name() -> String {
    std::fs::read_to_string("/etc/hostname")
        .ok()
        .map(|s| s.trim().to_string())
        .filter(|s| !s.is_empty())
        .or_else(|| {
            Command::new("hostname")
                .output()
                .ok()
                .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
                .filter(|s| !s.is_empty())
        })
        .unwrap_or_else(|| "provider".to_string())
}

fn seconds(flag: &str, v: f64) -> Result<Duration> {
    Duration::try_from_secs_f64(v).map_err(|_| {
        Error::Usage(format!(
            "`{flag}` must be a non-negative number of seconds, got `{v}`"
        ))
    })
}

/// Everything the provider loop needs, from the command line.
pub fn provider_config(cli: &Cli, work_dir: &Path) -> Result<ProviderConfig> {
    let mut capabilities = device::detect(cli.device)?;
    let launch_mode = resolve_launch_mode(cli, &capabilities);
    if let Some(n) = cli.cpu_ranks {
        if capabilities.backend != "cpu" {
            return Err(Error::Usage(format!(
                "`--cpu-ranks {n}` is for CPU providers; this one offers `{}`\nhint: on CUDA the ranks are the GPUs; pass `--device cpu` to test CPU ranks",
                capabilities.backend
            )));
        }
        if launch_mode == LaunchMode::Docker && n > 1 {
            return Err(Error::Usage(format!(
                "`--cpu-ranks {n}` needs native launch mode: Docker mode runs one rank per job\nhint: pass `--launch-mode native`"
            )));
        }
        capabilities = device::with_cpu_ranks(capabilities, n);
    }
    if launch_mode == LaunchMode::Docker && capabilities.device_count > 1 {
        // One container runs one rank: a job leased N ranks would need N containers that
        // rendezvous with each other, which Docker mode does not start (yet).
        tracing::warn!(
            gpus = capabilities.device_count,
            "Docker launch mode runs one rank per job: offering 1 of {} GPUs (native mode runs a rank per GPU)",
            capabilities.device_count
        );
        capabilities.device_count = 1;
    }
    let (worker, worker_version, docker) = if launch_mode == LaunchMode::Docker {
        let d = docker_config(cli, &capabilities, work_dir)?;
        // The image is the run's own version (or the image its admin named):
        // the version that counts is this run-manager's, as the coordinator sees it.
        let cmd = WorkerCommand {
            program: d.program.clone(),
            args: Vec::new(),
        };
        (cmd, CLIENT_VERSION.to_string(), Some(d))
    } else {
        let (w, v) = worker_command(cli)?;
        (w, v, None)
    };
    if let Some(declared) = &cli.native_client_version {
        if declared != &worker_version {
            return Err(Error::Usage(format!(
                "`--native-client-version {declared}` but the worker is version `{worker_version}`\nhint: pass the version `{} --version` prints",
                worker.program.display()
            )));
        }
    }
    let rpc = RetryPolicy {
        retries: cli.rpc_retries,
        backoff: Backoff::doubling(
            Duration::from_millis(cli.rpc_backoff_ms),
            Duration::from_millis(cli.rpc_backoff_max_ms),
        ),
    };
    let heartbeat_override = cli
        .heartbeat_interval
        .map(|s| seconds("--heartbeat-interval", s))
        .transpose()?;
    let idle_timeout = match (cli.idle_timeout, cli.local) {
        (Some(s), _) => Some(Duration::from_secs(s)),
        (None, true) => Some(Duration::from_secs(60)),
        (None, false) => None,
    };
    Ok(ProviderConfig {
        name: cli.name.clone().unwrap_or_else(host_name),
        launch_mode,
        native_client_version: cli.native_client_version.clone(),
        poll_wait: cli.poll_wait,
        max_jobs: cli.max_jobs,
        idle_timeout,
        heartbeat_override,
        attempt: AttemptConfig {
            work_dir: work_dir.to_path_buf(),
            worker,
            docker,
            policy: PolicyContext {
                launch_mode,
                capabilities,
                worker_version,
                declared_native_version: cli.native_client_version.clone(),
            },
            max_restarts: cli.max_restarts,
            restart_backoff: Backoff::doubling(
                Duration::from_millis(cli.restart_backoff_ms),
                Duration::from_millis(cli.restart_backoff_max_ms),
            ),
            rpc,
            heartbeat_interval: Duration::from_secs(10),
            grace: seconds("--grace-period", cli.grace_period)?,
        },
    })
}

/// The coordinator to join: `--coordinator` with the TLS files and `--insecure`.
pub fn coordinator_target(cli: &Cli) -> Result<Target> {
    let addr = cli.coordinator.as_deref().ok_or_else(|| {
        Error::Usage(
            "no coordinator given\nhint: pass `--coordinator https://HOST:PORT` (or set `DFLASH_COORDINATOR`), or `--local` to run one here".into(),
        )
    })?;
    let files = TlsFiles {
        ca_file: cli.ca_file.clone(),
        client_cert: cli.client_cert.clone(),
        client_key: cli.client_key.clone(),
    };
    Target::new(addr, &files, cli.insecure)
}

/// The provider token: `--token` > `--token-file` / `DFLASH_PROVIDER_TOKEN_FILE` > `DFLASH_PROVIDER_TOKEN`
/// (read by `lockdown::lock_down` before it scrubbed the environment).
pub fn provider_token(cli: &Cli) -> Result<(String, token::TokenSource)> {
    token::provider_token(
        cli.token.as_deref(),
        cli.token_file.as_deref(),
        cli.env_token.clone(),
    )
}

/// Create the work directory and return its absolute path.
pub fn prepare_work_dir(dir: &Path) -> Result<PathBuf> {
    std::fs::create_dir_all(dir).map_err(Error::io("cannot create work directory", dir))?;
    dir.canonicalize()
        .map_err(Error::io("cannot resolve work directory", dir))
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[test]
    fn version_output() {
        assert_eq!(
            parse_version_output("dflash-native-client 0.1.0 (commit abc, python 3.11.7)\n"),
            Some("0.1.0".into())
        );
        assert_eq!(
            parse_version_output("dflash-native-client 1.2.3-rc.1+b5"),
            Some("1.2.3-rc.1+b5".into())
        );
        assert_eq!(parse_version_output("python 3.11"), None);
        assert_eq!(parse_version_output(""), None);
        assert_eq!(parse_version_output("dflash-native-client $(rm -rf)"), None);
    }

    #[test]
    fn tokens_may_start_with_a_hyphen() {
        let cli = Cli::try_parse_from(["run-manager", "--token", "-Qx_y", "--coordinator", "h:1"])
            .expect("parse");
        assert_eq!(cli.token.as_deref(), Some("-Qx_y"));
    }

    #[test]
    fn launch_mode_auto_is_docker_only_on_linux_cuda() {
        let cuda = device::cuda_capabilities(&device::parse_nvidia_smi("81559, 9.0"));
        let cpu = device::detect(device::DeviceChoice::Cpu).expect("cpu");
        let parse = |args: &[&str]| {
            let mut v = vec!["run-manager"];
            v.extend_from_slice(args);
            Cli::try_parse_from(v).expect("parse")
        };
        let auto = parse(&[]);
        let want = if cfg!(target_os = "linux") {
            LaunchMode::Docker
        } else {
            LaunchMode::Native
        };
        assert_eq!(resolve_launch_mode(&auto, &cuda), want);
        assert_eq!(resolve_launch_mode(&auto, &cpu), LaunchMode::Native);
        // An explicit native client or worker command keeps auto native.
        let nc = parse(&["--native-client", "/x/nc"]);
        assert_eq!(resolve_launch_mode(&nc, &cuda), LaunchMode::Native);
        // `--local` runs this environment's worker unless Docker is asked for.
        assert_eq!(
            resolve_launch_mode(&parse(&["--local"]), &cuda),
            LaunchMode::Native
        );
        let local_docker = parse(&["--local", "--launch-mode", "docker"]);
        assert_eq!(
            resolve_launch_mode(&local_docker, &cuda),
            LaunchMode::Docker
        );
        let explicit = parse(&["--launch-mode", "docker"]);
        assert_eq!(resolve_launch_mode(&explicit, &cpu), LaunchMode::Docker);
        assert_eq!(
            resolve_launch_mode(&parse(&["--launch-mode", "native"]), &cuda),
            LaunchMode::Native
        );
    }

    #[test]
    fn docker_mode_errors_are_clear() {
        let work = std::env::temp_dir();
        let cpu = device::detect(device::DeviceChoice::Cpu).expect("cpu");
        let cli = Cli::try_parse_from([
            "run-manager",
            "--launch-mode",
            "docker",
            "--docker",
            "/nonexistent/docker",
        ])
        .expect("parse");
        let err = docker_config(&cli, &cpu, &work).expect_err("no docker");
        assert_eq!(err.exit_code(), 1);
        assert!(err.to_string().contains("hint:"), "{err}");
        let mixed = Cli::try_parse_from([
            "run-manager",
            "--launch-mode",
            "docker",
            "--worker-cmd",
            "sh",
        ])
        .expect("parse");
        let err = docker_config(&mixed, &cpu, &work).expect_err("mixed");
        assert!(err.to_string().contains("native launch mode"), "{err}");
        // `sh` stands in for docker: the configuration is built and GPUs follow the backend.
        let ok = Cli::try_parse_from(["run-manager", "--launch-mode", "docker", "--docker", "sh"])
            .expect("parse");
        let d = docker_config(&ok, &cpu, &work).expect("config");
        assert!(!d.gpus);
        assert!(d.program.is_absolute());
        assert_eq!(d.repository, docker::DEFAULT_IMAGE_REPOSITORY);
        // Extra read-only mounts must exist; they are resolved to absolute paths.
        let tmp = std::env::temp_dir();
        let tmp_s = tmp.to_str().expect("utf8");
        let mounts = Cli::try_parse_from([
            "run-manager",
            "--launch-mode",
            "docker",
            "--docker",
            "sh",
            "--docker-mount",
            tmp_s,
        ])
        .expect("parse");
        let d = docker_config(&mounts, &cpu, &work).expect("config");
        assert_eq!(d.ro_mounts, vec![tmp.canonicalize().expect("tmp")]);
        let missing = Cli::try_parse_from([
            "run-manager",
            "--launch-mode",
            "docker",
            "--docker",
            "sh",
            "--docker-mount",
            "/nonexistent/models",
        ])
        .expect("parse");
        let err = docker_config(&missing, &cpu, &work).expect_err("missing mount");
        assert!(
            err.to_string()
                .contains("--docker-mount /nonexistent/models"),
            "{err}"
        );
    }

    #[test]
    fn every_launch_mode_offers_job_graphs() {
        let work = std::env::temp_dir();
        for args in [
            &["--device", "cpu", "--worker-cmd", "sh"][..],
            &["--device", "cpu", "--worker-cmd", "sh", "--cpu-ranks", "2"],
            &[
                "--device",
                "cpu",
                "--launch-mode",
                "docker",
                "--docker",
                "sh",
            ],
        ] {
            let mut v = vec!["run-manager"];
            v.extend_from_slice(args);
            let cli = Cli::try_parse_from(v).expect("parse");
            let cfg = provider_config(&cli, &work).expect("config");
            let features = &cfg.attempt.policy.capabilities.features;
            assert!(
                features.iter().any(|f| f == device::JOB_GRAPH_FEATURE),
                "{args:?}: {features:?}"
            );
        }
    }

    #[test]
    fn worker_cmd_counts_as_this_version() {
        let cli =
            Cli::try_parse_from(["run-manager", "--worker-cmd", "python -m dflash_worker.job"])
                .expect("parse");
        let (cmd, v) = worker_command(&cli).expect("ok");
        assert_eq!(cmd.program, PathBuf::from("python"));
        assert_eq!(v, CLIENT_VERSION);
    }

    #[test]
    fn native_client_flag_forms() {
        let bare = Cli::try_parse_from(["run-manager", "--native-client"]).expect("parse");
        assert_eq!(bare.native_client, Some(None));
        let with = Cli::try_parse_from(["run-manager", "--native-client", "/x/nc"]).expect("parse");
        assert_eq!(with.native_client, Some(Some(PathBuf::from("/x/nc"))));
        assert!(
            Cli::try_parse_from(["run-manager", "--native-client", "/x", "--worker-cmd", "y"])
                .is_err()
        );
        assert!(Cli::try_parse_from(["run-manager", "--local", "--coordinator", "h:1"]).is_err());
        assert!(Cli::try_parse_from(["run-manager", "--spec", "s.json"]).is_err());
        // A native client that does not exist is a user error with a hint.
        let missing = Cli::try_parse_from(["run-manager", "--native-client", "/nonexistent/nc"])
            .expect("parse");
        let err = worker_command(&missing).expect_err("missing");
        assert_eq!(err.exit_code(), 1);
        assert!(err.to_string().contains("hint:"));
    }
}
