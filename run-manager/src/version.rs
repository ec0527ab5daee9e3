//! Version facts printed by `--version` and sent to the coordinator.

/// Version of this crate (and of the native client built from it).
pub const CLIENT_VERSION: &str = env!("CARGO_PKG_VERSION");
/// Provider-coordinator protocol spoken by this binary (`proto/dflash/v1`).
pub const PROTOCOL_VERSION: &str = "dflash.v1";

/// The commit a binary was built from, as its builder named it in `DFLASH_GIT_COMMIT` (`make`,
/// the scripts under scripts/ and the Docker build name it: `<sha>`, `-dirty` when the tree had
/// changes), else `unknown`.
///
/// A macro, not a constant of this library: `option_env!` is read where it is expanded, and cargo
/// rebuilds only the units that read a variable when its value changes. Expanded in the binaries'
/// `main.rs`, a new commit relinks the binaries and leaves this library's build (and its tests'
/// builds) as they were; read here, every commit rebuilt the whole crate in every profile.
#[macro_export]
macro_rules! git_commit {
    () => {
        match option_env!("DFLASH_GIT_COMMIT") {
            Some(commit) => commit,
            None => "unknown",
        }
    };
}

/// The long `--version` text: `<version> (commit <sha>, protocol <proto>)`.
pub fn long_version(commit: &str) -> String {
    format!("{CLIENT_VERSION} (commit {commit}, protocol {PROTOCOL_VERSION})")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn long_version_names_version_commit_and_protocol() {
        assert_eq!(
            long_version("0123456789ab-dirty"),
            format!(
                "{} (commit 0123456789ab-dirty, protocol dflash.v1)",
                env!("CARGO_PKG_VERSION")
            )
        );
    }
}
