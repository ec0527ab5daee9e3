"""The processes tests start on loopback: the coordinator and the run-manager, and `wait_until`.

`Coordinator` serves `dflash-coordinator serve` on 127.0.0.1 with its own SQLite file, and talks to it as an
admin would: the gRPC `AdminClient` (`admin()`), the admin CLI (`cli()`), or its database read-only.
`RunManager` runs `run-manager` and collects its JSON log lines on a thread, so a test can wait for a moment
in the job (a committed checkpoint) and act then (SIGKILL a process). The coordinator tests reach them
through the `start_coordinator` fixture (tests/coordinator/conftest.py), the end-to-end tests through
`procs` (tests/e2e/conftest.py).

Warm stand-ins are opt-in, the same way for every launcher: a launch runs the real thing (the console
script `dflash-coordinator`; the run-manager's worker in `dflash-native-client`) unless its call says
`warm=True`, which serves it from a fork of the pre-warmed interpreter instead (tests/warm_worker.py; ~1.5
CPU-s less per start). A test that must run the real one says so with `@pytest.mark.real_process(KIND)`,
and the two are checked against each other at every launch (`warm_worker.choose`).
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import subprocess
import threading
import time
from pathlib import Path

from prewarmed import coordinator_cli
from warm_worker import choose

REPO = Path(__file__).resolve().parents[1]
VENV = REPO / ".venv"
BIN = VENV / "bin"
RUN_MANAGER = BIN / "run-manager"
NATIVE_CLIENT = BIN / "dflash-native-client"
COORDINATOR = BIN / "dflash-coordinator"

# Every wait in these tests is bounded; generous because the box is shared.
WAIT_S = 120.0


def clean_env(**extra: str) -> dict[str, str]:
    """This environment without any DFLASH_* setting (a developer's shell must not leak in)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("DFLASH_")}
    env.update(VIRTUAL_ENV=str(VENV), NO_COLOR="1", PYTHONUNBUFFERED="1")
    env.update(extra)
    return env


def wait_until(pred, timeout: float = WAIT_S, interval: float = 0.05, what: str = "condition"):
    """`pred()`'s first true value, polled every `interval` seconds; `AssertionError` naming `what` after `timeout`."""
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        v = pred()
        if v:
            return v
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")


class Coordinator:
    """`dflash-coordinator serve` on 127.0.0.1 with its own SQLite file in `workdir`; `start()` starts it.

    `serve_args` are extra `serve` flags (e.g. `--tls-cert`/`--tls-key`); `tls` is the `ClientTls` the admin
    client then needs. The server makes (or keeps, across restarts on the same database) its admin token file;
    `admin_token` is read from it. `info` is its "listening" line; `address` is `HOST:PORT` (a gRPC target),
    `url` the address a client is given (`https://HOST:PORT` when serving TLS). `warm=True` serves from a fork
    of the pre-warmed interpreter (`warm_worker.module_command`: the console script's `main`); else the console
    script itself runs. `pid` is the serving process's either way (a warm one's `proc` is its stand-in, which
    forwards SIGTERM and exits as the server did).
    """

    def __init__(self, workdir: Path, *, lease_ttl: float = 30.0, serve_args: tuple[str, ...] = (), tls=None, warm: bool = False):
        self.workdir = workdir
        workdir.mkdir(parents=True, exist_ok=True)
        self.db = workdir / "coordinator.db"
        self.lease_ttl = lease_ttl
        self.serve_args = tuple(serve_args)
        self.tls = tls
        self.warm = warm
        self.proc: subprocess.Popen | None = None
        self.address = ""
        self.admin_token = ""
        self.info: dict = {}

    def start(self, port: int = 0) -> Coordinator:
        """Start (or restart, on the same database and, given `port`, the same port); `RuntimeError` with the
        server's stderr if it does not come up."""
        args = [
            "serve", "--db", str(self.db), "--listen", f"127.0.0.1:{port}",
            "--lease-ttl", str(self.lease_ttl), "--max-wait", "2",
            *self.serve_args,
        ]  # fmt: skip
        if choose(self.warm, "coordinator"):
            from warm_worker import module_command

            cmd = module_command("dflash_worker.coordinator.cli", *args)
        else:
            cmd = [str(COORDINATOR), *args]
        self.stderr_path = self.workdir / f"stderr-{time.monotonic_ns()}.log"
        with open(self.stderr_path, "wb") as stderr:
            self.proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, env=clean_env())
        sel = selectors.DefaultSelector()
        sel.register(self.proc.stdout, selectors.EVENT_READ)
        if not sel.select(timeout=60):
            self.proc.kill()
            raise RuntimeError(f"coordinator did not start: {self.stderr_path.read_text()}")
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(10)
            raise RuntimeError(f"coordinator exited {self.proc.returncode}: {self.stderr_path.read_text()}")
        self.info = json.loads(line)
        self.address = self.info["address"]
        self.admin_token = Path(self.info["admin_token_file"]).read_text().strip()
        return self

    @property
    def url(self) -> str:
        """The address as a client names it: `https://HOST:PORT` when serving TLS."""
        return f"https://{self.address}" if self.info.get("tls") else self.address

    @property
    def port(self) -> int:
        return int(self.address.rpartition(":")[2])

    @property
    def pid(self) -> int:
        """The serving process: the warm job (not its stand-in, `self.proc`), or the console script's."""
        from warm_worker import serving_pid

        return serving_pid(self.proc.pid, self.proc.args)

    def kill(self) -> None:
        """SIGKILL to the serving process: no cleanup, no graceful shutdown, as a crash would (a warm one's
        stand-in then exits as killed by the same signal)."""
        os.kill(self.pid, signal.SIGKILL)
        self.proc.wait(30)

    def stop(self) -> int | None:
        """SIGTERM (a warm stand-in forwards it), then SIGKILL after 15 s; the exit status (None if never started)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(15)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return None if self.proc is None else self.proc.returncode

    def admin(self):
        """An `AdminClient` (gRPC) for this coordinator, as a context manager."""
        from dflash_worker.coordinator.client import AdminClient

        return AdminClient(self.url, self.admin_token, timeout=10, tls=self.tls)

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess:
        """One admin CLI call, as a run admin would type it (`dflash-coordinator ARGS` in a process forked from
        a pre-warmed interpreter, tests/prewarmed.py)."""
        p = coordinator_cli(*args, "--server", self.url, timeout=120, env=clean_env(DFLASH_ADMIN_TOKEN=self.admin_token))
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
        if (warm or native_client) and choose(warm, "native_client"):
            from warm_worker import command

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
