//! A checkpoint as the run-manager moves it: the worker's `manifest.json`
//! and the files it lists, which travel as artifacts of their own.
//!
//! The manifest (written by `dflash_worker.train.checkpoint`, read here):
//! `{"format": ..., "step": N, "files": {FILE: {"sha256": HEX, "size": BYTES}}}`.
//! Only `files` matters here; a manifest without it (the `noop` stage's)
//! lists none. FILE is one path segment, a file next to the manifest; it
//! travels as the artifact `DIR/FILE`, DIR being the manifest artifact's
//! directory (its name without `/manifest.json`), kind `checkpoint_file`,
//! with the manifest's step, and is uploaded before the manifest: the
//! coordinator refuses a checkpoint whose files this attempt has not
//! uploaded. The limits are the coordinator's (`coordinator/artifacts/names.py`).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::artifacts::transfer::is_sha256;
use crate::paths::check_artifact_name;

/// Largest manifest accepted (the files' hashes, not their bytes, live in it).
pub const MAX_MANIFEST_BYTES: u64 = 1 << 20;
/// Most files one manifest may list.
pub const MAX_MANIFEST_FILES: usize = 256;
/// The artifact kind of a file a checkpoint lists.
pub const FILE_KIND: &str = "checkpoint_file";
/// The manifest's file name inside its checkpoint directory.
pub const MANIFEST_FILE: &str = "manifest.json";

/// One file a manifest lists.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ListedFile {
    /// Relative to the manifest's directory.
    pub file: String,
    /// Its artifact name, `DIR/FILE`.
    pub name: String,
    pub sha256: String,
    pub size: u64,
}

#[derive(Deserialize)]
struct RawEntry {
    sha256: String,
    size: u64,
}

#[derive(Deserialize)]
struct RawManifest {
    #[serde(default)]
    files: Option<BTreeMap<String, RawEntry>>,
}

/// The directory of a checkpoint's manifest artifact (`DIR/manifest.json` ->
/// `DIR`; empty at the top), under which its files are named.
pub fn artifact_dir(manifest_name: &str) -> &str {
    manifest_name.rsplit_once('/').map_or("", |(dir, _)| dir)
}

/// The artifact name of `file` in the checkpoint `dir`.
fn file_name_in(dir: &str, file: &str) -> String {
    if dir.is_empty() {
        file.to_string()
    } else {
        format!("{dir}/{file}")
    }
}

/// The files `text` (a manifest whose artifact is `manifest_name`) lists, in
/// name order; the error says what is wrong with the manifest.
pub fn parse(manifest_name: &str, text: &[u8]) -> Result<Vec<ListedFile>, String> {
    let raw: RawManifest = serde_json::from_slice(text)
        .map_err(|e| format!("checkpoint manifest `{manifest_name}` is not a manifest: {e}"))?;
    let dir = artifact_dir(manifest_name);
    let files = raw.files.unwrap_or_default();
    if files.len() > MAX_MANIFEST_FILES {
        return Err(format!(
            "checkpoint manifest `{manifest_name}` lists {} files; at most {MAX_MANIFEST_FILES} are allowed",
            files.len()
        ));
    }
    let mut out = Vec::new();
    for (file, entry) in files {
        let name = file_name_in(dir, &file);
        check_artifact_name(&file)
            .and_then(|()| check_artifact_name(&name))
            .map_err(|e| format!("checkpoint manifest `{manifest_name}` lists `{file}`: {e}"))?;
        if file.contains('/') || file == MANIFEST_FILE {
            return Err(format!(
                "checkpoint manifest `{manifest_name}` lists `{file}`: a listed file is one path segment other than `{MANIFEST_FILE}`"
            ));
        }
        if !is_sha256(&entry.sha256) {
            return Err(format!(
                "checkpoint manifest `{manifest_name}`: `{file}` has sha256 `{}`, not 64 lowercase hex digits",
                entry.sha256.chars().take(80).collect::<String>()
            ));
        }
        out.push(ListedFile {
            file,
            name,
            sha256: entry.sha256,
            size: entry.size,
        });
    }
    Ok(out)
}

/// Where a listed file lies on disk: next to the manifest.
pub fn local_path(manifest_path: &Path, f: &ListedFile) -> PathBuf {
    manifest_path
        .parent()
        .map_or_else(|| PathBuf::from(&f.file), |d| d.join(&f.file))
}

/// Read a manifest file (bounded) and parse it.
pub fn read(manifest_name: &str, path: &Path) -> Result<Vec<ListedFile>, String> {
    use std::io::Read;
    let f = std::fs::File::open(path)
        .map_err(|e| format!("cannot read checkpoint manifest `{}`: {e}", path.display()))?;
    let mut text = Vec::new();
    f.take(MAX_MANIFEST_BYTES + 1)
        .read_to_end(&mut text)
        .map_err(|e| format!("cannot read checkpoint manifest `{}`: {e}", path.display()))?;
    if text.len() as u64 > MAX_MANIFEST_BYTES {
        return Err(format!(
            "checkpoint manifest `{}` is larger than {MAX_MANIFEST_BYTES} bytes",
            path.display()
        ));
    }
    parse(manifest_name, &text)
}

#[cfg(test)]
mod tests {
    use super::*;

    const SHA: &str = "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad";

    #[test]
    fn lists_files_under_the_manifest_directory() {
        let text = format!(
            r#"{{"format": "x", "step": 4, "files": {{"trainable.safetensors": {{"sha256": "{SHA}", "size": 3}}, "state.json": {{"sha256": "{SHA}", "size": 0}}}}}}"#
        );
        let files = parse("run/checkpoints/step-4/manifest.json", text.as_bytes()).expect("ok");
        let names: Vec<_> = files.iter().map(|f| f.name.as_str()).collect();
        assert_eq!(
            names,
            [
                "run/checkpoints/step-4/state.json",
                "run/checkpoints/step-4/trainable.safetensors"
            ]
        );
        assert_eq!((files[1].size, files[1].sha256.as_str()), (3, SHA));
        assert_eq!(
            local_path(
                Path::new("/j/run/checkpoints/step-4/manifest.json"),
                &files[0]
            ),
            Path::new("/j/run/checkpoints/step-4/state.json")
        );
    }

    #[test]
    fn a_manifest_without_files_lists_none() {
        let noop = br#"{"format": "dflash-worker-noop-checkpoint/1", "state": "ab", "step": 2}"#;
        assert_eq!(
            parse("checkpoints/step-000002/manifest.json", noop),
            Ok(vec![])
        );
        assert_eq!(parse("c/manifest.json", br#"{"files": {}}"#), Ok(vec![]));
        assert_eq!(
            artifact_dir("checkpoints/step-2/manifest.json"),
            "checkpoints/step-2"
        );
        assert_eq!(artifact_dir("manifest.json"), "");
        let top = format!(r#"{{"files": {{"w.bin": {{"sha256": "{SHA}", "size": 1}}}}}}"#);
        assert_eq!(
            parse("manifest.json", top.as_bytes()).expect("ok")[0].name,
            "w.bin"
        );
    }

    #[test]
    fn corrupt_manifests_are_refused_with_the_reason() {
        let name = "c/manifest.json";
        for (text, want) in [
            ("not json".to_string(), "is not a manifest"),
            (r#"[1]"#.to_string(), "is not a manifest"),
            (r#"{"files": [1]}"#.to_string(), "is not a manifest"),
            (
                r#"{"files": {"a": {"sha256": "x"}}}"#.to_string(),
                "is not a manifest",
            ),
            (
                r#"{"files": {"a": {"sha256": "x", "size": -1}}}"#.to_string(),
                "is not a manifest",
            ),
            (
                r#"{"files": {"a": {"sha256": "xyz", "size": 1}}}"#.to_string(),
                "not 64 lowercase hex",
            ),
            (
                format!(r#"{{"files": {{"../escape": {{"sha256": "{SHA}", "size": 1}}}}}}"#),
                "not a safe relative path",
            ),
            (
                format!(r#"{{"files": {{"a/../../b": {{"sha256": "{SHA}", "size": 1}}}}}}"#),
                "not a safe relative path",
            ),
            (
                format!(r#"{{"files": {{"sub/w.bin": {{"sha256": "{SHA}", "size": 1}}}}}}"#),
                "one path segment",
            ),
            (
                format!(r#"{{"files": {{"/etc/passwd": {{"sha256": "{SHA}", "size": 1}}}}}}"#),
                "not a safe relative path",
            ),
            (
                format!(r#"{{"files": {{"manifest.json": {{"sha256": "{SHA}", "size": 1}}}}}}"#),
                "one path segment other than",
            ),
        ] {
            let err = parse(name, text.as_bytes()).expect_err(&text);
            assert!(err.contains(want), "{text}: {err}");
            assert!(err.contains(name), "{err}");
        }
    }

    #[test]
    fn oversized_manifests_are_refused() {
        let dir = std::env::temp_dir().join(format!("rm-ckpt-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("mkdir");
        let p = dir.join("manifest.json");
        std::fs::write(&p, vec![b' '; MAX_MANIFEST_BYTES as usize + 1]).expect("write");
        assert!(read("c/manifest.json", &p)
            .expect_err("big")
            .contains("larger than"));
        std::fs::write(&p, b"{}").expect("write");
        assert_eq!(read("c/manifest.json", &p), Ok(vec![]));
        let _ = std::fs::remove_dir_all(&dir);
    }
}
