//! Uploads: every verified artifact travels to the coordinator as an
//! UploadArtifact stream, one at a time in the order the worker announced
//! them, on a task of its own so heartbeats and worker events never wait
//! for the network.
//!
//! One file: UploadOffset says how much the coordinator already staged (or
//! that it is committed: nothing to send), then one stream sends the header
//! and the rest of the file in chunks of at most [`CHUNK_BYTES`]. The file is
//! read once per try, from the start (the prefix only hashed, not sent), so
//! its sha256 is checked before the last chunk leaves: a file that changed
//! since it was verified is never committed, and the stream is cancelled
//! instead. Memory stays bounded: two chunks queued, one being read.
//!
//! A checkpoint is its listed files first (kind `checkpoint_file`), then its
//! manifest. A checkpoint whose files cannot be read any more (the worker
//! pruned it, or a file changed) is skipped with an error: a newer one
//! follows. Retries are `crate::artifacts::transfer`'s; a refusal or a lost lease stops
//! the queue and is reported to the supervisor at once.

use std::path::PathBuf;

use sha2::Digest;
use tokio::sync::{mpsc, oneshot};
use tokio::task::JoinHandle;
use tokio_stream::wrappers::ReceiverStream;

use crate::artifacts::transfer::{hex, GiveUp, LeaseClock, Retrier, Transfer, CHUNK_BYTES};
use crate::backoff::Backoff;
use crate::proto::{
    upload_artifact_request, Artifact, UploadArtifactRequest, UploadHeader, UploadOffsetRequest,
};
use crate::signal::{Signal, UploadFailure};

/// Chunks queued between the file reader and the stream.
const QUEUED_CHUNKS: usize = 2;

/// One verified file to upload as `artifact` (name, kind, sha256, size, step).
#[derive(Debug, Clone, PartialEq)]
pub struct FileUpload {
    pub path: PathBuf,
    pub artifact: Artifact,
}

/// What the queue uploads, in announcement order.
#[derive(Debug, Clone, PartialEq)]
pub enum Item {
    File(FileUpload),
    /// Its files first, then its manifest.
    Checkpoint {
        files: Vec<FileUpload>,
        manifest: FileUpload,
    },
}

impl Item {
    fn name(&self) -> &str {
        match self {
            Item::File(f) => &f.artifact.name,
            Item::Checkpoint { manifest, .. } => &manifest.artifact.name,
        }
    }
}

/// How one try of a stream ended.
enum Sent {
    Done(Artifact),
    Status(tonic::Status),
    Local(String),
}

/// Why the file reader stopped early.
enum ReadStop {
    /// The stream is gone: the call's status says why.
    Closed,
    Local(String),
}

/// Uploads files for one lease.
pub struct Uploader<T> {
    pub client: T,
    pub lease_id: String,
    pub job_id: String,
    pub clock: LeaseClock,
    pub backoff: Backoff,
    /// Cut streams without progress tolerated in a row.
    pub retries: u32,
}

impl<T: Transfer> Uploader<T> {
    /// Upload one item: a checkpoint's files, then its manifest.
    pub async fn item(&mut self, item: &Item) -> Result<(), UploadFailure> {
        match item {
            Item::File(f) => self.file(f).await,
            Item::Checkpoint { files, manifest } => {
                for f in files {
                    self.file(f).await?;
                }
                self.file(manifest).await
            }
        }
    }

    /// Upload one file, resuming from what the coordinator staged, until it
    /// is committed or the retries give up.
    pub async fn file(&mut self, f: &FileUpload) -> Result<(), UploadFailure> {
        let name = f.artifact.name.clone();
        let give_up = |g: GiveUp| match g {
            GiveUp::Lost(l) => UploadFailure::Lost(l),
            GiveUp::Refused(status) => UploadFailure::Refused {
                name: name.clone(),
                status,
            },
        };
        let mut retrier = Retrier::new(self.clock.clone(), self.backoff, self.retries);
        let mut last_offset: Option<u64> = None;
        loop {
            let req = UploadOffsetRequest {
                lease_id: self.lease_id.clone(),
                artifact: Some(f.artifact.clone()),
            };
            let staged = match self.client.upload_offset(req).await {
                Ok(s) => s,
                Err(status) => {
                    retrier
                        .after("UploadOffset", &name, status)
                        .await
                        .map_err(give_up)?;
                    continue;
                }
            };
            if staged.committed {
                tracing::info!(job_id = %self.job_id, artifact = %name, kind = %f.artifact.kind, sha256 = %f.artifact.sha256, "artifact already uploaded");
                return Ok(());
            }
            if last_offset.is_some_and(|o| staged.offset > o) {
                retrier.progressed();
            }
            last_offset = Some(staged.offset);
            match self.send(f, staged.offset).await {
                Sent::Done(rec) => {
                    tracing::info!(job_id = %self.job_id, artifact = %name, kind = %f.artifact.kind, sha256 = %f.artifact.sha256, size_bytes = f.artifact.size_bytes, step = f.artifact.step, uri = %rec.uri, resumed_at = staged.offset, "artifact reported");
                    return Ok(());
                }
                Sent::Local(message) => return Err(UploadFailure::Local { name, message }),
                // The stream ended short, or an earlier stream of this file is still open on
                // the coordinator: ask where to resume, a bounded number of times without
                // progress (a checkpoint whose files are missing fails the same way every time).
                Sent::Status(status) if status.code() == tonic::Code::FailedPrecondition => retrier
                    .after_cut("UploadArtifact", &name, status)
                    .await
                    .map_err(give_up)?,
                Sent::Status(status) => retrier
                    .after("UploadArtifact", &name, status)
                    .await
                    .map_err(give_up)?,
            }
        }
    }

    /// One UploadArtifact stream from `offset`.
    async fn send(&mut self, f: &FileUpload, offset: u64) -> Sent {
        let (tx, rx) = mpsc::channel(QUEUED_CHUNKS);
        let header = UploadArtifactRequest {
            msg: Some(upload_artifact_request::Msg::Header(UploadHeader {
                lease_id: self.lease_id.clone(),
                artifact: Some(f.artifact.clone()),
                offset,
            })),
        };
        if tx.send(header).await.is_err() {
            return Sent::Local("the upload stream closed before its header".into());
        }
        let (path, size, sha) = (
            f.path.clone(),
            f.artifact.size_bytes,
            f.artifact.sha256.clone(),
        );
        // Dropped when this call ends (or is dropped): a reader waiting to queue a chunk stops then.
        let (_call_alive, mut call_gone) = oneshot::channel::<()>();
        let handle = tokio::runtime::Handle::current();
        let mut reader = tokio::task::spawn_blocking(move || {
            let stop = {
                let mut sink = |m| {
                    handle.block_on(async {
                        tokio::select! {
                            r = tx.send(m) => r.map_err(|_| ReadStop::Closed),
                            _ = &mut call_gone => Err(ReadStop::Closed),
                        }
                    })
                };
                read_chunks(&path, offset, size, &sha, &mut sink).err()
            };
            // The sender goes back to the caller, which ends the stream itself.
            (stop, tx)
        });
        let mut client = self.client.clone();
        let mut call = Box::pin(client.upload(ReceiverStream::new(rx)));
        tokio::select! {
            biased;
            res = &mut call => {
                reader.abort();
                match res {
                    Ok(resp) => Sent::Done(resp.artifact.unwrap_or_default()),
                    Err(status) => Sent::Status(status),
                }
            }
            joined = &mut reader => match joined {
                Ok((None | Some(ReadStop::Closed), tx)) => {
                    // All sent (dropping the sender ends the stream), or the stream is gone.
                    drop(tx);
                    match call.await {
                        Ok(resp) => Sent::Done(resp.artifact.unwrap_or_default()),
                        Err(status) => Sent::Status(status),
                    }
                }
                Ok((Some(ReadStop::Local(m)), tx)) => {
                    // The last chunk was held back, so the stream is short and
                    // nothing is committed however it ends; cancel it first anyway.
                    drop(call);
                    drop(tx);
                    Sent::Local(m)
                }
                Err(e) => Sent::Local(format!("the file reader failed: {e}")),
            }
        }
    }
}

/// Read `path` from the start, hashing all of it and sending bytes from
/// `offset` on in chunks of at most [`CHUNK_BYTES`]; the last chunk is sent
/// only once the whole file hashed to `sha256` in exactly `size` bytes.
///
/// Each chunk that travels is read straight into the buffer its message owns
/// (no copy, no zeroing); bytes before `offset` are only hashed, through one
/// reused buffer. The caller runs this on a blocking thread, so reading and
/// hashing the next chunk overlap the sending of the queued ones.
fn read_chunks(
    path: &std::path::Path,
    offset: u64,
    size: u64,
    sha256: &str,
    sink: &mut dyn FnMut(UploadArtifactRequest) -> Result<(), ReadStop>,
) -> Result<(), ReadStop> {
    use std::io::Read;
    let local = |m: String| ReadStop::Local(m);
    let mut file = std::fs::File::open(path)
        .map_err(|e| local(format!("cannot read `{}`: {e}", path.display())))?;
    let mut hasher = sha2::Sha256::new();
    let mut skipped = Vec::new();
    let mut pos = 0u64;
    loop {
        let want = (size - pos).min(CHUNK_BYTES as u64) as usize;
        let end = pos + want as u64;
        let mut buf = if end > offset {
            Vec::with_capacity(want)
        } else {
            skipped.clear();
            std::mem::take(&mut skipped)
        };
        let got = (&mut file)
            .take(want as u64)
            .read_to_end(&mut buf)
            .map_err(|e| {
                local(format!(
                    "cannot read `{}` at byte {pos} of {size}: {e}",
                    path.display()
                ))
            })?;
        if got < want {
            return Err(local(format!(
                "cannot read `{}` at byte {} of {size}: the file ends there",
                path.display(),
                pos + got as u64
            )));
        }
        hasher.update(&buf);
        if end == size {
            // One more byte would mean the file grew: its first `size` bytes may still hash right.
            let got = hex(&hasher.clone().finalize());
            if got != sha256 {
                return Err(local(format!(
                    "`{}` changed since it was verified: its sha256 is now `{got}`, not `{sha256}`",
                    path.display()
                )));
            }
        }
        if end > offset {
            // Only the first chunk of a resumed upload starts inside the buffer.
            let from = offset.saturating_sub(pos) as usize;
            if from > 0 {
                buf.drain(..from);
            }
            sink(UploadArtifactRequest {
                msg: Some(upload_artifact_request::Msg::Chunk(buf)),
            })?;
        } else {
            skipped = buf;
        }
        pos = end;
        if pos == size {
            return Ok(());
        }
    }
}

/// The ordered upload queue of one attempt (see the module docs).
pub struct UploadQueue {
    tx: Option<mpsc::UnboundedSender<Item>>,
    task: Option<JoinHandle<Result<(), UploadFailure>>>,
}

impl UploadQueue {
    /// Start the queue's task; failures also go to `signals` as they happen.
    pub fn start<T: Transfer>(uploader: Uploader<T>, signals: mpsc::Sender<Signal>) -> Self {
        let (tx, rx) = mpsc::unbounded_channel();
        let task = tokio::spawn(run_queue(uploader, rx, signals));
        UploadQueue {
            tx: Some(tx),
            task: Some(task),
        }
    }

    /// Queue `item` after everything announced before it (dropped when the queue already failed).
    pub fn push(&self, item: Item) {
        if let Some(tx) = &self.tx {
            let _ = tx.send(item);
        }
    }

    /// Wait until everything queued is uploaded, or the first failure.
    pub async fn drain(&mut self) -> Result<(), UploadFailure> {
        self.tx = None;
        match self.task.as_mut() {
            Some(task) => {
                let res = task.await;
                self.task = None;
                match res {
                    Ok(r) => r,
                    Err(e) => Err(UploadFailure::Local {
                        name: "(queue)".into(),
                        message: format!("the upload task failed: {e}"),
                    }),
                }
            }
            None => Ok(()),
        }
    }
}

impl Drop for UploadQueue {
    fn drop(&mut self) {
        if let Some(task) = &self.task {
            task.abort();
        }
    }
}

async fn run_queue<T: Transfer>(
    mut up: Uploader<T>,
    mut rx: mpsc::UnboundedReceiver<Item>,
    signals: mpsc::Sender<Signal>,
) -> Result<(), UploadFailure> {
    while let Some(item) = rx.recv().await {
        match up.item(&item).await {
            Ok(()) => {}
            Err(UploadFailure::Local { name, message })
                if matches!(item, Item::Checkpoint { .. }) =>
            {
                tracing::error!(job_id = %up.job_id, artifact = %item.name(), "checkpoint not uploaded: `{name}`: {message}; a later checkpoint replaces it");
            }
            Err(failure) => {
                let _ = signals.send(Signal::Upload(failure.clone())).await;
                return Err(failure);
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::time::Duration;

    use super::*;
    use crate::artifacts::transfer::testing::{Call, FakeStore, Fault};
    use crate::lease_lost::LeaseLost;

    fn tmp(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rm-upload-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    /// Deterministic bytes that differ chunk to chunk.
    fn bytes(n: usize) -> Vec<u8> {
        (0..n).map(|i| (i % 251) as u8 ^ (i >> 20) as u8).collect()
    }

    fn upload_of(dir: &std::path::Path, name: &str, kind: &str, data: &[u8]) -> FileUpload {
        let path = dir.join(name.replace('/', "_"));
        std::fs::write(&path, data).expect("write");
        FileUpload {
            path,
            artifact: Artifact {
                name: name.into(),
                kind: kind.into(),
                sha256: hex(&sha2::Sha256::digest(data)),
                size_bytes: data.len() as u64,
                step: 2,
                uri: String::new(),
            },
        }
    }

    fn uploader(store: &FakeStore) -> Uploader<FakeStore> {
        Uploader {
            client: store.clone(),
            lease_id: "lease-1".into(),
            job_id: "job-1".into(),
            clock: LeaseClock::start(Duration::from_secs(60)),
            backoff: Backoff::doubling(Duration::from_millis(1), Duration::from_millis(2)),
            retries: 3,
        }
    }

    #[tokio::test]
    async fn chunks_are_at_most_one_mib_and_add_up_to_the_file() {
        let dir = tmp("chunks");
        for (n, want) in [
            (0usize, vec![]),
            (1, vec![1]),
            (CHUNK_BYTES, vec![CHUNK_BYTES]),
            (CHUNK_BYTES + 1, vec![CHUNK_BYTES, 1]),
            (
                3 * CHUNK_BYTES - 7,
                vec![CHUNK_BYTES, CHUNK_BYTES, CHUNK_BYTES - 7],
            ),
        ] {
            let store = FakeStore::default();
            let data = bytes(n);
            let f = upload_of(&dir, &format!("a-{n}"), "report", &data);
            uploader(&store).file(&f).await.expect("uploaded");
            let st = store.state();
            assert_eq!(st.chunk_sizes, want, "{n} bytes");
            assert_eq!(st.header_offsets, vec![0]);
            let (rec, got) = &st.committed[&f.artifact.name];
            assert_eq!(got, &data);
            assert!(rec.uri.starts_with("dflash-artifact://"), "{rec:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn an_upload_resumes_at_the_staged_offset() {
        let dir = tmp("resume");
        let store = FakeStore::default();
        let data = bytes(2 * CHUNK_BYTES + 10);
        let f = upload_of(&dir, "exports/model.safetensors", "export", &data);
        let staged = CHUNK_BYTES as u64 + 5;
        store.state().staged.insert(
            (f.artifact.name.clone(), f.artifact.sha256.clone()),
            data[..staged as usize].to_vec(),
        );
        uploader(&store).file(&f).await.expect("uploaded");
        let st = store.state();
        assert_eq!(st.header_offsets, vec![staged]);
        // The rest of the first MiB, then the rest: only bytes past the offset travel.
        // Only bytes past the offset travel: the rest of the second MiB, then the tail.
        assert_eq!(st.chunk_sizes, vec![CHUNK_BYTES - 5, 10]);
        assert_eq!(
            st.chunk_sizes.iter().sum::<usize>() as u64,
            data.len() as u64 - staged
        );
        assert_eq!(st.committed[&f.artifact.name].1, data);
        drop(st);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_cut_stream_resumes_where_the_coordinator_says() {
        let dir = tmp("cut");
        let store = FakeStore::default();
        let data = bytes(3 * CHUNK_BYTES);
        let f = upload_of(&dir, "exports/big.bin", "export", &data);
        store.fault(
            Call::Upload,
            Fault::CutAfter(CHUNK_BYTES as u64, tonic::Status::cancelled("reset")),
        );
        store.fault(
            Call::Offset,
            Fault::Status(tonic::Status::unavailable("restarting")),
        );
        store.fault(
            Call::Upload,
            Fault::Status(tonic::Status::unavailable("disk full")),
        );
        uploader(&store).file(&f).await.expect("uploaded");
        let st = store.state();
        assert_eq!(
            st.header_offsets,
            vec![0, CHUNK_BYTES as u64, CHUNK_BYTES as u64]
        );
        assert_eq!(st.committed[&f.artifact.name].1, data);
        drop(st);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn streams_cut_mid_file_resume_from_unaligned_offsets_and_send_each_byte_once() {
        let dir = tmp("cut-unaligned");
        let store = FakeStore::default();
        let data = bytes(4 * CHUNK_BYTES + 123);
        let f = upload_of(&dir, "captures/shard-0.bin", "capture", &data);
        // An earlier stream staged 7 bytes: this one starts inside the first chunk.
        store.state().staged.insert(
            (f.artifact.name.clone(), f.artifact.sha256.clone()),
            data[..7].to_vec(),
        );
        // The server cuts the next two streams after their first chunk (a reset connection,
        // a restarted server): each resumes where the staged bytes end.
        store.fault(
            Call::Upload,
            Fault::CutAfter(1, tonic::Status::internal("RST_STREAM")),
        );
        store.fault(
            Call::Upload,
            Fault::CutAfter(1, tonic::Status::unknown("connection reset")),
        );
        uploader(&store).file(&f).await.expect("uploaded");
        let st = store.state();
        let mib = CHUNK_BYTES as u64;
        assert_eq!(st.header_offsets, vec![7, mib, 2 * mib]);
        assert_eq!(
            st.chunk_sizes,
            vec![CHUNK_BYTES - 7, CHUNK_BYTES, CHUNK_BYTES, CHUNK_BYTES, 123]
        );
        assert_eq!(st.chunk_sizes.iter().sum::<usize>(), data.len() - 7);
        assert_eq!(st.committed[&f.artifact.name].1, data);
        drop(st);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_file_that_ends_early_names_the_byte_and_commits_nothing() {
        let dir = tmp("short");
        let store = FakeStore::default();
        let data = bytes(2 * CHUNK_BYTES);
        let f = upload_of(&dir, "exports/m.bin", "export", &data);
        std::fs::write(&f.path, &data[..CHUNK_BYTES + 10]).expect("truncate");
        let err = uploader(&store).file(&f).await.expect_err("short");
        let want = format!(
            "at byte {} of {}: the file ends there",
            CHUNK_BYTES + 10,
            data.len()
        );
        assert!(
            matches!(&err, UploadFailure::Local { message, .. } if message.contains(&want)),
            "{err}"
        );
        assert!(store.state().committed.is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn committed_artifacts_are_not_sent_again() {
        let dir = tmp("committed");
        let store = FakeStore::default();
        let f = upload_of(&dir, "report.json", "report", b"{}");
        uploader(&store).file(&f).await.expect("first");
        uploader(&store).file(&f).await.expect("again");
        assert_eq!(store.state().header_offsets, vec![0]);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_refusal_is_final_and_names_the_artifact() {
        let dir = tmp("refused");
        let store = FakeStore::default();
        let f = upload_of(&dir, "report.json", "report", b"{}");
        store.fault(
            Call::Upload,
            Fault::Status(tonic::Status::resource_exhausted("quota of 1 GiB")),
        );
        let err = uploader(&store).file(&f).await.expect_err("refused");
        assert!(
            matches!(&err, UploadFailure::Refused { status, .. } if status.code() == tonic::Code::ResourceExhausted)
        );
        let text = err.to_string();
        assert!(
            text.contains("`report.json`") && text.contains("quota of 1 GiB"),
            "{text}"
        );
        // FAILED_PRECONDITION (an earlier stream still open, a short stream) is asked about again,
        // but a bounded number of times without progress.
        store.fault(
            Call::Upload,
            Fault::Status(tonic::Status::failed_precondition("in progress")),
        );
        uploader(&store).file(&f).await.expect("resynced");
        for _ in 0..4 {
            store.fault(
                Call::Upload,
                Fault::Status(tonic::Status::failed_precondition("missing file")),
            );
        }
        let g = upload_of(&dir, "other.json", "report", b"[]");
        let err = uploader(&store).file(&g).await.expect_err("refused");
        assert!(
            matches!(&err, UploadFailure::Refused { status, .. } if status.code() == tonic::Code::FailedPrecondition)
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_file_changed_since_verification_is_never_committed() {
        let dir = tmp("changed");
        let store = FakeStore::default();
        let data = bytes(CHUNK_BYTES + 3);
        let f = upload_of(&dir, "exports/m.bin", "export", &data);
        let mut other = data.clone();
        other[CHUNK_BYTES + 1] ^= 1;
        std::fs::write(&f.path, &other).expect("rewrite");
        let err = uploader(&store).file(&f).await.expect_err("changed");
        assert!(
            matches!(&err, UploadFailure::Local { message, .. } if message.contains("changed since it was verified")),
            "{err}"
        );
        {
            let st = store.state();
            assert!(st.committed.is_empty());
            // The last chunk (the one that would have completed the file) never left.
            assert!(
                st.chunk_sizes.iter().sum::<usize>() <= CHUNK_BYTES,
                "{:?}",
                st.chunk_sizes
            );
        }
        std::fs::write(&f.path, &data[..10]).expect("truncate");
        let err = uploader(&store).file(&f).await.expect_err("short");
        assert!(
            matches!(&err, UploadFailure::Local { message, .. } if message.contains("cannot read")),
            "{err}"
        );
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_checkpoint_sends_its_files_before_its_manifest() {
        let dir = tmp("ckpt");
        let store = FakeStore::default();
        let weights = upload_of(
            &dir,
            "c/step-2/trainable.safetensors",
            "checkpoint_file",
            &bytes(100),
        );
        let manifest_text = format!(
            r#"{{"step": 2, "files": {{"trainable.safetensors": {{"sha256": "{}", "size": 100}}}}}}"#,
            weights.artifact.sha256
        );
        let manifest = upload_of(
            &dir,
            "c/step-2/manifest.json",
            "checkpoint",
            manifest_text.as_bytes(),
        );
        // The coordinator refuses the manifest alone.
        let alone = Item::Checkpoint {
            files: vec![],
            manifest: manifest.clone(),
        };
        assert!(matches!(
            uploader(&store).item(&alone).await,
            Err(UploadFailure::Refused { .. })
        ));
        let item = Item::Checkpoint {
            files: vec![weights],
            manifest,
        };
        uploader(&store).item(&item).await.expect("uploaded");
        assert_eq!(store.state().committed.len(), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn the_queue_skips_an_unreadable_checkpoint_and_stops_at_a_refusal() {
        let dir = tmp("queue");
        let store = FakeStore::default();
        let (sig_tx, mut sig_rx) = mpsc::channel(4);
        let mut q = UploadQueue::start(uploader(&store), sig_tx.clone());
        let mut gone = upload_of(&dir, "c/step-2/w.bin", "checkpoint_file", b"w");
        gone.path = dir.join("pruned");
        let m = upload_of(&dir, "c/step-2/manifest.json", "checkpoint", b"{}");
        q.push(Item::Checkpoint {
            files: vec![gone],
            manifest: m,
        });
        q.push(Item::File(upload_of(&dir, "report.json", "report", b"r")));
        q.drain().await.expect("drained");
        assert_eq!(
            store.state().committed.keys().cloned().collect::<Vec<_>>(),
            vec!["report.json".to_string()]
        );

        let mut q = UploadQueue::start(uploader(&store), sig_tx);
        store.fault(
            Call::Offset,
            Fault::Status(tonic::Status::invalid_argument("bad name")),
        );
        q.push(Item::File(upload_of(&dir, "a.json", "report", b"a")));
        q.push(Item::File(upload_of(&dir, "b.json", "report", b"b")));
        assert!(
            matches!(q.drain().await, Err(UploadFailure::Refused { name, .. }) if name == "a.json")
        );
        assert!(matches!(
            sig_rx.recv().await,
            Some(Signal::Upload(UploadFailure::Refused { .. }))
        ));
        assert!(!store.state().committed.contains_key("b.json"));
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn an_aborted_upload_is_a_lost_lease() {
        let dir = tmp("lost");
        let store = FakeStore::default();
        store.fault(
            Call::Upload,
            Fault::Status(tonic::Status::aborted("lease expired")),
        );
        let f = upload_of(&dir, "r.json", "report", b"r");
        assert!(matches!(
            uploader(&store).file(&f).await,
            Err(UploadFailure::Lost(LeaseLost::Stale(_)))
        ));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
