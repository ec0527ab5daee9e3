//! `run-manager --upload-file PATH --upload-lease LEASE --coordinator URL --token-file FILE`
//! (hidden): upload one file as an `export` artifact of a lease the caller holds, through the
//! same uploader the attempts use (`crate::artifacts::upload`), print one JSON line and exit.
//!
//! It exists so that `bench/artifacts.py` measures the run-manager's real upload path (channel,
//! chunking, hashing, retries) against the Python client on the same file and coordinator.
//! The file is hashed first, as `crate::artifacts::verify` does before any upload; only the
//! upload itself is timed.

use std::path::Path;
use std::time::{Duration, Instant};

use crate::artifacts::transfer::LeaseClock;
use crate::artifacts::upload::{FileUpload, Uploader};
use crate::backoff::Backoff;
use crate::cli::Cli;
use crate::coordinator::client::provider_client;
use crate::error::{Error, Result};
use crate::proto::Artifact;
use crate::setup::{coordinator_target, provider_token};
use crate::worker::jobdir::hash_file;

/// How long the uploader may keep retrying without a heartbeat (nothing heartbeats here).
const LEASE_HORIZON: Duration = Duration::from_secs(3600);

/// Upload `path` under the lease `lease_id` as `name`; print `{"name", "sha256", "size_bytes",
/// "seconds", "hash_seconds", "peak_rss_kib"}` on stdout (`seconds`: the upload alone;
/// `hash_seconds`: the hash pass before it).
pub async fn run(cli: &Cli, path: &Path, lease_id: &str, name: Option<&str>) -> Result<()> {
    let target = coordinator_target(cli)?;
    let (token, _) = provider_token(cli)?;
    let client = provider_client(&target, &token)?;
    let p = path.to_path_buf();
    let hashing = Instant::now();
    let (sha256, size_bytes) = tokio::task::spawn_blocking(move || hash_file(&p))
        .await
        .map_err(|e| Error::Internal(format!("hashing `{}` failed: {e}", path.display())))?
        .map_err(Error::io("cannot read the file to upload", path))?;
    let hash_seconds = hashing.elapsed().as_secs_f64();
    let name = match name {
        Some(n) => n.to_string(),
        None => path
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .ok_or_else(|| Error::Usage(format!("`{}` names no file", path.display())))?,
    };
    let artifact = Artifact {
        name: name.clone(),
        kind: "export".into(),
        sha256: sha256.clone(),
        size_bytes,
        ..Default::default()
    };
    let mut uploader = Uploader {
        client,
        lease_id: lease_id.to_string(),
        job_id: "(upload)".into(),
        clock: LeaseClock::start(LEASE_HORIZON),
        backoff: Backoff::doubling(
            Duration::from_millis(cli.rpc_backoff_ms),
            Duration::from_millis(cli.rpc_backoff_max_ms),
        ),
        retries: cli.rpc_retries,
    };
    let file = FileUpload {
        path: path.to_path_buf(),
        artifact,
    };
    let started = Instant::now();
    uploader
        .file(&file)
        .await
        .map_err(|e| Error::Usage(e.to_string()))?;
    let seconds = started.elapsed().as_secs_f64();
    let line = serde_json::json!({
        "name": name,
        "sha256": sha256,
        "size_bytes": size_bytes,
        "seconds": seconds,
        "hash_seconds": hash_seconds,
        "peak_rss_kib": peak_rss_kib(),
    });
    println!("{line}");
    Ok(())
}

/// This process's peak resident set (VmHWM of /proc/self/status), KiB; null where there is none.
fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    status
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.split_whitespace().next())
        .and_then(|v| v.parse().ok())
}
