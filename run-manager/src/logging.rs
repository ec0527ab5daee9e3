//! Log set-up: tracing to stderr, text or JSON, colour only on a terminal
//! without `NO_COLOR`.

use std::io::IsTerminal;

use tracing::level_filters::LevelFilter;

use crate::cli::{LogFormat, LogLevel};

/// The level after `-v` flags raise `level`.
pub fn effective_level(level: LogLevel, verbose: u8) -> LevelFilter {
    let base = match level {
        LogLevel::Error => 0,
        LogLevel::Warn => 1,
        LogLevel::Info => 2,
        LogLevel::Debug => 3,
        LogLevel::Trace => 4,
    };
    match (base + usize::from(verbose)).min(4) {
        0 => LevelFilter::ERROR,
        1 => LevelFilter::WARN,
        2 => LevelFilter::INFO,
        3 => LevelFilter::DEBUG,
        _ => LevelFilter::TRACE,
    }
}

/// Install the global subscriber (once; later calls are ignored).
pub fn init(format: LogFormat, level: LogLevel, verbose: u8) {
    let level = effective_level(level, verbose);
    let ansi =
        std::io::stderr().is_terminal() && std::env::var_os(crate::env_vars::NO_COLOR).is_none();
    let builder = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level)
        .with_target(false);
    let _ = match format {
        LogFormat::Text => builder.with_ansi(ansi).try_init(),
        LogFormat::Json => builder.json().flatten_event(true).try_init(),
    };
}
