"""Smoke runs of `bench/load.py` on tiny checkpoints, so the benchmark cannot rot.

The timings of a tiny checkpoint mean nothing (the bench and each loader's process run forked from a
pre-warmed interpreter: `--child-cmd`); what is checked is that all three loaders
(mapped default, `mmap=False` copies, `from_pretrained`) run in their own processes on the
same checkpoint, agree on a checksum over every weight, and that every figure the closing
note quotes is printed. Both runs skip the unmeasured warm-up (three more fresh processes that
run the same loaders). The Qwen3.5-MoE run also builds its checkpoint the way the bench
builds the full-size one (wrapper with vision tower, per-expert tensors, `mtp.*` shard).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from prewarmed import run_script
from warm_worker import command as warm_command

ROOT = Path(__file__).resolve().parents[2]


def child_cmd() -> str:
    """Each loader's process forked from a pre-warmed interpreter (tests/warm_worker.py): the bench and its
    three loaders each spent ~7 CPU-seconds importing torch and transformers first."""
    return f"{warm_command()} -m {ROOT / 'bench' / 'load.py'}"


def run_bench(*args: str) -> str:
    out = run_script(ROOT / "bench" / "load.py", ["--runs", "1", "--child-cmd", child_cmd(), *args], timeout=600)
    assert out.returncode == 0, out.stderr[-3000:]
    text = out.stdout
    assert "checksum over all weights identical in every run: True" in text
    assert "every loader built the same class: True" in text
    assert "ours read exactly the text tower's bytes and skipped the rest: True" in text
    for kind in ("ours", "ours-copy", "transformers"):
        assert re.search(rf"^{re.escape(kind)}\s+[\d.]+\s+[\d.]+\s+[\d.]+\s+[\d.]+$", text, re.M), (kind, text)
    assert re.search(r"wall-time ratio ours/transformers \(load\+touch\): \d+\.\d{3}", text), text
    assert re.search(r"peak RSS ratio ours .*: -?\d+\.\d{3}", text), text
    assert re.search(r"copy mode \(mmap=False\): wall-time ratio \d+\.\d{3}", text), text
    assert re.search(r"^goals \(\w+\): wall time (met|MISSED), peak RSS (met|MISSED)$", text, re.M), text
    return text


@pytest.mark.slow
def test_load_bench_runs_all_three_loaders(tmp_path):
    from dflash_worker.testing import save_tiny_target

    ckpt = tmp_path / "tiny"
    save_tiny_target(ckpt, family="qwen3", dtype="bfloat16", max_shard_size="64KB")
    text = run_bench("--path", str(ckpt), "--no-warmup")
    assert "no warm-up" in text
    assert "family qwen3; transformers baseline: Qwen3ForCausalLM.from_pretrained" in text
    assert "(goal <= 1.0)" in text


@pytest.mark.slow
def test_load_bench_builds_and_loads_a_qwen3_5_moe_wrapper(tmp_path):
    ckpt = tmp_path / "wrapper"
    text = run_bench("--family", "qwen3_5_moe", "--tiny", "--path", str(ckpt), "--no-warmup")
    assert "family qwen3_5_moe; transformers baseline: Qwen3_5MoeForCausalLM.from_pretrained" in text
    m = re.search(r"loaded \(text tower\): \d+ tensors, \d+ bytes .*; (\d+) of them per-expert MoE tensors", text)
    assert m and int(m[1]) == 4 * 4 * 3, text  # 4 layers x 4 experts x gate/up/down
    m = re.search(r"skipped unread by both loaders: \d+ tensors, (\d+) bytes \(vision tower (\d+), mtp (\d+)\)", text)
    assert m and int(m[2]) > 0 and int(m[3]) > 0 and int(m[1]) == int(m[2]) + int(m[3]), text
    assert "(goal <= 0.5)" in text
