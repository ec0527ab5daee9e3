"""A job of two local ranks through the real run-manager and coordinator: `run-manager --local
--cpu-ranks 2` starts two `dflash-native-client` processes (gloo on CPU, `torch.distributed`'s
standard environment), rank 1 is SIGKILLed after the first committed checkpoint, both ranks stop,
and the restarted pair finishes from that checkpoint.

Shown: the job succeeds in one attempt; every artifact is reported once (rank 0 alone reports);
both ranks' logs are relayed, tagged with their rank; every training step ran on two ranks;
and the capture shards and the export are byte-identical to the one-rank baseline's (two
micro-batches per step on two ranks add the same gradients in the same single addition).
"""

from __future__ import annotations

import json
import os
import re
import signal
from collections import Counter
from pathlib import Path

import pytest
from e2e_helpers import (
    STEPS,
    export_model,
    kill_worker,
    local_path,
    metrics_steps,
    pid_alive,
    sha256_file,
    stop_at_first_checkpoint,
)
from launchers import wait_until

pytestmark = pytest.mark.slow


def _rank_started(rank: int):
    return lambda v: str(v.get("message", "")).startswith(f"worker started: rank {rank} of 2")


def _shards(job_dir: Path) -> dict[str, str]:
    cap = job_dir / "capture"
    return {p.relative_to(cap).as_posix(): sha256_file(p) for p in sorted(cap.rglob("*.safetensors"))}


@pytest.mark.real_process("native_client")  # one native client per rank, one of them SIGKILLed
def test_a_two_rank_job_survives_a_sigkilled_rank_and_matches_one_rank(tmp_path, procs, spec, baseline):
    spec_file = tmp_path / "run.json"
    spec_file.write_text(json.dumps({"name": "two-ranks", "spec": spec, "max_local_ranks": 2}))
    work = tmp_path / "work"
    rm = procs.run_manager(work, "--local", "--json", "--spec", str(spec_file), "--cpu-ranks", "2")
    r0 = rm.wait_for("rank 0 to start", _rank_started(0))
    r1 = rm.wait_for("rank 1 to start", _rank_started(1))
    job_dir = (work / "jobs" / r0["job_id"]).resolve()
    pid0, pid1 = int(r0["pid"]), int(r1["pid"])

    # Rank 0 is frozen when its first checkpoint is reported to the run-manager; rank 1 waits for
    # it in the next step's collective and is SIGKILLed there.
    stopped = stop_at_first_checkpoint(rm, pid0, job_dir)
    assert stopped < STEPS, f"rank 0 was stopped at step {stopped}, after training"
    kill_worker(pid1, job_dir)
    # The run-manager takes rank 0 down too (it is frozen: only SIGKILL can end it).
    wait_until(lambda: not pid_alive(pid0), timeout=60, what=f"rank 0 (pid {pid0}) to be killed")

    rc = rm.wait()
    assert rc == 0, f"stdout:\n{rm.stdout}\nstderr:\n{rm.text()}"
    crash = rm.wait_for("the restart", lambda v: "restarting" in str(v.get("message", "")))
    assert "rank 1 of 2 killed by signal 9 (SIGKILL)" in crash["message"], crash
    m = re.search(r"restarting from checkpoint at step (\d+)", crash["message"])
    assert m and stopped <= int(m.group(1)) < STEPS, crash
    starts = rm.messages(lambda v: str(v.get("message", "")).startswith("worker started: rank"))
    assert [int(v["rank"]) for v in starts] == [0, 1, 0, 1], starts
    assert len({int(v["pid"]) for v in starts}) == 4

    summary = json.loads(rm.stdout)
    (job,) = summary["jobs"]
    assert job["state"] == "succeeded" and job["attempts"] == 1, json.dumps(summary, indent=1)
    # Every artifact once: on the coordinator and in the run-manager's reports.
    names = [a["name"] for a in job["artifacts"]]
    assert len(names) == len(set(names)), Counter(names).most_common(3)
    reported = Counter(v["artifact"] for v in rm.messages(lambda v: v.get("message") == "artifact reported"))
    assert reported and max(reported.values()) == 1, reported.most_common(3)
    assert set(names) <= set(reported)  # (the summary leaves out the files a checkpoint manifest lists)

    # Both ranks' own log lines were relayed, each tagged with its rank.
    for rank in (0, 1):
        lines = rm.messages(lambda v, r=rank: v.get("rank") == r and "stage `train` starting" in str(v.get("message", "")))
        assert lines and all(f"(rank {rank}/2)" in v["message"] for v in lines), rank

    # Every step once (the restart truncated what came after the checkpoint), each on two ranks.
    run = job_dir / "run"
    assert metrics_steps(run) == list(range(1, STEPS + 1))
    lines = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]
    assert {line["world_size"] for line in lines} == {2}
    manifest = json.loads((job_dir / "capture" / "manifest.json").read_text())
    assert manifest["run"]["ranks"] == 2

    base_job = (baseline.work / "jobs" / baseline.summary["jobs"][0]["job_id"]).resolve()
    shards = _shards(job_dir)
    assert len(shards) > 2 and shards == _shards(base_job), "the two-rank capture differs from one rank's"
    model = export_model(job)
    assert model["sha256"] == sha256_file(local_path(job_dir, model))
    assert model["sha256"] == baseline.export_sha256, "the two-rank export differs from the one-rank baseline's"
    # Nothing of either start is left running.
    for v in starts:
        pid = int(v["pid"])
        if pid_alive(pid):
            os.kill(pid, signal.SIGKILL)
            pytest.fail(f"rank {v['rank']} (pid {pid}) outlived the job")
