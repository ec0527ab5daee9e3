//! `run-manager --local [--spec FILE]`: the embedded default.
//!
//! Starts the Python coordinator as a child process on 127.0.0.1 (port 0,
//! SQLite and its artifact store under `<work-dir>/coordinator/`), creates
//! a provider token and one run through the admin API, runs that run's jobs
//! on this machine, prints a summary (job states, artifacts with sha256 from
//! ListArtifacts, and where each file is on this machine) and stops the
//! coordinator.

use std::collections::HashMap;
use std::path::{Path, PathBuf};
use std::process::Stdio;
use std::time::Duration;

use serde::{Deserialize, Serialize};
use tokio::io::{AsyncBufReadExt, BufReader};
use tokio::process::{Child, Command};
use tokio::sync::watch;

use crate::attempt::AttemptResult;
use crate::cli::Cli;
use crate::client::{admin_client, provider_client, AdminClient};
use crate::error::{Error, Result};
use crate::proto::{
    ApproveVersionRequest, Artifact, ArtifactInfo, CreateProviderRequest, CreateRunRequest,
    GetRunResponse, RunSpec,
};
use crate::provider::{get_run, list_artifacts, run_loop, Until};
use crate::setup::{prepare_work_dir, provider_config};
use crate::transport::Target;
use crate::version::CLIENT_VERSION;

/// The run spec file `--spec` reads (JSON). Unknown fields are refused so a
/// typo cannot silently fall back to a default.
#[derive(Debug, Clone, Deserialize, PartialEq)]
#[serde(deny_unknown_fields)]
pub struct RunSpecFile {
    /// Run name (default: `local-<unix time>-<pid>`).
    #[serde(default)]
    pub name: Option<String>,
    /// The job spec as a JSON object...
    #[serde(default)]
    pub spec: Option<serde_json::Value>,
    /// ...or as a JSON string.
    #[serde(default)]
    pub spec_json: Option<String>,
    /// Client version the run requires (default: this run-manager's).
    #[serde(default)]
    pub required_client_version: Option<String>,
    #[serde(default)]
    pub checkpoint_policy: Option<String>,
    #[serde(default)]
    pub max_local_ranks: Option<u32>,
    #[serde(default)]
    pub required_features: Vec<String>,
    #[serde(default)]
    pub image: Option<String>,
    #[serde(default)]
    pub num_jobs: Option<u32>,
    /// Native client versions to approve for the run right after creating it.
    #[serde(default)]
    pub approve_native_versions: Vec<String>,
}

/// The job spec used when `--local` gets no `--spec`: the `noop` stage.
pub fn default_job_spec() -> serde_json::Value {
    serde_json::json!({
        "stages": ["noop"],
        "noop": {"steps": 6, "step_seconds": 0.05, "checkpoint_every": 2}
    })
}

impl RunSpecFile {
    /// Read and check a spec file.
    pub fn load(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| {
            Error::Usage(format!("cannot read spec file `{}`: {e}", path.display()))
        })?;
        Self::parse(&text).map_err(|m| Error::Usage(format!("spec file `{}`: {m}", path.display())))
    }

    /// Parse spec text; errors name the problem (serde reports line and column).
    pub fn parse(text: &str) -> std::result::Result<Self, String> {
        let s: RunSpecFile = serde_json::from_str(text).map_err(|e| e.to_string())?;
        if s.spec.is_some() && s.spec_json.is_some() {
            return Err("give either `spec` or `spec_json`, not both".into());
        }
        if let Some(v) = &s.spec {
            if !v.is_object() {
                return Err("`spec` must be a JSON object".into());
            }
        }
        if let Some(t) = &s.spec_json {
            crate::jobdir::parse_spec(t)?;
        }
        Ok(s)
    }

    /// The admin API's RunSpec, with defaults filled in.
    pub fn to_run_spec(&self) -> Result<RunSpec> {
        let spec_json = match (&self.spec, &self.spec_json) {
            (_, Some(t)) => t.clone(),
            (Some(v), None) => v.to_string(),
            (None, None) => default_job_spec().to_string(),
        };
        let now = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_secs())
            .unwrap_or(0);
        Ok(RunSpec {
            name: self
                .name
                .clone()
                .unwrap_or_else(|| format!("local-{now}-{}", std::process::id())),
            spec_json,
            required_client_version: self
                .required_client_version
                .clone()
                .unwrap_or_else(|| CLIENT_VERSION.to_string()),
            checkpoint_policy: self
                .checkpoint_policy
                .clone()
                .unwrap_or_else(|| "durable".into()),
            max_local_ranks: self.max_local_ranks.unwrap_or(1),
            required_features: self.required_features.clone(),
            image: self.image.clone().unwrap_or_default(),
            num_jobs: self.num_jobs.unwrap_or(1),
            // No job graph: the local harness queues pipeline jobs.
            ..Default::default()
        })
    }
}

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
                    status.map(|s| crate::worker::describe_exit(&s)).unwrap_or_else(|| "unknown status".into())
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
            let _ = crate::worker::signal(pid, libc::SIGTERM);
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

/// The summary printed at the end of `--local`.
#[derive(Debug, Serialize)]
pub struct Summary {
    pub run_id: String,
    pub name: String,
    pub jobs: Vec<JobSummary>,
}

#[derive(Debug, Serialize)]
pub struct JobSummary {
    pub job_id: String,
    pub state: String,
    pub attempts: u32,
    /// The SUCCEEDED attempt's artifacts; every attempt's when the job did not succeed.
    pub artifacts: Vec<ArtifactSummary>,
    /// The SUCCEEDED attempt's export model, when there is one.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub export: Option<ArtifactSummary>,
    /// The coordinator's regression gate on that export: published (served by
    /// `artifacts get`) or held back, and why.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub publication: Option<PublicationSummary>,
}

#[derive(Debug, Clone, Serialize)]
pub struct PublicationSummary {
    pub published: bool,
    pub verdict: String,
    pub reason: String,
}

#[derive(Debug, Clone, Serialize)]
pub struct ArtifactSummary {
    pub name: String,
    pub kind: String,
    pub sha256: String,
    pub size_bytes: u64,
    pub step: u64,
    /// Where the coordinator keeps it: `dflash-artifact://RUN/JOB/ATTEMPT/NAME`.
    pub uri: String,
    /// The attempt that recorded it (0 when unknown).
    pub attempt: u32,
    /// The file the worker wrote, when it is on this machine.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub path: Option<String>,
}

/// Where this machine's workers wrote each verified file: (job, name, sha256) -> path.
pub type LocalFiles = HashMap<(String, String, String), PathBuf>;

/// The files the attempts in `results` verified.
pub fn local_files(results: &[AttemptResult]) -> LocalFiles {
    let mut out = LocalFiles::new();
    for r in results {
        for a in &r.local_artifacts {
            out.insert(
                (r.job_id.clone(), a.name.clone(), a.sha256.clone()),
                a.path.clone(),
            );
        }
    }
    out
}

impl ArtifactSummary {
    fn new(job_id: &str, a: &Artifact, attempt: u32, local: &LocalFiles) -> Self {
        let key = (job_id.to_string(), a.name.clone(), a.sha256.clone());
        ArtifactSummary {
            name: a.name.clone(),
            kind: a.kind.clone(),
            sha256: a.sha256.clone(),
            size_bytes: a.size_bytes,
            step: a.step,
            uri: a.uri.clone(),
            attempt,
            path: local
                .get(&key)
                .filter(|p| p.is_file())
                .map(|p| p.display().to_string()),
        }
    }
}

impl Summary {
    /// The summary of `resp`'s jobs, with `artifacts` (job id -> ListArtifacts records)
    /// and the paths of the files that are on this machine.
    pub fn new(
        resp: &GetRunResponse,
        artifacts: &HashMap<String, Vec<ArtifactInfo>>,
        local: &LocalFiles,
    ) -> Self {
        let run = resp.run.clone().unwrap_or_default();
        let job = |j: &crate::proto::JobInfo| JobSummary {
            job_id: j.job_id.clone(),
            state: j.state.clone(),
            attempts: j.attempts,
            artifacts: artifacts
                .get(&j.job_id)
                .into_iter()
                .flatten()
                .filter_map(|info| {
                    let a = info.artifact.as_ref()?;
                    Some(ArtifactSummary::new(&j.job_id, a, info.attempt, local))
                })
                .collect(),
            export: j
                .export
                .as_ref()
                .filter(|e| !e.name.is_empty())
                .map(|e| ArtifactSummary::new(&j.job_id, e, 0, local)),
            publication: j.publication.as_ref().map(|p| PublicationSummary {
                published: p.published,
                verdict: p.verdict.clone(),
                reason: p.reason.clone(),
            }),
        };
        Summary {
            run_id: run.run_id,
            name: run.spec.map(|s| s.name).unwrap_or_default(),
            jobs: resp.jobs.iter().map(job).collect(),
        }
    }

    /// Fetch the run and each job's artifacts from the coordinator.
    pub async fn fetch(admin: &mut AdminClient, run_id: &str, local: &LocalFiles) -> Result<Self> {
        let resp = get_run(admin, run_id).await?;
        let mut artifacts = HashMap::new();
        for j in &resp.jobs {
            // A job that did not succeed has no final artifacts: show what its attempts recorded.
            let all_attempts = j.state != "succeeded";
            let list = list_artifacts(admin, run_id, &j.job_id, all_attempts).await?;
            artifacts.insert(j.job_id.clone(), list);
        }
        Ok(Summary::new(&resp, &artifacts, local))
    }

    /// Where each export is, and how to fetch it (for stderr).
    pub fn export_hints(&self) -> Vec<String> {
        self.jobs
            .iter()
            .filter_map(|j| {
                let e = j.export.as_ref()?;
                let here = match &e.path {
                    Some(p) => format!(" (on this machine: `{p}`)"),
                    None => String::new(),
                };
                let fetch = match &j.publication {
                    Some(p) if !p.published => format!(
                        "note: the regression gate held it back: {}\nhint: `dflash-coordinator runs publish {} --override` publishes it (recorded); then `artifacts get` serves it",
                        p.reason, self.run_id
                    ),
                    _ => format!(
                        "hint: fetch it from the coordinator with `dflash-coordinator artifacts get {} {} -o PATH`",
                        self.run_id, e.name
                    ),
                };
                Some(format!(
                    "job `{}` exported `{}`, sha256 {}{here}\n{fetch}",
                    j.job_id, e.name, e.sha256
                ))
            })
            .collect()
    }

    /// Human-readable form.
    pub fn to_text(&self) -> String {
        let mut out = format!(
            "run `{}` ({}): {} job(s)\n",
            self.run_id,
            self.name,
            self.jobs.len()
        );
        for j in &self.jobs {
            out.push_str(&format!(
                "  job `{}`: {} after {} attempt(s)\n",
                j.job_id, j.state, j.attempts
            ));
            for a in &j.artifacts {
                out.push_str(&format!(
                    "    {:<15} {}  sha256 {}  {} bytes  step {}\n",
                    a.kind, a.name, a.sha256, a.size_bytes, a.step
                ));
            }
        }
        out
    }

    /// Jobs that did not succeed.
    pub fn failed(&self) -> usize {
        self.jobs.iter().filter(|j| j.state != "succeeded").count()
    }
}

/// Run `--local`.
pub async fn run(cli: &Cli, shutdown: &mut watch::Receiver<Option<i32>>) -> Result<()> {
    let spec = match &cli.spec {
        Some(p) => RunSpecFile::load(p)?,
        None => RunSpecFile::parse("{}").map_err(Error::Internal)?,
    };
    let run_spec = spec.to_run_spec()?;
    let work_dir = prepare_work_dir(&cli.work_dir)?;
    // Check the flags (worker, device) before starting anything.
    let cfg = provider_config(cli, &work_dir)?;
    let jobs_dir = work_dir.join("jobs");
    std::fs::create_dir_all(&jobs_dir).map_err(Error::io("cannot create", &jobs_dir))?;

    let python = find_python(cli.python.as_deref());
    let coordinator = EmbeddedCoordinator::start(&python, &work_dir.join("coordinator")).await?;
    let outcome = drive(
        &coordinator,
        run_spec,
        &spec.approve_native_versions,
        &cfg,
        shutdown,
    )
    .await;
    coordinator.stop().await;
    let summary = outcome?;
    if cli.json {
        let text =
            serde_json::to_string_pretty(&summary).map_err(|e| Error::Internal(e.to_string()))?;
        println!("{text}");
    } else {
        print!("{}", summary.to_text());
    }
    for hint in summary.export_hints() {
        eprintln!("{hint}");
    }
    match summary.failed() {
        0 => Ok(()),
        failed => Err(Error::JobsFailed {
            run_id: summary.run_id.clone(),
            failed,
            total: summary.jobs.len(),
        }),
    }
}

async fn drive(
    coordinator: &EmbeddedCoordinator,
    run_spec: RunSpec,
    approve: &[String],
    cfg: &crate::provider::ProviderConfig,
    shutdown: &mut watch::Receiver<Option<i32>>,
) -> Result<Summary> {
    // Plaintext on loopback: the embedded coordinator listens on 127.0.0.1 only.
    let target = Target::loopback(&coordinator.address)?;
    let mut admin = admin_client(&target, &coordinator.admin_token)?;
    let rpc = |call: &'static str| move |status| Error::Rpc { call, status };
    let token = admin
        .create_provider(CreateProviderRequest {
            name: cfg.name.clone(),
        })
        .await
        .map_err(rpc("CreateProvider"))?
        .into_inner()
        .token;
    let run = admin
        .create_run(CreateRunRequest {
            spec: Some(run_spec),
        })
        .await
        .map_err(rpc("CreateRun"))?
        .into_inner()
        .run
        .ok_or_else(|| Error::Internal("CreateRun returned no run".into()))?;
    for v in approve {
        admin
            .approve_version(ApproveVersionRequest {
                run_id: run.run_id.clone(),
                version: v.clone(),
            })
            .await
            .map_err(rpc("ApproveVersion"))?;
    }
    tracing::info!(run_id = %run.run_id, jobs = run.job_states.values().sum::<u32>(), "created run");
    let provider = provider_client(&target, &token)?;
    let until = Until::RunDone {
        admin: Box::new(admin.clone()),
        run_id: run.run_id.clone(),
    };
    let results = run_loop(&provider, cfg, until, shutdown).await?;
    Summary::fetch(&mut admin, &run.run_id, &local_files(&results)).await
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_file_defaults() {
        let s = RunSpecFile::parse("{}").expect("parse");
        let r = s.to_run_spec().expect("spec");
        assert_eq!(r.required_client_version, CLIENT_VERSION);
        assert_eq!(r.checkpoint_policy, "durable");
        assert_eq!(r.num_jobs, 1);
        let v: serde_json::Value = serde_json::from_str(&r.spec_json).expect("json");
        assert_eq!(v["stages"][0], "noop");
        assert!(r.name.starts_with("local-"));
    }

    #[test]
    fn spec_file_errors_are_clear() {
        assert!(RunSpecFile::parse(r#"{"nmae": "typo"}"#)
            .expect_err("typo")
            .contains("nmae"));
        assert!(RunSpecFile::parse(r#"{"spec": [1]}"#).is_err());
        assert!(RunSpecFile::parse(r#"{"spec": {}, "spec_json": "{}"}"#).is_err());
        assert!(RunSpecFile::parse(r#"{"spec_json": "not json"}"#).is_err());
        assert!(RunSpecFile::parse("{\n  \"num_jobs\": -1\n}")
            .expect_err("neg")
            .contains("line 2"));
        let s = RunSpecFile::parse(
            r#"{"spec": {"stages": ["noop"]}, "required_client_version": "9.9.9", "num_jobs": 2}"#,
        )
        .expect("parse");
        let r = s.to_run_spec().expect("spec");
        assert_eq!(
            (r.required_client_version.as_str(), r.num_jobs),
            ("9.9.9", 2)
        );
    }

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
    fn summary_lists_records_with_local_paths_and_hints_at_the_export() {
        use crate::proto::{JobInfo, Publication, Run};
        let dir = std::env::temp_dir().join(format!("rm-summary-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let model = dir.join("model.safetensors");
        std::fs::write(&model, b"m").expect("write");
        let export = Artifact {
            name: "run/export/model.safetensors".into(),
            kind: "export".into(),
            sha256: "ab".repeat(32),
            size_bytes: 1,
            step: 6,
            uri: "dflash-artifact://r1/j1/2/run/export/model.safetensors".into(),
        };
        let gone = Artifact {
            name: "report.json".into(),
            kind: "report".into(),
            sha256: "cd".repeat(32),
            ..Default::default()
        };
        let resp = GetRunResponse {
            run: Some(Run {
                run_id: "r1".into(),
                ..Default::default()
            }),
            jobs: vec![JobInfo {
                job_id: "j1".into(),
                state: "succeeded".into(),
                attempts: 2,
                artifact_count: 2,
                export: Some(export.clone()),
                publication: Some(Publication {
                    published: true,
                    verdict: "improved".into(),
                    reason: "improved: acceptance length 1.2 trained vs 1.0 released".into(),
                    ..Default::default()
                }),
                ..Default::default()
            }],
            next_page_token: String::new(),
        };
        let info = |a: &Artifact| ArtifactInfo {
            job_id: "j1".into(),
            attempt: 2,
            attempt_state: "succeeded".into(),
            artifact: Some(a.clone()),
            created_unix: 0,
        };
        let artifacts = HashMap::from([("j1".to_string(), vec![info(&export), info(&gone)])]);
        let mut local = LocalFiles::new();
        local.insert(
            ("j1".into(), export.name.clone(), export.sha256.clone()),
            model.clone(),
        );
        local.insert(
            ("j1".into(), gone.name.clone(), gone.sha256.clone()),
            dir.join("missing"),
        );
        let summary = Summary::new(&resp, &artifacts, &local);
        let v = serde_json::to_value(&summary).expect("json");
        let arts = &v["jobs"][0]["artifacts"];
        assert_eq!(arts[0]["path"], model.display().to_string());
        assert_eq!(arts[0]["attempt"], 2);
        assert_eq!(arts[0]["uri"], export.uri);
        // A file no longer on this machine has no `path`.
        assert!(arts[1].get("path").is_none(), "{v:#}");
        assert_eq!(v["jobs"][0]["export"]["name"], export.name);
        let hints = summary.export_hints();
        assert_eq!(hints.len(), 1);
        assert!(
            hints[0].contains(&model.display().to_string())
                && hints[0].contains("hint: fetch it from the coordinator with `dflash-coordinator artifacts get r1 run/export/model.safetensors -o PATH`"),
            "{}",
            hints[0]
        );
        assert_eq!(v["jobs"][0]["publication"]["published"], true);
        assert_eq!(summary.failed(), 0);
        // A held-back export: the hint says why and how to publish it, not how to fetch it.
        let mut held = resp.clone();
        held.jobs[0].publication = Some(Publication {
            published: false,
            verdict: "regressed".into(),
            reason: "regressed: acceptance length 1.0 trained vs 1.2 released".into(),
            ..Default::default()
        });
        let hints = Summary::new(&held, &artifacts, &local).export_hints();
        assert!(
            hints[0].contains("note: the regression gate held it back: regressed: acceptance length 1.0 trained vs 1.2 released")
                && hints[0].contains("`dflash-coordinator runs publish r1 --override`")
                && !hints[0].contains("artifacts get r1"),
            "{}",
            hints[0]
        );
        let _ = std::fs::remove_dir_all(&dir);
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
