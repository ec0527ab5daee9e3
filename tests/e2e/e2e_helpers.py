"""Helpers for the end-to-end tests: the installed binaries on loopback, a tiny job, and moments in it.

The processes themselves are started by tests/launchers.py (`Coordinator`, `RunManager`; through the `procs`
fixture). Nothing is stubbed: the worker is `dflash-native-client` running `dflash_worker.job` on the tiny
world from `dflash_worker.testing.world`, or, where a launch says `warm=True`, the same job in a fork of the
pre-warmed interpreter (tests/warm_worker.py). Here: what to run (`pipeline_spec`, `run_one_job`), and how to
act at a moment of a job (stop or kill its worker at its first checkpoint).
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
from pathlib import Path

from launchers import COORDINATOR, NATIVE_CLIENT, RUN_MANAGER, Coordinator, RunManager, wait_until

# Training long enough that a kill after the first committed checkpoint
# (step 2) lands well before the last step, short enough to stay cheap.
STEPS = 16
CHECKPOINT_EVERY = 2

def missing_binaries() -> list[str]:
    return [str(p) for p in (RUN_MANAGER, NATIVE_CLIENT, COORDINATOR) if not os.access(p, os.X_OK)]


def client_version() -> str:
    """The native client's own version (what the coordinator compares)."""
    out = subprocess.run([str(NATIVE_CLIENT), "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    # `dflash-native-client 0.1.0 (commit ..., python 3.11)`
    return out.split()[1]


def sha256_file(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


def local_path(job_dir: Path, artifact: dict) -> Path:
    """Where the worker wrote an artifact: its name is its path relative to the job directory."""
    assert artifact["uri"].startswith("dflash-artifact://"), artifact
    return job_dir / artifact["name"]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    # A zombie still answers kill(0); it is dead for our purposes.
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def cmdline(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return []


def is_checkpoint_report(v: dict) -> bool:
    return v.get("message") == "artifact reported" and v.get("kind") == "checkpoint"


def worker_process(pid: int, job_dir: Path) -> int:
    """The process to signal for the worker `pid` (as the run-manager reports it) of `job_dir`, after checking
    that `pid` is that worker: the native client itself, or the job a warm stand-in runs (tests/warm_worker.py)."""
    from warm_worker import is_stand_in, serving_pid

    argv = cmdline(pid)
    assert argv and str(job_dir) in argv and (Path(argv[0]).name == NATIVE_CLIENT.name or is_stand_in(argv)), (
        f"pid {pid} is not the worker of `{job_dir}`: {argv}"
    )
    return serving_pid(pid, argv)


def kill_worker(pid: int, job_dir: Path) -> None:
    """SIGKILL the worker `pid` of `job_dir` (`worker_process`) and wait until it is gone."""
    target = worker_process(pid, job_dir)
    os.kill(target, signal.SIGKILL)
    wait_until(lambda: not pid_alive(target), timeout=30, what=f"worker {target} to die")


def resume_worker(pid: int, job_dir: Path) -> None:
    """SIGCONT the worker `pid` of `job_dir` that `stop_at_first_checkpoint` stopped."""
    os.kill(worker_process(pid, job_dir), signal.SIGCONT)


def is_checkpoint_queued(v: dict) -> bool:
    """The run-manager has the worker's checkpoint event (its upload is queued, not yet done)."""
    return v.get("message") == "artifact verified; queued for upload" and v.get("kind") == "checkpoint"


def stop_at_first_checkpoint(rm: RunManager, pid: int, job_dir: Path) -> int:
    """SIGSTOP the worker `pid` once `rm` has its first checkpoint event; the newest committed step.

    The checkpoint's report comes later (after its files are uploaded, which on a loaded box
    can outlast the rest of training), so a test that waited for the report before acting
    could find training over. Freezing the worker when the run-manager queues the upload
    leaves the remaining steps for the test to act in. (Freezing it when the directory appears
    on disk is too early: the worker may not have sent the event yet, and no report would come.)
    `resume_worker(pid, job_dir)` lets it go on.
    """
    rm.wait_for("a checkpoint event", is_checkpoint_queued)
    os.kill(worker_process(pid, job_dir), signal.SIGSTOP)
    root = job_dir / "run" / "checkpoints"
    return max(int(e.name[5:]) for e in os.scandir(root) if e.name.startswith("step-") and e.name[5:].isdigit())


def metrics_steps(run_dir: Path) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def pipeline_spec(world, *, stages: list[str] | None = None) -> dict:
    """The real pipeline on the tiny world, with a short evaluation."""
    from dflash_worker.testing.world import job_spec

    spec = job_spec(world, steps=STEPS, checkpoint_every=CHECKPOINT_EVERY, stages=stages)
    # Validate only at the last step, so the selected (exported) checkpoint is the
    # final one: an export hash then covers every step of training, not an early best.
    spec["recipe"]["train"]["val_every"] = STEPS
    # Two micro-batches per step and several capture shards, so that a job of two local ranks
    # divides both, and its export still equals one rank's byte for byte (test_e2e_ranks).
    spec["recipe"]["train"]["grad_accum"] = 2
    spec["recipe"]["capture"]["shard_examples"] = 4
    spec["recipe"]["evaluate"] = {"max_new_tokens": 8}
    spec["evaluate"] = {"split": "test", "max_prompts": 2}
    return spec


def run_one_job(
    procs, coord: Coordinator, work: Path, name: str, spec: dict, timeout: float = 600, *, warm: bool = False
) -> tuple[str, dict, RunManager]:
    """Run `name` of one job from `spec`, taken by one provider (`run-manager --max-jobs 1` in `work`):
    `(run_id, job as the coordinator shows it, run-manager)` once the job succeeded. The job runs in the native
    client, or with `warm=True` in a fork of the pre-warmed interpreter (`RunManager`)."""
    run_id = coord.create_run(name, spec, client_version=client_version())
    token = coord.provider_token(f"box-{name}")
    rm = procs.run_manager(work, "--coordinator", coord.address, "--token", token, "--max-jobs", "1", warm=warm)
    assert rm.wait(timeout=timeout) == 0, rm.text()
    (job,) = coord.show(run_id)["jobs"]
    assert job["state"] == "succeeded", json.dumps(job, indent=1)
    return run_id, job, rm


def export_model(job: dict) -> dict:
    """The job's registered `model.safetensors` export artifact."""
    arts = [a for a in job["artifacts"] if a["kind"] == "export" and a["name"].endswith("/model.safetensors")]
    assert len(arts) == 1, json.dumps(job, indent=1)
    return arts[0]
