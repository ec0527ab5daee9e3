//! Downloads of a lease's artifacts into its job directory: the one download
//! loop that the resume checkpoint (`crate::artifacts::resume`) and a graph job's inputs
//! (`crate::artifacts::inputs`) share.
//!
//! [`Fetcher::fetch_file`] makes one file local: a file already at its place
//! with the right size and sha256 is kept without a download (a restarted
//! run-manager, a job leased again to this machine); otherwise the bytes are
//! streamed with DownloadArtifact into a `.part` file next to the place,
//! resumed by offset after an interruption (retried per
//! `crate::artifacts::transfer::Retrier`), checked for size and sha256, then renamed into
//! place. A file that does not match is deleted, never kept: a resumed
//! download that does not hash right is fetched once more from the start, and
//! one that still does not is an error. Memory stays bounded: chunks go to
//! disk as they arrive, and hashing reads the file back in 1 MiB pieces.
//!
//! What a failure means is the caller's to decide: a resume checkpoint that
//! cannot be had is logged and the job starts fresh, a missing input ends the
//! attempt RETRYABLE. A lost lease ([`FetchError::Lost`]) ends it for both.

use std::path::Path;

use tokio::io::AsyncWriteExt;
use tokio_stream::StreamExt;

use crate::artifacts::transfer::{is_sha256, GiveUp, LeaseClock, Retrier, Transfer};
use crate::backoff::Backoff;
use crate::lease_lost::LeaseLost;
use crate::proto::{download_artifact_response, DownloadArtifactRequest, Lease};
use crate::worker::jobdir::hash_file;

/// Why a file could not be made local.
#[derive(Debug)]
pub enum FetchError {
    /// Stale (ABORTED), token refused, or the lease expired while the
    /// coordinator stayed unavailable: the attempt is over.
    Lost(LeaseLost),
    /// Refused by the coordinator, bytes that do not hash right, or a local
    /// file error; the message says which.
    Unusable(String),
}

impl From<String> for FetchError {
    fn from(m: String) -> Self {
        FetchError::Unusable(m)
    }
}

/// How a file ended up at its place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fetched {
    /// It was already there with the right size and sha256.
    Kept,
    /// It was downloaded (in full or the rest of a `.part` file).
    Downloaded,
}

/// How one download ended.
enum Got {
    Done,
    /// The bytes did not hash right; the part file was removed.
    Mismatch(String),
}

/// Downloads a lease's artifacts into its job directory.
pub struct Fetcher<'a, T> {
    pub client: T,
    pub lease: &'a Lease,
    pub job_dir: &'a Path,
    pub clock: LeaseClock,
    pub backoff: Backoff,
    /// Cut streams without progress tolerated in a row.
    pub retries: u32,
}

impl<T: Transfer> Fetcher<'_, T> {
    /// Make `dest` the artifact `name` (`sha256`, `size` bytes): kept when it
    /// already is, else downloaded; a resumed download that does not hash
    /// right is fetched once more from the start.
    pub async fn fetch_file(
        &mut self,
        name: &str,
        sha256: &str,
        size: u64,
        dest: &Path,
    ) -> Result<Fetched, FetchError> {
        if !is_sha256(sha256) {
            return Err(format!(
                "`{name}` has sha256 `{}`, not 64 lowercase hex digits",
                short(sha256)
            )
            .into());
        }
        if matches_file(dest, sha256, size).await {
            return Ok(Fetched::Kept);
        }
        let dir = dest
            .parent()
            .ok_or_else(|| format!("`{}` has no directory", dest.display()))?;
        tokio::fs::create_dir_all(dir)
            .await
            .map_err(|e| format!("cannot create `{}`: {e}", dir.display()))?;
        let file_name = dest
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_default();
        let part = dir.join(format!(".{file_name}.{}.part", &sha256[..16]));
        let mut retrier = Retrier::new(self.clock.clone(), self.backoff, self.retries);
        let mut from_scratch = false;
        loop {
            match self
                .download(name, sha256, size, &part, &mut retrier)
                .await?
            {
                Got::Done => break,
                Got::Mismatch(why) if !from_scratch => {
                    tracing::warn!(job_id = %self.lease.job_id, artifact = %name, "{why}; downloading it again from the start");
                    from_scratch = true;
                }
                Got::Mismatch(why) => return Err(why.into()),
            }
        }
        tokio::fs::rename(&part, dest)
            .await
            .map_err(|e| format!("cannot rename `{}` into place: {e}", part.display()))?;
        Ok(Fetched::Downloaded)
    }

    /// Download into `part` (appending to what it holds) until it has `size`
    /// bytes, retrying per `retrier`; then check its sha256.
    async fn download(
        &mut self,
        name: &str,
        sha256: &str,
        size: u64,
        part: &Path,
        retrier: &mut Retrier,
    ) -> Result<Got, FetchError> {
        let give_up = |g: GiveUp| match g {
            GiveUp::Lost(l) => FetchError::Lost(l),
            GiveUp::Refused(s) => FetchError::Unusable(format!(
                "downloading `{name}` failed: {} ({:?})",
                s.message(),
                s.code()
            )),
        };
        loop {
            let mut have = tokio::fs::metadata(part).await.map_or(0, |m| m.len());
            if have > size {
                remove(part).await;
                have = 0;
            }
            if have == size {
                if size == 0 {
                    // an empty artifact (an empty split file) has nothing to download: the part file is made here
                    tokio::fs::write(part, b"").await.map_err(|e| {
                        FetchError::Unusable(format!("cannot write `{}`: {e}", part.display()))
                    })?;
                }
                return check_part(part, name, sha256, size).await;
            }
            let req = DownloadArtifactRequest {
                lease_id: self.lease.lease_id.clone(),
                name: name.to_string(),
                sha256: sha256.to_string(),
                offset: have,
            };
            let status = match self.client.download(req).await {
                Ok(stream) => match append(stream, part, name, sha256, size, have).await? {
                    None => continue,
                    Some(status) => status,
                },
                Err(status) => status,
            };
            let now = tokio::fs::metadata(part).await.map_or(0, |m| m.len());
            if now > have {
                retrier.progressed();
            }
            retrier
                .after("DownloadArtifact", name, status)
                .await
                .map_err(give_up)?;
        }
    }
}

/// Append one download stream (from `offset`) to `part`: None when the stream
/// ended (the caller looks at the size), the status when it broke.
async fn append(
    mut stream: crate::artifacts::transfer::DownloadStream,
    part: &Path,
    name: &str,
    sha256: &str,
    size: u64,
    offset: u64,
) -> Result<Option<tonic::Status>, FetchError> {
    let io =
        |e: std::io::Error| FetchError::Unusable(format!("cannot write `{}`: {e}", part.display()));
    match stream.next().await {
        Some(Ok(m)) => match m.msg {
            Some(download_artifact_response::Msg::Artifact(a)) => {
                if a.sha256 != sha256 || a.size_bytes != size {
                    return Err(format!(
                        "the coordinator offers `{name}` with sha256 `{}` and {} bytes; its manifest says `{sha256}` and {size}",
                        a.sha256, a.size_bytes
                    )
                    .into());
                }
            }
            _ => {
                return Err(
                    format!("the download of `{name}` did not start with its header").into(),
                )
            }
        },
        Some(Err(status)) => return Ok(Some(status)),
        None => {
            return Ok(Some(tonic::Status::unknown(
                "the download stream ended before its header",
            )))
        }
    }
    let mut file = tokio::fs::OpenOptions::new()
        .create(true)
        .append(true)
        .open(part)
        .await
        .map_err(io)?;
    let mut pos = offset;
    let mut broke = None;
    while let Some(m) = stream.next().await {
        match m {
            Ok(crate::proto::DownloadArtifactResponse {
                msg: Some(download_artifact_response::Msg::Chunk(c)),
            }) => {
                pos += c.len() as u64;
                if pos > size {
                    drop(file);
                    remove(part).await;
                    return Err(format!(
                        "the coordinator sent more than the {size} bytes of `{name}`"
                    )
                    .into());
                }
                file.write_all(&c).await.map_err(io)?;
            }
            Ok(_) => {
                drop(file);
                remove(part).await;
                return Err(format!("the download of `{name}` sent a second header").into());
            }
            Err(status) => {
                broke = Some(status);
                break;
            }
        }
    }
    file.flush().await.map_err(io)?;
    file.sync_all().await.map_err(io)?;
    Ok(broke)
}

/// `part` is complete: keep it if it hashes to `sha256`, else remove it.
async fn check_part(part: &Path, name: &str, sha256: &str, size: u64) -> Result<Got, FetchError> {
    let p = part.to_path_buf();
    let (got, n) =
        blocking(move || hash_file(&p).map_err(|e| format!("cannot read `{}`: {e}", p.display())))
            .await?;
    if got == sha256 && n == size {
        return Ok(Got::Done);
    }
    remove(part).await;
    Ok(Got::Mismatch(format!(
        "the downloaded `{name}` has sha256 `{got}` ({n} bytes), not `{sha256}` ({size} bytes)"
    )))
}

/// Whether `path` is a file with `size` bytes hashing to `sha256`.
pub async fn matches_file(path: &Path, sha256: &str, size: u64) -> bool {
    match tokio::fs::metadata(path).await {
        Ok(m) if m.is_file() && m.len() == size => {}
        _ => return false,
    }
    let p = path.to_path_buf();
    matches!(blocking(move || hash_file(&p).map_err(|e| e.to_string())).await, Ok((got, _)) if got == sha256)
}

async fn remove(path: &Path) {
    let _ = tokio::fs::remove_file(path).await;
}

/// At most 80 characters of `s`, for messages.
fn short(s: &str) -> String {
    s.chars().take(80).collect()
}

/// Run blocking file work off the async threads.
pub async fn blocking<R: Send + 'static>(
    f: impl FnOnce() -> Result<R, String> + Send + 'static,
) -> Result<R, String> {
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| format!("file work failed: {e}"))?
}

#[cfg(test)]
pub(crate) mod testing {
    //! What the download tests of `resume`, `graph` and `attempt` share.

    use std::path::PathBuf;
    use std::time::Duration;

    use sha2::Digest;

    use super::*;
    use crate::artifacts::transfer::hex;
    use crate::artifacts::transfer::testing::FakeStore;
    use crate::proto::Artifact;

    /// A fresh, empty, canonical temp directory for test `tag`.
    pub fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rm-fetch-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d.canonicalize().expect("canonical")
    }

    pub fn sha(b: &[u8]) -> String {
        hex(&sha2::Sha256::digest(b))
    }

    /// A `data` input named `name` holding `bytes`, as a graph lease lists its prepare job's files.
    pub fn input(name: &str, bytes: &[u8]) -> Artifact {
        Artifact {
            name: name.into(),
            kind: "data".into(),
            sha256: sha(bytes),
            size_bytes: bytes.len() as u64,
            uri: format!("dflash-artifact://run-1/prepare/1/{name}"),
            step: 0,
        }
    }

    /// A fetcher on `store` with quick retries.
    pub fn fetcher<'a>(
        store: &FakeStore,
        lease: &'a Lease,
        job_dir: &'a Path,
    ) -> Fetcher<'a, FakeStore> {
        Fetcher {
            client: store.clone(),
            lease,
            job_dir,
            clock: LeaseClock::start(Duration::from_secs(60)),
            backoff: Backoff::doubling(Duration::from_millis(1), Duration::from_millis(2)),
            retries: 3,
        }
    }

    /// The `.part` files left anywhere under `dir`.
    pub fn part_files(dir: &Path) -> Vec<PathBuf> {
        let mut found = Vec::new();
        let mut stack = vec![dir.to_path_buf()];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).into_iter().flatten().flatten() {
                let p = e.path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.to_string_lossy().ends_with(".part") {
                    found.push(p);
                }
            }
        }
        found
    }
}
