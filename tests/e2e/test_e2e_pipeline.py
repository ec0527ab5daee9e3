"""A real training job end to end: `run-manager --local` runs prepare, check, capture, train and evaluate
through the native client; the export it registers with the coordinator is the file on disk, byte for byte."""

from __future__ import annotations

import json

import pytest
from e2e_helpers import STEPS, export_model, local_path, sha256_file

pytestmark = pytest.mark.slow


def test_real_pipeline_job_registers_its_export_with_a_matching_sha256(procs, baseline):
    job = baseline.summary["jobs"][0]
    assert job["state"] == "succeeded" and job["attempts"] == 1, json.dumps(baseline.summary, indent=1)
    job_dir = (baseline.work / "jobs" / job["job_id"]).resolve()

    # Read the record back from the coordinator's own database, through the admin
    # CLI of a coordinator started on it after `--local` stopped the embedded one.
    coord = procs.coordinator(baseline.work / "coordinator", lease_ttl=30, warm=True)
    shown = coord.show(baseline.summary["run_id"])
    (rjob,) = shown["jobs"]
    assert rjob["job_id"] == job["job_id"] and rjob["state"] == "succeeded", json.dumps(shown, indent=1)

    model = export_model(rjob)
    path = local_path(job_dir, model)
    assert path == job_dir / "run" / "export" / "model.safetensors"
    assert model["sha256"] == sha256_file(path) == baseline.export_sha256
    assert int(model["size_bytes"]) == path.stat().st_size
    assert rjob["export"]["sha256"] == model["sha256"]
    # The regression gate read the real evaluation report the job uploaded and decided from its figures:
    # published unless the trained draft regressed against the released one on `test` (tolerance 0.02).
    report = json.loads((job_dir / "eval" / "report.json").read_text())
    pub = rjob["publication"]
    assert pub["split"] == report["split"] == "test" and pub["tolerance"] == 0.02, pub
    assert pub["tau_trained"] == report["trained"]["tau_pooled"] and pub["tau_released"] == report["baseline"]["tau_pooled"], (pub, report)
    assert pub["verdict"] == report["verdict"] and pub["published"] is (report["verdict"] != "regressed"), (pub, report["verdict"])
    if not pub["published"]:
        coord.cli("runs", "publish", baseline.summary["run_id"], "--override", "--note", "e2e: the tiny world's draft regressed")
    # The run admin fetches the export from the coordinator: the same bytes.
    got = coord.fetch(baseline.summary["run_id"], model["name"], baseline.work.parent / "fetched" / "model.safetensors")
    assert sha256_file(got) == baseline.export_sha256
    # Every record's bytes are in the coordinator's blob store (uploaded, not a path on the
    # provider's disk), and no record points at deleted bytes: checkpoint rotation drops
    # the records of old checkpoints before their blobs.
    kinds: dict[str, set[str]] = {}
    everything = coord.cli_json("artifacts", "list", baseline.summary["run_id"], "--all-attempts")
    for row in everything:
        a = row["artifact"]
        blob = coord.blob_path(a["sha256"])
        assert blob.is_file() and blob.stat().st_size == int(a["size_bytes"]), a
        assert sha256_file(blob) == a["sha256"], a
    for a in rjob["artifacts"]:
        p = local_path(job_dir, a)
        if a["kind"] not in ("checkpoint", "checkpoint_file") or p.exists():
            assert sha256_file(p) == a["sha256"], a
        kinds.setdefault(a["kind"], set()).add(a["name"])
    # Only the newest checkpoints are kept (serve --keep-checkpoints, default 2), each with its files.
    assert len(kinds["checkpoint"]) <= 2, sorted(kinds["checkpoint"])
    for m in kinds["checkpoint"]:
        files = json.loads(coord.blob_path(next(a["sha256"] for a in rjob["artifacts"] if a["name"] == m)).read_text())["files"]
        assert {f"{m.rpartition('/')[0]}/{f}" for f in files} <= kinds["checkpoint_file"], (m, sorted(kinds["checkpoint_file"]))
    assert {"run/export/config.json", "run/export/manifest.json", "run/export/model.safetensors"} <= kinds["export"]
    assert {"eval/report.json"} <= kinds["report"]
    assert "data/manifest.json" in kinds["manifest"] and "capture/manifest.json" in kinds["capture"]
    # A checkpoint is reported as its manifest.json, one artifact per checkpoint; the manifest
    # hashes the checkpoint's files.
    final = f"run/checkpoints/step-{STEPS:08d}/manifest.json"
    assert final in kinds["checkpoint"] and (job_dir / final).is_file(), sorted(kinds["checkpoint"])
    assert all(n.endswith("/manifest.json") for n in kinds["checkpoint"]), sorted(kinds["checkpoint"])
    listed = json.loads((job_dir / final).read_text())["files"]["trainable.safetensors"]
    assert listed["sha256"] == sha256_file(job_dir / final.replace("manifest.json", "trainable.safetensors"))
    selection = json.loads((job_dir / "run" / "selection.json").read_text())
    assert selection["step"] == STEPS, selection

    # The export's manifest names the weights file by the same hash.
    manifest = json.loads((job_dir / "run" / "export" / "manifest.json").read_text())
    assert model["sha256"] in json.dumps(manifest), manifest
    report = json.loads((job_dir / "eval" / "report.json").read_text())
    assert report["prompts"] == 2, report
