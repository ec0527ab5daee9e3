"""Smoke run of `bench/gpu.py` (the GPU check's benchmark) on CPU with two gloo ranks and tiny sizes,
so the script `scripts/gpu-check.sh` runs on a GPU machine cannot rot where no GPU is.

Timings of so small a run mean nothing; what is checked is that every phase runs through the real
CLI on 1 and on 2 ranks, prints its figures, and that the two-rank capture holds one rank's bytes.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_gpu_bench_runs_every_phase_on_cpu():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "gpu.py"), "--device", "cpu", "--ranks", "2", "--hidden", "64", "--layers", "2",
         "--head-dim", "16", "--examples", "24", "--max-length", "128", "--shard-examples", "4", "--steps", "3",
         "--grad-accum", "2", "--blocks", "2", "--block-size", "4", "--geometry", "tiny", "--prompts", "2", "--new-tokens", "8"],
        capture_output=True, text=True, timeout=900, env=env,
    )  # fmt: skip
    assert out.returncode == 0, out.stdout + out.stderr[-4000:]
    for pattern in (
        r"build: target hidden 64 x 2 layers \(bf16\), draft `tiny` block 4: [\d.]+ s",
        r"capture, 1 rank\(s\): [\d.]+ s, [\d.]+ examples/s, [\d,]+ tokens/s",
        r"capture, 2 rank\(s\): [\d.]+ s, [\d.]+ examples/s, [\d,]+ tokens/s",
        r"capture shards on 2 ranks byte-identical to 1 rank: True",
        r"preflight, one training step at length 128: teacher peak [\d.]+ GiB, training peak [\d.]+ GiB",
        r"train, 1 rank\(s\): [\d,]+ tokens/s",
        r"train, 2 rank\(s\): [\d,]+ tokens/s",
        r"training scaling 2 ranks / 1 rank: x\d+\.\d\d",
        r"evaluate, trained draft: tau \(pooled\) \d\.\d{3} over \d+ verify steps",
    ):
        assert re.search(pattern, out.stdout), (pattern, out.stdout)
    summary = json.loads(out.stdout.strip().splitlines()[-1])
    assert summary["ranks"] == 2 and summary["capture_same_bytes"] is True
    assert summary["train_1"]["tokens_per_s"] > 0 and summary["train_2"]["tokens_per_s"] > 0
