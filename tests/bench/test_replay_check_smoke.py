"""`bench/replay_check.py`: the figures' algebra, and a miniature run end to end (its timings mean
nothing; what is checked is that every verify job recomputes its capture exactly, the train replay
reproduces the train job's checkpoint and export exactly, and every figure is printed and written)."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from _load import bench_module
from prewarmed import run_script
from warm_worker import command as warm_command

ROOT = Path(__file__).resolve().parents[2]


def test_figures_follow_the_coordinator_s_choice_of_shards():
    rc = bench_module("replay_check")
    times = {"prepare": 1.0, "capture0": 2.0, "capture1": 4.0, "train": 10.0, "evaluate": 3.0, "verify0": 2.0, "verify1": 4.0}
    sizes = {"capture0": 100, "capture1": 100, "verify0": 100, "verify1": 100}
    none = rc.figures(times, sizes, 2, 0.0, "r")
    assert none["checked"] == [] and none["extra_work"] == 0 and none["critical_path_overhead"] == 0
    both = rc.figures(times, sizes, 2, 1.0, "r")
    assert both["checked"] == [0, 1]
    assert both["extra_work"] == pytest.approx(6 / 20)  # both recaptures over the run's 20 s of jobs
    assert both["critical_path_s"] == pytest.approx(1 + 8 + 10 + 3) and both["critical_path_unchecked_s"] == pytest.approx(18)
    assert both["extra_upload"] == pytest.approx(1.0)
    half = rc.figures(times, sizes, 2, 0.5, "r")
    assert len(half["checked"]) == 1


def test_train_replay_figures_follow_the_coordinator_s_start():
    rc = bench_module("replay_check")
    assert rc.replay_starts([0.0, 0.25, 0.5, 1.0], 8, [6, 8]) == {0.25: 6, 0.5: 0, 1.0: 0}  # 4 is not held: from step 0
    times = {"prepare": 1.0, "capture0": 2.0, "train": 10.0, "evaluate": 3.0, "verify0": 2.0, "replay@6": 3.0, "replay@0": 9.0}
    sizes = {"capture0": 100, "verify0": 100, "train": 400, "replay@6": 100, "replay@0": 100}
    assert "train_replay" not in rc.figures(times, sizes, 1, 0.0, "r")
    row = rc.figures(times, sizes, 1, 0.25, "r", replay=(6, 8))
    assert row["work_s"] == pytest.approx(16)  # the replays are not the run's work
    assert row["train_replay"]["steps"] == 2 and row["train_replay"]["extra_work"] == pytest.approx(3 / 16)
    assert row["total"]["extra_work_s"] == pytest.approx(5) and row["total"]["critical_path_s"] == pytest.approx(1 + 4 + 10 + 3 + 3)
    assert row["train_replay"]["upload"] == pytest.approx(0.25)


@pytest.mark.slow
def test_a_miniature_run_prints_every_fraction(tmp_path):
    out = run_script(
        ROOT / "bench" / "replay_check.py", ["--shards", "1", "--fractions", "0,1", "--steps", "2", "--json", str(tmp_path / "r.json"),
         "--worker-cmd", warm_command()],  # each job in a fork of a pre-warmed interpreter (tests/warm_worker.py)
        timeout=900,
    )  # fmt: skip
    assert out.returncode == 0, out.stderr[-3000:]
    assert "every verify job recomputed its capture byte for byte" in out.stdout, out.stdout
    assert "every train replay reproduced the selected step 2's checkpoint and export byte for byte" in out.stdout, out.stdout
    assert re.search(r"^ +0\.00 +0 +0\.0 s +0\.0%", out.stdout, re.M) and re.search(r"^ +1\.00 +1 ", out.stdout, re.M), out.stdout
    doc = json.loads((tmp_path / "r.json").read_text())
    assert [r["fraction"] for r in doc["rows"]] == [0.0, 1.0] and doc["rows"][1]["extra_work"] > 0
    assert doc["rows"][1]["train_replay"]["from_step"] == 0 and doc["rows"][1]["total"]["extra_work"] > doc["rows"][1]["extra_work"]
