//! Artifacts a worker announced: verified against the file on disk, then
//! reported to the coordinator (inline or as a `file://` URI).
//!
//! Verification comes first and needs no network: the path must resolve inside
//! the job directory and its sha256 and size must be what the worker claimed.
//! A verified checkpoint is one a restarted worker may resume from, whether or
//! not the coordinator managed to record it.

use std::path::{Path, PathBuf};

use crate::client::{retry, ProviderClient, RetryPolicy};
use crate::error::Error;
use crate::events::ArtifactEvent;
use crate::jobdir::hash_file;
use crate::lease_lost::LeaseLost;
use crate::paths::{file_uri, resolve_inside};
use crate::proto::{Artifact, Lease, ReportArtifactRequest};

/// An artifact whose file matches the worker's claim.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    /// The file, resolved inside the job directory.
    pub path: PathBuf,
    pub sha256: String,
    pub size_bytes: u64,
}

/// What reporting a verified artifact came to.
#[derive(Debug, Clone)]
pub enum Reported {
    /// The coordinator recorded it.
    Recorded,
    /// The report failed for another reason (logged); the file is still verified.
    NotRecorded,
    /// The file could not be read for an inline report (logged).
    Unreadable,
    /// The lease is lost: stale (ABORTED) or this provider's token refused.
    Lost(LeaseLost),
}

/// Resolve `a.path` inside `job_dir` and check its sha256 and size; the error
/// says why the artifact is refused.
pub async fn verify(job_dir: &Path, a: &ArtifactEvent) -> Result<Verified, String> {
    let path = resolve_inside(job_dir, Path::new(&a.path))
        .map_err(|e| format!("refused artifact: {e}"))?;
    let p2 = path.clone();
    let (sha, size) = match tokio::task::spawn_blocking(move || hash_file(&p2)).await {
        Ok(Ok(h)) => h,
        Ok(Err(e)) => return Err(format!("cannot read artifact `{}`: {e}", path.display())),
        Err(e) => return Err(format!("hashing artifact failed: {e}")),
    };
    if sha != a.sha256 || size != a.size_bytes {
        return Err(format!(
            "refused artifact `{}`: the worker claimed sha256 `{}` and {} bytes, the file has sha256 `{sha}` and {size} bytes",
            path.display(), a.sha256, a.size_bytes
        ));
    }
    Ok(Verified {
        path,
        sha256: sha,
        size_bytes: size,
    })
}

/// Where reports go and how: the lease, RPC retries, and the inline size limit
/// (artifacts up to `inline_max_bytes` travel in the request; 0: none do).
pub struct Reporter<'a> {
    pub client: &'a ProviderClient,
    pub rpc: &'a RetryPolicy,
    pub lease: &'a Lease,
    pub inline_max_bytes: u64,
}

impl Reporter<'_> {
    /// Report one verified artifact (ReportArtifact, retried per the policy).
    pub async fn report(&self, a: &ArtifactEvent, v: &Verified) -> Reported {
        let job = &self.lease.job_id;
        let inline = self.inline_max_bytes > 0 && v.size_bytes <= self.inline_max_bytes;
        let content = if inline {
            match tokio::fs::read(&v.path).await {
                Ok(b) => b,
                Err(e) => {
                    tracing::error!(job_id = %job, artifact = %a.name, "cannot read artifact `{}`: {e}", v.path.display());
                    return Reported::Unreadable;
                }
            }
        } else {
            Vec::new()
        };
        let req = ReportArtifactRequest {
            lease_id: self.lease.lease_id.clone(),
            artifact: Some(Artifact {
                name: a.name.clone(),
                kind: a.kind.clone(),
                sha256: v.sha256.clone(),
                size_bytes: v.size_bytes,
                uri: if inline {
                    String::new()
                } else {
                    file_uri(&v.path)
                },
                step: a.step,
            }),
            content,
        };
        let res = retry(self.rpc, "ReportArtifact", || {
            let mut c = self.client.clone();
            let r = req.clone();
            async move { c.report_artifact(r).await }
        })
        .await;
        match res {
            Ok(resp) => {
                let uri = resp.artifact.map(|a| a.uri).unwrap_or_default();
                tracing::info!(job_id = %job, artifact = %a.name, kind = %a.kind, sha256 = %v.sha256, size_bytes = v.size_bytes, %uri, "artifact reported");
                Reported::Recorded
            }
            Err(Error::Rpc { status, .. }) => match LeaseLost::of("ReportArtifact", &status) {
                Some(lost) => Reported::Lost(lost),
                None => {
                    let e = Error::Rpc {
                        call: "ReportArtifact",
                        status,
                    };
                    tracing::error!(job_id = %job, artifact = %a.name, "{e}");
                    Reported::NotRecorded
                }
            },
            Err(e) => {
                tracing::error!(job_id = %job, artifact = %a.name, "{e}");
                Reported::NotRecorded
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn event(path: &str, sha256: &str, size_bytes: u64) -> ArtifactEvent {
        ArtifactEvent {
            name: "checkpoints/step-2".into(),
            kind: "checkpoint".into(),
            path: path.into(),
            sha256: sha256.into(),
            size_bytes,
            step: 2,
        }
    }

    #[tokio::test]
    async fn verify_checks_place_hash_and_size() {
        let dir = std::env::temp_dir().join(format!("rm-artifact-{}", std::process::id()));
        let ckpt = dir.join("run/checkpoints/step-00000002");
        std::fs::create_dir_all(&ckpt).expect("mkdir");
        std::fs::write(ckpt.join("manifest.json"), b"abc").expect("write");
        let dir = dir.canonicalize().expect("canonical");
        let sha = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";
        let rel = "run/checkpoints/step-00000002/manifest.json";
        let v = verify(&dir, &event(rel, sha, 3)).await.expect("verified");
        assert_eq!(v.path, dir.join(rel));
        assert_eq!((v.sha256.as_str(), v.size_bytes), (sha, 3));
        let wrong = verify(&dir, &event(rel, sha, 4)).await.expect_err("size");
        assert!(wrong.contains("the worker claimed"), "{wrong}");
        let outside = verify(&dir, &event("../../etc/passwd", sha, 3))
            .await
            .expect_err("escape");
        assert!(outside.starts_with("refused artifact"), "{outside}");
        let missing = verify(&dir, &event("run/none.json", sha, 3))
            .await
            .expect_err("missing");
        assert!(
            missing.contains("refused artifact") || missing.contains("cannot read"),
            "{missing}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }
}
