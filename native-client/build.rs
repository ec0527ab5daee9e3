//! Build script: gives `dflash-native-client` an rpath to the directory
//! holding libpython, so the embedded interpreter loads without
//! `LD_LIBRARY_PATH`, and records which Python it embeds for `--version`.
//! (The commit stamp comes from the run-manager crate: `run_manager::version`.)

fn main() {
    let config = pyo3_build_config::get();
    let v = config.version();
    println!(
        "cargo:rustc-env=DFLASH_EMBEDDED_PYTHON={}.{}",
        v.major, v.minor
    );
    if let Some(lib_dir) = config.lib_dir() {
        if std::env::var("CARGO_CFG_UNIX").is_ok() {
            println!("cargo:rustc-link-arg-bin=dflash-native-client=-Wl,-rpath,{lib_dir}");
        }
    }
}
