//! Build script:
//! - embeds the git commit the binary was built from, so `run-manager --version`
//!   can name it (`unknown` outside a checkout; `DFLASH_GIT_COMMIT` names it instead);
//! - generates the gRPC client for `proto/dflash/v1` with the `protoc` that the
//!   `protoc-bin-vendored` crate ships, so no system `protoc` is needed.
//!
//! Nothing here needs a Python (the native client's build script does).
use std::path::PathBuf;
use std::process::Command;

fn main() {
    embed_git_commit();
    if let Err(err) = generate_grpc() {
        // A build script reports failure by panicking; there is no caller to return to.
        panic!("generating the gRPC client from proto/dflash/v1 failed: {err}");
    }
}

fn embed_git_commit() {
    println!("cargo:rerun-if-env-changed=DFLASH_GIT_COMMIT");
    if let Ok(given) = std::env::var("DFLASH_GIT_COMMIT") {
        // Named by the builder (the Docker build, the fuzz targets): git is not asked, and a
        // moved HEAD does not rebuild the crate.
        println!("cargo:rustc-env=DFLASH_GIT_COMMIT={given}");
        return;
    }
    let commit = Command::new("git")
        .args(["rev-parse", "--short=12", "HEAD"])
        .output()
        .ok()
        .filter(|o| o.status.success())
        .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
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
    // Rebuild when HEAD moves (best effort: paths relative to the crate).
    println!("cargo:rerun-if-changed=../.git/HEAD");
    println!("cargo:rerun-if-changed=../.git/index");
    // A commit on the current branch moves the ref, not HEAD.
    if std::path::Path::new("../.git/refs/heads").is_dir() {
        println!("cargo:rerun-if-changed=../.git/refs/heads");
    }
}

fn generate_grpc() -> Result<(), Box<dyn std::error::Error>> {
    let proto_root = PathBuf::from("../proto");
    let protos = [
        proto_root.join("dflash/v1/provider.proto"),
        proto_root.join("dflash/v1/admin.proto"),
    ];
    for p in &protos {
        println!("cargo:rerun-if-changed={}", p.display());
    }
    // An explicit PROTOC wins (e.g. a distro build that forbids vendored binaries).
    if std::env::var_os("PROTOC").is_none() {
        let protoc = protoc_bin_vendored::protoc_bin_path()?;
        std::env::set_var("PROTOC", protoc);
    }
    println!("cargo:rerun-if-env-changed=PROTOC");
    tonic_prost_build::configure()
        .build_server(false)
        .build_client(true)
        .compile_protos(&protos, &[proto_root])?;
    Ok(())
}
