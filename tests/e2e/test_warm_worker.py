"""The warm worker stand-in (tests/warm_worker.py) behaves as the worker process the run-manager expects: events
on its own stdout as they happen, the environment it was given and nothing else, its exit code, a SIGTERM
forwarded to the job (which checkpoints and stops), a SIGKILLed stand-in takes its job with it, a killed job
ends its stand-in by the same signal, and a module job (`module_command`) exits as `python -m` would."""

from __future__ import annotations

import json
import os
import select
import signal
import subprocess
import time
from pathlib import Path

from launchers import wait_until
from warm_worker import command, job_pid, module_command

from dflash_worker.worker.noop import noop_final_state


def _noop_job(root: Path, steps: int, step_seconds: float) -> Path:
    job = root / "job"
    job.mkdir()
    spec = {"schema_version": 1, "spec": {"stages": ["noop"], "noop": {"steps": steps, "step_seconds": step_seconds, "checkpoint_every": 2}}}
    (job / "spec.json").write_text(json.dumps(spec))
    return job


def _start(job: Path, **env: str) -> subprocess.Popen:
    argv = [*command().split(), "--job-dir", str(job)]
    return subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=job, env={"PATH": "/usr/bin:/bin", **env})


def _events(out: str) -> list[dict]:
    return [json.loads(line) for line in out.splitlines() if line.strip()]


def test_a_job_runs_with_its_own_environment_pipes_and_exit_code(tmp_path):
    job = _noop_job(tmp_path, steps=3, step_seconds=0)
    p = _start(job, DFLASH_PROBE="yes")
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, out + err
    events = _events(out)
    assert events[-1] == {"event": "done"}, events
    report = next(e for e in events if e["event"] == "artifact" and e["kind"] == "report")
    assert json.loads(Path(report["path"]).read_text())["state"] == noop_final_state(3)
    assert any(json.loads(line).get("logger", "").startswith("dflash_worker") for line in err.splitlines() if line.startswith("{")), err

    # A job that fails reports its error event and exits non-zero through the stand-in.
    bad = tmp_path / "bad"
    bad.mkdir()
    (bad / "spec.json").write_text("{not json")
    p = _start(bad)
    out, err = p.communicate(timeout=120)
    assert p.returncode != 0 and _events(out)[-1]["event"] == "error", (p.returncode, out, err)


def test_sigterm_reaches_the_job_which_checkpoints_and_stops(tmp_path):
    job = _noop_job(tmp_path, steps=400, step_seconds=0.05)
    p = _start(job)
    first = p.stdout.readline()  # live: the first event arrives while the job runs
    assert json.loads(first)["event"] in ("progress", "artifact"), first
    p.send_signal(signal.SIGTERM)
    out, err = p.communicate(timeout=120)
    assert p.returncode == 0, err
    assert _events(out)[-1]["event"] == "stopped", out
    assert not (job / "report.json").exists() or noop_final_state(400) not in (job / "report.json").read_text()


def test_a_sigkilled_stand_in_takes_its_job_with_it(tmp_path):
    job = _noop_job(tmp_path, steps=2000, step_seconds=0.05)  # 100 s: longer than the wait below
    p = _start(job)
    p.stdout.readline()
    root = job / "checkpoints"
    wait_until(lambda: root.is_dir() and any(e.name.startswith("step-") for e in os.scandir(root)), timeout=60, what="a checkpoint")
    p.kill()
    p.wait(30)
    # The job holds the stand-in's stdout as its own: the pipe ends (EOF) only once the job is gone too.
    fd, end = p.stdout.fileno(), time.monotonic() + 30
    while True:
        left = end - time.monotonic()
        assert left > 0, "the job still runs 30 s after its stand-in was SIGKILLed"
        if select.select([fd], [], [], left)[0] and os.read(fd, 1 << 16) == b"":
            break
    seen = sorted(e.name for e in os.scandir(root))
    time.sleep(1.0)  # 20 steps' time: a live job would have committed more
    assert sorted(e.name for e in os.scandir(root)) == seen


def test_a_sigkilled_job_ends_its_stand_in_as_killed_by_sigkill(tmp_path):
    # What the run-manager (and `Popen.returncode`) sees of a crash: killed by signal 9, not an exit code.
    # (The stand-in once failed to re-raise SIGKILL, whose disposition cannot be set, and exited 1.)
    job = _noop_job(tmp_path, steps=2000, step_seconds=0.05)
    p = _start(job)
    p.stdout.readline()
    os.kill(job_pid(p.pid), signal.SIGKILL)
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGKILL, p.returncode
    # Another signal whose default action kills (the job installs no SIGABRT handler): the same.
    (tmp_path / "again").mkdir()
    p = _start(_noop_job(tmp_path / "again", steps=2000, step_seconds=0.05))
    p.stdout.readline()
    os.kill(job_pid(p.pid), signal.SIGABRT)
    p.communicate(timeout=30)
    assert p.returncode == -signal.SIGABRT, p.returncode


def test_a_module_job_exits_as_python_m_would(tmp_path):
    # `module_command` runs `MODULE.main()` as `python -m MODULE` would end: a `main` that returns None exits 0
    # (torch.distributed.run's does), `sys.exit(N)` exits N, `sys.exit("text")` prints the text and exits 1.
    # (The job once exited 1 for the first: a torchrun through it failed after its ranks had succeeded.)
    script = tmp_path / "ends.py"
    script.write_text(
        "import sys\n\n\ndef main():\n"
        "    how = sys.argv[1]\n"
        "    print('ran', how, flush=True)\n"
        "    if how == 'code':\n        sys.exit(7)\n"
        "    if how == 'text':\n        sys.exit('refused: the reason')\n"
        "    if how == 'raise':\n        raise RuntimeError('an uncaught error')\n"
    )
    got = {}
    for how in ("none", "code", "text", "raise"):
        p = subprocess.run(module_command(str(script), how), capture_output=True, text=True, timeout=120)
        assert p.stdout == f"ran {how}\n", (how, p.stdout, p.stderr)
        got[how] = p.returncode, p.stderr
    assert got["none"] == (0, "")
    assert got["code"] == (7, "")
    assert got["text"] == (1, "refused: the reason\n")
    assert got["raise"][0] == 1 and "RuntimeError: an uncaught error" in got["raise"][1], got["raise"]
