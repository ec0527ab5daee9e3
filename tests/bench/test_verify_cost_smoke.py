"""`bench/verify_cost.py`: the goal ceiling's algebra, a miniature run end to end, and bad arguments.

A miniature run's timings mean nothing; what is checked is that every figure the closing note
quotes is printed and written, and that the ceiling and the verdict follow from the figures.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from _load import bench_module
from prewarmed import run_script

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "verify_cost.py"


def _module():
    return bench_module("verify_cost")


def test_ceiling_is_one_exactly_where_verify_costs_the_goals_allowance():
    vc = _module()
    # a verify that costs one greedy step leaves the goal's 0.8 factor as headroom
    assert vc.ceiling(2.0, 1.0, 2.0) == pytest.approx(1.25)
    for t, d in ((1.0, 0.5), (3.0, 3.5), (2.5, 0.0)):
        allowance = 1.25 * t + 0.25 * d  # v <= 1.25 t + 0.25 d  <=>  ceiling >= 1
        assert vc.ceiling(t, d, allowance) == pytest.approx(1.0)
        assert vc.ceiling(t, d, allowance * 1.01) < 1.0 < vc.ceiling(t, d, allowance * 0.99)


@pytest.mark.parametrize("argv, message", [
    (["--block-size", "1"], "--block-size must be >= 2"),
    (["--threads", "0"], "give one or more integers >= 1"),
    (["--threads", "1,x"], "not a comma-separated list"),
    (["--heads", "3", "--kv-heads", "2"], "not a multiple of --kv-heads"),
    (["--accepted", "9", "--block-size", "8"], "--accepted must be between 1 and --block-size 8"),
    (["--repeat", "0"], "--repeat must be >= 1"),
])
def test_bad_arguments_are_refused_with_the_flag_named(argv, message, capsys):
    vc = _module()
    with pytest.raises(SystemExit) as e:
        vc.parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err


@pytest.mark.slow
def test_miniature_run_prints_and_writes_every_figure(tmp_path):
    out = tmp_path / "cost.json"
    proc = run_script(SCRIPT, ["--hidden", "64", "--layers", "2", "--heads", "2", "--kv-heads", "1",
         "--vocab", "256", "--draft-layers", "1", "--block-size", "4", "--context", "16", "--repeat", "3",
         "--threads", "1,2", "--json", str(out)], timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    assert [r["threads"] for r in report["results"]] == [1, 2]
    for r in report["results"]:
        assert list(r["target_ms"]) == ["1", "2", "4"]  # a greedy step, then verifies up to the block
        assert all(v > 0 for v in (*r["target_ms"].values(), r["draft_ms"], *r["gemm_ms"].values()))
        t, v, d = r["target_ms"]["1"], r["target_ms"]["4"], r["draft_ms"]
        assert r["verify_over_step"] == pytest.approx(v / t)
        assert r["ceiling"] == pytest.approx((t + d) / (0.8 * (d + v)))
        assert r["goal_needs_verify_over_step_at_most"] == pytest.approx(1.25 + 0.25 * d / t)
        # the two conditions are the same inequality
        assert (r["ceiling"] >= 1) == (r["verify_over_step"] <= r["goal_needs_verify_over_step_at_most"])
        assert r["gemm_gflops"]["4"] == pytest.approx(2 * 4 * 64 * 192 / (r["gemm_ms"]["4"] * 1e6))
    best = max(report["results"], key=lambda r: r["ceiling"])
    text = proc.stdout
    assert f"best ceiling {best['ceiling']:.3f}" in text
    assert ("is reachable here" if best["ceiling"] >= 1 else "is NOT reachable here") in text
    assert text.count("\n| 1 | ") == 1 and text.count("\n| 2 | ") == 1
