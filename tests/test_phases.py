"""scripts/phases.sh: the phase table `make test` prints, with its calibration line."""

from __future__ import annotations

import os
import re
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "scripts" / "phases.sh"


def _run(*args: str, times: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, DFLASH_PHASE_TIMES=str(times))
    return subprocess.run([str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=120, cwd=ROOT)


def test_the_report_lists_each_phase_and_the_calibration_at_both_ends(tmp_path):
    times = tmp_path / "phases.tsv"
    assert _run("--reset", times=times).returncode == 0
    # a phase as `make test` records it (scripts/phases.sh TARGET appends one such row)
    with open(times, "a") as f:
        f.write("lint\t12.5\t0\t97\n")
    out = _run("--report", times=times)
    assert out.returncode == 0, out.stderr
    assert re.search(r"^  lint +12\.5 s +cpu busy +97%$", out.stdout, re.M), out.stdout
    m = re.search(r"^  calibration +(\d+\.\d{3}) CPU s at the start, (\d+\.\d{3}) at the end ", out.stdout, re.M)
    assert m, out.stdout
    assert 0 < float(m.group(1)) < 60 and 0 < float(m.group(2)) < 60


def test_without_a_calibration_the_report_has_no_such_line(tmp_path):
    times = tmp_path / "phases.tsv"
    times.write_text("lint\t1.0\t0\t50\n")
    out = _run("--report", times=times)
    assert out.returncode == 0 and "lint" in out.stdout and "calibration" not in out.stdout, out.stdout
