//! Embeds the git commit the binary was built from (`DFLASH_GIT_COMMIT`), so
//! `run-manager --version` can name it. Falls back to `unknown` outside a checkout.
use std::process::Command;

fn main() {
    let commit = std::env::var("DFLASH_GIT_COMMIT").ok().or_else(|| {
        Command::new("git")
            .args(["rev-parse", "--short=12", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string())
    });
    let dirty = Command::new("git")
        .args(["status", "--porcelain", "--untracked-files=no"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| !o.stdout.is_empty())
        .unwrap_or(false);
    let mut commit = commit.unwrap_or_else(|| "unknown".to_string());
    if dirty && commit != "unknown" {
        commit.push_str("-dirty");
    }
    println!("cargo:rustc-env=DFLASH_GIT_COMMIT={commit}");
    println!("cargo:rerun-if-env-changed=DFLASH_GIT_COMMIT");
    // Rebuild when HEAD moves (best effort: paths relative to the crate).
    println!("cargo:rerun-if-changed=../.git/HEAD");
    println!("cargo:rerun-if-changed=../.git/index");
}
