"""Smoke run of `bench/capture.py` on a tiny teacher, so the benchmark cannot rot.

Timings of a tiny teacher mean nothing; what is checked is that the benchmark finds capture's
milestones among its events (teacher loaded, shards committed, teacher released) and prints
every figure it reports.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prewarmed import run_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_capture_bench_runs_and_reports_every_figure():
    out = run_script(ROOT / "bench" / "capture.py", ["--examples", "8", "--hidden", "64", "--layers", "2",
         "--repeats", "1", "--shard-examples", "4"], timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    for pattern in (
        r"baseline forward \(output_hidden_states\): [\d.]+ s",
        r"capture loop \(forward \+ cache writes\): +[\d.]+ s",
        r"teacher release after the loop .*: [\d.]+ s",
        r"capture loop / baseline time, median of runs: [\d.]+",
        r"cache bytes per token: [\d.]+ .*ratio 1\.0\d\d",
    ):
        assert re.search(pattern, out.stdout), (pattern, out.stdout)
