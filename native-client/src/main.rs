//! `dflash-native-client --job-dir DIR`: the worker launcher for native mode.
//!
//! Embeds CPython (pyo3), makes the provider's Python environment importable
//! (see `dflash_native_client::python_env` for how it is found), and calls
//! `dflash_worker.job.main(["--job-dir", DIR])` (`dflash_native_client::embed`).
//! This file only parses arguments, finds the environment and exits.

use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::LazyLock;

use clap::Parser;
use dflash_native_client::embed;
use dflash_native_client::python_env::{self, EXIT_USER};
use run_manager::{env_vars, version};

/// `<version> (commit <sha>, python <X.Y>)`; the commit is read here (`run_manager::git_commit!`),
/// so a new commit relinks this binary only.
static VERSION: LazyLock<String> = LazyLock::new(|| {
    format!(
        "{} (commit {}, python {})",
        version::CLIENT_VERSION,
        run_manager::git_commit!(),
        env!("DFLASH_EMBEDDED_PYTHON")
    )
});

/// `env_vars::BUILD_PYTHON_HOME` at build time (`option_env!` needs the literal name).
const BUILD_PYTHON_HOME: Option<&str> = option_env!("DFLASH_BUILD_PYTHON_HOME");
/// The prefix of the Python this binary embeds (set by build.rs when known).
const EMBEDDED_PYTHON_PREFIX: Option<&str> = option_env!("DFLASH_EMBEDDED_PYTHON_PREFIX");

/// Run one dflash-worker job in an embedded Python interpreter.
///
/// Exit codes: 0 done; 1 the job failed on bad input (DflashError); 2 an unexpected Python
/// exception or a broken environment; 130 interrupted; other codes are the job's own.
#[derive(Debug, Parser)]
#[command(name = "dflash-native-client", version = VERSION.as_str())]
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
    let found = python_env::find_python_home(
        args.python_home.as_deref(),
        std::env::var_os(env_vars::VIRTUAL_ENV).as_deref(),
        exe.as_deref(),
    );
    // Built by scripts/build-native-*.sh and not installed in an environment.
    let standalone = BUILD_PYTHON_HOME.is_some()
        && python_env::find_python_home(None, None, exe.as_deref()).is_none();
    let home = found.or_else(|| BUILD_PYTHON_HOME.map(PathBuf::from));
    let pinned = standalone && pin_stdlib_home();
    ExitCode::from(embed::run_job(&args.job_dir, home.as_deref(), pinned))
}

/// A standalone binary: point the interpreter at the standard library of the
/// Python it was built against, unless `PYTHONHOME` is set already. True when
/// it was set here (the interpreter then removes it once it is up).
fn pin_stdlib_home() -> bool {
    if std::env::var_os(env_vars::PYTHONHOME).is_some() {
        return false;
    }
    let version = env!("DFLASH_EMBEDDED_PYTHON");
    match EMBEDDED_PYTHON_PREFIX.and_then(|p| python_env::stdlib_home(Path::new(p), version)) {
        Some(prefix) => {
            // Single-threaded still: nothing else reads the environment yet.
            std::env::set_var(env_vars::PYTHONHOME, prefix);
            true
        }
        None => false,
    }
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
