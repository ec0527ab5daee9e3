//! Every environment variable the run-manager reads, in one place.
//! Precedence everywhere: command-line flag > environment > default.

/// Coordinator address, e.g. `http://127.0.0.1:50051`.
pub const COORDINATOR: &str = "DFLASH_COORDINATOR";
/// Bearer token identifying this provider to the coordinator.
pub const PROVIDER_TOKEN: &str = "DFLASH_PROVIDER_TOKEN";
/// Working directory for jobs (checkpoints, captured features, exports).
pub const WORK_DIR: &str = "DFLASH_WORK_DIR";
