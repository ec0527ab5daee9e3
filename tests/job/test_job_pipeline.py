"""`dflash_worker.job` runs the real pipeline stages from a spec and reports through events."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
from prewarmed import run_main

from dflash_worker.testing.world import build_world, job_spec


def _run_job(job_dir: Path, spec: dict) -> tuple[int, list[dict], str]:
    job_dir.mkdir(parents=True, exist_ok=True)
    (job_dir / "spec.json").write_text(json.dumps({"schema_version": 1, "spec": spec}))
    out = run_main("dflash_worker.job", ["--job-dir", job_dir], timeout=600, env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"})
    return out.returncode, [json.loads(line) for line in out.stdout.splitlines()], out.stderr


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    return build_world(tmp_path_factory.mktemp("world"))


@pytest.mark.slow
def test_pipeline_job_reports_every_stage_and_true_hashes(world, tmp_path):
    spec = job_spec(world, steps=4, checkpoint_every=2, stages=["prepare", "check", "capture", "train", "export", "evaluate"])
    spec["export_formats"] = ["af4g64"]
    spec["recipe"]["train"]["val_every"] = 2
    job = tmp_path / "job"
    rc, events, err = _run_job(job, spec)
    assert rc == 0, err
    assert events[-1] == {"event": "done"}
    phases = [e["phase"] for e in events if e["event"] == "progress"]
    order = ["starting", "prepare", "check", "capture", "train", "export", "evaluate"]
    assert [p for p in order if p in phases] == order
    assert phases == sorted(phases, key=order.index), "phases ran out of order"
    steps = [e["step"] for e in events if e["event"] == "progress" and e["phase"] == "train"]
    assert steps == [1, 2, 3, 4]

    arts = [e for e in events if e["event"] == "artifact"]
    for a in arts:  # every reported sha256 is the file's; names are relative to the job dir
        path = Path(a["path"])
        assert path == (job / a["name"]).resolve()
        assert hashlib.sha256(path.read_bytes()).hexdigest() == a["sha256"]
        assert a["size_bytes"] == path.stat().st_size
    kinds = {a["kind"] for a in arts}
    assert {"manifest", "capture", "checkpoint", "export", "report"} <= kinds
    selected = json.loads((job / "run" / "selection.json").read_text())["step"]
    exports = [a for a in arts if a["kind"] == "export"]
    assert {a["step"] for a in exports} == {selected}
    assert any(a["name"].endswith("model.safetensors") and "af4g64" in a["name"] for a in exports)
    report = json.loads((job / "eval" / "report.json").read_text())
    assert report["prompts"] >= 1 and report["baseline"]["tau_mean"] >= 1.0

    # rerunning the finished job verifies instead of retraining and ends with the same export
    first = {a["name"]: a["sha256"] for a in exports}
    rc, events, err = _run_job(job, spec)
    assert rc == 0, err
    again = {e["name"]: e["sha256"] for e in events if e["event"] == "artifact" and e["kind"] == "export"}
    assert again == first
    assert not [e for e in events if e["event"] == "progress" and e["phase"] == "train"]


def test_spec_that_sets_runner_owned_paths_is_refused(world, tmp_path):
    spec = job_spec(world)
    spec["recipe"]["train"]["output"] = "/tmp/elsewhere"
    rc, events, err = _run_job(tmp_path / "job", spec)
    assert rc == 1
    assert events[-1]["event"] == "error" and events[-1]["retryable"] is False
    assert "`spec.recipe.train.output` is set by the job runner" in events[-1]["message"]
    assert not (tmp_path / "job" / "data").exists()


def test_spec_without_recipe_fails_before_any_stage_runs_weights(world, tmp_path):
    spec = job_spec(world, stages=["prepare", "check"])
    del spec["recipe"]
    rc, events, err = _run_job(tmp_path / "job", spec)
    assert rc == 1
    assert "`spec.recipe` must be an object" in events[-1]["message"]
