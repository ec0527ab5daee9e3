//! Entry point: parse arguments, build the runtime, run, map the outcome to an
//! exit code (0 ok, 1 user error, 2 unexpected, 3 a `--local` job did not
//! succeed, 10 upgrade required, 128+N stopped by signal N).

use std::process::ExitCode;
use std::sync::LazyLock;

use anyhow::Context;
use clap::{CommandFactory, FromArgMatches};
use run_manager::cli::Cli;
use run_manager::error::EXIT_UNEXPECTED;

/// `--version`: `<version> (commit <sha>, protocol <proto>)`, the commit read here
/// (`run_manager::git_commit!`: a new commit relinks this binary, not the library).
static LONG_VERSION: LazyLock<String> =
    LazyLock::new(|| run_manager::version::long_version(run_manager::git_commit!()));

fn runtime() -> anyhow::Result<tokio::runtime::Runtime> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .context("cannot start the async runtime")
}

fn main() -> ExitCode {
    let matches = Cli::command()
        .long_version(LONG_VERSION.as_str())
        .get_matches();
    let mut cli = Cli::from_arg_matches(&matches).unwrap_or_else(|e| e.exit());
    // Before the runtime's threads and any child: it changes the environment.
    let lockdown = run_manager::lockdown::lock_down(&mut cli);
    run_manager::logging::init(cli.log_format, cli.log_level, cli.verbose);
    run_manager::lockdown::log(&lockdown);
    let rt = match runtime() {
        Ok(rt) => rt,
        Err(e) => {
            eprintln!("error: {e:#}");
            return ExitCode::from(EXIT_UNEXPECTED);
        }
    };
    match rt.block_on(run_manager::run(cli)) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
