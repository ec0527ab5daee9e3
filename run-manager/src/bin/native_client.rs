//! `dflash-native-client --job-dir DIR`: the worker launcher for native mode.
//!
//! Embeds CPython (pyo3), makes the provider's Python environment importable
//! (see `run_manager::native` for how it is found), and calls
//! `dflash_worker.job.main(["--job-dir", DIR])`. Python exceptions become exit
//! codes (documented in `run_manager::native`) with the traceback on stderr
//! and an `error` event on stdout, so the run-manager learns why even when
//! the job module could not report it itself.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use clap::Parser;
use pyo3::exceptions::{PyKeyboardInterrupt, PySystemExit};
use pyo3::prelude::*;
use pyo3::types::PyList;
use run_manager::env_vars;
use run_manager::native::{self, EXIT_INTERRUPTED, EXIT_UNEXPECTED, EXIT_USER};

const VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("DFLASH_GIT_COMMIT"),
    ", python ",
    env!("DFLASH_EMBEDDED_PYTHON"),
    ")"
);

/// `env_vars::BUILD_PYTHON_HOME` at build time (`option_env!` needs the literal name).
const BUILD_PYTHON_HOME: Option<&str> = option_env!("DFLASH_BUILD_PYTHON_HOME");

/// Run one dflash-worker job in an embedded Python interpreter.
///
/// Exit codes: 0 done; 1 the job failed on bad input (DflashError); 2 an unexpected Python
/// exception or a broken environment; 130 interrupted; other codes are the job's own.
#[derive(Debug, Parser)]
#[command(name = "dflash-native-client", version = VERSION)]
struct Args {
    /// Job directory holding `spec.json` (written by run-manager).
    #[arg(long, value_name = "DIR")]
    job_dir: PathBuf,

    /// Python environment (virtual environment or prefix) to import dflash_worker and torch from
    /// (default: `$VIRTUAL_ENV`, else the environment this binary is installed in, else the one
    /// recorded at build time by scripts/build-native-*.sh).
    #[arg(long, env = env_vars::PYTHON_HOME, value_name = "DIR")]
    python_home: Option<PathBuf>,
}

fn main() -> ExitCode {
    let args = Args::parse();
    if !args.job_dir.join("spec.json").is_file() {
        eprintln!(
            "error: `{}` has no spec.json\nhint: the run-manager writes it; pass the job directory it created",
            args.job_dir.display()
        );
        return ExitCode::from(EXIT_USER);
    }
    let exe = std::env::current_exe().ok();
    // A binary built by scripts/build-native-*.sh lives outside any environment
    // and runs with an empty environment: it falls back to the one it was built against.
    let home = native::find_python_home(
        args.python_home.as_deref(),
        std::env::var_os(env_vars::VIRTUAL_ENV).as_deref(),
        exe.as_deref(),
    )
    .or_else(|| BUILD_PYTHON_HOME.map(PathBuf::from));
    let code = Python::attach(|py| {
        let code = run(py, &args.job_dir, home.as_deref());
        flush_stdio(py);
        code
    });
    ExitCode::from(code)
}

fn emit_error_event(py: Python<'_>, message: &str, retryable: bool) {
    let line = native::error_event_line(message, retryable);
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
        let sp = match native::site_packages(home, major, minor) {
            Ok(sp) => sp,
            Err(msg) => return Ok(Err(msg)),
        };
        // addsitedir also runs the .pth files (editable installs, torch's paths).
        py.import("site")?
            .call_method1("addsitedir", (sp.to_string_lossy().into_owned(),))?;
        if let Some(exe) = native::python_executable(home) {
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

fn exit_code_of(value: &Bound<'_, PyAny>) -> u8 {
    if value.is_none() {
        return 0;
    }
    match value.extract::<i64>() {
        Ok(n) => u8::try_from(n.clamp(0, 255)).unwrap_or(EXIT_UNEXPECTED),
        Err(_) => EXIT_USER,
    }
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
            Some(c) => match c.extract::<i64>() {
                Ok(n) => u8::try_from(n.clamp(0, 255)).unwrap_or(EXIT_UNEXPECTED),
                Err(_) => {
                    eprintln!("{c}");
                    EXIT_USER
                }
            },
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
    #[test]
    fn build_time_variable_is_the_documented_one() {
        // `option_env!` above cannot take the constant; keep the two spellings together.
        assert_eq!(
            run_manager::env_vars::BUILD_PYTHON_HOME,
            "DFLASH_BUILD_PYTHON_HOME"
        );
    }
}
