"""`scripts/fuzz.sh` itself: a clean run reports its numbers, a crash fails the run and keeps the input.

Python targets only (a few seconds each); the Rust targets are built and run by
`make fuzz`, which `make test` includes.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FUZZ_SH = ROOT / "scripts" / "fuzz.sh"


def run(tmp_path: Path, *args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "DFLASH_FUZZ_DIR": str(tmp_path / "work"), "DFLASH_FUZZ_CRASHES": str(tmp_path / "crashes")}
    return subprocess.run([str(FUZZ_SH), *args], env=env, capture_output=True, text=True, timeout=180, cwd=ROOT)


def row(out: subprocess.CompletedProcess[str], target: str) -> dict[str, str]:
    header = out.stdout.splitlines()[0].split()
    line = next(line for line in out.stdout.splitlines() if line.startswith(target + " "))
    return dict(zip(header, line.split()))


def test_a_clean_run_prints_execs_rate_corpus_and_no_crash(tmp_path):
    out = run(tmp_path, "--seconds", "2", "py_header")
    assert out.returncode == 0, out.stderr
    r = row(out, "py_header")
    assert int(r["execs"]) > 100 and int(r["exec/s"]) > 0 and int(r["corpus"]) >= 1 and r["crashes"] == "0", r


def test_a_crash_fails_the_run_and_keeps_the_input(tmp_path):
    # py_canary raises KeyError on its own seed: the first input is a crash.
    out = run(tmp_path, "--seconds", "5", "py_canary")
    assert out.returncode == 1, out.stdout + out.stderr
    assert row(out, "py_canary")["crashes"] == "1"
    (crash,) = (tmp_path / "crashes" / "py_canary").iterdir()
    assert crash.read_bytes().startswith(b"FU")
    assert "KeyError: 'canary'" in out.stderr and f"crashing input: {crash}" in out.stderr
    assert "hint: fix the parser, then commit the input under tests/fuzz/inputs/py_canary/" in out.stderr


def test_bad_arguments_are_refused(tmp_path):
    out = run(tmp_path, "no_such_target")
    assert out.returncode == 2 and "unknown target `no_such_target`" in out.stderr and "hint:" in out.stderr
    assert run(tmp_path, "--seconds", "0").returncode == 2
    listed = run(tmp_path, "--list").stdout.split()
    assert listed == ["py_header", "py_jsonl", "py_recipe", "py_spec", "rs_worker_event", "rs_job_spec"]
