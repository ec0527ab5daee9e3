"""Smoke run of `bench/train.py --features` (issue 36) on a small tiny world, so the benchmark cannot rot.

Timings of a tiny world mean nothing here (tests never assert wall-clock times); what is checked is
that every figure is printed, the online capture's bytes per token are within the issue's goal,
and the cache and online exports are byte-identical.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prewarmed import run_script

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_train_features_bench_reports_every_figure():
    out = run_script(ROOT / "bench" / "train.py", ["--features", "--examples", "12", "--train-steps", "2",
         "--grad-accum", "1", "--repeats", "1"], timeout=600)  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr
    text = out.stdout
    for name in ("cache training only", r"capture \+ cache training", r"online \(token capture \+ online training\)"):
        assert re.search(name + r" +[\d.]+ s +[\d.]+ samples/s +\(cpu +[\d.]+ s\) +disk +[\d.]+ B/token", text), text
    assert re.search(r"online end to end / capture \+ cache training: [\d.]+x wall, [\d.]+x cpu time", text), text
    per_token = float(re.search(r"online disk ([\d.]+) B/token", text).group(1))
    assert per_token <= 16, text
    assert "exports byte-identical: yes" in text, text
