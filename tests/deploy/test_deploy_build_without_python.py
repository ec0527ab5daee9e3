"""The run-manager needs no Python: it builds with none on PATH and never links libpython.

Only the native client (the `dflash-native-client` crate, `native-client/`) embeds
CPython. The build runs under `env -i` with a PATH of links to the build tools
alone, reusing the shared CARGO_TARGET_DIR, so after any earlier build it only
checks freshness (seconds).
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# What `cargo build` of the run-manager crate runs: the toolchain, the C linker
# driver and the tools it calls, and git for the commit stamp (build.rs).
BUILD_TOOLS = ("cargo", "rustc", "cc", "ld", "as", "ar", "git")

pytestmark = pytest.mark.skipif(sys.platform != "linux", reason="checks a Linux build")


def needed_libraries(binary: Path) -> list[str]:
    out = subprocess.run(["readelf", "-d", str(binary)], capture_output=True, text=True, check=True).stdout
    return [line.split("[", 1)[1].rstrip("]") for line in out.splitlines() if "(NEEDED)" in line]


def python_free_bin(tmp: Path) -> Path:
    """A directory of links to the build tools, with no Python among them."""
    bin_dir = tmp / "bin"
    bin_dir.mkdir()
    for tool in BUILD_TOOLS:
        found = shutil.which(tool)
        if found is None:
            pytest.skip(f"`{tool}` is not on PATH")
        (bin_dir / tool).symlink_to(found)
    assert not any(p.name.startswith("python") for p in bin_dir.iterdir())
    return bin_dir


@pytest.mark.slow
def test_cargo_build_run_manager_with_no_python_on_path(tmp_path):
    bin_dir = python_free_bin(tmp_path)
    env = {
        "PATH": str(bin_dir),
        "HOME": os.environ["HOME"],
        "CARGO_TARGET_DIR": os.environ.get("CARGO_TARGET_DIR", str(Path.home() / ".cache" / "dflash-worker" / "cargo-target")),
    }
    # A toolchain installed outside HOME's defaults stays reachable; the build environment the
    # Makefile exports (scripts/cargo-env.py) keeps this build the same as the others.
    for var in ("RUSTUP_HOME", "CARGO_HOME", "RUSTUP_TOOLCHAIN", "DFLASH_RUST_SOURCES", "DFLASH_GIT_COMMIT"):
        if var in os.environ:
            env[var] = os.environ[var]
    probe = subprocess.run(["/usr/bin/env", "-i", f"PATH={bin_dir}", "/bin/sh", "-c", "command -v python3 python"], capture_output=True, text=True)
    assert probe.stdout == "", probe.stdout
    r = subprocess.run(
        ["/usr/bin/env", "-i", *(f"{k}={v}" for k, v in env.items()), "cargo", "build", "-j2", "--locked", "-p", "run-manager"],
        cwd=ROOT, capture_output=True, text=True, timeout=1800,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    assert "pyo3" not in r.stderr, r.stderr
    built = Path(env["CARGO_TARGET_DIR"]) / "debug" / "run-manager"
    v = subprocess.run([str(built), "--version"], capture_output=True, text=True, env={"PATH": "/usr/bin:/bin"}, timeout=60)
    assert v.returncode == 0 and v.stdout.startswith("run-manager "), v


def test_installed_run_manager_does_not_link_libpython():
    if shutil.which("readelf") is None:
        pytest.skip("readelf (binutils) is not installed")
    bin_dir = Path(sys.prefix) / "bin"
    run_manager, native_client = bin_dir / "run-manager", bin_dir / "dflash-native-client"
    if not (run_manager.exists() and native_client.exists()):
        pytest.skip("run `make install` first")
    assert not any("libpython" in lib for lib in needed_libraries(run_manager)), needed_libraries(run_manager)
    # The control: the native client, installed by the same `maturin develop`, does embed it.
    assert any("libpython" in lib for lib in needed_libraries(native_client)), needed_libraries(native_client)
