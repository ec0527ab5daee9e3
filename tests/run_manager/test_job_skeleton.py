"""The stage-runner skeleton (`dflash_worker.job`) speaks the worker event protocol.

Runs `python -m dflash_worker.job` as a real child process (the run-manager's
Rust integration tests run it through the native client); checks the event
lines, the artifacts' bytes and hashes, resume, SIGTERM and bad input.
"""

from __future__ import annotations

import hashlib
import json
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from dflash_worker.worker.noop import noop_final_state


def write_spec(job_dir: Path, spec: dict, **extra) -> None:
    job_dir.mkdir(parents=True, exist_ok=True)
    doc = {"schema_version": 1, "spec": spec, "restart": 0, "resume_checkpoint": None, **extra}
    (job_dir / "spec.json").write_text(json.dumps(doc))


def run_job(job_dir: Path, timeout: float = 60) -> tuple[int, list[dict], str]:
    p = subprocess.run(
        [sys.executable, "-m", "dflash_worker.job", "--job-dir", str(job_dir)],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    events = [json.loads(line) for line in p.stdout.splitlines() if line.strip()]
    return p.returncode, events, p.stderr


def noop(steps: int, every: int = 2, step_seconds: float = 0.0) -> dict:
    return {"stages": ["noop"], "noop": {"steps": steps, "checkpoint_every": every, "step_seconds": step_seconds}}


def test_noop_emits_progress_checkpoints_report_and_done(tmp_path):
    rc, events, stderr = run_job(_prepare(tmp_path, noop(5)))
    assert rc == 0, stderr
    assert events[0] == {"event": "progress", "phase": "starting", "step": 0, "total_steps": 0}
    assert events[-1] == {"event": "done"}
    train = [e for e in events if e["event"] == "progress" and e["phase"] == "train"]
    assert [e["step"] for e in train] == [1, 2, 3, 4, 5]
    assert [e["committed_step"] for e in train] == [0, 2, 2, 4, 4]
    arts = [e for e in events if e["event"] == "artifact"]
    assert [(a["kind"], a["step"]) for a in arts] == [("checkpoint", 2), ("checkpoint", 4), ("report", 5)]
    for a in arts:
        data = Path(a["path"]).read_bytes()
        assert hashlib.sha256(data).hexdigest() == a["sha256"]
        assert len(data) == a["size_bytes"]
        assert Path(a["path"]).is_relative_to(tmp_path / "job")
    report = json.loads(Path(arts[-1]["path"]).read_text())
    assert report["state"] == noop_final_state(5)
    # Logs are JSON lines on stderr.
    logs = [json.loads(line) for line in stderr.splitlines()]
    assert any(entry["message"] == "stage `noop` starting" and entry["level"] == "info" for entry in logs)


def _prepare(tmp_path: Path, spec: dict, **extra) -> Path:
    job = tmp_path / "job"
    write_spec(job, spec, **extra)
    return job


def test_a_sigterm_during_a_steps_progress_event_is_served_with_a_checkpoint(tmp_path):
    """The signal lands after the step's commit decision (here: while its progress event is written):
    the stop waits for the next step boundary and commits it, never stopping at an uncommitted step."""
    from dflash_worker.worker.context import StageContext, Stopped
    from dflash_worker.worker.noop import run_noop
    from dflash_worker.worker.placement import Placement
    from dflash_worker.worker.spec import JobSpec

    spec = JobSpec.load(_prepare(tmp_path, noop(400, every=1000)))
    events = []

    def emit(e):
        events.append(e)
        if getattr(e, "phase", None) == "train" and e.step == 1:
            ctx.stop_requested = True  # what `on_term` does, at this exact moment

    ctx = StageContext(spec=spec, placement=Placement.from_spec(spec), emit=emit)
    with pytest.raises(Stopped) as stop:
        run_noop(ctx)
    checkpoints = [e.step for e in events if getattr(e, "kind", None) == "checkpoint"]
    assert checkpoints == [2] and stop.value.committed_step == 2, (checkpoints, stop.value.committed_step)


def test_resume_from_checkpoint_reaches_the_same_state(tmp_path):
    job = _prepare(tmp_path, noop(6, every=2))
    rc, events, _ = run_job(job)
    assert rc == 0
    ck = next(e for e in events if e["event"] == "artifact" and e["step"] == 4)
    full = json.loads((job / "export/noop-report.json").read_text())

    job2 = tmp_path / "job2"
    write_spec(job2, noop(6, every=2), resume_checkpoint=ck["path"], restart=1)
    rc, events2, stderr = run_job(job2)
    assert rc == 0, stderr
    steps = [e["step"] for e in events2 if e["event"] == "progress" and e["phase"] == "train"]
    assert steps == [5, 6]
    resumed = json.loads((job2 / "export/noop-report.json").read_text())
    assert resumed["state"] == full["state"] == noop_final_state(6)
    assert resumed["resumed_from"] == 4


def test_sigterm_commits_a_checkpoint_and_stops(tmp_path):
    job = _prepare(tmp_path, noop(400, every=1000, step_seconds=0.02))
    p = subprocess.Popen(
        [sys.executable, "-m", "dflash_worker.job", "--job-dir", str(job)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        # Wait for the event, not the clock: SIGTERM goes only once a train step has been reported
        # (the handler is installed by then), however long a loaded machine takes to get there.
        events = []
        while not (events and events[-1].get("phase") == "train" and events[-1].get("step", 0) >= 1):
            line = p.stdout.readline()
            assert line, f"the job ended before its first train step: {events}\n{p.stderr.read()}"
            events.append(json.loads(line))
        p.send_signal(signal.SIGTERM)
        out, _ = p.communicate(timeout=120)
    finally:
        p.kill()
    events += [json.loads(line) for line in out.splitlines()]
    assert p.returncode == 0
    stopped = events[-1]
    assert stopped["event"] == "stopped"
    ck = [e for e in events if e["event"] == "artifact" and e["kind"] == "checkpoint"]
    assert len(ck) == 1 and ck[0]["step"] == stopped["committed_step"] < 400
    assert not any(e["event"] == "done" for e in events)


@pytest.mark.parametrize(
    ("spec", "extra", "needle"),
    [
        ({"stages": ["launch"]}, {}, "unknown stage"),
        ({"stages": []}, {}, "non-empty list"),
        (noop(-1), {}, "spec.noop.steps"),
        ({"stages": ["noop"], "noop": {"steps": True}}, {}, "spec.noop.steps"),
        (noop(3), {"schema_version": 99}, "schema_version"),
    ],
)
def test_bad_input_is_a_non_retryable_error_event(tmp_path, spec, extra, needle):
    job = tmp_path / "job"
    write_spec(job, spec)
    if extra:
        doc = json.loads((job / "spec.json").read_text())
        doc.update(extra)
        (job / "spec.json").write_text(json.dumps(doc))
    rc, events, stderr = run_job(job)
    assert rc == 1, stderr
    assert events[-1]["event"] == "error" and events[-1]["retryable"] is False
    assert needle in events[-1]["message"]


@pytest.mark.parametrize("content", [b"", b"{", b"\xff\xfe", b"[]", b'{"spec": 3}'])
def test_corrupt_spec_json_is_reported_not_a_traceback(tmp_path, content):
    job = tmp_path / "job"
    job.mkdir()
    (job / "spec.json").write_bytes(content)
    rc, events, stderr = run_job(job)
    assert rc == 1
    assert events[-1]["event"] == "error" and events[-1]["retryable"] is False
    assert "Traceback" not in stderr


@pytest.mark.parametrize(
    "content",
    [None, b'{"step": "x"}', b"not json", json.dumps({"format": "dflash-worker-noop-checkpoint/1", "step": 2**62, "state": "0" * 64}).encode()],
)
def test_an_unusable_resume_checkpoint_is_skipped_with_a_warning(tmp_path, content):
    """Issue 34: a resume checkpoint may be another attempt's bytes (a missing file, garbage, a manifest
    claiming step 2**62): it is skipped with a warning and the job starts from the beginning, never fails."""
    bad = tmp_path / "bad.json"
    if content is not None:
        bad.write_bytes(content)
    job = tmp_path / "job"
    write_spec(job, noop(3), resume_checkpoint=str(bad))
    rc, events, stderr = run_job(job)
    assert rc == 0, stderr
    assert f"skipped resume checkpoint `{bad}`" in stderr and "noop starts from step 0" in stderr, stderr
    report = json.loads((job / "export/noop-report.json").read_text())
    assert report["state"] == noop_final_state(3) and report["resumed_from"] == 0


def test_an_unusable_resume_checkpoint_falls_back_to_the_newest_older_one(tmp_path):
    job = _prepare(tmp_path, noop(6, every=2))
    rc, events, _ = run_job(job)
    assert rc == 0
    # The job directory keeps its own checkpoints 2, 4, 6; the lease names a lying one.
    bad = tmp_path / "lying" / "manifest.json"
    bad.parent.mkdir()
    bad.write_text(json.dumps({"format": "dflash-worker-noop-checkpoint/1", "step": 2**62, "state": "0" * 64}))
    (job / "checkpoints" / "step-000006").rename(job / "checkpoints" / ".gone")
    write_spec(job, noop(6, every=2), resume_checkpoint=str(bad), restart=1)
    rc, events, stderr = run_job(job)
    assert rc == 0, stderr
    assert [e["step"] for e in events if e["event"] == "progress" and e["phase"] == "train"] == [5, 6]
    report = json.loads((job / "export/noop-report.json").read_text())
    assert report["state"] == noop_final_state(6) and report["resumed_from"] == 4
