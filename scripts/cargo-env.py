#!/usr/bin/env python3
"""The environment every cargo build of this checkout runs with (the Makefile exports it).

    scripts/cargo-env.py hash             the hash of the Rust sources: DFLASH_RUST_SOURCES
    scripts/cargo-env.py commit           the commit the binaries name: DFLASH_GIT_COMMIT
    scripts/cargo-env.py pyo3-signature   what maturin sets PYO3_ENVIRONMENT_SIGNATURE to
    scripts/cargo-env.py settle           give the clean Rust sources an old modification time

Why: cargo decides whether a workspace crate is fresh from modification times. A fresh clone's
files are all newer than any earlier build, so each clone rebuilt the run-manager and the native
client in every profile it used (maturin develop, clippy, cargo test, the tests' builds, the CPU
image's wheel), though the Rust sources had not changed. Here the content decides instead:

  - both crates' build scripts declare `cargo:rerun-if-env-changed=DFLASH_RUST_SOURCES`, so the
    hash of the sources is part of their build fingerprint, and a build of other sources (another
    commit, an edit, a plain `cargo build` with no hash at all) never counts as fresh for this one;
  - `settle`, run once when a checkout's .venv is made (scripts/setup-env.sh), sets the
    modification time of the tracked, unmodified files under those paths to 2000-01-01, so a build
    of the same sources (same hash) is fresh, and one of any other sources is not (other hash).

Every file under the hashed paths counts, tracked or not (a new file changes the hash); `settle`
touches only tracked files that git reports unmodified, and nothing outside a git checkout.

The commit is read by the binaries' own `main.rs` (`run_manager::git_commit!`), so a new commit
relinks the binaries and rebuilds nothing else. The PyO3 pair keeps `maturin develop` and plain
cargo from rebuilding PyO3 and the native client after each other: maturin sets
PYO3_PYTHON=$VIRTUAL_ENV/bin/python and PYO3_ENVIRONMENT_SIGNATURE, both in PyO3's fingerprint.

Standard library only: it runs before the environment exists.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# Everything the two crates are built from (their build scripts read ../proto).
HASHED = ("run-manager", "native-client", "proto", "Cargo.toml", "Cargo.lock")
SKIP_DIRS = {"target", ".git", "__pycache__"}
# 2000-01-01T00:00:00Z: older than any build output.
SETTLED_MTIME = 946684800


def hashed_files(root: Path = ROOT) -> list[Path]:
    """Every regular file under the hashed paths, sorted by path relative to `root`."""
    found = []
    for name in HASHED:
        top = root / name
        if top.is_file():
            found.append(top)
            continue
        for dirpath, dirnames, filenames in os.walk(top):
            dirnames[:] = [d for d in dirnames if d not in SKIP_DIRS]
            for f in filenames:
                p = Path(dirpath) / f
                if p.is_file() and not p.is_symlink():
                    found.append(p)
    return sorted(found, key=lambda p: p.relative_to(root).as_posix())


def sources_hash(root: Path = ROOT) -> str:
    """sha256 over each file's relative path and content (16 hex digits)."""
    h = hashlib.sha256()
    for p in hashed_files(root):
        data = p.read_bytes()
        h.update(p.relative_to(root).as_posix().encode() + b"\0")
        h.update(len(data).to_bytes(8, "little") + data)
    return h.hexdigest()[:16]


def git(root: Path, *args: str) -> str | None:
    try:
        r = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return r.stdout if r.returncode == 0 else None


def commit(root: Path = ROOT) -> str:
    """`<12-digit sha>`, `-dirty` when tracked files differ from HEAD; `unknown` outside git."""
    sha = git(root, "rev-parse", "--short=12", "HEAD")
    if not sha:
        return "unknown"
    status = git(root, "status", "--porcelain", "--untracked-files=no")
    return sha.strip() + ("-dirty" if status else "")


def pyo3_signature() -> str:
    """The value maturin gives PYO3_ENVIRONMENT_SIGNATURE for this interpreter (run with the
    Python the .venv is made from)."""
    bits = 64 if sys.maxsize > 2**32 else 32
    return f"{sys.implementation.name}-{sys.version_info.major}.{sys.version_info.minor}-{bits}bit"


def settle(root: Path = ROOT) -> int:
    """Set the tracked, unmodified hashed files' mtime to SETTLED_MTIME; returns how many."""
    tracked = git(root, "ls-files", "-z", "--", *HASHED)
    status = git(root, "status", "--porcelain", "-z", "--untracked-files=no", "--", *HASHED)
    if tracked is None or status is None:
        return 0
    changed = set()
    entries = iter(status.split("\0"))
    for entry in entries:
        if len(entry) > 3:
            changed.add(entry[3:])
            if entry[0] in "RC":  # a rename or copy: its source path follows
                changed.add(next(entries, ""))
    n = 0
    for rel in tracked.split("\0"):
        if not rel or rel in changed:
            continue
        p = root / rel
        if p.is_file() and not p.is_symlink():
            os.utime(p, (SETTLED_MTIME, SETTLED_MTIME))
            n += 1
    return n


def main(argv: list[str]) -> int:
    commands = {
        "hash": lambda: print(sources_hash()),
        "commit": lambda: print(commit()),
        "pyo3-signature": lambda: print(pyo3_signature()),
        "settle": lambda: print(f"cargo-env: {settle()} Rust source files dated {SETTLED_MTIME} (2000-01-01)", file=sys.stderr),
    }
    if argv in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if len(argv) != 1 or argv[0] not in commands:
        got = " ".join(argv) if argv else "nothing"
        print(f"cargo-env: expected one of {', '.join(commands)}, got `{got}`\n\n{__doc__.strip()}", file=sys.stderr)
        return 2
    commands[argv[0]]()
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
