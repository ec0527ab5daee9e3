//! One job of a run's job graph: the lease's `kind`, shard and `inputs`,
//! checked, made local, and told to the worker.
//!
//! A graph run is split into jobs (`prepare` -> `capture` x N -> `train` ->
//! `evaluate` x M); each job's lease names the final artifacts of the jobs it
//! needs as `inputs`. Leases of kind `pipeline` (or empty, from older
//! coordinators) run every stage of the spec and list no inputs. Every
//! run-manager offers `crate::device::JOB_GRAPH_FEATURE`, which graph runs
//! require.
//!
//! In three steps, the first refusal winning:
//! - [`plan`], at admission, before a byte is read: every input name must be
//!   a safe artifact name and its sha256 64 lowercase hex digits; no name may
//!   be the run-manager's own (`spec.json`, the resume directory) or the
//!   directory of another input; the same name listed twice must be the same
//!   file (it is then fetched once); the shard must lie inside its stage. A
//!   refusal ends the attempt FAILED with a message naming the input: the
//!   lease is wrong, and another try would get the same one.
//! - [`Fetcher::inputs`], before the worker starts (and before any rank of a
//!   multi-rank job): each input becomes `JOB_DIR/NAME` through
//!   [`Fetcher::fetch_file`] (kept when already there with the right sha256
//!   and size, else downloaded with resume by offset). One that cannot be had
//!   (refused by the coordinator, e.g. NOT_FOUND, or bytes that do not hash
//!   right) ends the attempt RETRYABLE with the reason: the worker never starts
//!   without its inputs. A lost lease abandons the attempt.
//! - [`GraphInfo`], `spec.json`'s `graph` key (written only for graph leases,
//!   so a pipeline job's `spec.json` is unchanged): the kind, the shard and
//!   each input with its absolute local path.
//!
//! Docker mode needs nothing more: the inputs are in the job directory, which
//! the container mounts at the same path.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use crate::artifacts::fetch::{FetchError, Fetched, Fetcher};
use crate::artifacts::transfer::{is_sha256, Transfer};
use crate::paths::check_artifact_name;
use crate::proto::{Artifact, Lease};
use crate::worker::jobdir::{GraphInfo, InputFile, RESUME_DIR, SPEC_FILE, SPEC_TMP_FILE};

/// Whether `lease` runs one job of a graph (not the whole pipeline).
pub fn is_graph(lease: &Lease) -> bool {
    !matches!(lease.kind.as_str(), "" | "pipeline")
}

/// The lease's shard count (0 means 1).
fn shard_count(lease: &Lease) -> u32 {
    lease.shard_count.max(1)
}

/// The inputs to fetch, in lease order with duplicates dropped; Err (the
/// attempt ends FAILED) names the first input, or the shard, that is wrong.
pub fn plan(lease: &Lease) -> Result<Vec<Artifact>, String> {
    if lease.shard_index >= shard_count(lease) {
        return Err(format!(
            "the lease gives job `{}` shard {} of {}: not a shard (0 <= shard_index < shard_count)",
            lease.job_id,
            lease.shard_index,
            shard_count(lease)
        ));
    }
    let mut planned: Vec<Artifact> = Vec::new();
    let mut by_name: BTreeMap<&str, &Artifact> = BTreeMap::new();
    for (i, a) in lease.inputs.iter().enumerate() {
        check_input(i, a)?;
        match by_name.get(a.name.as_str()) {
            Some(first) if first.sha256 == a.sha256 && first.size_bytes == a.size_bytes => {}
            Some(first) => {
                return Err(format!(
                    "input `{}` is listed twice with different contents: sha256 `{}` ({} bytes) and `{}` ({} bytes)",
                    a.name, first.sha256, first.size_bytes, a.sha256, a.size_bytes
                ))
            }
            None => {
                by_name.insert(&a.name, a);
                planned.push(a.clone());
            }
        }
    }
    let names: BTreeSet<&str> = by_name.keys().copied().collect();
    for name in &names {
        let mut dir = *name;
        while let Some((parent, _)) = dir.rsplit_once('/') {
            if names.contains(parent) {
                return Err(format!(
                    "input `{parent}` would be a file where input `{name}` needs a directory"
                ));
            }
            dir = parent;
        }
    }
    Ok(planned)
}

/// One input on its own: a safe name that is not the run-manager's, a sha256.
fn check_input(i: usize, a: &Artifact) -> Result<(), String> {
    check_artifact_name(&a.name).map_err(|e| format!("input {i} of the lease: {e}"))?;
    if !is_sha256(&a.sha256) {
        return Err(format!(
            "input `{}` has sha256 `{}`, not 64 lowercase hex digits",
            a.name,
            a.sha256.chars().take(80).collect::<String>()
        ));
    }
    let top = a.name.split('/').next().unwrap_or_default();
    if a.name == SPEC_FILE || a.name == SPEC_TMP_FILE {
        return Err(format!(
            "input `{}` would overwrite the run-manager's `{SPEC_FILE}`",
            a.name
        ));
    }
    if top == RESUME_DIR {
        return Err(format!(
            "input `{}` would land in `{RESUME_DIR}/`, where the run-manager keeps the resume checkpoint",
            a.name
        ));
    }
    Ok(())
}

/// What [`Fetcher::inputs`] did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct InputsFetched {
    /// Inputs downloaded, and their bytes.
    pub downloaded: usize,
    pub bytes: u64,
    /// Inputs already in place with the right sha256 and size.
    pub kept: usize,
}

impl<T: Transfer> Fetcher<'_, T> {
    /// Make every planned input `JOB_DIR/NAME`, in order. A failure other
    /// than a lost lease names the input ([`FetchError::Unusable`]: the
    /// attempt ends RETRYABLE).
    pub async fn inputs(&mut self, inputs: &[Artifact]) -> Result<InputsFetched, FetchError> {
        let mut done = InputsFetched::default();
        for a in inputs {
            let dest = self.job_dir.join(&a.name);
            let got = match self
                .fetch_file(&a.name, &a.sha256, a.size_bytes, &dest)
                .await
            {
                Ok(got) => got,
                Err(FetchError::Lost(lost)) => return Err(FetchError::Lost(lost)),
                Err(FetchError::Unusable(why)) => {
                    let from = match a.uri.as_str() {
                        "" => String::new(),
                        uri => format!(" (`{uri}`)"),
                    };
                    return Err(FetchError::Unusable(format!(
                        "cannot download input `{}`{from}: {why}",
                        a.name
                    )));
                }
            };
            let job_id = &self.lease.job_id;
            match got {
                Fetched::Kept => {
                    done.kept += 1;
                    tracing::info!(job_id = %job_id, input = %a.name, bytes = a.size_bytes, "input already here");
                }
                Fetched::Downloaded => {
                    done.downloaded += 1;
                    done.bytes += a.size_bytes;
                    tracing::info!(job_id = %job_id, input = %a.name, bytes = a.size_bytes, from = %a.uri, "input downloaded");
                }
            }
        }
        if !inputs.is_empty() {
            tracing::info!(
                job_id = %self.lease.job_id, inputs = inputs.len(), downloaded = done.downloaded,
                bytes = done.bytes, kept = done.kept, "inputs ready"
            );
        }
        Ok(done)
    }
}

// `GraphInfo` is `spec.json`'s, so it is defined with it in `crate::worker::jobdir`;
// what fills it in is decided here.
impl GraphInfo {
    /// The `graph` of a graph lease whose planned inputs are `inputs`; None
    /// for a pipeline lease.
    pub fn new(lease: &Lease, inputs: &[Artifact], job_dir: &Path) -> Option<Self> {
        if !is_graph(lease) {
            return None;
        }
        let inputs = inputs
            .iter()
            .map(|a| InputFile {
                name: a.name.clone(),
                kind: a.kind.clone(),
                sha256: a.sha256.clone(),
                size_bytes: a.size_bytes,
                uri: a.uri.clone(),
                path: job_dir.join(&a.name),
            })
            .collect();
        Some(GraphInfo {
            kind: lease.kind.clone(),
            shard_index: lease.shard_index,
            shard_count: shard_count(lease),
            inputs,
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::artifacts::fetch::testing::{fetcher, input, part_files, sha, tmp};
    use crate::artifacts::transfer::testing::{Call, FakeStore, Fault};
    use crate::lease_lost::LeaseLost;

    /// A capture lease whose inputs are `files`, each offered by `store`.
    fn capture_lease(store: &FakeStore, files: &[(&str, &[u8])]) -> Lease {
        let mut st = store.state();
        for (name, bytes) in files {
            st.downloads
                .insert((name.to_string(), sha(bytes)), bytes.to_vec());
        }
        Lease {
            lease_id: "lease-1".into(),
            job_id: "capture-1".into(),
            kind: "capture".into(),
            shard_index: 1,
            shard_count: 3,
            inputs: files.iter().map(|(n, b)| input(n, b)).collect(),
            ..Default::default()
        }
    }

    fn big() -> Vec<u8> {
        (0..3 * crate::artifacts::transfer::CHUNK_BYTES + 17)
            .map(|i| (i % 251) as u8)
            .collect()
    }

    #[tokio::test]
    async fn inputs_are_downloaded_to_their_names_and_a_repeat_is_fetched_once() {
        let dir = tmp("input-fetch");
        let store = FakeStore::default();
        let big = big();
        let mut lease = capture_lease(
            &store,
            &[
                ("data/train.jsonl", b"{\"a\": 1}\n"),
                ("data/big.bin", &big),
            ],
        );
        lease.inputs.push(lease.inputs[0].clone());
        let planned = plan(&lease).expect("plan");
        assert_eq!(planned.len(), 2);
        let done = fetcher(&store, &lease, &dir)
            .inputs(&planned)
            .await
            .expect("fetched");
        assert_eq!(
            done,
            InputsFetched {
                downloaded: 2,
                bytes: 9 + big.len() as u64,
                kept: 0
            }
        );
        assert_eq!(
            std::fs::read(dir.join("data/train.jsonl")).expect("train"),
            b"{\"a\": 1}\n"
        );
        assert_eq!(std::fs::read(dir.join("data/big.bin")).expect("big"), big);
        assert_eq!(store.state().download_offsets, vec![0, 0]);
        assert!(part_files(&dir).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_cut_stream_is_resumed_at_its_offset() {
        let dir = tmp("input-cut");
        let store = FakeStore::default();
        let big = big();
        let lease = capture_lease(&store, &[("data/big.bin", &big)]);
        store.state().download_chunk = 1 << 19;
        store.fault(
            Call::Download,
            Fault::CutAfter(1 << 20, tonic::Status::cancelled("reset")),
        );
        let done = fetcher(&store, &lease, &dir)
            .inputs(&plan(&lease).expect("plan"))
            .await
            .expect("fetched");
        assert_eq!(done.downloaded, 1);
        assert_eq!(std::fs::read(dir.join("data/big.bin")).expect("big"), big);
        assert_eq!(store.state().download_offsets, vec![0, 1 << 20]);
        assert!(part_files(&dir).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn bytes_that_do_not_hash_right_are_refused_and_not_kept() {
        let dir = tmp("input-corrupt");
        let store = FakeStore::default();
        let lease = capture_lease(&store, &[("data/train.jsonl", b"0123456789")]);
        store.state().corrupt_download_at = Some(3);
        let err = fetcher(&store, &lease, &dir)
            .inputs(&plan(&lease).expect("plan"))
            .await
            .expect_err("corrupt");
        let FetchError::Unusable(m) = err else {
            panic!("{err:?}")
        };
        assert!(
            m.contains("input `data/train.jsonl`") && m.contains("sha256"),
            "{m}"
        );
        // Tried once more from the start, then given up; nothing is left behind.
        assert_eq!(store.state().download_offsets, vec![0, 0]);
        assert!(!dir.join("data/train.jsonl").exists());
        assert!(part_files(&dir).is_empty());
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn an_input_already_here_is_not_downloaded_again() {
        let dir = tmp("input-local");
        let store = FakeStore::default();
        let lease = capture_lease(
            &store,
            &[("data/train.jsonl", b"train"), ("data/eval.jsonl", b"eval")],
        );
        std::fs::create_dir_all(dir.join("data")).expect("mkdir");
        std::fs::write(dir.join("data/train.jsonl"), b"train").expect("write");
        std::fs::write(dir.join("data/eval.jsonl"), b"EVAL").expect("write");
        let planned = plan(&lease).expect("plan");
        let done = fetcher(&store, &lease, &dir)
            .inputs(&planned)
            .await
            .expect("fetched");
        // The right copy is kept; the one with other bytes (same size) is replaced.
        assert_eq!(
            done,
            InputsFetched {
                downloaded: 1,
                bytes: 4,
                kept: 1
            }
        );
        assert_eq!(store.state().download_offsets.len(), 1);
        assert_eq!(
            std::fs::read(dir.join("data/eval.jsonl")).expect("e"),
            b"eval"
        );
        // Again (a restarted run-manager, the job leased here again): no download at all.
        let again = fetcher(&store, &lease, &dir)
            .inputs(&planned)
            .await
            .expect("fetched");
        assert_eq!((again.downloaded, again.kept), (0, 2));
        assert_eq!(store.state().download_offsets.len(), 1);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn an_empty_input_is_placed_without_a_download() {
        // Found by bench/fanout.py: a prepare job with no test fraction uploads an empty
        // `data/test.jsonl`; its download read a part file that was never made.
        let dir = tmp("input-empty");
        let store = FakeStore::default();
        let lease = capture_lease(
            &store,
            &[("data/test.jsonl", b""), ("data/train.jsonl", b"train")],
        );
        let planned = plan(&lease).expect("plan");
        let done = fetcher(&store, &lease, &dir)
            .inputs(&planned)
            .await
            .expect("fetched");
        assert_eq!(
            std::fs::read(dir.join("data/test.jsonl")).expect("empty"),
            b""
        );
        assert_eq!(
            std::fs::read(dir.join("data/train.jsonl")).expect("train"),
            b"train"
        );
        assert_eq!(done.downloaded + done.kept, 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_refused_download_names_the_input_and_a_lost_lease_is_lost() {
        let dir = tmp("input-refused");
        let store = FakeStore::default();
        let mut lease = capture_lease(&store, &[("data/train.jsonl", b"train")]);
        lease.inputs.push(input("data/gone.jsonl", b"gone"));
        let planned = plan(&lease).expect("plan");
        let err = fetcher(&store, &lease, &dir)
            .inputs(&planned)
            .await
            .expect_err("not found");
        let FetchError::Unusable(m) = err else {
            panic!("{err:?}")
        };
        assert!(
            m.contains("cannot download input `data/gone.jsonl`")
                && m.contains("dflash-artifact://run-1/prepare/1/data/gone.jsonl")
                && m.contains("NotFound"),
            "{m}"
        );
        assert!(!dir.join("data/gone.jsonl").exists());
        store.fault(
            Call::Download,
            Fault::Status(tonic::Status::aborted("stale lease")),
        );
        let fresh = tmp("input-stale");
        let lost = fetcher(&store, &lease, &fresh).inputs(&planned).await;
        assert!(
            matches!(lost, Err(FetchError::Lost(LeaseLost::Stale(_)))),
            "{lost:?}"
        );
        let _ = std::fs::remove_dir_all(&dir);
        let _ = std::fs::remove_dir_all(&fresh);
    }

    #[test]
    fn wrong_inputs_are_refused_naming_the_input() {
        let store = FakeStore::default();
        let lease = capture_lease(&store, &[("data/train.jsonl", b"train")]);
        let with = |inputs: Vec<Artifact>| Lease {
            inputs,
            ..lease.clone()
        };
        let train = input("data/train.jsonl", b"train");
        let other = input("data/train.jsonl", b"other");
        let longer = Artifact {
            size_bytes: 6,
            ..train.clone()
        };
        let cases = [
            (
                vec![train.clone(), other],
                "input `data/train.jsonl` is listed twice with different contents",
            ),
            (
                vec![train.clone(), longer],
                "input `data/train.jsonl` is listed twice",
            ),
            (
                vec![Artifact {
                    sha256: "ABC".into(),
                    ..train.clone()
                }],
                "input `data/train.jsonl` has sha256 `ABC`",
            ),
            (
                vec![input("../etc/passwd", b"x")],
                "input 0 of the lease: artifact name `../etc/passwd`",
            ),
            (
                vec![train.clone(), input("", b"x")],
                "input 1 of the lease: artifact name is empty",
            ),
            (
                vec![input("spec.json", b"{}")],
                "input `spec.json` would overwrite",
            ),
            (
                vec![input(".spec.json.tmp", b"{}")],
                "input `.spec.json.tmp` would overwrite",
            ),
            (
                vec![input("resume/ckpt/manifest.json", b"{}")],
                "would land in `resume/`",
            ),
            (
                vec![input("resume", b"{}")],
                "input `resume` would land in `resume/`",
            ),
            (
                vec![input("data", b"x"), train.clone()],
                "input `data` would be a file where input `data/train.jsonl` needs a directory",
            ),
        ];
        for (inputs, want) in cases {
            let got = plan(&with(inputs.clone()));
            assert!(
                matches!(&got, Err(m) if m.contains(want)),
                "{inputs:?}: {got:?}"
            );
        }
        // The same file under two names, and names that only share a prefix, are fine.
        let ok = plan(&with(vec![
            train.clone(),
            input("data/train.jsonl.bak", b"train"),
            input("dataset", b"d"),
        ]));
        assert_eq!(ok.map(|p| p.len()), Ok(3));
        // A shard outside its stage.
        let bad_shard = Lease {
            shard_index: 3,
            ..lease.clone()
        };
        assert!(matches!(plan(&bad_shard), Err(m) if m.contains("shard 3 of 3")));
        let unsharded = Lease {
            shard_index: 0,
            shard_count: 0,
            ..lease.clone()
        };
        assert!(plan(&unsharded).is_ok());
        assert!(plan(&Lease::default()).expect("pipeline").is_empty());
    }
}
