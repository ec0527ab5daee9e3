//! End-to-end tests: the real Python coordinator on loopback, the real
//! run-manager binary and the real native client running the `noop` stage.
//!
//! They skip (with a message) when `.venv/bin/python` or the coordinator /
//! job modules are missing, so `cargo test` works before `make install`.
//! The native client is another crate's binary (`native-client/`), which
//! `cargo test --workspace` builds next to `run-manager` (see [`native_client`]).
//! The `--help` snapshot needs nothing and always runs
//! (`UPDATE_SNAPSHOTS=1 cargo test` rewrites it after an intended change).

use std::io::{BufRead, BufReader};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use run_manager::commands::local::embedded::EmbeddedCoordinator;
use run_manager::coordinator::client::admin_client;
use run_manager::coordinator::transport::Target;
use run_manager::proto::{
    download_artifact_response, AdminDownloadRequest, ArtifactInfo, CancelJobRequest,
    CreateProviderRequest, CreateRunRequest, GetRunRequest, ListArtifactsRequest,
    RequestCheckpointRequest, RevokeProviderRequest, RunSpec,
};
use sha2::Digest;

const RUN_MANAGER: &str = env!("CARGO_BIN_EXE_run-manager");

/// The native client next to the run-manager binary. Cargo names only a
/// package's own binaries (`CARGO_BIN_EXE_*`); `cargo test --workspace`
/// builds this one too, because its crate has integration tests of its own.
fn native_client() -> PathBuf {
    let p = Path::new(RUN_MANAGER).with_file_name("dflash-native-client");
    assert!(
        p.is_file(),
        "`{}` is missing\nhint: run `cargo test --workspace` (or `cargo build -p dflash-native-client` first)",
        p.display()
    );
    p
}

fn repo_root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The venv's python if it can import the coordinator and the job module.
fn python() -> Option<PathBuf> {
    let py = repo_root().join(".venv/bin/python");
    if !py.exists() {
        eprintln!("SKIP: `{}` is missing (run `make install`)", py.display());
        return None;
    }
    let ok = Command::new(&py)
        .args([
            "-c",
            "import dflash_worker.coordinator.cli, dflash_worker.job",
        ])
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    if !ok {
        eprintln!(
            "SKIP: `{}` cannot import dflash_worker.coordinator / dflash_worker.job",
            py.display()
        );
        return None;
    }
    Some(py)
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("rm-it-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("mkdir");
    d
}

fn venv_dir() -> PathBuf {
    repo_root().join(".venv")
}

/// A run-manager command with a clean DFLASH_* environment and fast retry/restart settings.
fn run_manager(work: &Path) -> Command {
    let mut c = Command::new(RUN_MANAGER);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("DFLASH_") {
            c.env_remove(k);
        }
    }
    c.env("VIRTUAL_ENV", venv_dir())
        .env("NO_COLOR", "1")
        .arg("--work-dir")
        .arg(work)
        .arg("--native-client")
        .arg(native_client())
        .args(["--device", "cpu", "--log-format", "json"])
        .args([
            "--restart-backoff-ms",
            "50",
            "--rpc-backoff-ms",
            "50",
            "--heartbeat-interval",
            "0.2",
        ]);
    c
}

fn write_spec(dir: &Path, spec: serde_json::Value) -> PathBuf {
    let p = dir.join("run-spec.json");
    std::fs::write(&p, serde_json::to_vec_pretty(&spec).expect("json")).expect("write spec");
    p
}

/// The noop stage's final state after `steps` steps, computed independently of the Python code.
fn noop_final_state(steps: u64) -> String {
    let hex = |d: &[u8]| d.iter().map(|b| format!("{b:02x}")).collect::<String>();
    let mut state = hex(&sha2::Sha256::digest(b"dflash-noop-v1"));
    for k in 1..=steps {
        state = hex(&sha2::Sha256::digest(format!("{state}:{k}").as_bytes()));
    }
    state
}

fn sha256_hex(path: &Path) -> String {
    let bytes = std::fs::read(path).expect("read artifact");
    sha2::Sha256::digest(&bytes)
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect()
}

type Admin = run_manager::coordinator::client::AdminClient;

/// Every attempt's artifact records of a job (all pages).
async fn list_artifacts(admin: &mut Admin, run_id: &str, job_id: &str) -> Vec<ArtifactInfo> {
    let mut out = Vec::new();
    let mut page_token = String::new();
    loop {
        let page = admin
            .list_artifacts(ListArtifactsRequest {
                run_id: run_id.into(),
                job_id: job_id.into(),
                all_attempts: true,
                page_size: 0,
                page_token: page_token.clone(),
            })
            .await
            .expect("list artifacts")
            .into_inner();
        out.extend(page.artifacts);
        if page.next_page_token.is_empty() {
            return out;
        }
        page_token = page.next_page_token;
    }
}

/// The bytes of a job's final artifact `name`, fetched from the coordinator.
async fn download(admin: &mut Admin, run_id: &str, job_id: &str, name: &str) -> Vec<u8> {
    let mut stream = admin
        .download_artifact(AdminDownloadRequest {
            run_id: run_id.into(),
            job_id: job_id.into(),
            name: name.into(),
            ..Default::default()
        })
        .await
        .expect("download")
        .into_inner();
    let mut out = Vec::new();
    while let Some(m) = stream.message().await.expect("download stream") {
        if let Some(download_artifact_response::Msg::Chunk(c)) = m.msg {
            out.extend(c);
        }
    }
    out
}

fn json_lines(stderr: &str) -> Vec<serde_json::Value> {
    stderr
        .lines()
        .filter_map(|l| serde_json::from_str(l).ok())
        .collect()
}

fn show(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

/// Check the summary's single job: succeeded, and its report artifact, recorded
/// in the coordinator's store, is the exact bytes the worker wrote in the job
/// directory, with the state an uninterrupted run would reach.
fn check_report(summary: &serde_json::Value, steps: u64) -> serde_json::Value {
    let job = &summary["jobs"][0];
    assert_eq!(job["state"], "succeeded", "{summary:#}");
    let report = job["artifacts"]
        .as_array()
        .expect("artifacts")
        .iter()
        .find(|a| a["kind"] == "report")
        .expect("report artifact");
    let uri = report["uri"].as_str().expect("uri");
    let run_id = summary["run_id"].as_str().expect("run id");
    assert!(
        uri.starts_with(&format!("dflash-artifact://{run_id}/"))
            && uri.ends_with(report["name"].as_str().expect("name")),
        "{report}"
    );
    let path = PathBuf::from(report["path"].as_str().expect("path on this machine"));
    assert_eq!(report["sha256"].as_str(), Some(sha256_hex(&path).as_str()));
    let body: serde_json::Value =
        serde_json::from_slice(&std::fs::read(&path).expect("read")).expect("json");
    assert_eq!(
        body["state"].as_str(),
        Some(noop_final_state(steps).as_str()),
        "{body}"
    );
    body
}

/// A current-thread runtime and an embedded coordinator started inside it,
/// with state under `DIR/coord` and artifacts under `DIR/work/jobs`; returns
/// the work directory too. `args`: extra `serve` flags.
fn runtime_with_coordinator(
    py: &Path,
    dir: &Path,
    args: &[&str],
) -> (tokio::runtime::Runtime, EmbeddedCoordinator, PathBuf) {
    let rt = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("rt");
    let work = dir.join("work");
    std::fs::create_dir_all(work.join("jobs")).expect("mkdir");
    let coordinator = {
        let _guard = rt.enter();
        rt.block_on(EmbeddedCoordinator::start_with_args(
            py,
            &dir.join("coord"),
            args,
        ))
        .expect("coordinator")
    };
    (rt, coordinator, work)
}

#[test]
fn local_noop_job_end_to_end() {
    let Some(py) = python() else { return };
    let dir = temp_dir("local");
    let spec = write_spec(
        &dir,
        serde_json::json!({"spec": {"stages": ["noop"], "noop": {"steps": 5, "step_seconds": 0.02, "checkpoint_every": 2}}}),
    );
    // The shell's TLS settings for serving a coordinator are not the embedded
    // one's: it must serve the plaintext loopback `--local` dials (with these
    // files missing, a coordinator that read them would not even start).
    let absent = dir.join("absent.pem");
    let out = run_manager(&dir.join("work"))
        .args(["--local", "--json", "--python"])
        .arg(&py)
        .arg("--spec")
        .arg(&spec)
        .env("DFLASH_TLS_CERT", &absent)
        .env("DFLASH_TLS_KEY", &absent)
        .env("DFLASH_TLS_CLIENT_CA", &absent)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).expect("summary json");
    let body = check_report(&summary, 5);
    assert_eq!(body["resumed_from"], 0);
    let kinds: Vec<&str> = summary["jobs"][0]["artifacts"]
        .as_array()
        .expect("artifacts")
        .iter()
        .filter_map(|a| a["kind"].as_str())
        .collect();
    assert_eq!(
        kinds.iter().filter(|k| **k == "checkpoint").count(),
        2,
        "{kinds:?}"
    );
    // Worker logs are re-emitted tagged with run id and rank.
    let logs = json_lines(&String::from_utf8_lossy(&out.stderr));
    assert!(
        logs.iter().any(|l| l["message"] == "stage `noop` starting"
            && l["rank"] == 0
            && l["run_id"].is_string()),
        "{}",
        show(&out)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Spawn with stderr read line by line on a thread.
fn spawn_watched(mut cmd: Command) -> (Child, mpsc::Receiver<String>) {
    let mut child = cmd
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("spawn");
    let stderr = child.stderr.take().expect("stderr");
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        for line in BufReader::new(stderr).lines().map_while(Result::ok) {
            if tx.send(line).is_err() {
                break;
            }
        }
    });
    (child, rx)
}

/// Read lines until `pred` matches one; returns every line read.
fn wait_for(
    rx: &mpsc::Receiver<String>,
    seen: &mut Vec<String>,
    what: &str,
    pred: impl Fn(&serde_json::Value) -> bool,
) -> serde_json::Value {
    let deadline = Instant::now() + Duration::from_secs(60);
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        match rx.recv_timeout(left) {
            Ok(line) => {
                seen.push(line.clone());
                if let Ok(v) = serde_json::from_str::<serde_json::Value>(&line) {
                    if pred(&v) {
                        return v;
                    }
                }
            }
            Err(_) => panic!(
                "timed out waiting for {what}; stderr so far:\n{}",
                seen.join("\n")
            ),
        }
    }
}

fn finish(
    mut child: Child,
    rx: mpsc::Receiver<String>,
    mut seen: Vec<String>,
) -> (Option<i32>, String, Vec<String>) {
    let mut stdout = String::new();
    if let Some(mut out) = child.stdout.take() {
        use std::io::Read;
        out.read_to_string(&mut stdout).expect("stdout");
    }
    let status = child.wait().expect("wait");
    seen.extend(rx.iter());
    (status.code(), stdout, seen)
}

#[test]
fn sigkilled_worker_is_restarted_from_its_checkpoint_and_completes() {
    let Some(py) = python() else { return };
    let dir = temp_dir("sigkill");
    let steps = 10;
    let spec = write_spec(
        &dir,
        serde_json::json!({"spec": {"stages": ["noop"], "noop": {"steps": steps, "step_seconds": 0.15, "checkpoint_every": 3}}}),
    );
    let mut cmd = run_manager(&dir.join("work"));
    cmd.args(["--local", "--json", "--python"])
        .arg(&py)
        .arg("--spec")
        .arg(&spec);
    let (child, rx) = spawn_watched(cmd);
    let mut seen = Vec::new();
    let started = wait_for(&rx, &mut seen, "worker start", |v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("worker started"))
    });
    let pid = started["pid"].as_i64().expect("pid") as i32;
    wait_for(&rx, &mut seen, "first checkpoint", |v| {
        v["message"] == "artifact reported" && v["kind"] == "checkpoint"
    });
    // SAFETY: kill(2) on the worker's pid, read from the run-manager's log.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let (code, stdout, seen) = finish(child, rx, seen);
    let all = seen.join("\n");
    assert_eq!(code, Some(0), "stdout:\n{stdout}\nstderr:\n{all}");
    assert!(all.contains("killed by signal 9 (SIGKILL)"), "{all}");
    let summary: serde_json::Value = serde_json::from_str(&stdout).expect("summary");
    // Restarted within the same attempt, and the result equals an uninterrupted run's.
    assert_eq!(summary["jobs"][0]["attempts"], 1, "{summary:#}");
    let body = check_report(&summary, steps);
    // Resumed from a checkpoint (normally step 3; a slow machine may let the
    // worker reach a later one before the kill lands), never from scratch.
    let resumed = body["resumed_from"].as_u64().expect("resumed_from");
    assert!(resumed > 0 && resumed.is_multiple_of(3), "{body}");
    assert!(
        all.contains(&format!("restarting from checkpoint at step {resumed}")),
        "{all}"
    );
    assert_eq!(body["restart"], 1, "{body}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn worker_that_keeps_crashing_ends_the_attempt_retryable() {
    let Some(py) = python() else { return };
    let dir = temp_dir("crashloop");
    // `false` exits 1 at once, every time.
    let mut cmd = Command::new(RUN_MANAGER);
    cmd.env("NO_COLOR", "1")
        .arg("--work-dir")
        .arg(dir.join("work2"))
        .args([
            "--worker-cmd",
            "false",
            "--device",
            "cpu",
            "--log-format",
            "json",
            "--local",
            "--json",
        ])
        .args([
            "--max-restarts",
            "2",
            "--restart-backoff-ms",
            "10",
            "--python",
        ])
        .arg(&py)
        .arg("--spec")
        .arg(write_spec(&dir, serde_json::json!({})));
    let out = cmd.output().expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    // The coordinator requeues RETRYABLE attempts until its attempt limit, then fails the job.
    assert_eq!(out.status.code(), Some(3), "{}", show(&out));
    assert!(err.contains("worker failed 3 time(s)"), "{err}");
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).expect("summary");
    assert_eq!(summary["jobs"][0]["state"], "failed", "{summary:#}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stand-in worker: the first start commits a checkpoint (its
/// `manifest.json`, the one file a checkpoint artifact names) and crashes at
/// once, so the event may be read before or after the exit is seen; the
/// restart must find that manifest as `resume_checkpoint` in `spec.json`.
const CHECKPOINT_THEN_CRASH: &str = r#"#!/bin/sh
set -eu
job=$2
if grep -q '"restart": 0,' "$job/spec.json"; then
  d="$job/run/checkpoints/step-00000004"
  mkdir -p "$d"
  printf '{"step": 4}' > "$d/manifest.json"
  sha=$(sha256sum "$d/manifest.json" | cut -d' ' -f1)
  size=$(wc -c < "$d/manifest.json" | tr -d ' ')
  printf '{"event":"artifact","name":"checkpoints/step-00000004","kind":"checkpoint","path":"%s","sha256":"%s","size_bytes":%s,"step":4}\n' "$d/manifest.json" "$sha" "$size"
  exit 1
fi
if grep -qF "\"resume_checkpoint\": \"$job/run/checkpoints/step-00000004/manifest.json\"," "$job/spec.json" \
  && grep -q '"resume_step": 4,' "$job/spec.json"; then
  echo '{"event":"done"}'
  exit 0
fi
echo '{"event":"error","message":"spec.json does not name the committed manifest","retryable":false}'
exit 1
"#;

#[test]
fn checkpoint_announced_just_before_a_crash_is_what_the_restart_resumes_from() {
    use std::os::unix::fs::PermissionsExt;
    let Some(py) = python() else { return };
    let dir = temp_dir("ckpt-crash");
    let script = dir.join("worker.sh");
    std::fs::write(&script, CHECKPOINT_THEN_CRASH).expect("write");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let mut cmd = Command::new(RUN_MANAGER);
    cmd.env("NO_COLOR", "1")
        .arg("--work-dir")
        .arg(dir.join("work"))
        .arg("--worker-cmd")
        .arg(&script)
        .args([
            "--device",
            "cpu",
            "--log-format",
            "json",
            "--local",
            "--json",
        ])
        .args(["--restart-backoff-ms", "10", "--python"])
        .arg(&py)
        .arg("--spec")
        .arg(write_spec(&dir, serde_json::json!({})));
    let out = cmd.output().expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("restarting from checkpoint at step 4"),
        "{err}"
    );
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).expect("summary");
    let job = &summary["jobs"][0];
    assert_eq!(job["state"], "succeeded", "{summary:#}");
    assert_eq!(job["attempts"], 1, "{summary:#}");
    let ckpt = job["artifacts"]
        .as_array()
        .expect("artifacts")
        .iter()
        .find(|a| a["kind"] == "checkpoint")
        .expect("checkpoint artifact");
    assert_eq!(ckpt["step"], 4, "{ckpt}");
    assert!(
        ckpt["uri"]
            .as_str()
            .is_some_and(|u| u.starts_with("dflash-artifact://")
                && u.ends_with("/checkpoints/step-00000004")),
        "{ckpt}"
    );
    assert!(
        ckpt["path"]
            .as_str()
            .is_some_and(|p| p.ends_with("/run/checkpoints/step-00000004/manifest.json")),
        "{ckpt}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A run on `coordinator` with `spec_json`, and a provider token; returns (token, run id).
fn create_run(
    rt: &tokio::runtime::Runtime,
    admin: &mut Admin,
    name: &str,
    spec_json: &str,
) -> (String, String) {
    rt.block_on(async {
        let token = admin
            .create_provider(CreateProviderRequest { name: "it".into() })
            .await
            .expect("provider")
            .into_inner()
            .token;
        let run = admin
            .create_run(CreateRunRequest {
                spec: Some(RunSpec {
                    name: name.into(),
                    spec_json: spec_json.into(),
                    required_client_version: run_manager::version::CLIENT_VERSION.into(),
                    checkpoint_policy: "durable".into(),
                    max_local_ranks: 1,
                    num_jobs: 1,
                    ..Default::default()
                }),
            })
            .await
            .expect("run")
            .into_inner()
            .run
            .expect("run");
        (token, run.run_id)
    })
}

fn job_of(
    rt: &tokio::runtime::Runtime,
    admin: &mut Admin,
    run_id: &str,
) -> run_manager::proto::JobInfo {
    rt.block_on(admin.get_run(GetRunRequest {
        run_id: run_id.into(),
        ..Default::default()
    }))
    .expect("get run")
    .into_inner()
    .jobs
    .remove(0)
}

#[test]
fn a_provider_without_the_first_attempts_files_resumes_from_a_downloaded_checkpoint() {
    let Some(py) = python() else { return };
    let dir = temp_dir("resume-dl");
    let (rt, coordinator, _) = runtime_with_coordinator(&py, &dir, &[]);
    let _guard = rt.enter();
    let target = Target::loopback(&coordinator.address).expect("target");
    let mut admin = admin_client(&target, &coordinator.admin_token).expect("admin");
    let steps = 10;
    let (token, run_id) = create_run(
        &rt,
        &mut admin,
        "resume-elsewhere",
        &format!(
            r#"{{"stages":["noop"],"noop":{{"steps":{steps},"step_seconds":0.15,"checkpoint_every":3}}}}"#
        ),
    );
    let provider = |work: &Path| {
        let mut cmd = run_manager(work);
        cmd.args(["--coordinator", &coordinator.address, "--token", &token])
            .args(["--max-jobs", "1", "--max-restarts", "0"]);
        cmd
    };
    // First provider: its worker is killed once a checkpoint is uploaded; with no
    // restarts left the attempt ends RETRYABLE and the job is queued again.
    let first = dir.join("first");
    let (child, rx) = spawn_watched(provider(&first));
    let mut seen = Vec::new();
    let started = wait_for(&rx, &mut seen, "worker start", |v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("worker started"))
    });
    let pid = started["pid"].as_i64().expect("pid") as i32;
    let ck = wait_for(&rx, &mut seen, "an uploaded checkpoint", |v| {
        v["message"] == "artifact reported" && v["kind"] == "checkpoint"
    });
    assert!(
        ck["uri"]
            .as_str()
            .is_some_and(|u| u.starts_with("dflash-artifact://")),
        "{ck}"
    );
    // SAFETY: kill(2) on the worker's pid, read from the run-manager's log.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGKILL) }, 0);
    let (code, _, seen) = finish(child, rx, seen);
    let all = seen.join("\n");
    assert_eq!(code, Some(0), "{all}");
    let finished = json_lines(&all)
        .into_iter()
        .find(|l| l["message"] == "attempt finished")
        .unwrap_or_else(|| panic!("no `attempt finished` line:\n{all}"));
    assert_eq!(finished["outcome"], "Retryable", "{all}");
    // The first machine is gone: nothing of its job directory is left.
    std::fs::remove_dir_all(&first).expect("remove the first work dir");

    let second = dir.join("second");
    let out = provider(&second).output().expect("second provider");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    assert!(err.contains("downloaded the resume checkpoint"), "{err}");
    let job = job_of(&rt, &mut admin, &run_id);
    assert_eq!(
        (job.state.as_str(), job.attempts),
        ("succeeded", 2),
        "{err}"
    );
    let report = rt
        .block_on(list_artifacts(&mut admin, &run_id, &job.job_id))
        .into_iter()
        .filter_map(|i| i.artifact)
        .find(|a| a.kind == "report")
        .expect("report");
    let body: serde_json::Value = serde_json::from_slice(&rt.block_on(download(
        &mut admin,
        &run_id,
        &job.job_id,
        &report.name,
    )))
    .expect("report json");
    assert_eq!(
        body["state"].as_str(),
        Some(noop_final_state(steps).as_str()),
        "{body}"
    );
    let resumed = body["resumed_from"].as_u64().expect("resumed_from");
    assert!(resumed > 0 && resumed.is_multiple_of(3), "{body}");
    let manifest = second
        .canonicalize()
        .expect("second")
        .join("jobs")
        .join(&job.job_id)
        .join(format!(
            "resume/checkpoints/step-{resumed:06}/manifest.json"
        ));
    assert!(manifest.is_file(), "{}", manifest.display());
    rt.block_on(coordinator.stop());
    let _ = std::fs::remove_dir_all(&dir);
}

/// A stand-in worker whose checkpoint lists a file: attempt 1 commits it and
/// crashes; attempt 2 (on a machine without attempt 1's files) must find the
/// manifest and the file, downloaded, as its `resume_checkpoint`.
const CHECKPOINT_WITH_FILES: &str = r#"#!/bin/sh
set -eu
job=$2
if grep -q '"attempt": 1,' "$job/spec.json"; then
  d="$job/run/checkpoints/step-00000004"
  mkdir -p "$d"
  printf 'weights of step 4' > "$d/w.bin"
  wsha=$(sha256sum "$d/w.bin" | cut -d' ' -f1)
  printf '{"files": {"w.bin": {"sha256": "%s", "size": 17}}, "step": 4}' "$wsha" > "$d/manifest.json"
  sha=$(sha256sum "$d/manifest.json" | cut -d' ' -f1)
  size=$(wc -c < "$d/manifest.json" | tr -d ' ')
  printf '{"event":"artifact","name":"run/checkpoints/step-00000004/manifest.json","kind":"checkpoint","path":"%s","sha256":"%s","size_bytes":%s,"step":4}\n' "$d/manifest.json" "$sha" "$size"
  exit 1
fi
m="$job/resume/run/checkpoints/step-00000004/manifest.json"
if grep -qF "\"resume_checkpoint\": \"$m\"," "$job/spec.json" \
  && [ "$(cat "$job/resume/run/checkpoints/step-00000004/w.bin")" = "weights of step 4" ]; then
  echo '{"event":"done"}'
  exit 0
fi
echo '{"event":"error","message":"the downloaded checkpoint is not in spec.json","retryable":false}'
exit 1
"#;

#[test]
fn checkpoint_files_are_uploaded_before_their_manifest_and_downloaded_with_it() {
    use std::os::unix::fs::PermissionsExt;
    let Some(py) = python() else { return };
    let dir = temp_dir("ckpt-files");
    let script = dir.join("worker.sh");
    std::fs::write(&script, CHECKPOINT_WITH_FILES).expect("write");
    std::fs::set_permissions(&script, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    let (rt, coordinator, _) = runtime_with_coordinator(&py, &dir, &[]);
    let _guard = rt.enter();
    let target = Target::loopback(&coordinator.address).expect("target");
    let mut admin = admin_client(&target, &coordinator.admin_token).expect("admin");
    let (token, run_id) = create_run(&rt, &mut admin, "ckpt-files", r#"{"stages":["noop"]}"#);
    let provider = |work: &Path| {
        let mut cmd = Command::new(RUN_MANAGER);
        cmd.env("NO_COLOR", "1")
            .arg("--work-dir")
            .arg(work)
            .arg("--worker-cmd")
            .arg(&script)
            .args([
                "--device",
                "cpu",
                "--log-format",
                "json",
                "--rpc-backoff-ms",
                "50",
            ])
            .args(["--coordinator", &coordinator.address, "--token", &token])
            .args(["--max-jobs", "1", "--max-restarts", "0"]);
        cmd
    };
    let first = dir.join("first");
    let out = provider(&first).output().expect("first provider");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    std::fs::remove_dir_all(&first).expect("remove the first work dir");
    let out = provider(&dir.join("second"))
        .output()
        .expect("second provider");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let job = job_of(&rt, &mut admin, &run_id);
    assert_eq!(
        (job.state.as_str(), job.attempts),
        ("succeeded", 2),
        "{}",
        show(&out)
    );
    let records = rt.block_on(list_artifacts(&mut admin, &run_id, &job.job_id));
    let first_attempt: Vec<(String, String)> = records
        .iter()
        .filter(|i| i.attempt == 1)
        .filter_map(|i| i.artifact.as_ref())
        .map(|a| (a.name.clone(), a.kind.clone()))
        .collect();
    assert!(
        first_attempt.contains(&(
            "run/checkpoints/step-00000004/w.bin".into(),
            "checkpoint_file".into()
        )) && first_attempt.contains(&(
            "run/checkpoints/step-00000004/manifest.json".into(),
            "checkpoint".into()
        )),
        "{first_attempt:?}"
    );
    rt.block_on(coordinator.stop());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_upload_the_coordinator_refuses_fails_the_attempt() {
    let Some(py) = python() else { return };
    let dir = temp_dir("refused");
    // 100 bytes per attempt: the first checkpoint manifest (133 bytes) is over the quota.
    let (rt, coordinator, work) =
        runtime_with_coordinator(&py, &dir, &["--quota-attempt-bytes", "100"]);
    let _guard = rt.enter();
    let target = Target::loopback(&coordinator.address).expect("target");
    let mut admin = admin_client(&target, &coordinator.admin_token).expect("admin");
    let (token, run_id) = create_run(
        &rt,
        &mut admin,
        "over-quota",
        r#"{"stages":["noop"],"noop":{"steps":40,"step_seconds":0.05,"checkpoint_every":2}}"#,
    );
    let out = run_manager(&work)
        .args(["--coordinator", &coordinator.address, "--token", &token])
        .args(["--max-jobs", "1"])
        .output()
        .expect("run");
    let all = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let finished = json_lines(&all)
        .into_iter()
        .find(|l| l["message"] == "attempt finished")
        .unwrap_or_else(|| panic!("no `attempt finished` line:\n{all}"));
    assert_eq!(finished["outcome"], "Failed", "{all}");
    let reason = finished["reason"].as_str().expect("reason");
    assert!(
        reason.contains("the coordinator refused artifact `checkpoints/step-000002/manifest.json`")
            && reason.contains("(ResourceExhausted)"),
        "{reason}"
    );
    assert!(all.contains("killing the worker"), "{all}");
    let job = job_of(&rt, &mut admin, &run_id);
    assert_eq!(job.state, "failed", "{all}");
    rt.block_on(coordinator.stop());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn uploads_wait_out_a_coordinator_restart_and_the_attempt_still_succeeds() {
    let Some(py) = python() else { return };
    let dir = temp_dir("restart");
    let (rt, coordinator, work) = runtime_with_coordinator(&py, &dir, &[]);
    let _guard = rt.enter();
    let address = coordinator.address.clone();
    let target = Target::loopback(&address).expect("target");
    let mut admin = admin_client(&target, &coordinator.admin_token).expect("admin");
    let steps = 12;
    let (token, run_id) = create_run(
        &rt,
        &mut admin,
        "restart",
        &format!(
            r#"{{"stages":["noop"],"noop":{{"steps":{steps},"step_seconds":0.1,"checkpoint_every":2}}}}"#
        ),
    );
    let mut cmd = run_manager(&work);
    cmd.args([
        "--coordinator",
        &address,
        "--token",
        &token,
        "--max-jobs",
        "1",
    ]);
    let (child, rx) = spawn_watched(cmd);
    let mut seen = Vec::new();
    wait_for(&rx, &mut seen, "the first upload", |v| {
        v["message"] == "artifact reported" && v["kind"] == "checkpoint"
    });
    // Down for longer than the rest of the job takes: its later checkpoints and
    // its report are announced while nothing answers.
    drop(admin);
    rt.block_on(coordinator.stop());
    std::thread::sleep(Duration::from_millis(2000));
    let coordinator = rt
        .block_on(EmbeddedCoordinator::start_with_args(
            &py,
            &dir.join("coord"),
            &["--listen", &address],
        ))
        .expect("coordinator restarted");
    let (code, _, seen) = finish(child, rx, seen);
    let all = seen.join("\n");
    assert_eq!(code, Some(0), "{all}");
    assert!(
        all.contains("artifact transfer failed") || all.contains("coordinator unavailable"),
        "{all}"
    );
    let finished = json_lines(&all)
        .into_iter()
        .find(|l| l["message"] == "attempt finished")
        .unwrap_or_else(|| panic!("no `attempt finished` line:\n{all}"));
    assert_eq!(finished["outcome"], "Succeeded", "{all}");
    let mut admin = admin_client(&target, &coordinator.admin_token).expect("admin");
    let job = job_of(&rt, &mut admin, &run_id);
    assert_eq!(
        (job.state.as_str(), job.attempts),
        ("succeeded", 1),
        "{all}"
    );
    let names: Vec<String> = rt
        .block_on(list_artifacts(&mut admin, &run_id, &job.job_id))
        .into_iter()
        .filter_map(|i| i.artifact.map(|a| a.name))
        .collect();
    assert!(
        names.iter().any(|n| n.ends_with("noop-report.json")),
        "{names:?}\n{all}"
    );
    assert!(
        names.contains(&format!("checkpoints/step-{steps:06}/manifest.json")),
        "{names:?}\n{all}"
    );
    rt.block_on(coordinator.stop());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn version_mismatch_exits_10_and_approval_lets_it_run() {
    let Some(py) = python() else { return };
    let dir = temp_dir("version");
    let spec = write_spec(
        &dir,
        serde_json::json!({"required_client_version": "9.9.9"}),
    );
    let out = run_manager(&dir.join("work"))
        .args(["--local", "--python"])
        .arg(&py)
        .arg("--spec")
        .arg(&spec)
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(10), "{}", show(&out));
    assert!(
        err.contains("upgrade required") && err.contains("`9.9.9`") && err.contains("hint:"),
        "{err}"
    );

    // The run admin approves this native client's version: with
    // --native-client-version the same run requirement is accepted.
    let version = run_manager::version::CLIENT_VERSION;
    let spec = write_spec(
        &dir,
        serde_json::json!({"required_client_version": "9.9.9", "approve_native_versions": [version],
                           "spec": {"stages": ["noop"], "noop": {"steps": 2, "step_seconds": 0.0}}}),
    );
    let out = run_manager(&dir.join("work"))
        .args([
            "--local",
            "--json",
            "--native-client-version",
            version,
            "--python",
        ])
        .arg(&py)
        .arg("--spec")
        .arg(&spec)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).expect("summary");
    check_report(&summary, 2);

    // Declaring a version the native client is not is a user error, before any network call.
    let out = run_manager(&dir.join("work"))
        .args(["--local", "--native-client-version", "9.9.9", "--python"])
        .arg(&py)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn cancel_directive_stops_the_worker_with_a_checkpoint() {
    let Some(py) = python() else { return };
    let dir = temp_dir("cancel");
    let (rt, coordinator, work) = runtime_with_coordinator(&py, &dir, &[]);
    // Channels are created inside the runtime (tonic spawns onto it).
    let _guard = rt.enter();
    let target = Target::loopback(&coordinator.address).expect("target");
    let mut admin = admin_client(&target, &coordinator.admin_token).expect("admin");
    let (token, run) = rt.block_on(async {
        let token = admin
            .create_provider(CreateProviderRequest { name: "it".into() })
            .await
            .expect("provider")
            .into_inner()
            .token;
        let run = admin
            .create_run(CreateRunRequest {
                spec: Some(RunSpec {
                    name: "cancel-me".into(),
                    spec_json: r#"{"stages":["noop"],"noop":{"steps":200,"step_seconds":0.05,"checkpoint_every":1000}}"#.into(),
                    required_client_version: run_manager::version::CLIENT_VERSION.into(),
                    checkpoint_policy: "durable".into(),
                    max_local_ranks: 1,
                    num_jobs: 1,
                    ..Default::default()
                }),
            })
            .await
            .expect("run")
            .into_inner()
            .run
            .expect("run");
        (token, run)
    });
    let mut cmd = run_manager(&work);
    cmd.args([
        "--coordinator",
        &coordinator.address,
        "--token",
        &token,
        "--max-jobs",
        "1",
    ]);
    let (child, rx) = spawn_watched(cmd);
    let mut seen = Vec::new();
    wait_for(&rx, &mut seen, "training progress", |v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("stage `noop` starting"))
    });
    let job_id = rt.block_on(async {
        let r = admin
            .get_run(GetRunRequest {
                run_id: run.run_id.clone(),
                ..Default::default()
            })
            .await
            .expect("get")
            .into_inner();
        r.jobs[0].job_id.clone()
    });
    // CHECKPOINT_NOW -> SIGUSR1 -> the worker commits a checkpoint it would not
    // otherwise write (checkpoint_every is larger than the run) and keeps going.
    rt.block_on(admin.request_checkpoint(RequestCheckpointRequest {
        job_id: job_id.clone(),
    }))
    .expect("request checkpoint");
    let ck = wait_for(&rx, &mut seen, "requested checkpoint", |v| {
        v["message"] == "artifact reported" && v["kind"] == "checkpoint"
    });
    assert!(seen
        .iter()
        .any(|l| l.contains("CHECKPOINT_NOW from the coordinator")));
    let requested_step = ck["artifact"].as_str().expect("artifact name").to_string();
    rt.block_on(admin.cancel_job(CancelJobRequest {
        job_id: job_id.clone(),
    }))
    .expect("cancel");
    let (code, _stdout, seen) = finish(child, rx, seen);
    let all = seen.join("\n");
    assert_eq!(code, Some(0), "{all}");
    assert!(all.contains("CANCEL from the coordinator"), "{all}");
    let final_state = rt.block_on(async {
        admin
            .get_run(GetRunRequest {
                run_id: run.run_id.clone(),
                ..Default::default()
            })
            .await
            .expect("get")
            .into_inner()
    });
    let job = &final_state.jobs[0];
    assert_eq!(job.job_id, job_id);
    assert_eq!(job.state, "cancelled", "{all}");
    // Two checkpoints, neither on the regular schedule (checkpoint_every is larger
    // than the run): one on CHECKPOINT_NOW, a later one on SIGTERM before exiting.
    let mut ckpts: Vec<(String, u64)> = rt
        .block_on(list_artifacts(&mut admin, &run.run_id, &job_id))
        .into_iter()
        .filter_map(|i| i.artifact)
        .filter(|a| a.kind == "checkpoint")
        .map(|a| (a.name.clone(), a.step))
        .collect();
    ckpts.sort_by_key(|c| c.1);
    assert_eq!(ckpts.len(), 2, "{ckpts:?}\n{all}");
    assert_eq!(ckpts[0].0, requested_step);
    assert!(
        0 < ckpts[0].1 && ckpts[0].1 < ckpts[1].1 && ckpts[1].1 < 200,
        "{ckpts:?}"
    );
    assert!(
        all.contains("worker stopped after committing a checkpoint"),
        "{all}"
    );
    rt.block_on(coordinator.stop());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn sigterm_to_run_manager_stops_the_worker_and_exits_143() {
    let Some(py) = python() else { return };
    let dir = temp_dir("sigterm");
    let spec = write_spec(
        &dir,
        serde_json::json!({"spec": {"stages": ["noop"], "noop": {"steps": 200, "step_seconds": 0.05, "checkpoint_every": 1000}}}),
    );
    let mut cmd = run_manager(&dir.join("work"));
    cmd.args(["--local", "--python"])
        .arg(&py)
        .arg("--spec")
        .arg(&spec);
    let (child, rx) = spawn_watched(cmd);
    let mut seen = Vec::new();
    wait_for(&rx, &mut seen, "stage start", |v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("stage `noop` starting"))
    });
    let pid = child.id() as i32;
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGTERM) }, 0);
    let (code, _stdout, seen) = finish(child, rx, seen);
    let all = seen.join("\n");
    assert_eq!(code, Some(143), "{all}");
    // The worker checkpointed before exiting, and the attempt was handed back.
    assert!(
        all.contains("worker stopped after committing a checkpoint"),
        "{all}"
    );
    let finished = json_lines(&all)
        .into_iter()
        .find(|l| l["message"] == "attempt finished")
        .unwrap_or_else(|| panic!("no `attempt finished` line:\n{all}"));
    assert_eq!(finished["outcome"], "Retryable", "{all}");
    assert_eq!(finished["job_state"], "queued", "{all}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn local_run_this_machine_cannot_take_fails_after_the_idle_timeout() {
    let Some(py) = python() else { return };
    let dir = temp_dir("idle");
    // The coordinator never leases ephemeral runs to native providers.
    let spec = write_spec(&dir, serde_json::json!({"checkpoint_policy": "ephemeral"}));
    let out = run_manager(&dir.join("work"))
        .args([
            "--local",
            "--idle-timeout",
            "1",
            "--poll-wait",
            "1",
            "--python",
        ])
        .arg(&py)
        .arg("--spec")
        .arg(&spec)
        .output()
        .expect("run");
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    assert!(
        err.contains("this provider cannot take them") && err.contains("checkpoint_policy"),
        "{err}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn stale_lease_kills_the_worker_and_abandons_the_attempt() {
    let Some(py) = python() else { return };
    let dir = temp_dir("stale");
    let (rt, coordinator, work) = runtime_with_coordinator(&py, &dir, &["--lease-ttl", "1"]);
    // Channels are created inside the runtime (tonic spawns onto it).
    let _guard = rt.enter();
    let target = Target::loopback(&coordinator.address).expect("target");
    let mut admin = admin_client(&target, &coordinator.admin_token).expect("admin");
    let token = rt.block_on(async {
        let token = admin
            .create_provider(CreateProviderRequest { name: "it".into() })
            .await
            .expect("provider")
            .into_inner()
            .token;
        admin
            .create_run(CreateRunRequest {
                spec: Some(RunSpec {
                    name: "stale".into(),
                    spec_json: r#"{"stages":["noop"],"noop":{"steps":200,"step_seconds":0.05}}"#
                        .into(),
                    required_client_version: run_manager::version::CLIENT_VERSION.into(),
                    checkpoint_policy: "durable".into(),
                    max_local_ranks: 1,
                    num_jobs: 1,
                    ..Default::default()
                }),
            })
            .await
            .expect("run");
        token
    });
    let mut cmd = run_manager(&work);
    cmd.args([
        "--coordinator",
        &coordinator.address,
        "--token",
        &token,
        "--max-jobs",
        "1",
    ]);
    let (child, rx) = spawn_watched(cmd);
    let mut seen = Vec::new();
    wait_for(&rx, &mut seen, "stage start", |v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("stage `noop` starting"))
    });
    // Freeze the run-manager past the lease TTL: the coordinator expires the
    // lease, and the run-manager's next write is refused ABORTED.
    let pid = child.id() as i32;
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    std::thread::sleep(Duration::from_millis(2500));
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let (code, _stdout, seen) = finish(child, rx, seen);
    let all = seen.join("\n");
    assert_eq!(code, Some(0), "{all}");
    assert!(all.contains("lease is stale"), "{all}");
    assert!(all.contains("killed by signal 9 (SIGKILL)"), "{all}");
    assert!(!all.contains("attempt finished"), "{all}");
    rt.block_on(coordinator.stop());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn token_refused_on_a_reopened_heartbeat_stream_stops_the_worker_and_exits_1() {
    let Some(py) = python() else { return };
    let dir = temp_dir("revoked");
    let (rt, coordinator, work) = runtime_with_coordinator(&py, &dir, &[]);
    let _guard = rt.enter();
    let address = coordinator.address.clone();
    let target = Target::loopback(&address).expect("target");
    let mut admin = admin_client(&target, &coordinator.admin_token).expect("admin");
    let provider = rt.block_on(async {
        let provider = admin
            .create_provider(CreateProviderRequest { name: "it".into() })
            .await
            .expect("provider")
            .into_inner();
        admin
            .create_run(CreateRunRequest {
                spec: Some(RunSpec {
                    name: "revoked".into(),
                    // No checkpoint (so no UploadArtifact) before the revocation.
                    spec_json: r#"{"stages":["noop"],"noop":{"steps":400,"step_seconds":0.05,"checkpoint_every":1000}}"#.into(),
                    required_client_version: run_manager::version::CLIENT_VERSION.into(),
                    checkpoint_policy: "durable".into(),
                    max_local_ranks: 1,
                    num_jobs: 1,
                    ..Default::default()
                }),
            })
            .await
            .expect("run");
        provider
    });
    let mut cmd = run_manager(&work);
    cmd.args([
        "--coordinator",
        &address,
        "--token",
        &provider.token,
        "--max-jobs",
        "1",
    ]);
    let (child, rx) = spawn_watched(cmd);
    let mut seen = Vec::new();
    wait_for(&rx, &mut seen, "stage start", |v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("stage `noop` starting"))
    });
    // Freeze the run-manager, revoke the provider and restart the coordinator
    // on the same port: the open stream (which would answer ABORTED) is gone,
    // and the stream the run-manager reopens is refused UNAUTHENTICATED.
    let pid = child.id() as i32;
    // SAFETY: kill(2) on our own child.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGSTOP) }, 0);
    let revoked = rt
        .block_on(admin.revoke_provider(RevokeProviderRequest {
            provider_id: provider.provider_id.clone(),
        }))
        .expect("revoke")
        .into_inner();
    assert_eq!(revoked.aborted_leases, 1);
    drop(admin);
    rt.block_on(coordinator.stop());
    let coordinator = rt
        .block_on(EmbeddedCoordinator::start_with_args(
            &py,
            &dir.join("coord"),
            &["--listen", &address],
        ))
        .expect("coordinator restarted");
    assert_eq!(coordinator.address, address);
    // SAFETY: as above.
    assert_eq!(unsafe { libc::kill(pid, libc::SIGCONT) }, 0);
    let (code, _stdout, seen) = finish(child, rx, seen);
    let all = seen.join("\n");
    assert_eq!(code, Some(1), "{all}");
    assert!(
        all.contains("the coordinator refused this provider's token: killing the worker"),
        "{all}"
    );
    assert!(all.contains("killed by signal 9 (SIGKILL)"), "{all}");
    assert!(!all.contains("attempt finished"), "{all}");
    assert!(
        all.contains("abandoned and its worker stopped: coordinator call `Heartbeat` refused this provider: this provider's token was revoked (Unauthenticated)"),
        "{all}"
    );
    assert!(
        all.contains("hint: check the provider token (`--token`, `--token-file`"),
        "{all}"
    );
    rt.block_on(coordinator.stop());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn rate_limited_after_failed_authentications_exits_1_with_the_coordinators_hint() {
    let Some(py) = python() else { return };
    let dir = temp_dir("ratelimit");
    let (rt, coordinator, work) =
        runtime_with_coordinator(&py, &dir, &["--auth-failure-limit", "1"]);
    let attempt = || {
        run_manager(&work)
            .args([
                "--coordinator",
                &coordinator.address,
                "--token",
                "not-a-token",
            ])
            .output()
            .expect("run")
    };
    let first = attempt();
    assert_eq!(first.status.code(), Some(1), "{}", show(&first));
    assert!(
        String::from_utf8_lossy(&first.stderr).contains("(Unauthenticated)"),
        "{}",
        show(&first)
    );
    let throttled = attempt();
    let err = String::from_utf8_lossy(&throttled.stderr);
    assert_eq!(throttled.status.code(), Some(1), "{}", show(&throttled));
    assert!(
        err.contains("error: coordinator call `Register` failed: too many failed authentications from `127.0.0.1`")
            && err.contains("retry after")
            && err.contains("(ResourceExhausted)\nhint: check the provider token (`--token`)"),
        "{err}"
    );
    rt.block_on(coordinator.stop());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn help_snapshot() {
    let out = Command::new(RUN_MANAGER)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .arg("--help")
        .output()
        .expect("run");
    assert!(out.status.success());
    let got = String::from_utf8(out.stdout).expect("utf8");
    let path = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/snapshots/help.txt");
    if std::env::var_os("UPDATE_SNAPSHOTS").is_some() {
        std::fs::create_dir_all(path.parent().expect("dir")).expect("mkdir");
        std::fs::write(&path, &got).expect("write snapshot");
        return;
    }
    let want = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        got == want,
        "`run-manager --help` changed; if intended, rerun with UPDATE_SNAPSHOTS=1 and review the diff of `{}`\n--- got\n{got}",
        path.display()
    );
}

// ---------------------------------------------------------------------------
// Docker launch mode, against a stand-in `docker` (no Docker engine is needed):
// a shell script placed first on PATH that records every call and, for `run`,
// checks the job directory is bind-mounted and runs the entrypoint (the real
// native client) natively on it. A stand-in `nvidia-smi` makes this a "CUDA"
// machine, so the default launch mode picks Docker and `--gpus all` is passed.

const FAKE_DOCKER: &str = r#"#!/usr/bin/env bash
# Stand-in for the docker CLI: records its arguments (one call per line,
# separated by \x1f), and for `run` executes the entrypoint natively.
set -u
state=$FAKE_DOCKER_STATE
{ printf '%s\037' "$@"; printf '\n'; } >> "$state/calls.log"
cmd=$1; shift
# The environment the CLI itself got (the entrypoint below inherits it, plus the `--env`s).
[ "$cmd" = run ] && env > "$state/run-env.log"
pid_of() { cat "$state/$1.pid" 2>/dev/null; }
case "$cmd" in
  pull|image) exit 0 ;;
  kill)
    [ "$1" = --signal ] || { echo "fake docker: unexpected kill args $*" >&2; exit 125; }
    pid=$(pid_of "$3") || { echo "Error response from daemon: No such container: $3" >&2; exit 1; }
    kill -"$2" "$pid"; exit 0 ;;
  stop)
    [ "$1" = --time ] || { echo "fake docker: unexpected stop args $*" >&2; exit 125; }
    pid=$(pid_of "$3") || { echo "Error response from daemon: No such container: $3" >&2; exit 1; }
    kill -TERM "$pid"
    for _ in $(seq $(( $2 * 10 ))); do kill -0 "$pid" 2>/dev/null || exit 0; sleep 0.1; done
    kill -KILL "$pid" 2>/dev/null; exit 0 ;;
  rm)
    [ "$1" = -f ] || { echo "fake docker: unexpected rm args $*" >&2; exit 125; }
    pid=$(pid_of "$2") || { echo "Error response from daemon: No such container: $2" >&2; exit 1; }
    kill -KILL "$pid" 2>/dev/null; rm -f "$state/$2.pid"; exit 0 ;;
  run) ;;
  *) echo "fake docker: unknown command $cmd" >&2; exit 125 ;;
esac
name=""; workdir=""; mounts=()
while [ $# -gt 0 ]; do
  case "$1" in
    --rm|--init|--read-only|--sig-proxy=false) shift ;;
    --name) name=$2; shift 2 ;;
    --mount) mounts+=("$2"); shift 2 ;;
    --workdir) workdir=$2; shift 2 ;;
    --env) export "${2?}"; shift 2 ;;
    --gpus|--cap-drop|--security-opt|--tmpfs|--shm-size|--user|--label) shift 2 ;;
    -*) echo "fake docker: unknown run option $1" >&2; exit 125 ;;
    *) break ;;
  esac
done
shift  # the image
[ "$1" = --job-dir ] || { echo "fake docker: entrypoint args are not --job-dir: $*" >&2; exit 125; }
mounted=no
for m in "${mounts[@]}"; do
  [ "$m" = "type=bind,source=$2,target=$2" ] && mounted=yes
done
[ "$mounted" = yes ] || { echo "fake docker: job dir $2 is not bind-mounted" >&2; exit 125; }
[ -z "$workdir" ] || cd "$workdir" || exit 125
mkdir -p "$HOME"
"$FAKE_DOCKER_ENTRYPOINT" "$@" &
pid=$!
echo "$pid" > "$state/$name.pid"
wait "$pid"; rc=$?
rm -f "$state/$name.pid"
exit "$rc"
"#;

/// A bin directory holding the stand-in `docker` and `nvidia-smi`, and the state directory.
fn fake_docker(dir: &Path) -> (PathBuf, PathBuf) {
    use std::os::unix::fs::PermissionsExt;
    let bin = dir.join("fake-bin");
    let state = dir.join("fake-docker-state");
    std::fs::create_dir_all(&bin).expect("mkdir");
    std::fs::create_dir_all(&state).expect("mkdir");
    for (name, body) in [
        ("docker", FAKE_DOCKER.to_string()),
        ("nvidia-smi", "#!/bin/sh\necho '81559, 9.0'\n".to_string()),
    ] {
        let p = bin.join(name);
        std::fs::write(&p, body).expect("write");
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    }
    (bin, state)
}

/// A run-manager with the stand-ins first on PATH and no launch-mode or worker flags.
fn run_manager_docker(work: &Path, bin: &Path, state: &Path) -> Command {
    let mut c = Command::new(RUN_MANAGER);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("DFLASH_") {
            c.env_remove(k);
        }
    }
    let path = std::env::var_os("PATH").unwrap_or_default();
    let mut dirs = vec![bin.to_path_buf()];
    dirs.extend(std::env::split_paths(&path));
    c.env("PATH", std::env::join_paths(dirs).expect("PATH"))
        .env("VIRTUAL_ENV", venv_dir())
        .env("FAKE_DOCKER_STATE", state)
        .env("FAKE_DOCKER_ENTRYPOINT", native_client())
        .env("NO_COLOR", "1")
        .arg("--work-dir")
        .arg(work)
        .args(["--log-format", "json", "--grace-period", "5"])
        .args([
            "--restart-backoff-ms",
            "50",
            "--rpc-backoff-ms",
            "50",
            "--heartbeat-interval",
            "0.2",
        ]);
    c
}

/// The stand-in's recorded calls, each as its argument list.
fn docker_calls(state: &Path) -> Vec<Vec<String>> {
    std::fs::read_to_string(state.join("calls.log"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            l.split('\x1f')
                .filter(|a| !a.is_empty())
                .map(str::to_string)
                .collect()
        })
        .collect()
}

/// The value after `flag` in `args`, for every occurrence.
fn values<'a>(args: &'a [String], flag: &str) -> Vec<&'a str> {
    args.windows(2)
        .filter(|w| w[0] == flag)
        .map(|w| w[1].as_str())
        .collect()
}

/// Check one recorded `docker run` call: hardening flags, the job directory's
/// bind mount, the container name and the entrypoint arguments.
fn check_docker_run(run: &[String], image: &str, job_dir: &Path, name: &str) {
    let shown = run.join(" ");
    let job = job_dir.to_str().expect("utf8");
    assert_eq!(run[0], "run", "{shown}");
    assert!(run.contains(&"--rm".to_string()), "{shown}");
    assert!(run.contains(&"--read-only".to_string()), "{shown}");
    assert!(!shown.contains("--privileged"), "{shown}");
    assert_eq!(values(run, "--gpus"), ["all"], "{shown}");
    assert_eq!(values(run, "--cap-drop"), ["ALL"], "{shown}");
    assert_eq!(
        values(run, "--security-opt"),
        ["no-new-privileges"],
        "{shown}"
    );
    assert_eq!(values(run, "--name"), [name], "{shown}");
    assert_eq!(
        values(run, "--mount"),
        [format!("type=bind,source={job},target={job}").as_str()],
        "{shown}"
    );
    assert!(
        values(run, "--tmpfs")
            .iter()
            .any(|t| t.starts_with("/tmp:")),
        "{shown}"
    );
    // The image, then the entrypoint's own arguments.
    let n = run.len();
    assert_eq!(&run[n - 3..], [image, "--job-dir", job], "{shown}");
}

/// Credentials a provider's shell may hold; none may reach a worker.
const SECRETS: [(&str, &str); 4] = [
    ("DFLASH_PROVIDER_TOKEN", "tok-provider-5ecret"),
    ("DFLASH_ADMIN_TOKEN", "tok-admin-5ecret"),
    ("AWS_SECRET_ACCESS_KEY", "aws-5ecret-value"),
    ("MY_API_TOKEN", "my-api-5ecret"),
];

/// The recorded `docker run` passes no secret (by name or value) with `--env`
/// or anywhere else, and the CLI's own environment holds none either.
fn check_no_secrets(run: &[String], state: &Path) {
    let env = values(run, "--env");
    let names: Vec<&str> = env
        .iter()
        .map(|e| e.split('=').next().unwrap_or(""))
        .collect();
    assert_eq!(
        names,
        [
            "HOME",
            "TMPDIR",
            "USER",
            "LOGNAME",
            "PYTHONUNBUFFERED",
            "XDG_CACHE_HOME",
            "TORCH_HOME",
            "TORCHINDUCTOR_CACHE_DIR",
            "TRITON_CACHE_DIR",
            "HF_HOME",
            "MPLCONFIGDIR"
        ],
        "{run:?}"
    );
    let cli_env = std::fs::read_to_string(state.join("run-env.log")).expect("run-env.log");
    for (k, v) in SECRETS {
        assert!(
            !run.iter().any(|a| a.contains(k) || a.contains(v)),
            "`{k}` passed to docker run: {run:?}"
        );
        assert!(
            !cli_env.contains(k) && !cli_env.contains(v),
            "`{k}` in the docker CLI's environment:\n{cli_env}"
        );
    }
}

#[test]
fn docker_mode_runs_the_image_with_a_hardened_container() {
    let Some(py) = python() else { return };
    let dir = temp_dir("docker-local");
    let (bin, state) = fake_docker(&dir);
    let spec = write_spec(
        &dir,
        serde_json::json!({"spec": {"stages": ["noop"], "noop": {"steps": 3, "step_seconds": 0.02, "checkpoint_every": 2}}}),
    );
    let work = dir.join("work");
    let mut cmd = run_manager_docker(&work, &bin, &state);
    // Secrets in the run-manager's environment must not reach the container.
    for (k, v) in SECRETS {
        cmd.env(k, v);
    }
    let out = cmd
        // `--local` defaults to native; Docker is asked for explicitly.
        .args(["--local", "--launch-mode", "docker", "--json", "--python"])
        .arg(&py)
        .arg("--spec")
        .arg(&spec)
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).expect("summary json");
    check_report(&summary, 3);
    let job_id = summary["jobs"][0]["job_id"].as_str().expect("job id");
    let job_dir = work.canonicalize().expect("work").join("jobs").join(job_id);
    let name = format!("dflash-{job_id}-a1-r0");
    // No image in the run: the default repository, tagged with the run's client version.
    let image = format!(
        "{}:{}",
        run_manager::worker::docker::DEFAULT_IMAGE_REPOSITORY,
        run_manager::version::CLIENT_VERSION
    );
    let calls = docker_calls(&state);
    let verbs: Vec<&str> = calls.iter().map(|c| c[0].as_str()).collect();
    assert_eq!(verbs, ["pull", "rm", "run", "rm"], "{calls:?}");
    assert_eq!(calls[0], ["pull", image.as_str()]);
    assert_eq!(calls[1], ["rm", "-f", name.as_str()]);
    check_docker_run(&calls[2], &image, &job_dir, &name);
    assert_eq!(calls[3], ["rm", "-f", name.as_str()]);
    check_no_secrets(&calls[2], &state);
    // Worker logs come through the docker CLI and are re-emitted tagged.
    let logs = json_lines(&String::from_utf8_lossy(&out.stderr));
    assert!(
        logs.iter().any(|l| l["message"] == "stage `noop` starting"
            && l["rank"] == 0
            && l["job_id"] == job_id
            && l["run_id"].is_string()),
        "{}",
        show(&out)
    );
    assert!(
        logs.iter().any(|l| l["container"] == name.as_str()),
        "{}",
        show(&out)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn docker_mode_cancel_stops_and_removes_the_container() {
    let Some(py) = python() else { return };
    let dir = temp_dir("docker-cancel");
    let (bin, state) = fake_docker(&dir);
    let (rt, coordinator, work) = runtime_with_coordinator(&py, &dir, &[]);
    // Channels are created inside the runtime (tonic spawns onto it).
    let _guard = rt.enter();
    let target = Target::loopback(&coordinator.address).expect("target");
    let mut admin = admin_client(&target, &coordinator.admin_token).expect("admin");
    let image = format!("registry.example:5000/dflash@sha256:{}", "0f".repeat(32));
    let (token, run) = rt.block_on(async {
        let token = admin
            .create_provider(CreateProviderRequest { name: "it".into() })
            .await
            .expect("provider")
            .into_inner()
            .token;
        let run = admin
            .create_run(CreateRunRequest {
                spec: Some(RunSpec {
                    name: "docker-cancel".into(),
                    spec_json: r#"{"stages":["noop"],"noop":{"steps":200,"step_seconds":0.05,"checkpoint_every":1000}}"#.into(),
                    required_client_version: run_manager::version::CLIENT_VERSION.into(),
                    checkpoint_policy: "durable".into(),
                    max_local_ranks: 1,
                    num_jobs: 1,
                    image: image.clone(),
                    ..Default::default()
                }),
            })
            .await
            .expect("run")
            .into_inner()
            .run
            .expect("run");
        (token, run)
    });
    // No `--launch-mode`: with (stand-in) NVIDIA GPUs on Linux, Docker is the default.
    let mut cmd = run_manager_docker(&work, &bin, &state);
    if !cfg!(target_os = "linux") {
        cmd.args(["--launch-mode", "docker"]);
    }
    cmd.args([
        "--coordinator",
        &coordinator.address,
        "--token",
        &token,
        "--max-jobs",
        "1",
    ]);
    let (child, rx) = spawn_watched(cmd);
    let mut seen = Vec::new();
    wait_for(&rx, &mut seen, "stage start", |v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("stage `noop` starting"))
    });
    let job_id = rt.block_on(async {
        admin
            .get_run(GetRunRequest {
                run_id: run.run_id.clone(),
                ..Default::default()
            })
            .await
            .expect("get")
            .into_inner()
            .jobs[0]
            .job_id
            .clone()
    });
    let name = format!("dflash-{job_id}-a1-r0");
    // CHECKPOINT_NOW reaches the container as `docker kill --signal USR1`.
    rt.block_on(admin.request_checkpoint(RequestCheckpointRequest {
        job_id: job_id.clone(),
    }))
    .expect("request checkpoint");
    wait_for(&rx, &mut seen, "requested checkpoint", |v| {
        v["message"] == "artifact reported" && v["kind"] == "checkpoint"
    });
    rt.block_on(admin.cancel_job(CancelJobRequest {
        job_id: job_id.clone(),
    }))
    .expect("cancel");
    let (code, _stdout, seen) = finish(child, rx, seen);
    let all = seen.join("\n");
    assert_eq!(code, Some(0), "{all}");
    let job = rt.block_on(async {
        admin
            .get_run(GetRunRequest {
                run_id: run.run_id.clone(),
                ..Default::default()
            })
            .await
            .expect("get")
            .into_inner()
            .jobs
            .remove(0)
    });
    assert_eq!(job.state, "cancelled", "{all}");
    // The worker committed a checkpoint on SIGTERM (from `docker stop`) before exiting.
    assert!(
        all.contains("worker stopped after committing a checkpoint"),
        "{all}"
    );
    let calls = docker_calls(&state);
    let verbs: Vec<&str> = calls.iter().map(|c| c[0].as_str()).collect();
    assert_eq!(
        verbs,
        ["pull", "rm", "run", "kill", "stop", "rm"],
        "{calls:?}\n{all}"
    );
    assert_eq!(calls[0], ["pull", image.as_str()]);
    let job_dir = work
        .canonicalize()
        .expect("work")
        .join("jobs")
        .join(&job_id);
    check_docker_run(&calls[2], &image, &job_dir, &name);
    assert_eq!(calls[3], ["kill", "--signal", "USR1", name.as_str()]);
    assert_eq!(calls[4], ["stop", "--time", "5", name.as_str()]);
    assert_eq!(calls[5], ["rm", "-f", name.as_str()]);
    // Nothing of the container is left running.
    assert!(!state.join(format!("{name}.pid")).exists());
    rt.block_on(coordinator.stop());
    let _ = std::fs::remove_dir_all(&dir);
}

// Least privilege against a compromised worker (`run_manager::lockdown`): a worker of the
// same user can read the run-manager's `/proc/PID/cmdline` and, while it is dumpable,
// `/proc/PID/environ`. The run-manager below joins a closed port and keeps retrying Register,
// so it lives (with its credentials read) until killed.

/// A value no test environment holds by chance.
#[cfg(target_os = "linux")]
fn marker(tag: &str) -> String {
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .map(|d| d.as_nanos())
        .unwrap_or(0);
    format!("{tag}-{}-{nanos}", std::process::id())
}

/// `program` (a run-manager binary) joining a closed port, with `args` and `env` added to a
/// clean DFLASH_* environment.
#[cfg(target_os = "linux")]
fn lingering_run_manager(
    program: &Path,
    work: &Path,
    args: &[&str],
    env: &[(&str, &str)],
) -> Command {
    let mut c = Command::new(program);
    for (k, _) in std::env::vars_os() {
        if k.to_string_lossy().starts_with("DFLASH_") {
            c.env_remove(k);
        }
    }
    c.env("NO_COLOR", "1")
        .envs(env.iter().copied())
        .args(["--coordinator", "http://127.0.0.1:9", "--work-dir"])
        .arg(work)
        .args([
            "--worker-cmd",
            "sleep 600",
            "--device",
            "cpu",
            "--log-format",
            "json",
        ])
        .args([
            "--rpc-retries",
            "1000",
            "--rpc-backoff-ms",
            "100",
            "--rpc-backoff-max-ms",
            "300",
        ])
        .args(args);
    c
}

/// Start `cmd` and return it once it logged where its token came from (its credentials are
/// read and scrubbed by then), with that line.
#[cfg(target_os = "linux")]
fn start_until_connecting(cmd: Command) -> (Child, serde_json::Value) {
    let (mut child, rx) = spawn_watched(cmd);
    let mut seen = Vec::new();
    let line = wait_for(&rx, &mut seen, "the connection line", |v| {
        v["message"]
            .as_str()
            .is_some_and(|m| m.starts_with("connecting over"))
    });
    // Keep draining stderr so the process never blocks on a full pipe.
    std::thread::spawn(move || rx.iter().for_each(drop));
    assert!(child.try_wait().expect("try_wait").is_none(), "{seen:?}");
    (child, line)
}

/// `/proc/PID/environ`, or `None` where this user may not read it: the run-manager is not
/// dumpable, so only root (or `CAP_SYS_PTRACE`) can.
#[cfg(target_os = "linux")]
fn proc_environ(pid: u32) -> Option<Vec<u8>> {
    match std::fs::read(format!("/proc/{pid}/environ")) {
        Ok(b) => Some(b),
        Err(e)
            if e.kind() == std::io::ErrorKind::PermissionDenied
                && unsafe { libc::geteuid() } != 0 =>
        {
            None
        }
        Err(e) => panic!("cannot read /proc/{pid}/environ: {e}"),
    }
}

#[cfg(target_os = "linux")]
fn contains(haystack: &[u8], needle: &str) -> bool {
    haystack
        .windows(needle.len())
        .any(|w| w == needle.as_bytes())
}

#[cfg(target_os = "linux")]
#[test]
fn credentials_are_scrubbed_from_the_run_managers_own_environ_and_cmdline() {
    let dir = temp_dir("lockdown");
    let flag_token = marker("flag-tok");
    let env_token = marker("env-tok");
    let token_file = dir.join(marker("token-file")).display().to_string();
    let admin_token = marker("admin-tok");
    let aws_secret = marker("aws-secret");
    let env = [
        ("DFLASH_PROVIDER_TOKEN", env_token.as_str()),
        ("DFLASH_PROVIDER_TOKEN_FILE", token_file.as_str()),
        ("DFLASH_ADMIN_TOKEN", admin_token.as_str()),
        ("AWS_SECRET_ACCESS_KEY", aws_secret.as_str()),
    ];
    let work = dir.join("work");
    // The token on the command line (it outranks the file and the environment).
    let (mut child, line) = start_until_connecting(lingering_run_manager(
        Path::new(RUN_MANAGER),
        &work,
        &["--token", &flag_token],
        &env,
    ));
    assert_eq!(
        line["message"],
        "connecting over plaintext; provider token from `--token`"
    );
    let pid = child.id();
    let cmdline = std::fs::read(format!("/proc/{pid}/cmdline")).expect("cmdline");
    assert!(
        !contains(&cmdline, &flag_token),
        "{}",
        String::from_utf8_lossy(&cmdline)
    );
    // Only the value went: the other arguments read as they were given.
    assert!(contains(&cmdline, "\0--token\0") && contains(&cmdline, "\0--worker-cmd\0sleep 600\0"));
    if let Some(environ) = proc_environ(pid) {
        let text = String::from_utf8_lossy(&environ);
        for (name, value) in env {
            assert!(
                !contains(&environ, value),
                "the value of `{name}` is in {text:?}"
            );
        }
        assert!(text.split('\0').any(|e| e == "NO_COLOR=1"), "{text:?}");
    }
    let _ = child.kill();
    let _ = child.wait();

    // The token from the environment only: read before the scrub, and gone from the block.
    let (mut child, line) = start_until_connecting(lingering_run_manager(
        Path::new(RUN_MANAGER),
        &work,
        &[],
        &[("DFLASH_PROVIDER_TOKEN", &env_token)],
    ));
    assert_eq!(
        line["message"],
        "connecting over plaintext; provider token from `DFLASH_PROVIDER_TOKEN`"
    );
    if let Some(environ) = proc_environ(child.id()) {
        assert!(
            !contains(&environ, &env_token),
            "{}",
            String::from_utf8_lossy(&environ)
        );
        assert!(contains(&environ, "DFLASH_PROVIDER_TOKEN=\0"));
    }
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
}

/// The kernel gives a non-dumpable process's `/proc/PID/environ` (and its other private files)
/// to root, and `/proc/PID` itself to the process's user: so the run-manager runs as another
/// user than root (as `nobody` when this test runs as root, from a copy `nobody` can execute).
#[cfg(target_os = "linux")]
#[test]
fn the_run_manager_is_not_dumpable() {
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    use std::os::unix::process::CommandExt;

    let dir = temp_dir("dumpable");
    let work = dir.join("work");
    std::fs::create_dir_all(&work).expect("mkdir");
    let root = unsafe { libc::geteuid() } == 0;
    let mut program = PathBuf::from(RUN_MANAGER);
    if root && Command::new("true").uid(65534).gid(65534).status().is_err() {
        eprintln!("SKIP: running as root and cannot start a process as uid 65534");
        return;
    }
    if root {
        let copy = dir.join("run-manager");
        std::fs::copy(&program, &copy).expect("copy the binary");
        for (p, mode) in [(&dir, 0o755), (&copy, 0o755), (&work, 0o777)] {
            std::fs::set_permissions(p, std::fs::Permissions::from_mode(mode)).expect("chmod");
        }
        program = copy;
    }
    let mut cmd = lingering_run_manager(&program, &work, &["--token", "t"], &[]);
    if root {
        cmd.uid(65534).gid(65534);
    }
    let (mut child, _) = start_until_connecting(cmd);
    let pid = child.id();
    let owner = std::fs::metadata(format!("/proc/{pid}"))
        .expect("stat")
        .uid();
    let environ_owner = std::fs::metadata(format!("/proc/{pid}/environ"))
        .expect("stat")
        .uid();
    let _ = child.kill();
    let _ = child.wait();
    let _ = std::fs::remove_dir_all(&dir);
    assert_ne!(owner, 0, "the run-manager ran as root");
    assert_eq!(
        environ_owner, 0,
        "/proc/{pid}/environ belongs to uid {environ_owner}: the run-manager is dumpable"
    );
}
