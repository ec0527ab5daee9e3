//! Build script:
//! - makes the hash of the Rust sources (`DFLASH_RUST_SOURCES`) part of the build fingerprint;
//! - generates the gRPC client for `proto/dflash/v1` with the `protoc` that the
//!   `protoc-bin-vendored` crate ships, so no system `protoc` is needed.
//!
//! Nothing here needs a Python (the native client's build script does).
use std::path::PathBuf;

fn main() {
    track_sources_hash();
    if let Err(err) = generate_grpc() {
        // A build script reports failure by panicking; there is no caller to return to.
        panic!("generating the gRPC client from proto/dflash/v1 failed: {err}");
    }
}

/// `DFLASH_RUST_SOURCES`: a hash of the Rust sources (run-manager/, native-client/, proto/,
/// Cargo.toml, Cargo.lock), which `make` and the scripts compute (scripts/cargo-env.py). Declared
/// here, its value is part of this crate's build fingerprint: a fresh clone, whose unchanged
/// sources have their old modification times back (`cargo-env.py settle`), reuses the build of
/// the same sources, and any change to them rebuilds the crate whatever the modification times
/// say. (The commit a binary names is no longer read here: see `git_commit!` in src/version.rs.)
fn track_sources_hash() {
    println!("cargo:rerun-if-env-changed=DFLASH_RUST_SOURCES");
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
