//! Version facts printed by `--version` and sent to the coordinator.

/// Version of this crate (and of the native client built from it).
pub const CLIENT_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Git commit the binary was built from, `-dirty` when the tree had changes.
pub const GIT_COMMIT: &str = env!("DFLASH_GIT_COMMIT");
/// Provider-coordinator protocol spoken by this binary (`proto/dflash/v1`).
pub const PROTOCOL_VERSION: &str = "dflash.v1";

/// The long `--version` text: `<version> (commit <sha>, protocol <proto>)`.
pub const LONG_VERSION: &str = concat!(
    env!("CARGO_PKG_VERSION"),
    " (commit ",
    env!("DFLASH_GIT_COMMIT"),
    ", protocol dflash.v1)"
);
