//! Build script: gives `dflash-native-client` an rpath to the directory
//! holding libpython, so the embedded interpreter loads without
//! `LD_LIBRARY_PATH`; records which Python it embeds (for `--version`) and
//! that Python's prefix, the parent of its `LIBDIR` (a standalone build's
//! standard library, see `python_env::stdlib_home`).
//! Like run-manager's build script, it makes the hash of the Rust sources
//! (`DFLASH_RUST_SOURCES`, scripts/cargo-env.py) part of the build fingerprint.

fn main() {
    println!("cargo:rerun-if-env-changed=DFLASH_RUST_SOURCES");
    let config = pyo3_build_config::get();
    let v = config.version();
    println!(
        "cargo:rustc-env=DFLASH_EMBEDDED_PYTHON={}.{}",
        v.major, v.minor
    );
    if let Some(lib_dir) = config.lib_dir() {
        if let Some(prefix) = std::path::Path::new(lib_dir).parent() {
            println!(
                "cargo:rustc-env=DFLASH_EMBEDDED_PYTHON_PREFIX={}",
                prefix.display()
            );
        }
        if std::env::var("CARGO_CFG_UNIX").is_ok() {
            println!("cargo:rustc-link-arg-bin=dflash-native-client=-Wl,-rpath,{lib_dir}");
        }
    }
}
