//! Entry point: parse arguments, run, map the outcome to an exit code.
//! Exit codes: 0 ok, 1 user error, 2 unexpected, 10 upgrade required.

use clap::Parser;
use run_manager::cli::Cli;

fn main() -> std::process::ExitCode {
    let cli = Cli::parse();
    match cli.coordinator {
        None => {
            eprintln!("error: no coordinator given\nhint: pass `--coordinator http://HOST:PORT` or set `DFLASH_COORDINATOR`");
            std::process::ExitCode::from(1)
        }
        Some(addr) => {
            eprintln!("error: coordinator client not built yet (address `{addr}`)");
            std::process::ExitCode::from(2)
        }
    }
}
