//! The `--local` coordinator: `python -m dflash_worker.coordinator serve` as a
//! child process, plaintext on 127.0.0.1 (port 0), its state (SQLite and the
//! artifact store) under the work directory, the admin token in its
//! environment; stopped (SIGTERM, then killed) when the run is done.

use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};

use crate::error::{Error, Result};
use crate::worker::process;

/// A coordinator child process; killed when dropped.
pub struct EmbeddedCoordinator {
    child: Child,
    /// `HOST:PORT` it listens on.
    pub address: String,
    pub admin_token: String,
}

/// 32 random bytes from the OS, hex-encoded.
pub fn random_token() -> Result<String> {
    use std::io::Read;
    let mut buf = [0u8; 32];
    std::fs::File::open("/dev/urandom")
        .and_then(|mut f| f.read_exact(&mut buf))
        .map_err(Error::io("cannot read", "/dev/urandom"))?;
    Ok(buf.iter().map(|b| format!("{b:02x}")).collect())
}

/// The interpreter for the coordinator: the flag, else `python3` next to this
/// binary (a venv's bin/), else `$VIRTUAL_ENV/bin/python`, else `python3`.
pub fn find_python(flag: Option<&Path>) -> PathBuf {
    if let Some(p) = flag {
        return p.to_path_buf();
    }
    if let Some(dir) = std::env::current_exe()
        .ok()
        .and_then(|e| e.parent().map(Path::to_path_buf))
    {
        let p = dir.join("python3");
        if p.is_file() {
            return p;
        }
    }
    if let Some(venv) = std::env::var_os(crate::env_vars::VIRTUAL_ENV) {
        let p = PathBuf::from(venv).join("bin/python");
        if p.is_file() {
            return p;
        }
    }
    PathBuf::from("python3")
}

/// The coordinator's `serve` variables for TLS, which `--local` never wants.
const SERVE_TLS_VARS: [&str; 3] = [
    crate::env_vars::COORDINATOR_TLS_CERT,
    crate::env_vars::COORDINATOR_TLS_KEY,
    crate::env_vars::COORDINATOR_TLS_CLIENT_CA,
];

/// The embedded coordinator's command: plaintext on 127.0.0.1 (port 0), its
/// state under `state_dir`, the admin token in its environment and the TLS
/// variables out of it (the shell may have them set for another coordinator;
/// `--local` dials plaintext).
fn serve_command(python: &Path, state_dir: &Path, extra: &[&str], admin_token: &str) -> Command {
    let mut cmd = Command::new(python);
    cmd.args([
        "-m",
        "dflash_worker.coordinator",
        "serve",
        "--listen",
        "127.0.0.1:0",
        "--db",
    ])
    .arg(state_dir.join("coordinator.db"))
    .arg("--artifact-store")
    .arg(state_dir.join("artifacts"))
    .args(extra)
    // Through the environment: its command line is readable by other users.
    .env(crate::env_vars::ADMIN_TOKEN, admin_token);
    for var in SERVE_TLS_VARS {
        cmd.env_remove(var);
    }
    cmd.stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        // Its own process group: a Ctrl-C in the terminal must reach only the
        // run-manager, which still needs the coordinator to hand the job back.
        .process_group(0)
        .kill_on_drop(true);
    cmd
}

impl EmbeddedCoordinator {
    /// Start `python -m dflash_worker.coordinator serve` under `state_dir`
    /// (its database and artifact store) and wait for its "listening" line.
    pub async fn start(python: &Path, state_dir: &Path) -> Result<Self> {
        Self::start_with_args(python, state_dir, &[]).await
    }

    /// [`EmbeddedCoordinator::start`] with extra `serve` flags (e.g. `--lease-ttl 1` in tests).
    pub async fn start_with_args(python: &Path, state_dir: &Path, extra: &[&str]) -> Result<Self> {
        std::fs::create_dir_all(state_dir).map_err(Error::io("cannot create", state_dir))?;
        let admin_token = random_token()?;
        let mut child = serve_command(python, state_dir, extra, &admin_token)
            .spawn()
            .map_err(|e| {
                Error::Usage(format!(
                    "cannot start the embedded coordinator with `{}`: {e}\nhint: pass `--python PATH` (the environment's python with dflash_worker installed)",
                    python.display()
                ))
            })?;
        let stdout = child
            .stdout
            .take()
            .ok_or_else(|| Error::Internal("coordinator stdout was not piped".into()))?;
        let mut lines = BufReader::new(stdout).lines();
        let first = tokio::time::timeout(Duration::from_secs(60), lines.next_line()).await;
        let line = match first {
            Ok(Ok(Some(line))) => line,
            Ok(Ok(None)) | Ok(Err(_)) => {
                let status = child.wait().await.ok();
                return Err(Error::Coordinator(format!(
                    "`{} -m dflash_worker.coordinator serve` exited ({}) before it listened; its errors are above",
                    python.display(),
                    status.map(|s| process::describe_exit(&s)).unwrap_or_else(|| "unknown status".into())
                )));
            }
            Err(_) => {
                return Err(Error::Coordinator(
                    "did not report its address within 60 s".into(),
                ))
            }
        };
        let info: serde_json::Value = serde_json::from_str(&line).map_err(|e| {
            Error::Coordinator(format!(
                "first stdout line is not JSON ({e}): `{}`",
                line.chars().take(200).collect::<String>()
            ))
        })?;
        let address = info
            .get("address")
            .and_then(|a| a.as_str())
            .ok_or_else(|| {
                Error::Coordinator(format!(
                    "first stdout line has no `address`: `{}`",
                    line.chars().take(200).collect::<String>()
                ))
            })?
            .to_string();
        // Keep draining stdout so the coordinator never blocks on a full pipe.
        tokio::spawn(async move { while let Ok(Some(_)) = lines.next_line().await {} });
        tracing::info!(%address, "embedded coordinator listening");
        Ok(EmbeddedCoordinator {
            child,
            address,
            admin_token,
        })
    }

    /// SIGTERM the coordinator and wait (briefly) for it to exit.
    pub async fn stop(mut self) {
        if let Some(pid) = self.child.id() {
            let _ = process::signal(pid, libc::SIGTERM);
        }
        if tokio::time::timeout(Duration::from_secs(10), self.child.wait())
            .await
            .is_err()
        {
            let _ = self.child.start_kill();
            let _ = self.child.wait().await;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn embedded_coordinator_gets_no_tls_variables_but_the_admin_token() {
        let cmd = serve_command(Path::new("python3"), Path::new("/state"), &[], "secret");
        let envs: std::collections::HashMap<_, _> = cmd
            .as_std()
            .get_envs()
            .map(|(k, v)| (k.to_string_lossy().into_owned(), v.map(|v| v.to_owned())))
            .collect();
        for var in ["DFLASH_TLS_CERT", "DFLASH_TLS_KEY", "DFLASH_TLS_CLIENT_CA"] {
            // Present with no value: removed from what the child inherits.
            assert_eq!(envs.get(var), Some(&None), "{var}: {envs:?}");
        }
        assert_eq!(envs.get("DFLASH_ADMIN_TOKEN"), Some(&Some("secret".into())));
        let args: Vec<_> = cmd.as_std().get_args().collect();
        assert!(
            args.windows(2).any(|w| w == ["--listen", "127.0.0.1:0"]),
            "{args:?}"
        );
        assert!(
            !args
                .iter()
                .any(|a| a.to_string_lossy().starts_with("--tls")),
            "{args:?}"
        );
    }
    #[test]
    fn tokens_are_random_hex() {
        let a = random_token().expect("token");
        let b = random_token().expect("token");
        assert_eq!(a.len(), 64);
        assert_ne!(a, b);
        assert!(a.bytes().all(|c| c.is_ascii_hexdigit()));
    }
}
