//! Python-environment discovery for the native client, and its exit codes
//! (plain Rust, testable without an interpreter; `embed` calls these).
//!
//! The native client embeds the CPython it was built against and must import
//! the packages of the environment that holds `dflash_worker` and torch. It
//! finds that environment from, in order: `--python-home DIR` /
//! `DFLASH_PYTHON_HOME`, `VIRTUAL_ENV`, or the virtual environment it is
//! installed in (its own `bin/` holds `python3` or its parent `pyvenv.cfg`).
//!
//! Exit codes of `dflash-native-client`:
//! 0 the job finished; N what `dflash_worker.job.main` returned or passed to
//! `SystemExit`; 1 a `DflashError` (user error: bad spec, bad data; an
//! `error` event with `retryable: false` precedes it); 2 an unexpected
//! Python exception (traceback on stderr, `retryable: true` event) or a
//! broken environment; 130 interrupted.

use std::ffi::OsStr;
use std::path::{Path, PathBuf};

/// Exit code for an unexpected exception or a broken environment.
pub const EXIT_UNEXPECTED: u8 = 2;
/// Exit code for a `DflashError` without its own `exit_code`.
pub const EXIT_USER: u8 = 1;
/// Exit code after KeyboardInterrupt.
pub const EXIT_INTERRUPTED: u8 = 130;

/// Which Python environment to import from; None means the interpreter's own.
pub fn find_python_home(
    flag: Option<&Path>,
    virtual_env: Option<&OsStr>,
    exe: Option<&Path>,
) -> Option<PathBuf> {
    if let Some(p) = flag {
        return Some(p.to_path_buf());
    }
    if let Some(v) = virtual_env.filter(|v| !v.is_empty()) {
        return Some(PathBuf::from(v));
    }
    let bin = exe?.parent()?;
    let prefix = bin.parent()?;
    if bin.join("python3").exists() || prefix.join("pyvenv.cfg").is_file() {
        return Some(prefix.to_path_buf());
    }
    None
}

/// `<home>/lib/pythonX.Y/site-packages` for the embedded interpreter's
/// version, or an error that names the mismatch.
pub fn site_packages(home: &Path, major: u32, minor: u32) -> Result<PathBuf, String> {
    let want = format!("python{major}.{minor}");
    let sp = home.join("lib").join(&want).join("site-packages");
    if sp.is_dir() {
        return Ok(sp);
    }
    let found: Vec<String> = std::fs::read_dir(home.join("lib"))
        .map(|rd| {
            rd.filter_map(|e| e.ok())
                .map(|e| e.file_name().to_string_lossy().into_owned())
                .filter(|n| n.starts_with("python"))
                .collect()
        })
        .unwrap_or_default();
    if found.is_empty() {
        Err(format!(
            "`{}` is not a Python environment (no `lib/python*/site-packages`)\nhint: pass `--python-home` pointing at the virtual environment that has dflash_worker installed",
            home.display()
        ))
    } else {
        Err(format!(
            "the environment `{}` is for {} but this native client embeds {want}\nhint: rebuild the native client inside that environment (`make install`)",
            home.display(),
            found.join(", ")
        ))
    }
}

/// The home (`PYTHONHOME`) a standalone native client gives its interpreter:
/// `prefix`, the Python it was built against, when that Python's standard
/// library is there. Such a binary lives outside any Python installation, so
/// CPython's own search from the executable's location can settle on another
/// Python of the same version (a system `/usr/lib/python3.11` whose extension
/// modules are built in, not in `lib-dynload`, and then `import math` fails).
pub fn stdlib_home(prefix: &Path, version: &str) -> Option<PathBuf> {
    let os_py = prefix
        .join("lib")
        .join(format!("python{version}"))
        .join("os.py");
    os_py.is_file().then(|| prefix.to_path_buf())
}

/// The interpreter executable of an environment, for `sys.executable` (so
/// `multiprocessing` and subprocesses start Python, not the native client).
pub fn python_executable(home: &Path) -> Option<PathBuf> {
    ["bin/python3", "bin/python"]
        .iter()
        .map(|p| home.join(p))
        .find(|p| p.exists())
}

/// The `error` event line the native client prints for an exception.
pub fn error_event_line(message: &str, retryable: bool) -> String {
    let msg: String = message.chars().take(4000).collect();
    serde_json::json!({"event": "error", "message": msg, "retryable": retryable}).to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn venv(tag: &str, pyver: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("rm-native-{tag}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(d.join("lib").join(pyver).join("site-packages")).expect("mkdir");
        std::fs::create_dir_all(d.join("bin")).expect("mkdir");
        std::fs::write(d.join("pyvenv.cfg"), "home = /usr/bin\n").expect("write");
        d
    }

    #[test]
    fn home_precedence() {
        let v = venv("prec", "python3.11");
        let exe = v.join("bin/dflash-native-client");
        assert_eq!(
            find_python_home(
                Some(Path::new("/flag")),
                Some(OsStr::new("/venv")),
                Some(&exe)
            ),
            Some("/flag".into())
        );
        assert_eq!(
            find_python_home(None, Some(OsStr::new("/venv")), Some(&exe)),
            Some("/venv".into())
        );
        assert_eq!(
            find_python_home(None, Some(OsStr::new("")), Some(&exe)),
            Some(v.clone())
        );
        assert_eq!(
            find_python_home(None, None, Some(Path::new("/usr/local/bin/x"))),
            None
        );
        let _ = std::fs::remove_dir_all(&v);
    }

    #[test]
    fn site_packages_checks_version() {
        let v = venv("sp", "python3.11");
        assert!(site_packages(&v, 3, 11)
            .expect("ok")
            .ends_with("python3.11/site-packages"));
        let err = site_packages(&v, 3, 12).expect_err("mismatch");
        assert!(
            err.contains("python3.11") && err.contains("python3.12"),
            "{err}"
        );
        assert!(site_packages(Path::new("/nonexistent"), 3, 11)
            .expect_err("none")
            .contains("hint:"));
        let _ = std::fs::remove_dir_all(&v);
    }

    #[test]
    fn stdlib_home_needs_the_standard_library() {
        let v = venv("stdlib", "python3.11");
        assert_eq!(stdlib_home(&v, "3.11"), None);
        std::fs::write(v.join("lib/python3.11/os.py"), "").expect("write");
        assert_eq!(stdlib_home(&v, "3.11"), Some(v.clone()));
        assert_eq!(stdlib_home(&v, "3.12"), None);
        let _ = std::fs::remove_dir_all(&v);
    }

    #[test]
    fn error_event_is_a_valid_event() {
        let line = error_event_line("boom \"quoted\"\nnext", true);
        assert!(!line.contains('\n'));
        match run_manager::worker::events::parse_event(&line).expect("parses") {
            run_manager::worker::events::WorkerEvent::Error { message, retryable } => {
                assert!(retryable);
                assert!(message.contains("quoted"));
            }
            other => panic!("{other:?}"),
        }
    }
}
