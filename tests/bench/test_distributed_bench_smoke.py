"""Smoke run of `bench/distributed.py` (two gloo ranks vs one) so the benchmark cannot rot.

Timings of so small a run mean nothing (the bench and each training process, every rank's under the real
`torchrun`, run forked from a pre-warmed interpreter: `--python-cmd`); what is checked is that both arms
train through the real CLI and every figure the benchmark reports is printed.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prewarmed import run_script
from warm_worker import command as warm_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_distributed_bench_runs_and_reports_every_figure():
    out = run_script(ROOT / "bench" / "distributed.py", ["--repeats", "1", "--steps", "3", "--grad-accum", "2",
         "--hidden", "64", "--examples", "12", "--python-cmd", warm_command()], timeout=900)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    for pattern in (
        r"run 1/1, 1 rank\(s\): [\d,]+ tokens/s",
        r"run 1/1, 2 rank\(s\): [\d,]+ tokens/s",
        r"1 rank  \(1 thread\): +[\d,]+ tokens/s",
        r"2 ranks \(1 thread each, gloo\): [\d,]+ tokens/s",
        r"scaling 2 ranks / 1 rank: x\d+\.\d\d",
        r"load average before: [\d.]+ [\d.]+ [\d.]+; after: [\d.]+ [\d.]+ [\d.]+",
    ):
        assert re.search(pattern, out.stdout), (pattern, out.stdout)
