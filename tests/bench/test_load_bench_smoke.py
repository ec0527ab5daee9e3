"""Smoke run of `bench/load.py` on a tiny checkpoint, so the benchmark cannot rot.

The timings of a tiny checkpoint mean nothing; what is checked is that all three loaders
(mapped default, `mmap=False` copies, `from_pretrained`) run in their own processes on the
same checkpoint, agree on a checksum over every weight, and that every figure the closing
note quotes is printed.
"""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_load_bench_runs_all_three_loaders(tmp_path):
    from dflash_worker.testing import save_tiny_target

    ckpt = tmp_path / "tiny"
    save_tiny_target(ckpt, family="qwen3", dtype="bfloat16", max_shard_size="64KB")
    out = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "load.py"), "--path", str(ckpt), "--runs", "1"],
        capture_output=True, text=True, timeout=600,
    )
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "checksum over all weights identical in every run: True" in text
    for kind in ("ours", "ours-copy", "transformers"):
        assert re.search(rf"^{re.escape(kind)}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", text, re.M), (kind, text)
    assert re.search(r"wall-time ratio ours/transformers \(load\+touch\): \d+\.\d{3}", text), text
    assert re.search(r"peak RSS ratio ours .*: -?\d+\.\d{3}", text), text
    assert re.search(r"copy mode \(mmap=False\): wall-time ratio \d+\.\d{3}", text), text
