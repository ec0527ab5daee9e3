//! What `--local` submits: the run spec file (`--spec`, JSON) made the admin
//! API's RunSpec, and the calls that create the provider token and the run and
//! approve the native client versions the spec names.

use std::path::Path;

use serde::Deserialize;

use crate::coordinator::client::AdminClient;
use crate::error::{Error, Result};
use crate::proto::{ApproveVersionRequest, CreateProviderRequest, CreateRunRequest, Run, RunSpec};
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
            crate::worker::jobdir::parse_spec(t)?;
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

/// Create a provider token named `provider_name` and the run, then approve the
/// native client versions in `approve` for it; returns the token and the run.
pub async fn submit(
    admin: &mut AdminClient,
    provider_name: &str,
    run_spec: RunSpec,
    approve: &[String],
) -> Result<(String, Run)> {
    let rpc = |call: &'static str| move |status| Error::Rpc { call, status };
    let token = admin
        .create_provider(CreateProviderRequest {
            name: provider_name.to_string(),
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
    Ok((token, run))
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
}
