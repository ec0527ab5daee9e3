"""Smoke run of `bench/fanout.py` on a tiny world, so the benchmark cannot rot.

Its timings mean nothing at this size; what is checked is that both arms (one provider, two
pinned providers) run the real coordinator and run-managers to a succeeded job graph, that they
captured the same bytes, and that every figure the closing note quotes is printed.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
from prewarmed import run_script
from warm_worker import command as warm_command

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.skipif(shutil.which("taskset") is None, reason="taskset (util-linux) is not installed")
def test_fanout_bench_runs_both_arms_to_the_same_capture():
    # each job in a fork of a pre-warmed interpreter (tests/warm_worker.py): the arms' figures mean nothing at
    # this size, what runs is the coordinator, the run-managers and the job graph
    out = run_script(ROOT / "bench" / "fanout.py", ["--repeats", "1", "--examples", "16", "--shard-examples", "4",
         "--hidden", "64", "--layers", "2", "--timeout", "600", "--worker-cmd", warm_command()], timeout=900)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
    text = out.stdout
    assert re.search(r"^K=1 provider : \d+\.\d\d s", text, re.M), text
    assert re.search(r"^K=2 providers: \d+\.\d\d s", text, re.M), text
    assert re.search(r"^speedup K=2 / K=1: x\d+\.\d\d", text, re.M), text
    assert "same capture at K=1 and K=2 (capture key and every shard's sha256): True" in text
