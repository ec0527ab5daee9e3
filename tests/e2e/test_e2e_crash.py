"""Crashes mid-training with the real pipeline: a SIGKILLed worker, a SIGKILLed run-manager (and its
worker, as a machine crash would), a SIGKILLed coordinator. Each time the job finishes from its last
committed checkpoint and its export is byte-identical to an uninterrupted run of the same spec."""

from __future__ import annotations

import json
import re
import shutil
import time
from pathlib import Path

import pytest
from e2e_helpers import (
    STEPS,
    client_version,
    export_model,
    is_checkpoint_report,
    kill_worker,
    local_path,
    metrics_steps,
    resume_worker,
    sha256_file,
    stop_at_first_checkpoint,
)
from launchers import wait_until

pytestmark = pytest.mark.slow


def _started(v: dict) -> bool:
    return str(v.get("message", "")).startswith("worker started")


def _resumed_step(v: dict) -> int | None:
    """The step in the trainer's `resumed from `...` at step N` log line, else None."""
    m = re.match(r"resumed from `.*` at step (\d+)$", str(v.get("message", "")))
    return int(m.group(1)) if m else None


def _checkpoint_step(v: dict) -> int:
    m = re.search(r"/step-(\d+)/", v["artifact"])
    assert m, v
    return int(m.group(1))


def _losses(run_dir: Path) -> list[float]:
    return [json.loads(line)["loss"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _check_same_as_baseline(job_dir: Path, registered: dict, baseline, first_step: int = 1) -> None:
    """The job's export (and every step's loss from `first_step` on) equals the uninterrupted run's.

    `metrics.jsonl` holds each step exactly once (a resume truncates lines past its
    checkpoint); a run seeded from another directory's checkpoint starts after it.
    """
    model = local_path(job_dir, registered)
    assert model == job_dir / "run" / "export" / "model.safetensors"
    assert registered["sha256"] == sha256_file(model)
    assert registered["sha256"] == baseline.export_sha256, "the resumed run's export differs from the uninterrupted run's"
    assert metrics_steps(job_dir / "run") == list(range(first_step, STEPS + 1))
    base_job = baseline.work / "jobs" / baseline.summary["jobs"][0]["job_id"]
    assert _losses(job_dir / "run") == _losses(base_job / "run")[first_step - 1 :]
    final = f"run/checkpoints/step-{STEPS:08d}/trainable.safetensors"
    assert sha256_file(job_dir / final) == sha256_file(base_job / final)


@pytest.mark.real_process("native_client")  # the native client SIGKILLed and restarted by the run-manager
def test_sigkilled_worker_is_restarted_and_resumes_to_an_identical_export(tmp_path, procs, spec, baseline):
    spec_file = tmp_path / "run.json"
    spec_file.write_text(json.dumps({"name": "worker-crash", "spec": spec}))
    work = tmp_path / "work"
    rm = procs.run_manager(work, "--local", "--json", "--spec", str(spec_file))
    started = rm.wait_for("the worker to start", _started)
    job_dir = (work / "jobs" / started["job_id"]).resolve()
    stopped = stop_at_first_checkpoint(rm, int(started["pid"]), job_dir)
    assert stopped < STEPS, f"the worker was stopped at step {stopped}, after training"
    first = rm.wait_for("a committed checkpoint", is_checkpoint_report)
    kill_worker(int(started["pid"]), job_dir)

    rc = rm.wait()
    assert rc == 0, f"stdout:\n{rm.stdout}\nstderr:\n{rm.text()}"
    crash = rm.wait_for("the restart", lambda v: "killed by signal 9 (SIGKILL)" in str(v.get("message", "")) and "restarting" in v["message"])
    m = re.search(r"restarting from checkpoint at step (\d+)", crash["message"])
    assert m, crash
    restart_step = int(m.group(1))
    # The kill landed after a committed checkpoint and before training ended.
    assert _checkpoint_step(first) <= restart_step < STEPS, crash
    # The second worker (same attempt) resumed training from a checkpoint, not from scratch.
    pids = rm.worker_pids()
    assert len(pids) == 2 and pids[0] == int(started["pid"]), pids
    resumed = [s for v in rm.messages() if (s := _resumed_step(v)) is not None]
    assert len(resumed) == 1 and restart_step <= resumed[0] < STEPS, resumed

    summary = json.loads(rm.stdout)
    (job,) = summary["jobs"]
    assert job["state"] == "succeeded" and job["attempts"] == 1, json.dumps(summary, indent=1)
    _check_same_as_baseline(job_dir, export_model(job), baseline)


def _provider(procs, tmp_path: Path, *, lease_ttl: float, spec: dict, warm: bool):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=lease_ttl, warm=warm)
    run_id = coord.create_run("crash-run", spec, client_version=client_version())
    token = coord.provider_token("box")
    return coord, run_id, token


# new-work-dir: the checkpoint's data fingerprint must not depend on where the job ran
# (it once hashed capture/manifest.json, which records absolute paths and timings, so a
# takeover in another directory refused to resume).
# other-machine: run-manager A's work directory is deleted after the crash and B runs with
# another HOME and work directory, sharing no path with A: the checkpoint can only come
# from the coordinator, downloaded by B and verified before the worker starts.
@pytest.mark.parametrize("takeover", ["same-work-dir", "new-work-dir", "other-machine"])
def test_sigkilled_run_manager_job_is_taken_over_after_the_lease_expires(tmp_path, procs, spec, baseline, takeover):
    coord, run_id, token = _provider(procs, tmp_path, lease_ttl=3, spec=spec, warm=True)
    work = tmp_path / "a" / "work"
    join = ("--coordinator", coord.address, "--token", token, "--max-jobs", "1")
    home_a, home_b = tmp_path / "a" / "home", tmp_path / "b" / "home"
    home_a.mkdir(parents=True)
    home_b.mkdir(parents=True)
    rm1 = procs.run_manager(work, *join, extra_env={"HOME": str(home_a)}, warm=True)
    started = rm1.wait_for("the worker to start", _started)
    job_id = started["job_id"]
    job_dir = (work / "jobs" / job_id).resolve()
    stopped = stop_at_first_checkpoint(rm1, int(started["pid"]), job_dir)
    assert stopped < STEPS, f"the worker was stopped at step {stopped}, after training"
    rm1.wait_for("a committed checkpoint", is_checkpoint_report)
    # A machine crash: the run-manager and its worker die together. (The run-manager
    # is frozen first so that it cannot see its worker die and restart it.)
    rm1.freeze()
    kill_worker(int(started["pid"]), job_dir)
    rm1.kill()
    assert not (job_dir / "run" / "selection.json").exists(), "training ended before the crash"
    if takeover == "other-machine":
        shutil.rmtree(tmp_path / "a")

    # The lease expires and the job is requeued with its last checkpoint.
    wait_until(lambda: coord.job_state(job_id) == "queued", timeout=60, interval=0.2, what="the lease to expire")
    ((number, state, message),) = coord.attempt_messages(job_id)
    assert (number, state) == (1, "expired") and "lease expired" in message

    # The provider restarts on the same work directory and takes the job over, or
    # (new-work-dir) a fresh install does, or (other-machine) one on another machine.
    work2 = work if takeover == "same-work-dir" else tmp_path / "b" / "work"
    job_dir2 = (work2 / "jobs" / job_id).resolve()
    rm2 = procs.run_manager(work2, *join, extra_env={"HOME": str(home_a if takeover == "same-work-dir" else home_b)}, warm=True)
    rc = rm2.wait()
    assert rc == 0, f"stdout:\n{rm2.stdout}\nstderr:\n{rm2.text()}"
    lease = rm2.wait_for("the lease", lambda v: v.get("message") == "lease acquired")
    assert lease["job_id"] == job_id and lease["attempt"] == 2, lease
    resuming = rm2.wait_for("the lease's resume checkpoint", lambda v: str(v.get("message", "")).startswith("resuming from"))
    assert resuming["step"] >= 2 and str(job_dir2) in resuming["message"], resuming
    refused = [v["message"] for v in rm2.messages() if "cannot resume" in str(v.get("message", ""))]
    assert not refused, refused
    resumed = [(v.get("attempt"), s) for v in rm2.messages() if (s := _resumed_step(v)) is not None]
    assert len(resumed) == 1 and resumed[0][0] == 2 and resuming["step"] <= resumed[0][1] < STEPS, (resumed, rm2.text())
    if takeover != "same-work-dir":
        # The checkpoint was copied in (hash-verified) and training went on from it.
        assert any(str(v.get("message", "")).startswith("seeded run from resume checkpoint") for v in rm2.messages()), rm2.text()
    if takeover == "other-machine":
        assert not (tmp_path / "a").exists()

    shown = coord.show(run_id)
    (job,) = shown["jobs"]
    assert job["state"] == "succeeded" and job["attempts"] == 2, json.dumps(shown, indent=1)
    _check_same_as_baseline(job_dir2, export_model(job), baseline, first_step=1 if takeover == "same-work-dir" else resumed[0][1] + 1)
    # The run admin fetches the export from the coordinator: the same bytes as the undisturbed run's.
    got = coord.fetch(run_id, "run/export/model.safetensors", tmp_path / "admin" / "model.safetensors")
    assert sha256_file(got) == baseline.export_sha256


@pytest.mark.real_process("coordinator")
def test_coordinator_killed_and_restarted_mid_training_the_job_completes(tmp_path, procs, spec, baseline):
    # A TTL longer than the outage: the same lease survives the restart. The coordinator is the console
    # script itself (not `warm=True`), SIGKILLed and started again on the same port and database.
    coord, run_id, token = _provider(procs, tmp_path, lease_ttl=30, spec=spec, warm=False)
    work = tmp_path / "work"
    rm = procs.run_manager(work, "--coordinator", coord.address, "--token", token, "--max-jobs", "1", warm=True)
    started = rm.wait_for("the worker to start", _started)
    job_dir = (work / "jobs" / started["job_id"]).resolve()
    worker = int(started["pid"])
    stopped = stop_at_first_checkpoint(rm, worker, job_dir)
    assert stopped < STEPS, f"the worker was stopped at step {stopped}, after training"
    first = rm.wait_for("a committed checkpoint", is_checkpoint_report)
    port = coord.port
    coord.kill()
    assert not (job_dir / "run" / "selection.json").exists(), "training ended before the coordinator was killed"
    resume_worker(worker, job_dir)
    # While it is down the worker trains on and the run-manager's calls fail UNAVAILABLE.
    down_from = len(rm.messages())
    rm.wait_for("a failed coordinator call", lambda v: "unavailable" in str(v.get("message", "")).lower() or "heartbeat stream" in str(v.get("message", "")), start=down_from)
    time.sleep(0.5)
    coord.start(port)
    assert coord.port == port

    rc = rm.wait()
    assert rc == 0, f"stdout:\n{rm.stdout}\nstderr:\n{rm.text()}"
    assert len(rm.worker_pids()) == 1, "the worker must not have been restarted"
    assert first["job_id"] == started["job_id"]
    shown = coord.show(run_id)
    (job,) = shown["jobs"]
    assert job["state"] == "succeeded" and job["attempts"] == 1, json.dumps(shown, indent=1)
    # Artifacts written while the coordinator was down were reported after it came back.
    names = {a["name"] for a in job["artifacts"]}
    assert f"run/checkpoints/step-{STEPS:08d}/manifest.json" in names, sorted(names)
    _check_same_as_baseline(job_dir, export_model(job), baseline)
