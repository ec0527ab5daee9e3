//! The lease's `resume_checkpoint`, made a local manifest the worker can
//! resume from, before the worker starts.
//!
//! Same machine first: when the job directory still holds the checkpoint
//! where the worker wrote it (`JOB_DIR/NAME`), or where an earlier attempt
//! downloaded it (`JOB_DIR/resume/NAME`), with the lease's sha256 and every
//! listed file hashing right, that copy is used. Otherwise the manifest and
//! each file it lists are fetched ([`Fetcher::fetch_file`]: `.part` file,
//! resumed by offset, sha256 and size checked, renamed into place) into
//! `JOB_DIR/resume/`.
//!
//! A checkpoint that cannot be fetched or checked is not fatal: the worker
//! starts from the beginning (with a warning saying why), as it does when no
//! checkpoint exists. Only a lost lease ends the attempt.

use std::path::{Path, PathBuf};

use crate::artifacts::checkpoint::{self, ListedFile};
use crate::artifacts::fetch::{blocking, FetchError, Fetcher};
use crate::artifacts::transfer::{is_sha256, Transfer};
use crate::lease_lost::LeaseLost;
use crate::paths::check_artifact_name;
use crate::worker::jobdir::{hash_file, RESUME_DIR};

impl<T: Transfer> Fetcher<'_, T> {
    /// The local manifest to resume from and its step; None (with a warning)
    /// when there is none or it cannot be had; Err only for a lost lease.
    pub async fn resume(&mut self) -> Result<Option<(PathBuf, u64)>, LeaseLost> {
        let Some(ckpt) = self.lease.resume_checkpoint.clone() else {
            return Ok(None);
        };
        let job_id = &self.lease.job_id;
        match self
            .local_or_fetch(&ckpt.name, &ckpt.sha256, ckpt.size_bytes)
            .await
        {
            Ok(path) => {
                tracing::info!(job_id = %job_id, step = ckpt.step, checkpoint = %ckpt.name, "resuming from `{}`", path.display());
                Ok(Some((path, ckpt.step)))
            }
            Err(FetchError::Lost(lost)) => Err(lost),
            Err(FetchError::Unusable(why)) => {
                tracing::warn!(job_id = %job_id, checkpoint = %ckpt.name, "cannot use the resume checkpoint: {why}; starting from the beginning");
                Ok(None)
            }
        }
    }

    async fn local_or_fetch(
        &mut self,
        name: &str,
        sha256: &str,
        size: u64,
    ) -> Result<PathBuf, FetchError> {
        check_artifact_name(name).map_err(|e| format!("{e}"))?;
        if !is_sha256(sha256) {
            return Err(format!("the lease gives it sha256 `{sha256}`").into());
        }
        let fetched = self.job_dir.join(RESUME_DIR).join(name);
        for candidate in [self.job_dir.join(name), fetched.clone()] {
            if let Some(files) = intact(name, &candidate, sha256).await {
                tracing::info!(job_id = %self.lease.job_id, checkpoint = %name, files, "the checkpoint is already on this machine");
                return Ok(candidate);
            }
        }
        self.fetch_file(name, sha256, size, &fetched).await?;
        let (n, p) = (name.to_string(), fetched.clone());
        let files = blocking(move || checkpoint::read(&n, &p)).await?;
        for f in &files {
            let dest = checkpoint::local_path(&fetched, f);
            self.fetch_file(&f.name, &f.sha256, f.size, &dest).await?;
        }
        tracing::info!(job_id = %self.lease.job_id, checkpoint = %name, files = files.len(), "downloaded the resume checkpoint");
        Ok(fetched)
    }
}

/// The number of files a local checkpoint lists when the manifest at `path`
/// hashes to `sha256` and every listed file to what it says; None otherwise.
async fn intact(name: &str, path: &Path, sha256: &str) -> Option<usize> {
    let (n, p, sha) = (name.to_string(), path.to_path_buf(), sha256.to_string());
    blocking(move || {
        let (got, _) = hash_file(&p).map_err(|e| e.to_string())?;
        if got != sha {
            return Err(String::new());
        }
        let files = checkpoint::read(&n, &p)?;
        for f in &files {
            if !file_is(&checkpoint::local_path(&p, f), f) {
                return Err(String::new());
            }
        }
        Ok(files.len())
    })
    .await
    .ok()
}

fn file_is(path: &Path, f: &ListedFile) -> bool {
    matches!(hash_file(path), Ok((sha, size)) if sha == f.sha256 && size == f.size)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifacts::fetch::testing::{fetcher, part_files, sha, tmp};
    use crate::artifacts::transfer::testing::{Call, FakeStore, Fault};
    use crate::proto::{Artifact, Lease};

    /// A checkpoint `ckpt/step-4` with one 3 MiB file, offered by `store`; returns the lease.
    fn offered(store: &FakeStore) -> (Lease, Vec<u8>, Vec<u8>) {
        let weights: Vec<u8> = (0..3 * crate::artifacts::transfer::CHUNK_BYTES + 17)
            .map(|i| (i % 253) as u8)
            .collect();
        let manifest = format!(
            r#"{{"format": "f", "step": 4, "files": {{"w.safetensors": {{"sha256": "{}", "size": {}}}}}}}"#,
            sha(&weights),
            weights.len()
        )
        .into_bytes();
        let mut st = store.state();
        st.downloads.insert(
            ("ckpt/step-4/manifest.json".into(), sha(&manifest)),
            manifest.clone(),
        );
        st.downloads.insert(
            ("ckpt/step-4/w.safetensors".into(), sha(&weights)),
            weights.clone(),
        );
        let lease = Lease {
            lease_id: "lease-2".into(),
            job_id: "job-1".into(),
            resume_checkpoint: Some(Artifact {
                name: "ckpt/step-4/manifest.json".into(),
                kind: "checkpoint".into(),
                sha256: sha(&manifest),
                size_bytes: manifest.len() as u64,
                step: 4,
                uri: String::new(),
            }),
            ..Default::default()
        };
        (lease, manifest, weights)
    }

    #[tokio::test]
    async fn downloads_the_manifest_and_its_files_resuming_a_cut_stream() {
        let dir = tmp("fetch");
        let store = FakeStore::default();
        let (lease, manifest, weights) = offered(&store);
        store.fault(
            Call::Download,
            Fault::Status(tonic::Status::unavailable("restarting")),
        );
        let got = fetcher(&store, &lease, &dir)
            .resume()
            .await
            .expect("not lost");
        let (path, step) = got.expect("resumable");
        assert_eq!(step, 4);
        assert_eq!(path, dir.join("resume/ckpt/step-4/manifest.json"));
        assert_eq!(std::fs::read(&path).expect("manifest"), manifest);
        assert_eq!(
            std::fs::read(dir.join("resume/ckpt/step-4/w.safetensors")).expect("w"),
            weights
        );
        assert_eq!(store.state().download_offsets, vec![0, 0, 0]);

        // Again, with the weights' stream cut mid-way: the retry resumes at the offset.
        let dir2 = tmp("fetch-cut");
        let store = FakeStore::default();
        let (lease, _, weights) = offered(&store);
        store.state().download_chunk = 1 << 19;
        store.fault(
            Call::Download,
            Fault::CutAfter(u64::MAX, tonic::Status::unavailable("unused")),
        );
        store.fault(
            Call::Download,
            Fault::CutAfter(1 << 20, tonic::Status::cancelled("reset")),
        );
        let (path, _) = fetcher(&store, &lease, &dir2)
            .resume()
            .await
            .expect("ok")
            .expect("resumable");
        assert_eq!(
            std::fs::read(path.with_file_name("w.safetensors")).expect("w"),
            weights
        );
        assert_eq!(store.state().download_offsets, vec![0, 0, 1 << 20]);
        let leftovers = part_files(&dir2);
        assert!(leftovers.is_empty(), "{leftovers:?}");
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&dir2);
    }

    #[tokio::test]
    async fn a_checkpoint_already_here_is_used_without_a_download() {
        let dir = tmp("local");
        let store = FakeStore::default();
        let (lease, manifest, weights) = offered(&store);
        let ck = dir.join("ckpt/step-4");
        std::fs::create_dir_all(&ck).expect("mkdir");
        std::fs::write(ck.join("manifest.json"), &manifest).expect("write");
        std::fs::write(ck.join("w.safetensors"), &weights).expect("write");
        let (path, _) = fetcher(&store, &lease, &dir)
            .resume()
            .await
            .expect("ok")
            .expect("resumable");
        assert_eq!(path, ck.join("manifest.json"));
        assert!(store.state().download_offsets.is_empty());
        // A listed file that no longer hashes right: the copy is not used, a download is.
        std::fs::write(ck.join("w.safetensors"), b"other").expect("write");
        let (path, _) = fetcher(&store, &lease, &dir)
            .resume()
            .await
            .expect("ok")
            .expect("resumable");
        assert_eq!(path, dir.join("resume/ckpt/step-4/manifest.json"));
        assert_eq!(store.state().download_offsets.len(), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn bytes_that_do_not_hash_right_are_not_kept() {
        let dir = tmp("corrupt");
        let store = FakeStore::default();
        let (lease, _, _) = offered(&store);
        store.state().corrupt_download_at = Some(1);
        let got = fetcher(&store, &lease, &dir)
            .resume()
            .await
            .expect("not lost");
        assert!(got.is_none());
        let fetched = dir.join("resume/ckpt/step-4");
        let left: Vec<_> = std::fs::read_dir(&fetched)
            .expect("ls")
            .filter_map(|e| e.ok())
            .map(|e| e.file_name())
            .collect();
        assert!(left.is_empty(), "{left:?}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_missing_or_refused_checkpoint_starts_fresh_but_a_lost_lease_is_lost() {
        let dir = tmp("missing");
        let store = FakeStore::default();
        let (lease, _, _) = offered(&store);
        store.state().downloads.clear();
        assert!(fetcher(&store, &lease, &dir)
            .resume()
            .await
            .expect("not lost")
            .is_none());
        let (lease, _, _) = offered(&store);
        store.fault(
            Call::Download,
            Fault::Status(tonic::Status::aborted("stale")),
        );
        assert!(matches!(
            fetcher(&store, &lease, &dir).resume().await,
            Err(LeaseLost::Stale(_))
        ));
        let mut bad = lease.clone();
        if let Some(c) = bad.resume_checkpoint.as_mut() {
            c.name = "../escape/manifest.json".into();
        }
        assert!(fetcher(&store, &bad, &dir)
            .resume()
            .await
            .expect("not lost")
            .is_none());
        let none = Lease::default();
        assert!(fetcher(&store, &none, &dir)
            .resume()
            .await
            .expect("ok")
            .is_none());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_manifest_listing_an_unsafe_name_is_refused() {
        let dir = tmp("unsafe");
        let store = FakeStore::default();
        let manifest = format!(
            r#"{{"files": {{"../../x": {{"sha256": "{}", "size": 1}}}}}}"#,
            sha(b"x")
        )
        .into_bytes();
        store
            .state()
            .downloads
            .insert(("c/manifest.json".into(), sha(&manifest)), manifest.clone());
        let lease = Lease {
            resume_checkpoint: Some(Artifact {
                name: "c/manifest.json".into(),
                sha256: sha(&manifest),
                size_bytes: manifest.len() as u64,
                step: 1,
                ..Default::default()
            }),
            ..Default::default()
        };
        assert!(fetcher(&store, &lease, &dir)
            .resume()
            .await
            .expect("not lost")
            .is_none());
        // Refused when the manifest was read: only the manifest was downloaded.
        assert_eq!(store.state().download_offsets, vec![0]);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
