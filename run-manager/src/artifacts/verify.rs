//! Artifacts a worker announced: verified against the file on disk, then
//! made into what the upload queue sends (`crate::artifacts::upload`).
//!
//! Verification comes first and needs no network: the path must resolve inside
//! the job directory and its sha256 and size must be what the worker claimed.
//! A checkpoint's manifest must parse and every file it lists must lie next to
//! it, inside the job directory, with the listed size (its sha256 is checked
//! as it uploads). A verified checkpoint is one a restarted worker may resume
//! from, whether or not the coordinator has recorded it yet.

use std::path::{Path, PathBuf};

use crate::artifacts::checkpoint;
use crate::artifacts::upload::{FileUpload, Item};
use crate::paths::resolve_inside;
use crate::proto::Artifact;
use crate::worker::events::ArtifactEvent;
use crate::worker::jobdir::hash_file;

/// An artifact whose file matches the worker's claim.
#[derive(Debug, Clone, PartialEq)]
pub struct Verified {
    /// The file, resolved inside the job directory.
    pub path: PathBuf,
    pub sha256: String,
    pub size_bytes: u64,
}

/// A verified file and where it is on this machine (for `--local`'s summary).
#[derive(Debug, Clone, PartialEq)]
pub struct LocalArtifact {
    pub name: String,
    pub sha256: String,
    pub path: PathBuf,
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

/// What the queue uploads for a verified artifact, and the files it covers:
/// the file itself, or for a checkpoint its listed files and then its
/// manifest. The error says why a checkpoint is refused.
pub async fn upload_item(
    job_dir: &Path,
    a: &ArtifactEvent,
    v: &Verified,
) -> Result<(Item, Vec<LocalArtifact>), String> {
    let upload = |name: &str, kind: &str, sha256: &str, size: u64, path: PathBuf| FileUpload {
        path,
        artifact: Artifact {
            name: name.to_string(),
            kind: kind.to_string(),
            sha256: sha256.to_string(),
            size_bytes: size,
            uri: String::new(),
            step: a.step,
        },
    };
    let manifest = upload(&a.name, &a.kind, &v.sha256, v.size_bytes, v.path.clone());
    let mut local = vec![LocalArtifact {
        name: a.name.clone(),
        sha256: v.sha256.clone(),
        path: v.path.clone(),
    }];
    if a.kind != "checkpoint" {
        return Ok((Item::File(manifest), local));
    }
    let (name, path, root) = (a.name.clone(), v.path.clone(), job_dir.to_path_buf());
    let listed = tokio::task::spawn_blocking(move || listed_files(&name, &path, &root))
        .await
        .map_err(|e| format!("reading the checkpoint manifest failed: {e}"))??;
    let mut files = Vec::with_capacity(listed.len());
    for (f, path) in listed {
        local.push(LocalArtifact {
            name: f.name.clone(),
            sha256: f.sha256.clone(),
            path: path.clone(),
        });
        files.push(upload(
            &f.name,
            checkpoint::FILE_KIND,
            &f.sha256,
            f.size,
            path,
        ));
    }
    Ok((Item::Checkpoint { files, manifest }, local))
}

/// The files the manifest at `path` lists, each resolved inside `job_dir` and of the listed size.
fn listed_files(
    name: &str,
    path: &Path,
    job_dir: &Path,
) -> Result<Vec<(checkpoint::ListedFile, PathBuf)>, String> {
    let refused = |m: String| format!("refused checkpoint `{name}`: {m}");
    let files = checkpoint::read(name, path).map_err(refused)?;
    let mut out = Vec::with_capacity(files.len());
    for f in files {
        let p = resolve_inside(job_dir, &checkpoint::local_path(path, &f))
            .map_err(|e| refused(format!("its file `{}`: {e}", f.file)))?;
        let size = std::fs::metadata(&p)
            .map_err(|e| refused(format!("cannot read `{}`: {e}", p.display())))?
            .len();
        if size != f.size {
            return Err(refused(format!(
                "`{}` has {size} bytes, its manifest says {}",
                p.display(),
                f.size
            )));
        }
        out.push((f, p));
    }
    Ok(out)
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

    fn sha(b: &[u8]) -> String {
        use sha2::Digest;
        crate::artifacts::transfer::hex(&sha2::Sha256::digest(b))
    }

    /// A job dir holding checkpoint `c/step-2` whose manifest is `manifest`; returns the dir.
    async fn checkpoint_with(
        tag: &str,
        manifest: &str,
        files: &[(&str, &[u8])],
    ) -> (PathBuf, ArtifactEvent, Verified) {
        let dir = std::env::temp_dir().join(format!("rm-artifact-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ck = dir.join("c/step-2");
        std::fs::create_dir_all(&ck).expect("mkdir");
        for (name, bytes) in files {
            std::fs::write(ck.join(name), bytes).expect("write");
        }
        std::fs::write(ck.join("manifest.json"), manifest).expect("write");
        let dir = dir.canonicalize().expect("canonical");
        let a = ArtifactEvent {
            name: "c/step-2/manifest.json".into(),
            kind: "checkpoint".into(),
            path: "c/step-2/manifest.json".into(),
            sha256: sha(manifest.as_bytes()),
            size_bytes: manifest.len() as u64,
            step: 2,
        };
        let v = verify(&dir, &a).await.expect("verified");
        (dir, a, v)
    }

    #[tokio::test]
    async fn a_checkpoint_uploads_its_listed_files_then_its_manifest() {
        let m = format!(
            r#"{{"step": 2, "files": {{"w.bin": {{"sha256": "{}", "size": 3}}}}}}"#,
            sha(b"abc")
        );
        let (dir, a, v) = checkpoint_with("ok", &m, &[("w.bin", b"abc")]).await;
        let (item, local) = upload_item(&dir, &a, &v).await.expect("item");
        let Item::Checkpoint { files, manifest } = item else {
            panic!("{item:?}")
        };
        assert_eq!(files.len(), 1);
        assert_eq!(files[0].artifact.name, "c/step-2/w.bin");
        assert_eq!(files[0].artifact.kind, "checkpoint_file");
        assert_eq!(
            (files[0].artifact.size_bytes, files[0].artifact.step),
            (3, 2)
        );
        assert_eq!(files[0].path, dir.join("c/step-2/w.bin"));
        assert_eq!(manifest.artifact.name, "c/step-2/manifest.json");
        assert_eq!(local.len(), 2);
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_checkpoint_with_a_missing_or_wrong_sized_file_is_refused() {
        let m = format!(
            r#"{{"files": {{"w.bin": {{"sha256": "{}", "size": 3}}}}}}"#,
            sha(b"abc")
        );
        let (dir, a, v) = checkpoint_with("missing", &m, &[]).await;
        let err = upload_item(&dir, &a, &v).await.expect_err("missing");
        assert!(
            err.contains("refused checkpoint") && err.contains("`w.bin`"),
            "{err}"
        );
        let (dir, a, v) = checkpoint_with("size", &m, &[("w.bin", b"abcd")]).await;
        let err = upload_item(&dir, &a, &v).await.expect_err("size");
        assert!(err.contains("has 4 bytes"), "{err}");
        let (dir, a, v) = checkpoint_with("corrupt", "{not json", &[]).await;
        let err = upload_item(&dir, &a, &v).await.expect_err("corrupt");
        assert!(err.contains("is not a manifest"), "{err}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn a_listed_file_may_not_point_outside_the_job_directory() {
        let m = format!(
            r#"{{"files": {{"link": {{"sha256": "{}", "size": 6}}}}}}"#,
            sha(b"secret")
        );
        let (dir, a, v) = checkpoint_with("link", &m, &[]).await;
        let outside = dir.with_extension("outside");
        std::fs::write(&outside, b"secret").expect("write");
        std::os::unix::fs::symlink(&outside, dir.join("c/step-2/link")).expect("symlink");
        let err = upload_item(&dir, &a, &v).await.expect_err("outside");
        assert!(err.contains("outside the job directory"), "{err}");
        let _ = std::fs::remove_file(&outside);
        let _ = std::fs::remove_dir_all(&dir);
    }
}
