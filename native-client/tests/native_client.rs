//! The native client as the run-manager runs it: a job directory with
//! `spec.json`, the project's Python environment, exit codes and the `error`
//! event it prints for a failing job (`dflash_native_client::python_env`).
//!
//! The Python cases skip (with a message) when `.venv/bin/python` cannot import
//! `dflash_worker.job`, so `cargo test` works before `make install`. This file
//! also makes `cargo test --workspace` build the binary, which the
//! run-manager's own integration tests start as their worker.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

const NATIVE_CLIENT: &str = env!("CARGO_BIN_EXE_dflash-native-client");

fn venv_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../.venv")
}

/// The venv's python if it can import the job module.
fn python() -> Option<PathBuf> {
    let py = venv_dir().join("bin/python");
    let ok = py.exists()
        && Command::new(&py)
            .args(["-c", "import dflash_worker.job"])
            .status()
            .map(|s| s.success())
            .unwrap_or(false);
    if !ok {
        eprintln!(
            "SKIP: `{}` cannot import dflash_worker.job (run `make install`)",
            py.display()
        );
        return None;
    }
    Some(py)
}

fn temp_dir(tag: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("nc-it-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).expect("mkdir");
    d
}

fn show(out: &Output) -> String {
    format!(
        "exit {:?}\n--- stdout\n{}\n--- stderr\n{}",
        out.status.code(),
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    )
}

#[test]
fn version_names_the_commit_and_the_embedded_python() {
    let out = Command::new(NATIVE_CLIENT)
        .arg("--version")
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(0), "{}", show(&out));
    let text = String::from_utf8_lossy(&out.stdout);
    let want = format!(
        "dflash-native-client {} (commit {}, python 3.",
        run_manager::version::CLIENT_VERSION,
        run_manager::git_commit!()
    );
    assert!(text.starts_with(&want), "{text}");
}

#[test]
fn native_client_maps_python_failures_to_exit_codes() {
    if python().is_none() {
        return;
    }
    let dir = temp_dir("native");
    let spec = serde_json::json!({"schema_version": 1, "spec": {"stages": ["warp_drive"]}});
    std::fs::write(dir.join("spec.json"), spec.to_string()).expect("write");
    let run = |home: &Path| {
        Command::new(NATIVE_CLIENT)
            .env_remove("VIRTUAL_ENV")
            .arg("--job-dir")
            .arg(&dir)
            .arg("--python-home")
            .arg(home)
            .output()
            .expect("run")
    };
    // A bad spec: the job reports a non-retryable error event and exits 1.
    let out = run(&venv_dir());
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let last = String::from_utf8_lossy(&out.stdout)
        .lines()
        .last()
        .unwrap_or_default()
        .to_string();
    let ev = run_manager::worker::events::parse_event(&last).expect("event");
    assert!(
        matches!(ev, run_manager::worker::events::WorkerEvent::Error { retryable: false, ref message } if message.contains("warp_drive")),
        "{ev:?}"
    );
    // No usable environment: exit 2 with a hint, never a crash.
    let out = run(&dir.join("no-such-env"));
    assert_eq!(out.status.code(), Some(2), "{}", show(&out));
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("hint:"),
        "{}",
        show(&out)
    );
    // A job directory without spec.json is a user error before Python starts.
    let out = Command::new(NATIVE_CLIENT)
        .arg("--job-dir")
        .arg(dir.join("missing"))
        .output()
        .expect("run");
    assert_eq!(out.status.code(), Some(1), "{}", show(&out));
    let _ = std::fs::remove_dir_all(&dir);
}
