//! run-manager: joins a dflash coordinator, enforces launch policy, runs the
//! DFlash2 worker as a child process and relays its progress.
//!
//! `main.rs` only parses arguments and maps exit codes; everything else lives
//! in this library so tests can call it.

pub mod cli;
pub mod env_vars;
pub mod version;
