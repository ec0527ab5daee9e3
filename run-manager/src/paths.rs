//! Path checks: artifact names, ids used as directory names, and artifact
//! files that must lie inside the job directory.
//!
//! The worker is trusted to compute, not to name arbitrary files: everything it
//! reports is checked here before the run-manager reads or reports it.

use std::path::{Path, PathBuf};

/// Longest artifact name accepted (same bound as the coordinator's).
pub const MAX_NAME_CHARS: usize = 512;
/// Longest id (run, job) used as a directory name.
pub const MAX_ID_CHARS: usize = 128;

/// Why a path or name was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum PathError {
    #[error("artifact name is empty")]
    EmptyName,
    #[error("artifact name has {0} characters; at most {MAX_NAME_CHARS} are allowed")]
    NameTooLong(usize),
    #[error("artifact name `{0}` is not a safe relative path (no `..`, `.`, empty segments, absolute paths, backslashes or control characters)")]
    UnsafeName(String),
    #[error("id `{0}` cannot name a directory (letters, digits, `._-`, 1-{MAX_ID_CHARS} characters, not `.`/`..`)")]
    BadId(String),
    #[error("`{path}` is outside the job directory `{root}`")]
    OutsideRoot { path: String, root: String },
    #[error("`{path}`: {message}")]
    Unreadable { path: String, message: String },
    #[error("`{0}` is not a regular file")]
    NotAFile(String),
}

/// Accept `name` if it is a relative path that cannot step outside its namespace.
pub fn check_artifact_name(name: &str) -> Result<(), PathError> {
    if name.is_empty() {
        return Err(PathError::EmptyName);
    }
    let chars = name.chars().count();
    if chars > MAX_NAME_CHARS {
        return Err(PathError::NameTooLong(chars));
    }
    let shown = || name.chars().take(80).collect::<String>();
    if name.starts_with('/') || name.contains('\\') || name.chars().any(|c| c.is_control()) {
        return Err(PathError::UnsafeName(shown()));
    }
    if name
        .split('/')
        .any(|seg| seg.is_empty() || seg == "." || seg == "..")
    {
        return Err(PathError::UnsafeName(shown()));
    }
    Ok(())
}

/// Accept `id` if it is safe as a single directory name.
pub fn check_id(id: &str) -> Result<(), PathError> {
    let ok = !id.is_empty()
        && id.len() <= MAX_ID_CHARS
        && id != "."
        && id != ".."
        && id
            .bytes()
            .all(|b| b.is_ascii_alphanumeric() || b == b'.' || b == b'_' || b == b'-');
    if ok {
        Ok(())
    } else {
        Err(PathError::BadId(id.chars().take(80).collect()))
    }
}

/// Resolve `path` (absolute, or relative to `root`) to a regular file inside
/// `root`, following symlinks: a link that points outside is refused.
pub fn resolve_inside(root: &Path, path: &Path) -> Result<PathBuf, PathError> {
    let unreadable = |p: &Path, e: std::io::Error| PathError::Unreadable {
        path: p.display().to_string(),
        message: e.to_string(),
    };
    let root_real = root.canonicalize().map_err(|e| unreadable(root, e))?;
    let joined = if path.is_absolute() {
        path.to_path_buf()
    } else {
        root.join(path)
    };
    let real = joined.canonicalize().map_err(|e| unreadable(&joined, e))?;
    if !real.starts_with(&root_real) {
        return Err(PathError::OutsideRoot {
            path: joined.display().to_string(),
            root: root_real.display().to_string(),
        });
    }
    let meta = std::fs::metadata(&real).map_err(|e| unreadable(&real, e))?;
    if !meta.is_file() {
        return Err(PathError::NotAFile(real.display().to_string()));
    }
    Ok(real)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rm-paths-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).expect("mkdir");
        d
    }

    #[test]
    fn artifact_names() {
        for ok in [
            "a",
            "ckpt/step-3.safetensors",
            "exports/bf16/model.safetensors",
            "a..b",
            ".hidden",
        ] {
            assert_eq!(check_artifact_name(ok), Ok(()), "{ok}");
        }
        for bad in [
            "",
            "/etc/passwd",
            "../x",
            "a/../b",
            "a//b",
            "a/",
            "./a",
            "a\\b",
            "a\0b",
            "a\nb",
            "..",
        ] {
            assert!(check_artifact_name(bad).is_err(), "{bad:?} accepted");
        }
        assert_eq!(
            check_artifact_name(&"x".repeat(513)),
            Err(PathError::NameTooLong(513))
        );
        assert_eq!(check_artifact_name(&"x".repeat(512)), Ok(()));
    }

    #[test]
    fn ids() {
        assert!(check_id("job-0f3a_1.2").is_ok());
        for bad in ["", ".", "..", "a/b", "a b", "é", &"x".repeat(129)] {
            assert!(check_id(bad).is_err(), "{bad:?}");
        }
    }

    #[test]
    fn resolve_inside_refuses_escapes() {
        let root = tmpdir("root");
        let outside = tmpdir("outside");
        std::fs::write(root.join("ok.bin"), b"x").expect("write");
        std::fs::write(outside.join("secret"), b"s").expect("write");
        std::fs::create_dir(root.join("sub")).expect("mkdir");

        assert!(resolve_inside(&root, Path::new("ok.bin")).is_ok());
        assert!(resolve_inside(&root, &root.join("ok.bin")).is_ok());
        assert!(matches!(
            resolve_inside(&root, &outside.join("secret")),
            Err(PathError::OutsideRoot { .. })
        ));
        assert!(matches!(
            resolve_inside(
                &root,
                Path::new("../")
                    .join(outside.file_name().expect("name"))
                    .join("secret")
                    .as_path()
            ),
            Err(PathError::OutsideRoot { .. })
        ));
        std::os::unix::fs::symlink(outside.join("secret"), root.join("link")).expect("symlink");
        assert!(matches!(
            resolve_inside(&root, Path::new("link")),
            Err(PathError::OutsideRoot { .. })
        ));
        assert!(matches!(
            resolve_inside(&root, Path::new("sub")),
            Err(PathError::NotAFile(_))
        ));
        assert!(matches!(
            resolve_inside(&root, Path::new("missing")),
            Err(PathError::Unreadable { .. })
        ));
        let _ = std::fs::remove_dir_all(&root);
        let _ = std::fs::remove_dir_all(&outside);
    }
}
