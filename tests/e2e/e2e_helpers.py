"""Helpers for the end-to-end tests: the installed binaries as real processes on loopback.

`Coordinator` runs `dflash-coordinator serve` (SQLite, 127.0.0.1) and drives
the admin CLI against it; `RunManager` runs `run-manager` and collects its
JSON log lines on a thread, so a test can wait for a moment in the job (a
committed checkpoint) and act then (SIGKILL a process). Nothing is stubbed:
the worker is `dflash-native-client` running `dflash_worker.job` on the tiny
world from `dflash_worker.testing.world`.
"""

from __future__ import annotations

import hashlib
import json
import os
import secrets
import selectors
import signal
import subprocess
import threading
import time
from pathlib import Path

from prewarmed import coordinator_cli

REPO = Path(__file__).resolve().parents[2]
VENV = REPO / ".venv"
BIN = VENV / "bin"
RUN_MANAGER = BIN / "run-manager"
NATIVE_CLIENT = BIN / "dflash-native-client"
COORDINATOR = BIN / "dflash-coordinator"

# Training long enough that a kill after the first committed checkpoint
# (step 2) lands well before the last step, short enough to stay cheap.
STEPS = 16
CHECKPOINT_EVERY = 2

# Every wait in these tests is bounded; generous because the box is shared.
WAIT_S = 120.0


def missing_binaries() -> list[str]:
    return [str(p) for p in (RUN_MANAGER, NATIVE_CLIENT, COORDINATOR) if not os.access(p, os.X_OK)]


def client_version() -> str:
    """The native client's own version (what the coordinator compares)."""
    out = subprocess.run([str(NATIVE_CLIENT), "--version"], capture_output=True, text=True, check=True, timeout=60).stdout
    # `dflash-native-client 0.1.0 (commit ..., python 3.11)`
    return out.split()[1]


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any DFLASH_* setting (a developer's shell must not leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(VIRTUAL_ENV=str(VENV), NO_COLOR="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


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


def wait_until(pred, timeout: float = WAIT_S, interval: float = 0.05, what: str = "condition"):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class Coordinator:
    """`dflash-coordinator serve` on 127.0.0.1 with its own SQLite file; admin CLI calls against it.

    `serve_args` are extra `serve` flags (e.g. `--tls-cert`/`--tls-key`); a coordinator serving TLS gets
    an `https://` address. `info` is its "listening" line. `warm=True` (the default) serves from a fork of the
    pre-warmed interpreter (`warm_worker.module_command`: the console script's `main`, ~1.5 CPU-s less per
    start); `warm=False` starts the console script itself. `pid` is the serving process's either way.
    """

    def __init__(
        self,
        workdir: Path,
        *,
        lease_ttl: float,
        admin_token: str | None = None,
        serve_args: tuple[str, ...] = (),
        warm: bool = True,
    ):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.db = workdir / "coordinator.db"
        self.lease_ttl = lease_ttl
        self.admin_token = admin_token or secrets.token_hex(16)
        self.serve_args = tuple(serve_args)
        self.warm = warm
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.info: dict = {}
        self.starts = 0

    def start(self, port: int = 0) -> Coordinator:
        """Start (or restart, on the same database and, given `port`, the same port)."""
        self.starts += 1
        self.stderr_path = self.workdir / f"serve-{self.starts}.log"
        args = [
            "serve", "--db", str(self.db), "--listen", f"127.0.0.1:{port}",
            "--lease-ttl", str(self.lease_ttl), "--max-wait", "2",
            *self.serve_args,
        ]  # fmt: skip
        from warm_worker import enabled, module_command

        args = module_command("dflash_worker.coordinator.cli", *args) if self.warm and enabled() else [str(COORDINATOR), *args]
        # The admin token travels in the environment, not on the command line.
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, stderr=open(self.stderr_path, "wb"), env=clean_env(DFLASH_ADMIN_TOKEN=self.admin_token)
        )
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=60):
            self.proc.kill()
            raise AssertionError(f"coordinator did not start: {self.stderr_path.read_text()}")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise AssertionError(f"coordinator exited {self.proc.returncode}: {self.stderr_path.read_text()}")
        self.info = json.loads(line)
        self.address = ("https://" if self.info.get("tls") else "") + self.info["address"]
        return self

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    @property
    def pid(self) -> int:
        """The serving process: the warm job (not its stand-in, `self.proc`), or the console script's."""
        from warm_worker import serving_pid

        return serving_pid(self.proc.pid, self.proc.args)

    def kill(self) -> None:
        """SIGKILL to the serving process: no graceful shutdown, as a crash would (a warm one's stand-in then
        exits as killed by the same signal)."""
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> None:
        """SIGTERM (a warm stand-in forwards it), then SIGKILL after 15 s."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """One admin CLI call, as a run admin would type it (`dflash-coordinator ARGS` in a process forked from
        a pre-warmed interpreter, tests/prewarmed.py)."""
        p = coordinator_cli(*args, "--server", self.address, timeout=120, env=clean_env(DFLASH_ADMIN_TOKEN=self.admin_token))
        if check and p.returncode != 0:
            raise AssertionError(f"`dflash-coordinator {' '.join(args)}` exited {p.returncode}:\n{p.stderr}")
        return p

    def cli_json(self, *args: str):
        return json.loads(self.cli(*args, "--json").stdout)

    def create_run(self, name: str, spec: dict, *extra: str, client_version: str) -> str:
        out = self.cli_json("runs", "create", "--name", name, "--spec-json", json.dumps(spec), "--client-version", client_version, *extra)
        return out["run_id"]

    def fetch(self, run_id: str, name: str, dest: Path) -> Path:
        """`artifacts get` as an admin would run it; returns `dest` (sha256-verified by the CLI)."""
        self.cli("artifacts", "get", run_id, name, "-o", str(dest))
        return dest

    def blob_path(self, sha256: str) -> Path:
        """Where the local blob store keeps a blob (`artifacts/sha256/ab/ab12...` next to the database)."""
        from dflash_worker.coordinator.artifacts.blobs import blob_key

        return self.workdir / "artifacts" / blob_key(sha256)

    def provider_token(self, name: str) -> str:
        return self.cli_json("providers", "create", name)["token"]

    def show(self, run_id: str) -> dict:
        return self.cli_json("runs", "show", run_id)

    def _query(self, sql: str, *params) -> list[tuple]:
        """Read the coordinator's database directly (read-only; cheaper than a CLI call when polling)."""
        import sqlite3

        con = sqlite3.connect(f"file:{self.db}?mode=ro", uri=True, timeout=10)
        try:
            return con.execute(sql, params).fetchall()
        finally:
            con.close()

    def attempt_messages(self, job_id: str) -> list[tuple[int, str, str]]:
        """(number, state, message) of a job's attempts."""
        return self._query("SELECT number, state, message FROM attempts WHERE job_id=? ORDER BY number", job_id)

    def job_state(self, job_id: str) -> str:
        ((state,),) = self._query("SELECT state FROM jobs WHERE job_id=?", job_id)
        return state


class RunManager:
    """`run-manager` as a child process; stderr JSON lines collected as they come."""

    def __init__(
        self,
        work_dir: Path,
        *args: str,
        heartbeat: float = 0.3,
        extra_env: dict[str, str] | None = None,
        native_client: bool = True,
        warm: bool = False,
    ):
        """`extra_env` joins the clean environment (e.g. credentials a test wants the run-manager to hold);
        `native_client=False` leaves out `--native-client` (Docker launch mode refuses it); `warm=True` runs
        each job in a fork of a pre-warmed interpreter instead of the native client (tests/warm_worker.py), unless
        `DFLASH_TEST_WARM_WORKERS=0` (every test then runs the native client)."""
        self.work_dir = work_dir
        from warm_worker import command, enabled

        if warm and enabled():
            native = ["--worker-cmd", command()]
        else:
            native = ["--native-client", str(NATIVE_CLIENT)] if native_client else []
        cmd = [
            str(RUN_MANAGER), "--work-dir", str(work_dir), *native,
            "--device", "cpu", "--log-format", "json", "--heartbeat-interval", str(heartbeat),
            "--restart-backoff-ms", "100", "--rpc-backoff-ms", "100", "--rpc-backoff-max-ms", "500",
            "--rpc-retries", "60", "--poll-wait", "2", *args,
        ]  # fmt: skip
        self.cmd = cmd
        self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=clean_env(**(extra_env or {})))
        self.lines: list[str] = []
        self.logs: list[dict] = []
        self.stdout = ""
        self._cv = threading.Condition()
        self._err = threading.Thread(target=self._read_stderr, daemon=True)
        self._out = threading.Thread(target=self._read_stdout, daemon=True)
        self._err.start()
        self._out.start()

    def _read_stderr(self) -> None:
        for raw in self.proc.stderr:
            line = raw.decode(errors="replace").rstrip("\n")
            try:
                v = json.loads(line)
            except ValueError:
                v = None
            with self._cv:
                self.lines.append(line)
                if isinstance(v, dict):
                    self.logs.append(v)
                self._cv.notify_all()

    def _read_stdout(self) -> None:
        self.stdout = self.proc.stdout.read().decode(errors="replace")

    def wait_for(self, what: str, pred, timeout: float = WAIT_S, start: int = 0) -> dict:
        """The first JSON log line (from index `start`) for which `pred` holds."""
        end = time.monotonic() + timeout
        i = start
        with self._cv:
            while True:
                while i < len(self.logs):
                    if pred(self.logs[i]):
                        return self.logs[i]
                    i += 1
                left = end - time.monotonic()
                if left <= 0 or (self.proc.poll() is not None and not self._err.is_alive() and i >= len(self.logs)):
                    raise AssertionError(f"no log line for {what} (exit {self.proc.poll()}):\n{self.text()}")
                self._cv.wait(min(left, 0.2))

    def wait(self, timeout: float = WAIT_S) -> int:
        try:
            rc = self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)
            raise AssertionError(f"run-manager did not finish within {timeout:.0f}s:\n{self.text()}") from None
        self._err.join(10)
        self._out.join(10)
        return rc

    def freeze(self) -> None:
        """SIGSTOP: the run-manager cannot react to anything (its worker dying) until killed."""
        self.proc.send_signal(signal.SIGSTOP)

    def kill(self) -> None:
        self.proc.send_signal(signal.SIGKILL)
        self.proc.wait(30)
        self._err.join(10)
        self._out.join(10)

    def text(self) -> str:
        with self._cv:
            return "\n".join(self.lines)

    def messages(self, pred=lambda v: True) -> list[dict]:
        with self._cv:
            return [v for v in self.logs if pred(v)]

    def worker_pids(self) -> list[int]:
        return [int(v["pid"]) for v in self.messages(lambda v: str(v.get("message", "")).startswith("worker started"))]


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
    procs, coord: Coordinator, work: Path, name: str, spec: dict, timeout: float = 600, *, warm: bool = True
) -> tuple[str, dict, RunManager]:
    """Run `name` of one job from `spec`, taken by one provider (`run-manager --max-jobs 1` in `work`):
    `(run_id, job as the coordinator shows it, run-manager)` once the job succeeded. `warm=False` runs the
    job in the native client instead of a fork of a pre-warmed interpreter (`RunManager`)."""
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
