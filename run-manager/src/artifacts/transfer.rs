//! What uploads and downloads share: the three artifact RPCs behind one
//! trait (so their logic is tested against an in-memory store), the lease
//! clock that bounds their retries, and the retry decision itself.
//!
//! Retries: UNAVAILABLE (the coordinator down, or its storage failing: disk
//! full, object store unreachable) is retried with backoff until the lease
//! would expire, i.e. `ttl` after the last heartbeat the coordinator answered:
//! while it answers heartbeats the lease lives, and a transfer may keep
//! waiting for its storage. A stream cut some other way (CANCELLED, UNKNOWN,
//! INTERNAL, DEADLINE_EXCEEDED: a reset connection, a restarted server) is
//! retried too, but at most `retries` times in a row without progress, so a
//! coordinator that fails the same way every time is not asked forever.
//! ABORTED / UNAUTHENTICATED / PERMISSION_DENIED are a lost lease
//! (`crate::lease_lost`); anything else is a refusal.

use std::future::Future;
use std::pin::Pin;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use tokio::time::Instant;
use tokio_stream::wrappers::ReceiverStream;
use tokio_stream::Stream;

use crate::backoff::{jitter_fraction, Backoff};
use crate::coordinator::client::{is_transient, ProviderClient};
use crate::lease_lost::LeaseLost;
use crate::proto::{
    DownloadArtifactRequest, DownloadArtifactResponse, UploadArtifactRequest,
    UploadArtifactResponse, UploadOffsetRequest, UploadOffsetResponse,
};

/// Largest chunk sent or expected in an artifact stream (the protocol's limit).
pub const CHUNK_BYTES: usize = 1 << 20;

/// The messages of one UploadArtifact call: its header, then its chunks.
pub type UploadStream = ReceiverStream<UploadArtifactRequest>;
/// The messages of one DownloadArtifact call.
pub type DownloadStream =
    Pin<Box<dyn Stream<Item = Result<DownloadArtifactResponse, tonic::Status>> + Send>>;

/// The artifact RPCs of the provider service.
pub trait Transfer: Clone + Send + Sync + 'static {
    fn upload_offset(
        &mut self,
        req: UploadOffsetRequest,
    ) -> impl Future<Output = Result<UploadOffsetResponse, tonic::Status>> + Send;

    fn upload(
        &mut self,
        messages: UploadStream,
    ) -> impl Future<Output = Result<UploadArtifactResponse, tonic::Status>> + Send;

    fn download(
        &mut self,
        req: DownloadArtifactRequest,
    ) -> impl Future<Output = Result<DownloadStream, tonic::Status>> + Send;
}

impl Transfer for ProviderClient {
    async fn upload_offset(
        &mut self,
        req: UploadOffsetRequest,
    ) -> Result<UploadOffsetResponse, tonic::Status> {
        Ok(ProviderClient::upload_offset(self, req).await?.into_inner())
    }

    async fn upload(
        &mut self,
        messages: UploadStream,
    ) -> Result<UploadArtifactResponse, tonic::Status> {
        Ok(self.upload_artifact(messages).await?.into_inner())
    }

    async fn download(
        &mut self,
        req: DownloadArtifactRequest,
    ) -> Result<DownloadStream, tonic::Status> {
        Ok(Box::pin(self.download_artifact(req).await?.into_inner()))
    }
}

/// When the attempt's lease expires unless a heartbeat renews it: `ttl` after
/// it was granted, then after each heartbeat the coordinator answered.
/// Cloned handles share one clock.
#[derive(Debug, Clone)]
pub struct LeaseClock {
    ttl: Duration,
    expires: Arc<Mutex<Instant>>,
}

impl LeaseClock {
    /// The clock of a lease granted now for `ttl`.
    pub fn start(ttl: Duration) -> Self {
        LeaseClock {
            ttl,
            expires: Arc::new(Mutex::new(Instant::now() + ttl)),
        }
    }

    /// The coordinator answered a heartbeat: the lease lives `ttl` from now.
    pub fn renewed(&self) {
        let at = Instant::now() + self.ttl;
        if let Ok(mut e) = self.expires.lock() {
            *e = (*e).max(at);
        }
    }

    pub fn expires_at(&self) -> Instant {
        match self.expires.lock() {
            Ok(e) => *e,
            Err(poisoned) => *poisoned.into_inner(),
        }
    }

    pub fn ttl(&self) -> Duration {
        self.ttl
    }
}

/// Why a transfer stopped retrying.
#[derive(Debug, Clone)]
pub enum GiveUp {
    /// Stale (ABORTED), token refused, or the lease expired while the
    /// coordinator stayed unavailable.
    Lost(LeaseLost),
    /// The coordinator refused the call, or failed it the same way too often.
    Refused(tonic::Status),
}

/// The retry state of one transfer: how many failures in a row, and how many
/// of them were cut streams without progress.
#[derive(Debug)]
pub struct Retrier {
    clock: LeaseClock,
    backoff: Backoff,
    /// Cut streams without progress tolerated in a row.
    retries: u32,
    failures: u32,
    cut: u32,
}

impl Retrier {
    pub fn new(clock: LeaseClock, backoff: Backoff, retries: u32) -> Self {
        Retrier {
            clock,
            backoff,
            retries,
            failures: 0,
            cut: 0,
        }
    }

    /// Bytes moved since the last failure: the next failure starts a new count.
    pub fn progressed(&mut self) {
        self.failures = 0;
        self.cut = 0;
    }

    /// After `status` from `call` on `name`: wait out the backoff and return
    /// Ok to try again, or say why not.
    pub async fn after(
        &mut self,
        call: &'static str,
        name: &str,
        status: tonic::Status,
    ) -> Result<(), GiveUp> {
        if let Some(lost) = LeaseLost::of(call, &status) {
            return Err(GiveUp::Lost(lost));
        }
        let cut = matches!(
            status.code(),
            tonic::Code::Cancelled
                | tonic::Code::Unknown
                | tonic::Code::Internal
                | tonic::Code::DeadlineExceeded
        );
        if !is_transient(&status) && !cut {
            return Err(GiveUp::Refused(status));
        }
        self.retry(call, name, status, cut).await
    }

    /// [`Retrier::after`] for a status the caller knows to be worth a few
    /// more tries (counted like a cut stream), whatever its code.
    pub async fn after_cut(
        &mut self,
        call: &'static str,
        name: &str,
        status: tonic::Status,
    ) -> Result<(), GiveUp> {
        if let Some(lost) = LeaseLost::of(call, &status) {
            return Err(GiveUp::Lost(lost));
        }
        self.retry(call, name, status, true).await
    }

    async fn retry(
        &mut self,
        call: &'static str,
        name: &str,
        status: tonic::Status,
        cut: bool,
    ) -> Result<(), GiveUp> {
        if cut {
            self.cut += 1;
            if self.cut > self.retries {
                return Err(GiveUp::Refused(status));
            }
        }
        let delay = self.backoff.jittered(self.failures, 0.2, jitter_fraction());
        self.failures = self.failures.saturating_add(1);
        if Instant::now() + delay >= self.clock.expires_at() {
            return Err(GiveUp::Lost(LeaseLost::Stale(format!(
                "the lease expired while `{call}` of `{name}` kept failing ({:?}: {}); no heartbeat reached the coordinator within the lease's {} s",
                status.code(),
                status.message(),
                self.clock.ttl().as_secs()
            ))));
        }
        tracing::warn!(call, artifact = %name, code = ?status.code(), retry_in_ms = delay.as_millis() as u64, "artifact transfer failed: {}", status.message());
        tokio::time::sleep(delay).await;
        Ok(())
    }
}

/// Lowercase hex of a digest.
pub fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Whether `s` looks like a sha256 as the coordinator records it (64 lowercase hex digits).
pub fn is_sha256(s: &str) -> bool {
    s.len() == 64
        && s.bytes()
            .all(|b| b.is_ascii_digit() || (b'a'..=b'f').contains(&b))
}

#[cfg(test)]
pub(crate) mod testing {
    //! An in-memory coordinator artifact store with the protocol's rules
    //! (offsets, size limit, sha256 at commit, checkpoint files first) and
    //! faults to inject.

    use std::collections::{HashMap, VecDeque};
    use std::sync::{Arc, Mutex};

    use sha2::Digest;
    use tokio_stream::StreamExt;

    use super::*;
    use crate::proto::{download_artifact_response, upload_artifact_request, Artifact};

    /// A fault the next call of its kind meets.
    #[derive(Debug, Clone)]
    pub enum Fault {
        /// The call fails with this status (a download: before its first message).
        Status(tonic::Status),
        /// The stream is cut with this status after this many chunk bytes.
        CutAfter(u64, tonic::Status),
    }

    /// Which call a fault is for.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    pub enum Call {
        Offset,
        Upload,
        Download,
    }

    #[derive(Default)]
    pub struct State {
        /// (name, sha256) -> staged bytes.
        pub staged: HashMap<(String, String), Vec<u8>>,
        /// name -> committed artifact and its bytes.
        pub committed: HashMap<String, (Artifact, Vec<u8>)>,
        /// Bytes offered for download: (name, sha256) -> bytes.
        pub downloads: HashMap<(String, String), Vec<u8>>,
        pub faults: VecDeque<(Call, Fault)>,
        /// Sizes of every chunk received, in order.
        pub chunk_sizes: Vec<usize>,
        /// Headers' offsets, in order.
        pub header_offsets: Vec<u64>,
        pub offset_calls: u32,
        /// Download requests' offsets, in order.
        pub download_offsets: Vec<u64>,
        /// Serve downloads in chunks of this many bytes (0: CHUNK_BYTES).
        pub download_chunk: usize,
        /// Corrupt the byte at this position of every download.
        pub corrupt_download_at: Option<usize>,
    }

    #[derive(Clone, Default)]
    pub struct FakeStore(pub Arc<Mutex<State>>);

    impl FakeStore {
        pub fn state(&self) -> std::sync::MutexGuard<'_, State> {
            self.0.lock().expect("fake store lock")
        }

        pub fn fault(&self, call: Call, f: Fault) {
            self.state().faults.push_back((call, f));
        }

        /// The first fault queued for `call`, taken off the queue.
        fn next_fault(&self, call: Call) -> Option<Fault> {
            let mut st = self.state();
            let i = st.faults.iter().position(|(c, _)| *c == call)?;
            st.faults.remove(i).map(|(_, f)| f)
        }

        fn commit(&self, a: &Artifact, bytes: Vec<u8>) -> Result<Artifact, tonic::Status> {
            let sha = hex(&sha2::Sha256::digest(&bytes));
            if sha != a.sha256 {
                return Err(tonic::Status::invalid_argument(format!(
                    "artifact `{}`: sha256 of the bytes is `{sha}`, the header says `{}`",
                    a.name, a.sha256
                )));
            }
            let mut st = self.state();
            if let Some((have, _)) = st.committed.get(&a.name) {
                if have.sha256 != a.sha256 {
                    return Err(tonic::Status::already_exists(format!(
                        "artifact `{}` exists with other bytes",
                        a.name
                    )));
                }
            }
            if a.kind == "checkpoint" {
                let m: serde_json::Value = serde_json::from_slice(&bytes)
                    .map_err(|e| tonic::Status::invalid_argument(e.to_string()))?;
                let dir = crate::artifacts::checkpoint::artifact_dir(&a.name);
                for file in m["files"].as_object().into_iter().flat_map(|o| o.keys()) {
                    let want = format!("{dir}/{file}");
                    if !st.committed.contains_key(&want) {
                        return Err(tonic::Status::failed_precondition(format!(
                            "checkpoint `{}` lists `{want}`, which this attempt has not uploaded",
                            a.name
                        )));
                    }
                }
            }
            let mut rec = a.clone();
            rec.uri = format!("dflash-artifact://run/job/1/{}", a.name);
            st.committed.insert(a.name.clone(), (rec.clone(), bytes));
            st.staged.remove(&(a.name.clone(), a.sha256.clone()));
            Ok(rec)
        }
    }

    impl Transfer for FakeStore {
        async fn upload_offset(
            &mut self,
            req: UploadOffsetRequest,
        ) -> Result<UploadOffsetResponse, tonic::Status> {
            self.state().offset_calls += 1;
            if let Some(Fault::Status(s)) = self.next_fault(Call::Offset) {
                return Err(s);
            }
            let a = req.artifact.unwrap_or_default();
            let st = self.state();
            if let Some((have, _)) = st.committed.get(&a.name) {
                if have.sha256 == a.sha256 {
                    return Ok(UploadOffsetResponse {
                        offset: a.size_bytes,
                        committed: true,
                    });
                }
            }
            let offset = st
                .staged
                .get(&(a.name.clone(), a.sha256.clone()))
                .map_or(0, |b| b.len() as u64);
            Ok(UploadOffsetResponse {
                offset,
                committed: false,
            })
        }

        async fn upload(
            &mut self,
            mut messages: UploadStream,
        ) -> Result<UploadArtifactResponse, tonic::Status> {
            let header = match messages.next().await.and_then(|m| m.msg) {
                Some(upload_artifact_request::Msg::Header(h)) => h,
                _ => return Err(tonic::Status::invalid_argument("no header")),
            };
            let a = header.artifact.unwrap_or_default();
            let key = (a.name.clone(), a.sha256.clone());
            self.state().header_offsets.push(header.offset);
            let staged = self.state().staged.get(&key).map_or(0, |b| b.len() as u64);
            if header.offset != staged {
                return Err(tonic::Status::failed_precondition(format!(
                    "upload of `{}` must resume at offset {staged}",
                    a.name
                )));
            }
            let cut = match self.next_fault(Call::Upload) {
                Some(Fault::CutAfter(n, s)) => Some((n, s)),
                Some(Fault::Status(s)) => return Err(s),
                None => None,
            };
            let mut received = 0u64;
            while let Some(m) = messages.next().await {
                let Some(upload_artifact_request::Msg::Chunk(c)) = m.msg else {
                    return Err(tonic::Status::invalid_argument("a second header"));
                };
                if c.len() > CHUNK_BYTES {
                    return Err(tonic::Status::invalid_argument("chunk over 1 MiB"));
                }
                let mut st = self.state();
                st.chunk_sizes.push(c.len());
                let buf = st.staged.entry(key.clone()).or_default();
                if buf.len() as u64 + c.len() as u64 > a.size_bytes {
                    return Err(tonic::Status::invalid_argument("bytes past size_bytes"));
                }
                buf.extend_from_slice(&c);
                received += c.len() as u64;
                if let Some((n, s)) = &cut {
                    if received >= *n {
                        return Err(s.clone());
                    }
                }
            }
            let bytes = self.state().staged.get(&key).cloned().unwrap_or_default();
            if (bytes.len() as u64) < a.size_bytes {
                return Err(tonic::Status::failed_precondition(format!(
                    "upload of `{}` ended at {} of {} bytes",
                    a.name,
                    bytes.len(),
                    a.size_bytes
                )));
            }
            let rec = self.commit(&a, bytes)?;
            Ok(UploadArtifactResponse {
                artifact: Some(rec),
            })
        }

        async fn download(
            &mut self,
            req: DownloadArtifactRequest,
        ) -> Result<DownloadStream, tonic::Status> {
            self.state().download_offsets.push(req.offset);
            let fault = self.next_fault(Call::Download);
            if let Some(Fault::Status(s)) = &fault {
                return Err(s.clone());
            }
            let st = self.state();
            let Some(bytes) = st.downloads.get(&(req.name.clone(), req.sha256.clone())) else {
                return Err(tonic::Status::not_found(format!(
                    "no artifact `{}`",
                    req.name
                )));
            };
            let mut bytes = bytes.clone();
            if let Some(i) = st.corrupt_download_at {
                if let Some(b) = bytes.get_mut(i) {
                    *b ^= 0xff;
                }
            }
            let head = Artifact {
                name: req.name.clone(),
                sha256: req.sha256.clone(),
                size_bytes: bytes.len() as u64,
                ..Default::default()
            };
            let size = if st.download_chunk == 0 {
                CHUNK_BYTES
            } else {
                st.download_chunk
            };
            let mut items = vec![Ok(DownloadArtifactResponse {
                msg: Some(download_artifact_response::Msg::Artifact(head)),
            })];
            let from = (req.offset as usize).min(bytes.len());
            let mut sent = 0u64;
            for c in bytes[from..].chunks(size) {
                if let Some(Fault::CutAfter(n, s)) = &fault {
                    if sent >= *n {
                        items.push(Err(s.clone()));
                        break;
                    }
                }
                sent += c.len() as u64;
                items.push(Ok(DownloadArtifactResponse {
                    msg: Some(download_artifact_response::Msg::Chunk(c.to_vec())),
                }));
            }
            Ok(Box::pin(tokio_stream::iter(items)))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn retrier(ttl_ms: u64, retries: u32) -> Retrier {
        Retrier::new(
            LeaseClock::start(Duration::from_millis(ttl_ms)),
            Backoff::doubling(Duration::from_millis(1), Duration::from_millis(2)),
            retries,
        )
    }

    #[tokio::test]
    async fn unavailable_is_retried_until_the_lease_would_expire() {
        let mut r = retrier(60, 0);
        let mut n = 0;
        let end = loop {
            match r
                .after(
                    "UploadArtifact",
                    "a",
                    tonic::Status::unavailable("disk full"),
                )
                .await
            {
                Ok(()) => n += 1,
                Err(e) => break e,
            }
        };
        assert!(n >= 5, "{n}");
        match end {
            GiveUp::Lost(LeaseLost::Stale(m)) => {
                assert!(
                    m.contains("lease expired") && m.contains("disk full"),
                    "{m}"
                )
            }
            other => panic!("{other:?}"),
        }
    }

    #[tokio::test]
    async fn renewals_move_the_deadline() {
        let clock = LeaseClock::start(Duration::from_millis(30));
        let first = clock.expires_at();
        tokio::time::sleep(Duration::from_millis(5)).await;
        clock.renewed();
        assert!(clock.expires_at() > first);
    }

    #[tokio::test]
    async fn cut_streams_are_retried_a_bounded_number_of_times_without_progress() {
        let mut r = retrier(60_000, 2);
        let cut = || tonic::Status::cancelled("stream reset");
        assert!(r.after("UploadArtifact", "a", cut()).await.is_ok());
        assert!(r.after("UploadArtifact", "a", cut()).await.is_ok());
        r.progressed();
        assert!(r.after("UploadArtifact", "a", cut()).await.is_ok());
        assert!(r.after("UploadArtifact", "a", cut()).await.is_ok());
        assert!(matches!(
            r.after("UploadArtifact", "a", cut()).await,
            Err(GiveUp::Refused(s)) if s.code() == tonic::Code::Cancelled
        ));
    }

    #[tokio::test]
    async fn refusals_and_lost_leases_are_not_retried() {
        let mut r = retrier(60_000, 5);
        for s in [
            tonic::Status::invalid_argument("past size_bytes"),
            tonic::Status::already_exists("other bytes"),
            tonic::Status::resource_exhausted("quota"),
            tonic::Status::failed_precondition("missing file"),
            tonic::Status::not_found("no such"),
        ] {
            let code = s.code();
            assert!(
                matches!(r.after("UploadArtifact", "a", s).await, Err(GiveUp::Refused(s)) if s.code() == code)
            );
        }
        for s in [
            tonic::Status::aborted("stale"),
            tonic::Status::unauthenticated("revoked"),
            tonic::Status::permission_denied("no"),
        ] {
            assert!(matches!(
                r.after("UploadArtifact", "a", s).await,
                Err(GiveUp::Lost(_))
            ));
        }
    }

    #[test]
    fn sha256_shape() {
        assert!(is_sha256(&"a".repeat(64)));
        assert!(!is_sha256(&"A".repeat(64)));
        assert!(!is_sha256(&"a".repeat(63)));
        assert!(!is_sha256(&format!("{}g", "a".repeat(63))));
    }
}
