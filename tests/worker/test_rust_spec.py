"""The worker reads a `spec.json` that the Rust run-manager wrote (`JobSpecFile`, run-manager/src/worker/jobdir.rs)
and applies its `device` and `downgrades`.

The file comes from the real Rust serializer: a cargo unit test writes it when
`DFLASH_SPEC_FIXTURE_OUT` names a path (the coordinator never leases a job whose features a
provider lacks, so no end-to-end run produces a downgrade). The worker then runs a real stage
(capture on the tiny world) under that file and records the downgrade in its manifest.
"""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest
from prewarmed import run_main

from dflash_worker.worker.spec import JobSpec

ROOT = Path(__file__).resolve().parents[2]
FIXTURE_TEST = "worker::jobdir::tests::writes_fixture_spec_json_for_python"


@pytest.fixture(scope="module")
def rust_spec(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("rust") / "spec.json"
    env = {**os.environ, "DFLASH_SPEC_FIXTURE_OUT": str(out)}
    env.setdefault("CARGO_TARGET_DIR", str(Path.home() / ".cache/dflash-worker/cargo-target"))
    p = subprocess.run(
        ["cargo", "test", "--locked", "-q", "-p", "run-manager", "--lib", FIXTURE_TEST, "--", "--exact"],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=1200,
    )  # fmt: skip
    assert p.returncode == 0, p.stdout + p.stderr
    return json.loads(out.read_text())


def test_the_rust_file_round_trips_field_for_field(rust_spec):
    spec = JobSpec.from_json(rust_spec, job_dir=Path(rust_spec["job_dir"]).resolve())
    assert spec.to_json() == rust_spec
    # every field the Rust side writes is one JobSpec knows (no field left behind)
    assert set(rust_spec) == spec.present and len(spec.present) == 12
    assert spec.downgrades and spec.device is not None and spec.lease is not None
    # a graph lease's job: kind, shard and the inputs at their local paths
    g = spec.graph
    assert g is not None and (g.kind, g.shard_index, g.shard_count) == ("capture", 1, 3)
    (inp,) = g.inputs
    assert inp.name == "data/train.jsonl" and inp.path == spec.job_dir / "data" / "train.jsonl" and inp.size_bytes == 77


@pytest.mark.slow
def test_the_worker_applies_device_and_downgrades_and_records_them(rust_spec, tmp_path):
    from dflash_worker.testing.world import build_world, job_spec

    world = build_world(tmp_path / "world")
    job = tmp_path / "job"
    job.mkdir()
    spec = job_spec(world, stages=["prepare", "check", "capture"])
    spec["recipe"]["capture"]["device"] = "auto"
    doc = {**rust_spec, "spec": spec, "job_dir": str(job.resolve()), "resume_checkpoint": None, "resume_step": 0}
    del doc["graph"]  # the whole pipeline's capture, with its manifest
    doc["downgrades"] = [{"feature": "torch_compile", "replacement": "eager", "reason": "`torch_compile` needs CUDA; this provider runs `cpu`"}]
    (job / "spec.json").write_text(json.dumps(doc))
    p = run_main("dflash_worker.job", ["--job-dir", job], timeout=600)
    assert p.returncode == 0, p.stderr
    events = [json.loads(line) for line in p.stdout.splitlines()]
    assert events[-1] == {"event": "done"}
    device = json.loads((job / "capture" / "manifest.json").read_text())["device"]
    assert device["device"] == "cpu" and device["device_requested"] == "auto"
    assert "`auto` pinned to the provider's backend `cpu`" in device["notes"]
    assert any(n.startswith("downgrade `torch_compile` -> `eager`") and "needs CUDA" in n for n in device["notes"]), device
    logs = [json.loads(line)["message"] for line in p.stderr.splitlines() if line.startswith("{")]
    assert any(m.startswith("downgrade `torch_compile` -> `eager`") for m in logs), logs

    # A backend the provider does not run is refused before anything is written.
    job2 = tmp_path / "job2"
    job2.mkdir()
    spec["recipe"]["capture"]["device"] = "cuda"
    (job2 / "spec.json").write_text(json.dumps({**doc, "spec": spec, "job_dir": str(job2.resolve())}))
    p = run_main("dflash_worker.job", ["--job-dir", job2], timeout=600)
    last = json.loads(p.stdout.splitlines()[-1])
    assert p.returncode == 1 and last["event"] == "error" and "`[capture].device` is `cuda` but this provider runs" in last["message"]
    assert not (job2 / "capture").exists()
