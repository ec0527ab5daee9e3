//! Turn the parsed command line into the provider's configuration: worker
//! command, versions, device capabilities, retry and restart policies.

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use crate::attempt::AttemptConfig;
use crate::backoff::Backoff;
use crate::cli::{Cli, LaunchModeArg};
use crate::client::RetryPolicy;
use crate::device;
use crate::error::{Error, Result};
use crate::policy::PolicyContext;
use crate::proto::LaunchMode;
use crate::provider::ProviderConfig;
use crate::version::CLIENT_VERSION;
use crate::worker::WorkerCommand;

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

/// The worker command and the version it counts as.
pub fn worker_command(cli: &Cli) -> Result<(WorkerCommand, String)> {
    if cli.launch_mode == LaunchModeArg::Docker {
        return Err(Error::Usage(
            "`--launch-mode docker` is not implemented yet\nhint: use `--launch-mode native` (the default) with the native client".into(),
        ));
    }
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
    let (worker, worker_version) = worker_command(cli)?;
    if let Some(declared) = &cli.native_client_version {
        if declared != &worker_version {
            return Err(Error::Usage(format!(
                "`--native-client-version {declared}` but the worker is version `{worker_version}`\nhint: pass the version `{} --version` prints",
                worker.program.display()
            )));
        }
    }
    let capabilities = device::detect(cli.device)?;
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
        launch_mode: LaunchMode::Native,
        native_client_version: cli.native_client_version.clone(),
        poll_wait: cli.poll_wait,
        max_jobs: cli.max_jobs,
        idle_timeout,
        heartbeat_override,
        attempt: AttemptConfig {
            work_dir: work_dir.to_path_buf(),
            worker,
            policy: PolicyContext {
                launch_mode: LaunchMode::Native,
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
            inline_max_bytes: cli.inline_artifacts_max_bytes,
        },
    })
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
    fn docker_mode_is_a_clear_error() {
        let cli = Cli::try_parse_from(["run-manager", "--launch-mode", "docker"]).expect("parse");
        let err = worker_command(&cli).expect_err("docker");
        assert_eq!(err.exit_code(), 1);
        assert!(err.to_string().contains("not implemented yet"), "{err}");
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
