//! The summary `--local` prints at the end: each job's state and attempts, the
//! artifacts the coordinator recorded (ListArtifacts, with sha256), where each
//! file is on this machine, and how to fetch or publish the export.

use std::collections::HashMap;
use std::path::PathBuf;

use serde::Serialize;

use crate::attempt::AttemptResult;
use crate::coordinator::client::AdminClient;
use crate::error::Result;
use crate::proto::{Artifact, ArtifactInfo, GetRunResponse};
use crate::provider::{get_run, list_artifacts};

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

#[cfg(test)]
mod tests {
    use super::*;

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
}
