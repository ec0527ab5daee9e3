//! The job directory handed to the worker: `spec.json` plus whatever the worker writes.
//!
//! Layout under `<work-dir>/jobs/<job_id>/`:
//! - `spec.json`: written by the run-manager before every worker start;
//! - `resume/NAME`: the lease's resume checkpoint (manifest and listed files)
//!   as the run-manager downloaded it, when it was not here already
//!   (`crate::artifacts::resume`);
//! - `NAME` for each of a graph job's `inputs` (e.g. `data/train.jsonl`),
//!   downloaded and verified before the worker starts (`crate::artifacts::inputs`);
//! - everything else (checkpoints, exports, logs) is the worker's, reported
//!   back through `artifact` events with paths inside this directory.
//!
//! The layout's names, `spec.json`'s types (the `graph` key's too) and
//! [`hash_file`] live here, below the modules that fill the directory:
//! `crate::artifacts::fetch` downloads into it, and `crate::artifacts::resume` and `crate::artifacts::inputs`
//! fetch through `crate::artifacts::fetch`. This module imports none of them.

use std::io::Write;
use std::path::{Path, PathBuf};

use serde::Serialize;

use crate::error::{Error, Result};
use crate::policy::Downgrade;
use crate::proto::{DeviceCapabilities, Lease};

/// Version of the `spec.json` layout below.
pub const SPEC_SCHEMA_VERSION: u32 = 1;
/// The spec file's name in the job directory.
pub const SPEC_FILE: &str = "spec.json";
/// The temporary file [`JobSpecFile::write`] renames into place.
pub const SPEC_TMP_FILE: &str = ".spec.json.tmp";
/// Where downloaded checkpoints go inside the job directory (`crate::artifacts::resume`).
pub const RESUME_DIR: &str = "resume";

/// Device facts the worker needs (a serializable copy of the capabilities).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct DeviceInfo {
    pub backend: String,
    pub device_count: u32,
    pub memory_bytes: u64,
    pub supports_bf16: bool,
    pub features: Vec<String>,
    pub platform: String,
}

impl From<&DeviceCapabilities> for DeviceInfo {
    fn from(c: &DeviceCapabilities) -> Self {
        DeviceInfo {
            backend: c.backend.clone(),
            device_count: c.device_count,
            memory_bytes: c.memory_bytes,
            supports_bf16: c.supports_bf16,
            features: c.features.clone(),
            platform: c.platform.clone(),
        }
    }
}

/// Lease facts the worker may log or record in manifests.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct LeaseInfo {
    pub lease_id: String,
    pub run_id: String,
    pub job_id: String,
    pub attempt: u32,
    pub checkpoint_policy: String,
    pub required_features: Vec<String>,
    pub required_client_version: String,
}

/// Contents of `spec.json`.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct JobSpecFile {
    pub schema_version: u32,
    /// The lease's `spec_json`, parsed (always a JSON object).
    pub spec: serde_json::Value,
    pub lease: LeaseInfo,
    /// Absolute path of the checkpoint to resume from (its `manifest.json`: the
    /// worker's last verified `checkpoint` artifact, or the lease's, found here
    /// or downloaded under `resume/`), or null to start fresh.
    pub resume_checkpoint: Option<PathBuf>,
    /// Step of that checkpoint (0 when none).
    pub resume_step: u64,
    /// How many times the worker was restarted within this attempt.
    pub restart: u32,
    pub job_dir: PathBuf,
    pub device: DeviceInfo,
    pub local_ranks: u32,
    /// Features the worker must do without, and what to use instead.
    pub downgrades: Vec<Downgrade>,
    /// Version of the run-manager that wrote this file.
    pub client_version: String,
    /// Which job of its run's graph this is, and its downloaded inputs;
    /// absent for a pipeline lease, so its `spec.json` is what it always was.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub graph: Option<GraphInfo>,
}

impl JobSpecFile {
    /// Build the spec for `lease` (whose `spec_json` was already parsed to `spec`).
    pub fn new(
        lease: &Lease,
        spec: serde_json::Value,
        job_dir: &Path,
        caps: &DeviceCapabilities,
        local_ranks: u32,
        downgrades: Vec<Downgrade>,
    ) -> Self {
        JobSpecFile {
            schema_version: SPEC_SCHEMA_VERSION,
            spec,
            lease: LeaseInfo {
                lease_id: lease.lease_id.clone(),
                run_id: lease.run_id.clone(),
                job_id: lease.job_id.clone(),
                attempt: lease.attempt,
                checkpoint_policy: lease.checkpoint_policy.clone(),
                required_features: lease.required_features.clone(),
                required_client_version: lease.required_client_version.clone(),
            },
            resume_checkpoint: None,
            resume_step: 0,
            restart: 0,
            job_dir: job_dir.to_path_buf(),
            device: DeviceInfo::from(caps),
            local_ranks,
            downgrades,
            client_version: crate::version::CLIENT_VERSION.to_string(),
            graph: None,
        }
    }

    /// Write `spec.json` into the job directory atomically (temp file, fsync, rename).
    pub fn write(&self) -> Result<PathBuf> {
        let path = self.job_dir.join(SPEC_FILE);
        let tmp = self.job_dir.join(SPEC_TMP_FILE);
        let text = serde_json::to_vec_pretty(self)
            .map_err(|e| Error::Internal(format!("serializing spec.json: {e}")))?;
        let mut f = std::fs::File::create(&tmp).map_err(Error::io("cannot write", &tmp))?;
        f.write_all(&text)
            .map_err(Error::io("cannot write", &tmp))?;
        f.sync_all().map_err(Error::io("cannot sync", &tmp))?;
        std::fs::rename(&tmp, &path).map_err(Error::io("cannot rename into place", &path))?;
        Ok(path)
    }
}

/// `spec.json`'s `graph`: which job of its graph the worker runs, and its inputs
/// (filled in by `crate::artifacts::inputs`, which checks and fetches them).
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct GraphInfo {
    /// `prepare`, `capture`, `train` or `evaluate` (the lease's `kind`).
    pub kind: String,
    /// 0-based, below `shard_count`.
    pub shard_index: u32,
    /// At least 1 (a lease's 0 means 1).
    pub shard_count: u32,
    /// In lease order, each once.
    pub inputs: Vec<InputFile>,
}

/// One input as `spec.json` names it.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct InputFile {
    pub name: String,
    pub kind: String,
    pub sha256: String,
    pub size_bytes: u64,
    /// Where the coordinator keeps it: `dflash-artifact://RUN/JOB/ATTEMPT/NAME`.
    pub uri: String,
    /// The local file, `JOB_DIR/NAME` (absolute).
    pub path: PathBuf,
}

/// Parse a lease's `spec_json`; it must be a JSON object.
pub fn parse_spec(spec_json: &str) -> std::result::Result<serde_json::Value, String> {
    match serde_json::from_str::<serde_json::Value>(spec_json) {
        Ok(v) if v.is_object() => Ok(v),
        Ok(_) => Err("the lease's `spec_json` is not a JSON object".into()),
        Err(e) => Err(format!("the lease's `spec_json` is not valid JSON: {e}")),
    }
}

/// Hex sha256 and size of a file, read in 1 MiB chunks.
pub fn hash_file(path: &Path) -> std::io::Result<(String, u64)> {
    use sha2::Digest;
    use std::io::Read;
    let mut f = std::fs::File::open(path)?;
    let mut hasher = sha2::Sha256::new();
    let mut buf = vec![0u8; 1 << 20];
    let mut size = 0u64;
    loop {
        let n = f.read(&mut buf)?;
        if n == 0 {
            break;
        }
        hasher.update(&buf[..n]);
        size += n as u64;
    }
    let digest = hasher.finalize();
    let hex = digest
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect::<String>();
    Ok((hex, size))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hashes_known_bytes() {
        let p = std::env::temp_dir().join(format!("rm-hash-{}", std::process::id()));
        std::fs::write(&p, b"abc").expect("write");
        let (h, n) = hash_file(&p).expect("hash");
        assert_eq!(
            h,
            "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad"
        );
        assert_eq!(n, 3);
        let _ = std::fs::remove_file(&p);
    }

    #[test]
    fn spec_must_be_an_object() {
        assert!(parse_spec(r#"{"stages":["noop"]}"#).is_ok());
        assert!(parse_spec("[1]").is_err());
        assert!(parse_spec("{").is_err());
        assert!(parse_spec("").is_err());
    }

    #[test]
    fn spec_numbers_reach_spec_json_exactly() {
        // Found by fuzzing (tests/fuzz/inputs/rs_job_spec/float-one-ulp-off.json): serde_json's
        // default float parser can be one ULP off, so spec.json held another number than the
        // coordinator sent. `float_roundtrip` (Cargo.toml) parses exactly; 6.666666666666667e40
        // is the nearest f64, what Python's json (the worker) reads from the same text.
        let text =
            "{\n  \"schrequiredetfau_renullersion\": 66666666666666666666666666666666666666666\n}";
        let v = parse_spec(text).expect("an object");
        assert_eq!(
            v["schrequiredetfau_renullersion"].as_f64(),
            Some(6.666666666666667e40)
        );
        let written = serde_json::to_string_pretty(&v).expect("serialize");
        assert_eq!(parse_spec(&written), Ok(v));
    }

    #[test]
    fn writes_spec_json_atomically() {
        let dir = std::env::temp_dir().join(format!("rm-spec-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let lease = Lease {
            lease_id: "l1".into(),
            run_id: "r1".into(),
            job_id: "j1".into(),
            attempt: 2,
            ..Default::default()
        };
        let caps = DeviceCapabilities {
            backend: "cpu".into(),
            device_count: 1,
            ..Default::default()
        };
        let mut s = JobSpecFile::new(
            &lease,
            serde_json::json!({"stages": ["noop"]}),
            &dir,
            &caps,
            1,
            vec![],
        );
        s.resume_checkpoint = Some(dir.join("ckpt"));
        let p = s.write().expect("write");
        let v: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&p).expect("read")).expect("json");
        assert_eq!(v["lease"]["attempt"], 2);
        assert_eq!(v["spec"]["stages"][0], "noop");
        assert_eq!(v["device"]["backend"], "cpu");
        assert!(v["resume_checkpoint"]
            .as_str()
            .expect("path")
            .ends_with("ckpt"));
        assert!(!dir.join(".spec.json.tmp").exists());
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// The sample spec: a CPU device, one rank, `flash_attention_2` downgraded
    /// to `sdpa`, a resume checkpoint (its `manifest.json`) and a restart.
    fn fixture_spec(job_dir: &Path) -> JobSpecFile {
        let lease = Lease {
            lease_id: "lease-fixture".into(),
            run_id: "run-fixture".into(),
            job_id: "job-fixture".into(),
            attempt: 2,
            checkpoint_policy: "durable".into(),
            required_features: vec!["flash_attention_2".into()],
            required_client_version: crate::version::CLIENT_VERSION.into(),
            // a graph lease, so the fixture carries every key `spec.json` can have
            kind: "capture".into(),
            shard_index: 1,
            shard_count: 3,
            inputs: vec![crate::proto::Artifact {
                name: "data/train.jsonl".into(),
                kind: "data".into(),
                sha256: "cd".repeat(32),
                size_bytes: 77,
                uri: "dflash-artifact://run-fixture/prepare-fixture/1/data/train.jsonl".into(),
                step: 0,
            }],
            ..Default::default()
        };
        let caps = DeviceCapabilities {
            backend: "cpu".into(),
            device_count: 1,
            memory_bytes: 8 << 30,
            supports_bf16: false,
            features: vec![],
            platform: "linux-x86_64".into(),
        };
        let downgrade = Downgrade {
            feature: "flash_attention_2".into(),
            replacement: "sdpa".into(),
            reason: "`flash_attention_2` needs CUDA; this provider runs `cpu`".into(),
        };
        let spec = serde_json::json!({"stages": ["noop"], "noop": {"steps": 6, "step_seconds": 0.05, "checkpoint_every": 2}});
        let mut s = JobSpecFile::new(&lease, spec, job_dir, &caps, 1, vec![downgrade]);
        s.resume_checkpoint = Some(job_dir.join("checkpoints/step-000004/manifest.json"));
        s.resume_step = 4;
        s.restart = 1;
        let inputs = crate::artifacts::inputs::plan(&lease).expect("plan");
        s.graph = GraphInfo::new(&lease, &inputs, job_dir);
        s
    }

    /// Check that `v` is an object with exactly the keys `names`.
    fn assert_keys(v: &serde_json::Value, names: &[&str]) {
        let mut have: Vec<&str> = v
            .as_object()
            .expect("object")
            .keys()
            .map(String::as_str)
            .collect();
        let mut want = names.to_vec();
        have.sort_unstable();
        want.sort_unstable();
        assert_eq!(have, want, "{v:#}");
    }

    #[test]
    fn a_graph_lease_names_its_job_and_inputs_and_a_pipeline_lease_does_not() {
        let dir = std::env::temp_dir().join(format!("rm-spec-graph-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let dir = dir.canonicalize().expect("canonical");
        let sha = "ab".repeat(32);
        let input = crate::proto::Artifact {
            name: "data/train.jsonl".into(),
            kind: "manifest".into(),
            sha256: sha.clone(),
            size_bytes: 123,
            uri: "dflash-artifact://run-1/prepare-1/1/data/train.jsonl".into(),
            step: 0,
        };
        let lease = Lease {
            job_id: "capture-1".into(),
            kind: "capture".into(),
            shard_index: 1,
            shard_count: 3,
            inputs: vec![input.clone(), input.clone()],
            ..Default::default()
        };
        let caps = DeviceCapabilities::default();
        let written = |lease: &Lease| {
            let inputs = crate::artifacts::inputs::plan(lease).expect("plan");
            let mut s = JobSpecFile::new(lease, serde_json::json!({}), &dir, &caps, 1, vec![]);
            s.graph = GraphInfo::new(lease, &inputs, &dir);
            let p = s.write().expect("write");
            let v: serde_json::Value =
                serde_json::from_slice(&std::fs::read(p).expect("read")).expect("json");
            v
        };
        let v = written(&lease);
        let path = dir.join("data/train.jsonl");
        assert_eq!(
            v["graph"],
            serde_json::json!({
                "kind": "capture",
                "shard_index": 1,
                "shard_count": 3,
                "inputs": [{
                    "name": "data/train.jsonl",
                    "kind": "manifest",
                    "sha256": sha,
                    "size_bytes": 123,
                    "uri": "dflash-artifact://run-1/prepare-1/1/data/train.jsonl",
                    "path": path.to_str().expect("utf8"),
                }],
            })
        );
        assert!(path.is_absolute());
        // An unsharded job (`shard_count` 0 in the lease) is shard 0 of 1.
        let train = Lease {
            kind: "train".into(),
            shard_index: 0,
            shard_count: 0,
            inputs: vec![],
            ..lease.clone()
        };
        let v = written(&train);
        assert_eq!(
            v["graph"],
            serde_json::json!({"kind": "train", "shard_index": 0, "shard_count": 1, "inputs": []})
        );
        // Pipeline leases (and older coordinators' empty kind): no `graph` key at all.
        for kind in ["pipeline", ""] {
            let pipeline = Lease {
                kind: kind.into(),
                shard_count: 0,
                shard_index: 0,
                inputs: vec![],
                ..lease.clone()
            };
            let v = written(&pipeline);
            assert!(v.get("graph").is_none(), "{kind:?}: {v:#}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A `spec.json` as the run-manager writes it, for the Python side's
    /// round-trip test (`tests/worker/test_rust_spec.py`): written by
    /// [`JobSpecFile::write`] to `$DFLASH_SPEC_FIXTURE_OUT` when that is set
    /// (the job directory is then that file's directory); always checks that
    /// every documented field is serialized.
    #[test]
    fn writes_fixture_spec_json_for_python() {
        let out = std::env::var_os(crate::env_vars::SPEC_FIXTURE_OUT).map(PathBuf::from);
        let job_dir = match out.as_deref().and_then(Path::parent) {
            Some(d) => d.to_path_buf(),
            None => std::env::temp_dir().join(format!("rm-spec-fixture-{}", std::process::id())),
        };
        std::fs::create_dir_all(&job_dir).expect("mkdir");
        let job_dir = job_dir.canonicalize().expect("canonical");
        let s = fixture_spec(&job_dir);
        let v = serde_json::to_value(&s).expect("json");
        assert_keys(
            &v,
            &[
                "schema_version",
                "spec",
                "lease",
                "resume_checkpoint",
                "resume_step",
                "restart",
                "job_dir",
                "device",
                "local_ranks",
                "downgrades",
                "client_version",
                "graph",
            ],
        );
        assert_keys(
            &v["lease"],
            &[
                "lease_id",
                "run_id",
                "job_id",
                "attempt",
                "checkpoint_policy",
                "required_features",
                "required_client_version",
            ],
        );
        assert_keys(
            &v["device"],
            &[
                "backend",
                "device_count",
                "memory_bytes",
                "supports_bf16",
                "features",
                "platform",
            ],
        );
        assert_keys(&v["downgrades"][0], &["feature", "replacement", "reason"]);
        assert_eq!(
            (&v["local_ranks"], &v["downgrades"][0]["replacement"]),
            (&1.into(), &"sdpa".into())
        );
        let written = s.write().expect("write");
        match out {
            Some(out) if written != out => {
                std::fs::rename(&written, &out).expect("rename to DFLASH_SPEC_FIXTURE_OUT")
            }
            Some(_) => {}
            None => {
                let _ = std::fs::remove_dir_all(&job_dir);
            }
        }
    }
}
