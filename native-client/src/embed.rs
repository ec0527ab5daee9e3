//! The embedded interpreter: make the provider's environment importable, call
//! `dflash_worker.job.main(["--job-dir", DIR])`, and turn what it raises into
//! an exit code (documented in [`crate::python_env`]) with the traceback on
//! stderr and an `error` event on stdout, so the run-manager learns why even
//! when the job module could not report it itself.

use std::path::Path;

use pyo3::exceptions::{PyKeyboardInterrupt, PySystemExit};
use pyo3::prelude::*;
use pyo3::types::PyList;

use crate::python_env::{self, EXIT_INTERRUPTED, EXIT_UNEXPECTED, EXIT_USER};

/// Run the job in `job_dir` importing from `home` (None: the interpreter's own
/// packages); returns the process exit code. `unset_home`: `PYTHONHOME` was
/// set only for this interpreter's start (`pin_stdlib_home` in main.rs) and
/// is removed once it is up, so the job's subprocesses never inherit it.
pub fn run_job(job_dir: &Path, home: Option<&Path>, unset_home: bool) -> u8 {
    Python::attach(|py| {
        if unset_home {
            let popped = py.import("os").and_then(|os| {
                os.getattr("environ")?
                    .call_method1("pop", (run_manager::env_vars::PYTHONHOME, py.None()))
            });
            if let Err(e) = popped {
                e.print(py);
                return EXIT_UNEXPECTED;
            }
        }
        let code = run(py, job_dir, home);
        flush_stdio(py);
        code
    })
}

fn emit_error_event(py: Python<'_>, message: &str, retryable: bool) {
    let line = python_env::error_event_line(message, retryable);
    let written = py.import("sys").and_then(|sys| {
        let out = sys.getattr("stdout")?;
        out.call_method1("write", (format!("{line}\n"),))?;
        out.call_method0("flush")?;
        Ok(())
    });
    if written.is_err() {
        println!("{line}");
    }
}

fn flush_stdio(py: Python<'_>) {
    let _ = py
        .import("atexit")
        .and_then(|m| m.call_method0("_run_exitfuncs"));
    if let Ok(sys) = py.import("sys") {
        for name in ["stdout", "stderr"] {
            if let Ok(stream) = sys.getattr(name) {
                let _ = stream.call_method0("flush");
            }
        }
    }
}

fn setup_environment(py: Python<'_>, home: Option<&Path>) -> PyResult<Result<(), String>> {
    let sys = py.import("sys")?;
    let vi = sys.getattr("version_info")?;
    let major: u32 = vi.getattr("major")?.extract()?;
    let minor: u32 = vi.getattr("minor")?.extract()?;
    if let Some(home) = home {
        let sp = match python_env::site_packages(home, major, minor) {
            Ok(sp) => sp,
            Err(msg) => return Ok(Err(msg)),
        };
        // addsitedir also runs the .pth files (editable installs, torch's paths).
        py.import("site")?
            .call_method1("addsitedir", (sp.to_string_lossy().into_owned(),))?;
        if let Some(exe) = python_env::python_executable(home) {
            sys.setattr("executable", exe.to_string_lossy().into_owned())?;
        }
    }
    // The interpreter was initialised without Python's own signal handlers:
    // restore Ctrl-C -> KeyboardInterrupt. SIGTERM/SIGUSR1 are the job's to handle.
    let signal = py.import("signal")?;
    signal.call_method1(
        "signal",
        (
            signal.getattr("SIGINT")?,
            signal.getattr("default_int_handler")?,
        ),
    )?;
    Ok(Ok(()))
}

/// An integer exit status as a process exit code (out of range: unexpected).
fn clamp_exit(n: i64) -> u8 {
    u8::try_from(n.clamp(0, 255)).unwrap_or(EXIT_UNEXPECTED)
}

/// What `main` returned (None, an int) as an exit code; anything else is a user error.
fn exit_code_of(value: &Bound<'_, PyAny>) -> u8 {
    if value.is_none() {
        return 0;
    }
    value.extract::<i64>().map(clamp_exit).unwrap_or(EXIT_USER)
}

fn run(py: Python<'_>, job_dir: &Path, home: Option<&Path>) -> u8 {
    match setup_environment(py, home) {
        Ok(Ok(())) => {}
        Ok(Err(msg)) => {
            eprintln!("error: {msg}");
            return EXIT_UNEXPECTED;
        }
        Err(e) => {
            e.print(py);
            return EXIT_UNEXPECTED;
        }
    }
    let dir = job_dir.to_string_lossy().into_owned();
    let result = (|| -> PyResult<Bound<'_, PyAny>> {
        let sys = py.import("sys")?;
        sys.setattr(
            "argv",
            PyList::new(py, ["dflash-native-client", "--job-dir", dir.as_str()])?,
        )?;
        let job = py.import("dflash_worker.job")?;
        job.call_method1("main", (vec!["--job-dir".to_string(), dir.clone()],))
    })();
    match result {
        Ok(v) => exit_code_of(&v),
        Err(err) => handle_exception(py, err),
    }
}

fn handle_exception(py: Python<'_>, err: PyErr) -> u8 {
    if err.is_instance_of::<PySystemExit>(py) {
        // SystemExit must not reach PyErr::print, which would exit the process itself.
        let code = err.value(py).getattr("code").ok();
        return match code {
            Some(c) if c.is_none() => 0,
            Some(c) => c.extract::<i64>().map(clamp_exit).unwrap_or_else(|_| {
                eprintln!("{c}");
                EXIT_USER
            }),
            None => EXIT_USER,
        };
    }
    if err.is_instance_of::<PyKeyboardInterrupt>(py) {
        eprintln!("error: interrupted");
        return EXIT_INTERRUPTED;
    }
    let message = err.value(py).to_string();
    let type_name = err
        .get_type(py)
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "Exception".into());
    let dflash_error = py
        .import("dflash_worker.errors")
        .and_then(|m| m.getattr("DflashError"))
        .ok()
        .filter(|cls| err.matches(py, cls).unwrap_or(false));
    if dflash_error.is_some() {
        let code = err
            .value(py)
            .getattr("exit_code")
            .ok()
            .and_then(|c| c.extract::<i64>().ok())
            .and_then(|c| u8::try_from(c.clamp(1, 255)).ok())
            .unwrap_or(EXIT_USER);
        eprintln!("error: {message}");
        emit_error_event(py, &format!("{type_name}: {message}"), false);
        return code;
    }
    err.print(py);
    emit_error_event(py, &format!("{type_name}: {message}"), true);
    EXIT_UNEXPECTED
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exit_statuses_clamp_to_a_byte() {
        assert_eq!(clamp_exit(0), 0);
        assert_eq!(clamp_exit(3), 3);
        assert_eq!(clamp_exit(-1), 0);
        assert_eq!(clamp_exit(300), 255);
    }
}
