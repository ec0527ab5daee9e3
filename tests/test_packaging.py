"""One install puts the Rust binaries and the Python package in one environment."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
BIN = Path(sys.executable).parent


def _run(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(args, capture_output=True, text=True, timeout=120)


def test_run_manager_version_names_commit_and_protocol():
    out = _run(str(BIN / "run-manager"), "--version")
    assert out.returncode == 0, out.stderr
    m = re.fullmatch(r"run-manager (\d+\.\d+\.\d+) \(commit ([0-9a-f]{7,}(-dirty)?|unknown), protocol dflash\.v1\)\n", out.stdout)
    assert m, out.stdout
    head = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=ROOT, capture_output=True, text=True)
    if head.returncode == 0:
        assert m.group(2).startswith(head.stdout.strip())


def test_dflash_worker_console_script_uses_this_environment():
    out = _run(str(BIN / "dflash-worker"), "--version")
    assert out.returncode == 0, out.stderr
    import dflash_worker

    assert out.stdout.strip() == f"dflash-worker {dflash_worker.__version__}"


def test_dflash_worker_without_command_prints_help_and_fails():
    out = _run(str(BIN / "dflash-worker"))
    assert out.returncode == 1
    assert "usage: dflash-worker" in out.stderr


def test_run_pytest_reports_empty_suite_as_its_own_failure(tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    out = subprocess.run(
        [str(ROOT / "scripts" / "run-pytest.sh"), str(empty), "-p", "no:cacheprovider"],
        capture_output=True, text=True, timeout=120, env={**os.environ},
    )
    assert out.returncode == 5
    assert "collected no tests" in out.stderr


def test_versions_agree_between_cargo_and_python():
    cargo = (ROOT / "Cargo.toml").read_text()
    py = (ROOT / "pyproject.toml").read_text()
    cv = re.search(r'^version = "([^"]+)"', cargo, re.M).group(1)
    pv = re.search(r'^version = "([^"]+)"', py, re.M).group(1)
    import dflash_worker

    assert cv == pv == dflash_worker.__version__


def test_closed_stdout_pipe_is_not_a_traceback(tmp_path):
    from dflash_worker.testing import save_tiny_target

    save_tiny_target(tmp_path / "t", max_shard_size="32KB")
    proc = subprocess.Popen(
        [str(BIN / "dflash-worker"), "inspect-checkpoint", str(tmp_path / "t")],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )
    proc.stdout.readline()
    proc.stdout.close()  # like `| head -1`
    err = proc.stderr.read().decode()
    assert proc.wait(timeout=120) in (0, 1)
    assert "Traceback" not in err, err
