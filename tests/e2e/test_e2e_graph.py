"""A run divided over providers (issue 18): three run-managers on loopback, each with its own work
directory and HOME (no shared path), take the jobs of one job graph (prepare -> capture x 3 ->
train -> evaluate) from a real coordinator. Every byte a job needs from an earlier one travels
through the coordinator's artifact store. The capture the train job assembles equals the one-job
capture of the same spec (capture key and every shard's sha256), and the export equals the
uninterrupted `run-manager --local` run's, also when a capture provider dies mid-job (a machine
crash: run-manager and worker SIGKILLed) and its job is re-leased to another provider."""

from __future__ import annotations

import json
import re
import shutil
from pathlib import Path

import pytest
from e2e_helpers import client_version, kill_worker, sha256_file
from launchers import wait_until

pytestmark = pytest.mark.slow

N_CAPTURE = 3


def _capture_identity(capture_dir: Path) -> tuple:
    m = json.loads((capture_dir / "manifest.json").read_text())
    return m["capture_key"], [(s["file"], s["sha256"], s["first"], s["end"]) for s in m["shards"]], m["totals"]


def _graph_run(procs, tmp_path, spec, *, lease_ttl: float):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=lease_ttl, warm=True)
    run_id = coord.create_run("graph", spec, "--capture-shards", str(N_CAPTURE), client_version=client_version())
    return coord, run_id


def _provider(procs, coord, root: Path, name: str):
    """A provider on its own 'machine': work directory and HOME of its own; its jobs run in forks of a
    pre-warmed interpreter (tests/warm_worker.py; a killed one included: e2e_helpers.kill_worker)."""
    home = root / name / "home"
    home.mkdir(parents=True)
    token = coord.provider_token(name)
    return procs.run_manager(root / name / "work", "--coordinator", coord.address, "--token", token, "--name", name,
                             extra_env={"HOME": str(home)}, warm=True)


def _kinds(coord, run_id: str) -> dict[str, tuple[str, int]]:
    return {j: (k, i) for j, k, i in coord._query("SELECT job_id, kind, shard_index FROM jobs WHERE run_id=?", run_id)}


def _run_state(coord, run_id: str) -> str:
    """`succeeded` once every job has, `failed` once the run records a failure, else `running`."""
    ((failure,),) = coord._query("SELECT failure FROM runs WHERE run_id=?", run_id)
    states = {s for (s,) in coord._query("SELECT state FROM jobs WHERE run_id=?", run_id)}
    return "failed" if failure else "succeeded" if states == {"succeeded"} else "running"


def _job_dir(rms, job_id: str) -> Path:
    """The job directory of the provider whose attempt succeeded (it holds the job's outputs)."""
    for rm in rms:
        d = (rm.work_dir / "jobs" / job_id).resolve()
        done = rm.messages(lambda v: v.get("job_id") == job_id and v.get("message") == "attempt finished" and v.get("job_state") == "succeeded")
        if d.is_dir() and done:
            return d
    raise AssertionError(f"no provider finished job {job_id}")


def _finish(coord, run_id: str, rms) -> dict:
    wait_until(lambda: _run_state(coord, run_id) != "running", timeout=900, interval=0.5,
               what="the graph run to end")
    shown = coord.show(run_id)
    assert _run_state(coord, run_id) == "succeeded", json.dumps(shown, indent=1) + "\n".join(rm.text()[-4000:] for rm in rms)
    return shown


def _check_same_as_one_job(coord, run_id: str, rms, baseline, tmp_path: Path) -> None:
    kinds = _kinds(coord, run_id)
    (train_id,) = [j for j, (k, _) in kinds.items() if k == "train"]
    train_dir = _job_dir(rms, train_id)
    base_job = baseline.work / "jobs" / baseline.summary["jobs"][0]["job_id"]
    assert _capture_identity(train_dir / "capture") == _capture_identity(base_job / "capture")
    assert sha256_file(train_dir / "run" / "export" / "model.safetensors") == baseline.export_sha256
    # Each capture job uploaded exactly its shards; the union is every shard once.
    owned = []
    for job_id, (kind, index) in kinds.items():
        if kind != "capture":
            continue
        names = [r["artifact"]["name"] for r in coord.cli_json("artifacts", "list", run_id, "--job", job_id)]
        shards = sorted({int(Path(n).name[6:11]) for n in names if n.startswith("capture/shard-")})
        assert shards and all(k % N_CAPTURE == index for k in shards), (index, names)
        owned += shards
    assert sorted(owned) == list(range(len(owned)))
    # The run admin fetches the run's export in one command (it lies in the train job): the same bytes.
    out = tmp_path / "admin" / "export"
    coord.cli("artifacts", "get", run_id, "--export", "-o", str(out))
    (got,) = out.rglob("model.safetensors")
    assert sha256_file(got) == baseline.export_sha256


def test_three_providers_run_one_graph_with_the_one_job_results(tmp_path, procs, spec, baseline):
    coord, run_id = _graph_run(procs, tmp_path, spec, lease_ttl=10)
    rms = [_provider(procs, coord, tmp_path, f"p{i}") for i in range(3)]
    shown = _finish(coord, run_id, rms)
    jobs = shown["jobs"]
    assert [j["kind"] for j in jobs] == ["prepare"] + ["capture"] * N_CAPTURE + ["train", "evaluate"]
    assert all(j["state"] == "succeeded" and j["attempts"] == 1 for j in jobs), json.dumps(jobs, indent=1)
    # More than one provider did the work, and no provider shares a path with another.
    ran = {rm.work_dir for rm in rms if any("worker started" in str(v.get("message", "")) for v in rm.messages())}
    assert len(ran) >= 2, "the graph ran on one provider only"
    _check_same_as_one_job(coord, run_id, rms, baseline, tmp_path)


def test_a_capture_provider_killed_midway_its_job_is_re_leased_and_the_export_is_unchanged(tmp_path, procs, spec, baseline):
    """Capture shard 0 of 3 owns two of the capture's shards (0 and 3). Its provider dies once the first
    one is uploaded: the job is re-leased to another provider, which is handed that shard (the lost
    attempt's records: the run trusts any provider's, `trust_inputs = "any"`), keeps it after verifying
    it, captures the rest, and the export is unchanged."""
    coord, run_id = _graph_run(procs, tmp_path, {**spec, "trust_inputs": "any"}, lease_ttl=3)
    rms = [_provider(procs, coord, tmp_path, f"p{i}") for i in range(3)]
    kinds = _kinds(coord, run_id)
    (job_id,) = [j for j, kind in kinds.items() if kind == ("capture", 0)]

    def capture_start():
        for rm in rms:
            for v in rm.messages(lambda v: v.get("job_id") == job_id and str(v.get("message", "")).startswith("worker started")):
                return rm, v
        return None

    wait_until(lambda: capture_start() is not None, timeout=300, interval=0.1, what="capture shard 0's worker to start")
    victim, started = capture_start()
    sidecar = "capture/shard-00000.json"  # reported after its shard file: both are uploaded once this is
    victim.wait_for("the first shard's upload", lambda v: v.get("message") == "artifact reported" and v.get("artifact") == sidecar)
    # A machine crash: the run-manager is frozen so it sends nothing more, then it and its worker are killed.
    victim.freeze()
    kill_worker(int(started["pid"]), (victim.work_dir / "jobs" / job_id).resolve())
    victim.kill()
    shutil.rmtree(victim.work_dir.parent)  # the machine is gone with its disk
    survivors = [rm for rm in rms if rm is not victim]
    shown = _finish(coord, run_id, survivors)
    attempts = coord.attempt_messages(job_id)
    assert [s for _, s, _ in attempts] == ["expired", "succeeded"], attempts
    assert "lease expired" in attempts[0][2]
    (job,) = [j for j in shown["jobs"] if j["job_id"] == job_id]
    assert job["state"] == "succeeded" and job["attempts"] == 2
    # the second attempt downloaded the lost one's shard and kept it
    logs = [v for rm in survivors for v in rm.messages(lambda v: v.get("job_id") == job_id)]
    assert any(v.get("message") == "input downloaded" and v.get("input") == sidecar for v in logs), logs[-20:]
    assert any(re.search(r"\(([1-9]\d*) shards reused\)", str(v.get("message", ""))) for v in logs), [v.get("message") for v in logs]
    _check_same_as_one_job(coord, run_id, survivors, baseline, tmp_path)


def test_an_online_graph_run_ships_token_ids_only(tmp_path, procs, spec):
    """Issue 36: `--capture-shards 2` with `[train].features = "online"`: each capture job uploads
    token-id shards (a few bytes per token, no hidden states); the train job computes the features."""
    spec = json.loads(json.dumps(spec))
    spec["recipe"]["train"]["features"] = "online"
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, warm=True)
    run_id = coord.create_run("online-graph", spec, "--capture-shards", "2", client_version=client_version())
    rms = [_provider(procs, coord, tmp_path, f"p{i}") for i in range(2)]
    shown = _finish(coord, run_id, rms)
    assert [j["kind"] for j in shown["jobs"]] == ["prepare", "capture", "capture", "train", "evaluate"]
    kinds = _kinds(coord, run_id)
    (train_id,) = [j for j, (k, _) in kinds.items() if k == "train"]
    manifest = json.loads((_job_dir(rms, train_id) / "capture" / "manifest.json").read_text())
    assert manifest["features"] == "online"
    totals = manifest["totals"]
    assert 0 < totals["payload_bytes"] / totals["tokens"] <= 16, totals  # issue 36's disk goal
    for job_id, (kind, _) in kinds.items():
        if kind == "capture":
            names = [r["artifact"]["name"] for r in coord.cli_json("artifacts", "list", run_id, "--job", job_id)]
            assert any(n.startswith("capture/shard-") for n in names), names
    out = tmp_path / "admin" / "export"
    coord.cli("artifacts", "get", run_id, "--export", "-o", str(out))
    assert list(out.rglob("model.safetensors"))
