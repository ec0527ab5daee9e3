"""scripts/cargo-env.py: Rust builds keyed by the content of their sources.

A fresh clone dates its unmodified Rust sources back (`settle`) so that cargo reuses the shared
build of the same sources; that is safe only because the hash of the sources is in the crates'
build fingerprint. The last test shows both halves on a real (tiny) cargo workspace: the settled
clone's build is fresh, an edit with an old modification time is rebuilt, and without the hash
cargo would have kept the stale binary.
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "scripts" / "cargo-env.py"
DIRECTIVE = "cargo:rerun-if-env-changed=DFLASH_RUST_SOURCES"


def load():
    spec = importlib.util.spec_from_file_location("cargo_env_under_test", SCRIPT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


cargo_env = load()


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def git(cwd: Path, *args: str) -> str:
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@e", "GIT_COMMITTER_NAME": "t", "GIT_COMMITTER_EMAIL": "t@e"}
    return subprocess.run(["git", *args], cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout


def tree(root: Path) -> None:
    write(root / "Cargo.toml", '[workspace]\nmembers = ["run-manager"]\nresolver = "2"\n')
    write(root / "Cargo.lock", "# lock\n")
    write(root / "run-manager" / "src" / "lib.rs", "pub const A: u32 = 1;\n")
    write(root / "native-client" / "src" / "main.rs", "fn main() {}\n")
    write(root / "proto" / "dflash" / "v1" / "provider.proto", 'syntax = "proto3";\n')
    write(root / "python" / "x.py", "x = 1\n")


def test_hash_follows_every_file_under_the_rust_paths_and_nothing_else(tmp_path):
    tree(tmp_path)
    h0 = cargo_env.sources_hash(tmp_path)
    assert re.fullmatch(r"[0-9a-f]{16}", h0)
    lib = tmp_path / "run-manager" / "src" / "lib.rs"
    lib.write_text("pub const A: u32 = 2;\n")
    assert cargo_env.sources_hash(tmp_path) != h0
    lib.write_text("pub const A: u32 = 1;\n")
    assert cargo_env.sources_hash(tmp_path) == h0  # content, not modification time
    # a renamed file, a new file, an edited proto or lock: each changes the hash
    lib.rename(lib.with_name("lib2.rs"))
    assert cargo_env.sources_hash(tmp_path) != h0
    lib.with_name("lib2.rs").rename(lib)
    new = write(tmp_path / "native-client" / "src" / "extra.rs", "")
    assert cargo_env.sources_hash(tmp_path) != h0
    new.unlink()
    for f in ("proto/dflash/v1/provider.proto", "Cargo.lock", "Cargo.toml"):
        p = tmp_path / f
        before = p.read_text()
        p.write_text(before + "// x\n")
        assert cargo_env.sources_hash(tmp_path) != h0, f
        p.write_text(before)
    assert cargo_env.sources_hash(tmp_path) == h0
    # outside the Rust paths, and build output inside them, do not count
    write(tmp_path / "python" / "x.py", "x = 2\n")
    write(tmp_path / "run-manager" / "target" / "debug" / "out.o", "binary")
    write(tmp_path / "run-manager" / "src" / "__pycache__" / "junk.pyc", "junk")
    assert cargo_env.sources_hash(tmp_path) == h0


def test_settle_dates_back_only_tracked_unmodified_files(tmp_path):
    tree(tmp_path)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "x")
    edited = tmp_path / "run-manager" / "src" / "lib.rs"
    edited.write_text("pub const A: u32 = 3;\n")
    untracked = write(tmp_path / "run-manager" / "src" / "new.rs", "")
    staged_rename_src = tmp_path / "native-client" / "src" / "main.rs"
    git(tmp_path, "mv", "native-client/src/main.rs", "native-client/src/bin.rs")
    n = cargo_env.settle(tmp_path)
    settled = cargo_env.SETTLED_MTIME
    for f in ("Cargo.toml", "Cargo.lock", "proto/dflash/v1/provider.proto"):
        assert (tmp_path / f).stat().st_mtime == settled, f
    assert n == 3
    for p in (edited, untracked, tmp_path / "native-client" / "src" / "bin.rs", tmp_path / "python" / "x.py"):
        assert p.stat().st_mtime > settled + 10**8, p
    assert not staged_rename_src.exists()


def test_settle_outside_a_git_checkout_touches_nothing(tmp_path):
    tree(tmp_path)
    assert cargo_env.settle(tmp_path) == 0
    assert (tmp_path / "Cargo.toml").stat().st_mtime > cargo_env.SETTLED_MTIME + 10**8


def test_commit_names_head_and_dirty_and_unknown_outside_git(tmp_path):
    assert cargo_env.commit(tmp_path) == "unknown"
    tree(tmp_path)
    git(tmp_path, "init", "-q")
    git(tmp_path, "add", "-A")
    git(tmp_path, "commit", "-q", "-m", "x")
    head = git(tmp_path, "rev-parse", "--short=12", "HEAD").strip()
    assert cargo_env.commit(tmp_path) == head
    (tmp_path / "Cargo.lock").write_text("changed\n")
    assert cargo_env.commit(tmp_path) == head + "-dirty"


def test_cli_prints_each_value_and_refuses_unknown_commands():
    def run(*args):
        return subprocess.run(["python3", str(SCRIPT), *args], capture_output=True, text=True, timeout=60)

    assert run("hash").stdout.strip() == cargo_env.sources_hash(ROOT)
    assert run("pyo3-signature").stdout.strip() == cargo_env.pyo3_signature()
    bad = run("bogus")
    assert bad.returncode == 2 and "got `bogus`" in bad.stderr and "settle" in bad.stderr and not bad.stdout
    none = run()
    assert none.returncode == 2 and "got `nothing`" in none.stderr and not none.stdout
    helped = run("--help")
    assert helped.returncode == 0 and "DFLASH_RUST_SOURCES" in helped.stdout


def test_every_hashed_crate_puts_the_hash_in_its_fingerprint():
    """A settled crate without the directive would reuse a build of other sources."""
    members = re.search(r"^members\s*=\s*\[([^\]]*)\]", (ROOT / "Cargo.toml").read_text(), re.M).group(1)
    settled = [m for m in re.findall(r'"([^"]+)"', members) if m.split("/")[0] in cargo_env.HASHED]
    assert set(settled) == {"run-manager", "native-client"}
    for crate in settled:
        assert DIRECTIVE in (ROOT / crate / "build.rs").read_text(), crate
    # The Makefile exports the hash to every cargo build it runs.
    assert re.search(r"^export DFLASH_RUST_SOURCES := \$\(shell .*cargo-env\.py hash\)", (ROOT / "Makefile").read_text(), re.M)


def _crate(root: Path, value: int, with_directive: bool) -> None:
    write(root / "Cargo.toml", '[workspace]\nmembers = ["run-manager"]\nresolver = "2"\n')
    write(root / "run-manager" / "Cargo.toml", '[package]\nname = "tiny"\nversion = "0.1.0"\nedition = "2021"\n')
    build = 'fn main() { println!("cargo:rerun-if-changed=build.rs");' + (f' println!("{DIRECTIVE}");' if with_directive else "") + " }\n"
    write(root / "run-manager" / "build.rs", build)
    write(root / "run-manager" / "src" / "main.rs", f'fn main() {{ println!("{value}"); }}\n')


def _build(root: Path, target: Path, with_hash: bool) -> tuple[bool, str]:
    """(whether cargo found the binary fresh, what the binary prints)."""
    env = {**os.environ, "CARGO_TARGET_DIR": str(target)}
    env.pop("DFLASH_RUST_SOURCES", None)
    if with_hash:
        env["DFLASH_RUST_SOURCES"] = cargo_env.sources_hash(root)
    r = subprocess.run(["cargo", "build", "--offline", "--message-format=json"], cwd=root, env=env, capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr
    fresh = [json.loads(line)["fresh"] for line in r.stdout.splitlines() if '"compiler-artifact"' in line and '"tiny"' in line and '"bin"' in line]
    assert len(fresh) == 1, r.stdout
    out = subprocess.run([str(target / "debug" / "tiny")], capture_output=True, text=True, timeout=60).stdout.strip()
    return fresh[0], out


@pytest.mark.skipif(shutil.which("cargo") is None or shutil.which("git") is None, reason="needs cargo and git")
@pytest.mark.parametrize("with_hash", [True, False], ids=["hash-in-fingerprint", "control-without-hash"])
def test_a_settled_clone_reuses_the_same_sources_and_rebuilds_changed_ones(tmp_path, with_hash):
    origin, target = tmp_path / "origin", tmp_path / "target"
    _crate(origin, 1, with_directive=with_hash)
    subprocess.run(["cargo", "generate-lockfile", "--offline"], cwd=origin, check=True, capture_output=True, timeout=120)
    git(origin, "init", "-q")
    git(origin, "add", "-A")
    git(origin, "commit", "-q", "-m", "x")
    assert _build(origin, target, with_hash) == (False, "1")
    # A fresh clone elsewhere, settled as scripts/setup-env.sh does: the shared build is reused.
    clone = tmp_path / "clone"
    git(tmp_path, "clone", "-q", str(origin), str(clone))
    assert cargo_env.settle(clone) > 0
    assert _build(clone, target, with_hash) == (True, "1")
    # The sources change but keep an old modification time (a settled file whose content differs
    # from the last build's: another commit, or a revert of an edit that was built).
    main = clone / "run-manager" / "src" / "main.rs"
    main.write_text('fn main() { println!("2"); }\n')
    os.utime(main, (cargo_env.SETTLED_MTIME, cargo_env.SETTLED_MTIME))
    if with_hash:
        assert _build(clone, target, with_hash) == (False, "2")
    else:
        # What the hash prevents: cargo trusts the modification time and keeps the stale binary.
        assert _build(clone, target, with_hash) == (True, "1")
