//! The worker child process: launch, event stream (stdout), log relay
//! (stderr), signals.
//!
//! The worker always runs as a separate process in its own process group, so
//! a crash, OOM kill or MPS abort leaves the run-manager alive to report and
//! restart it, and a Ctrl-C in the terminal reaches the run-manager only (it
//! forwards SIGTERM and waits for the checkpoint).

use std::ffi::OsString;
use std::os::unix::process::ExitStatusExt;
use std::path::{Path, PathBuf};
use std::process::{ExitStatus, Stdio};

use tokio::io::BufReader;
use tokio::process::{Child, ChildStderr, ChildStdout, Command};
use tokio::sync::mpsc;
use tokio::task::JoinHandle;

use crate::env_vars;
use crate::error::{Error, Result};
use crate::worker::events::{parse_event, read_bounded_line, Line, WorkerEvent, MAX_LINE_BYTES};

/// The program (and leading arguments) that runs a job; `--job-dir DIR` is appended.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WorkerCommand {
    pub program: PathBuf,
    pub args: Vec<String>,
}

impl WorkerCommand {
    /// Split a command line on whitespace (no shell quoting).
    pub fn parse(line: &str) -> Result<Self> {
        let mut parts = line.split_whitespace();
        let program = parts
            .next()
            .ok_or_else(|| Error::Usage("`--worker-cmd` is empty".into()))?;
        Ok(WorkerCommand {
            program: PathBuf::from(program),
            args: parts.map(str::to_string).collect(),
        })
    }
}

/// Fields every relayed log line is tagged with.
#[derive(Debug, Clone)]
pub struct LogTags {
    pub run_id: String,
    pub job_id: String,
    pub attempt: u32,
    pub rank: u32,
}

/// A running worker: the process, its events and its log relay, as separate
/// parts so a supervisor can wait on the process while reading the events.
pub struct Worker {
    pub child: Child,
    pub pid: u32,
    /// Parsed events from stdout; closes when stdout does.
    pub events: mpsc::Receiver<WorkerEvent>,
    pub logs: LogRelay,
}

/// The tasks reading the worker's stdout (events) and stderr (logs); one pair per
/// rank when a job runs several (`crate::worker::ranks`).
pub struct LogRelay {
    stdout_tasks: Vec<JoinHandle<()>>,
    stderr_tasks: Vec<JoinHandle<()>>,
}

impl LogRelay {
    /// One relay for the workers of several relays.
    pub fn merge(relays: Vec<LogRelay>) -> LogRelay {
        let (mut stdout_tasks, mut stderr_tasks) = (Vec::new(), Vec::new());
        for r in relays {
            stdout_tasks.extend(r.stdout_tasks);
            stderr_tasks.extend(r.stderr_tasks);
        }
        LogRelay {
            stdout_tasks,
            stderr_tasks,
        }
    }

    /// Wait for the log relay to finish reading stderr (bounded: a grandchild
    /// holding the pipe open must not hang the run-manager).
    pub async fn finish(self, within: std::time::Duration) {
        let deadline = tokio::time::Instant::now() + within;
        for task in self.stderr_tasks {
            let _ = tokio::time::timeout_at(deadline, task).await;
        }
        for task in self.stdout_tasks {
            task.abort();
        }
    }
}

/// Start `cmd --job-dir job_dir` with piped stdout/stderr in a new process
/// group, with exactly the environment `env` (see `worker_env`) and
/// `PYTHONUNBUFFERED=1`.
pub fn spawn(
    cmd: &WorkerCommand,
    job_dir: &Path,
    env: Vec<(OsString, OsString)>,
    tags: LogTags,
) -> Result<Worker> {
    let mut command = Command::new(&cmd.program);
    command
        .args(&cmd.args)
        .arg("--job-dir")
        .arg(job_dir)
        .env_clear()
        .envs(env)
        .env(env_vars::PYTHONUNBUFFERED, "1")
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .process_group(0)
        .kill_on_drop(true);
    let mut child = command.spawn().map_err(|source| {
        let hint = if source.kind() == std::io::ErrorKind::NotFound {
            "\nhint: pass `--native-client PATH` or `--worker-cmd`, or install with `make install` so the native client sits next to run-manager"
        } else {
            ""
        };
        Error::Usage(format!("cannot start worker `{}`: {source}{hint}", cmd.program.display()))
    })?;
    let pid = child
        .id()
        .ok_or_else(|| Error::Internal("worker exited before its pid was read".into()))?;
    let stdout = child
        .stdout
        .take()
        .ok_or_else(|| Error::Internal("worker stdout was not piped".into()))?;
    let stderr = child
        .stderr
        .take()
        .ok_or_else(|| Error::Internal("worker stderr was not piped".into()))?;
    let (tx, events) = mpsc::channel(256);
    let stdout_task = tokio::spawn(read_events(stdout, tx, tags.clone()));
    let stderr_task = tokio::spawn(relay_logs(stderr, tags));
    Ok(Worker {
        child,
        pid,
        events,
        logs: LogRelay {
            stdout_tasks: vec![stdout_task],
            stderr_tasks: vec![stderr_task],
        },
    })
}

/// Parse the worker's stdout into events until it closes (or nobody listens).
async fn read_events(stdout: ChildStdout, tx: mpsc::Sender<WorkerEvent>, t: LogTags) {
    let mut r = BufReader::new(stdout);
    loop {
        match read_bounded_line(&mut r, MAX_LINE_BYTES).await {
            Ok(None) => break,
            Ok(Some(Line::TooLong(n))) => {
                tracing::warn!(run_id = %t.run_id, job_id = %t.job_id, rank = t.rank, "ignored a {n}-byte line on worker stdout (limit {MAX_LINE_BYTES})")
            }
            Ok(Some(Line::Text(line))) if line.trim().is_empty() => {}
            Ok(Some(Line::Text(line))) => match parse_event(&line) {
                Ok(ev) => {
                    if tx.send(ev).await.is_err() {
                        break;
                    }
                }
                Err(e) => {
                    let shown: String = line.chars().take(200).collect();
                    tracing::warn!(run_id = %t.run_id, job_id = %t.job_id, rank = t.rank, "ignored worker stdout line ({e}): {shown}")
                }
            },
            Err(e) => {
                tracing::warn!(run_id = %t.run_id, job_id = %t.job_id, "reading worker stdout failed: {e}");
                break;
            }
        }
    }
}

/// Re-emit the worker's stderr lines as tagged log records until it closes.
async fn relay_logs(stderr: ChildStderr, tags: LogTags) {
    let mut r = BufReader::new(stderr);
    loop {
        match read_bounded_line(&mut r, MAX_LINE_BYTES).await {
            Ok(None) | Err(_) => break,
            Ok(Some(Line::TooLong(n))) => {
                relay_log(&tags, "warn", &format!("<{n}-byte log line dropped>"), None)
            }
            Ok(Some(Line::Text(line))) => relay_stderr_line(&tags, &line),
        }
    }
}

/// A worker log line: JSON `{"level": ..., "message": ..., "logger": ...}` or plain text.
/// Plain text is relayed as a warning: a well-behaved worker logs JSON, so
/// text is usually an uncaught traceback.
pub fn relay_stderr_line(tags: &LogTags, line: &str) {
    if line.trim().is_empty() {
        return;
    }
    match serde_json::from_str::<serde_json::Value>(line) {
        Ok(v) if v.is_object() => {
            let level = v
                .get("level")
                .and_then(|l| l.as_str())
                .unwrap_or("info")
                .to_ascii_lowercase();
            let message = v
                .get("message")
                .or_else(|| v.get("msg"))
                .and_then(|m| m.as_str())
                .map(str::to_string)
                .unwrap_or_else(|| line.to_string());
            let logger = v.get("logger").and_then(|l| l.as_str());
            relay_log(tags, &level, &message, logger);
        }
        _ => relay_log(tags, "warn", line, None),
    }
}

fn relay_log(tags: &LogTags, level: &str, message: &str, logger: Option<&str>) {
    let logger = logger.unwrap_or("worker");
    let (run_id, job_id, attempt, rank) = (&tags.run_id, &tags.job_id, tags.attempt, tags.rank);
    match level {
        "critical" | "fatal" | "error" => {
            tracing::error!(target: "worker", %run_id, %job_id, attempt, rank, logger, "{message}")
        }
        "warning" | "warn" => {
            tracing::warn!(target: "worker", %run_id, %job_id, attempt, rank, logger, "{message}")
        }
        "debug" => {
            tracing::debug!(target: "worker", %run_id, %job_id, attempt, rank, logger, "{message}")
        }
        "trace" => {
            tracing::trace!(target: "worker", %run_id, %job_id, attempt, rank, logger, "{message}")
        }
        _ => tracing::info!(target: "worker", %run_id, %job_id, attempt, rank, logger, "{message}"),
    }
}

/// Send `sig` to the worker process.
pub fn signal(pid: u32, sig: i32) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| std::io::Error::other("pid out of range"))?;
    // SAFETY: kill(2) has no memory-safety preconditions.
    let rc = unsafe { libc::kill(pid, sig) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// SIGKILL the worker's whole process group (its own children too, e.g. data loaders).
pub fn kill_group(pid: u32) -> std::io::Result<()> {
    let pid = libc::pid_t::try_from(pid).map_err(|_| std::io::Error::other("pid out of range"))?;
    // SAFETY: kill(2) has no memory-safety preconditions; a negative pid names the group.
    let rc = unsafe { libc::kill(-pid, libc::SIGKILL) };
    if rc == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// `exited with code 3`, `killed by signal 9 (SIGKILL)`.
pub fn describe_exit(status: &ExitStatus) -> String {
    if let Some(code) = status.code() {
        return format!("exited with code {code}");
    }
    match status.signal() {
        Some(sig) => format!("killed by signal {sig} ({})", signal_name(sig)),
        None => "ended for an unknown reason".to_string(),
    }
}

/// Conventional name of a signal number.
pub fn signal_name(sig: i32) -> &'static str {
    match sig {
        libc::SIGHUP => "SIGHUP",
        libc::SIGINT => "SIGINT",
        libc::SIGQUIT => "SIGQUIT",
        libc::SIGILL => "SIGILL",
        libc::SIGABRT => "SIGABRT",
        libc::SIGBUS => "SIGBUS",
        libc::SIGFPE => "SIGFPE",
        libc::SIGKILL => "SIGKILL",
        libc::SIGSEGV => "SIGSEGV",
        libc::SIGPIPE => "SIGPIPE",
        libc::SIGTERM => "SIGTERM",
        libc::SIGUSR1 => "SIGUSR1",
        libc::SIGUSR2 => "SIGUSR2",
        _ => "?",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn worker_cmd_parsing() {
        let c = WorkerCommand::parse("  python -m dflash_worker.job ").expect("ok");
        assert_eq!(c.program, PathBuf::from("python"));
        assert_eq!(c.args, vec!["-m", "dflash_worker.job"]);
        assert!(WorkerCommand::parse("   ").is_err());
    }

    #[tokio::test]
    async fn spawns_relays_events_and_reports_signals() {
        let dir = std::env::temp_dir().join(format!("rm-worker-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        // A shell worker: one good event, garbage, then waits to be killed.
        let script = r#"echo '{"event":"progress","phase":"train","step":1}'; echo 'garbage'; echo '{"event":"bogus"}'; echo '{"event":"done"}'; echo 'log line' >&2; exec sleep 30"#;
        let cmd = WorkerCommand {
            program: "sh".into(),
            args: vec!["-c".into(), script.into(), "worker".into()],
        };
        let tags = LogTags {
            run_id: "r".into(),
            job_id: "j".into(),
            attempt: 1,
            rank: 0,
        };
        let mut w = spawn(
            &cmd,
            &dir,
            crate::worker::environment::native(std::env::vars_os()),
            tags,
        )
        .expect("spawn");
        let first = w.events.recv().await.expect("event");
        assert!(matches!(first, WorkerEvent::Progress(ref p) if p.step == 1));
        assert_eq!(w.events.recv().await, Some(WorkerEvent::Done));
        signal(w.pid, libc::SIGKILL).expect("kill");
        let status = w.child.wait().await.expect("wait");
        assert_eq!(describe_exit(&status), "killed by signal 9 (SIGKILL)");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn the_child_gets_exactly_the_given_environment() {
        let dir = std::env::temp_dir().join(format!("rm-worker-env-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let parent: Vec<(std::ffi::OsString, std::ffi::OsString)> = [
            ("PATH", std::env::var("PATH").unwrap_or_default()),
            ("HOME", "/home/p".into()),
            ("DFLASH_PROVIDER_TOKEN", "tok-provider-secret".into()),
            ("AWS_SECRET_ACCESS_KEY", "aws-secret-value".into()),
            ("MY_API_TOKEN", "my-token-value".into()),
        ]
        .into_iter()
        .map(|(k, v)| (k.into(), v.into()))
        .collect();
        // `$2` is the job directory (`--job-dir DIR` is appended).
        let cmd = WorkerCommand {
            program: "sh".into(),
            args: vec!["-c".into(), r#"env > "$2/env.txt""#.into(), "worker".into()],
        };
        let tags = LogTags {
            run_id: "r".into(),
            job_id: "j".into(),
            attempt: 1,
            rank: 0,
        };
        let mut w =
            spawn(&cmd, &dir, crate::worker::environment::native(parent), tags).expect("spawn");
        assert!(w.child.wait().await.expect("wait").success());
        let env = std::fs::read_to_string(dir.join("env.txt")).expect("env.txt");
        for secret in [
            "DFLASH_PROVIDER_TOKEN",
            "tok-provider-secret",
            "AWS_SECRET_ACCESS_KEY",
            "aws-secret-value",
            "MY_API_TOKEN",
            "my-token-value",
        ] {
            assert!(
                !env.contains(secret),
                "`{secret}` reached the worker:\n{env}"
            );
        }
        assert!(env.lines().any(|l| l == "HOME=/home/p"), "{env}");
        assert!(env.lines().any(|l| l == "PYTHONUNBUFFERED=1"), "{env}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn missing_program_is_a_user_error() {
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .expect("rt");
        rt.block_on(async {
            let cmd = WorkerCommand {
                program: "/nonexistent/dflash-native-client".into(),
                args: vec![],
            };
            let tags = LogTags {
                run_id: "r".into(),
                job_id: "j".into(),
                attempt: 1,
                rank: 0,
            };
            let err = spawn(&cmd, Path::new("/tmp"), Vec::new(), tags)
                .err()
                .expect("error");
            assert_eq!(err.exit_code(), 1);
            assert!(err.to_string().contains("hint:"), "{err}");
        });
    }
}
