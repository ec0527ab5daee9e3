"""A run-manager worker forked from a pre-warmed interpreter: `run-manager --worker-cmd "$(warm_worker.command())"`.

Every job a run-manager starts is a fresh process that imports torch and transformers' model modules before
it reads its spec: about 6 of the ~9 CPU-seconds a tiny-world job costs here, and the end-to-end tests start
a few hundred. `WarmWorkers` is a server, forked once per pytest worker from `prewarmed`'s fork server (those
modules already imported), that forks one child per job; the run-manager's worker command is this file run
as a script (stdlib only, `python -S`: ~20 ms), a stand-in that

- sends its argv, cwd and environment, and its stdin, stdout and stderr themselves (`SCM_RIGHTS`), to the
  server, which forks a child that takes those descriptors as 0/1/2, that cwd and exactly that environment,
  and runs `dflash_worker.job.main(argv)` (or, given `-m MODULE ARGS`, `MODULE.main(ARGS)`: `torchrun()` runs
  the launcher so, `--no-python` with this stand-in as every rank's command): the events and logs reach the
  run-manager live, on its own pipes;
- forwards SIGTERM, SIGINT, SIGUSR1, SIGUSR2, SIGHUP and SIGQUIT to the child (the run-manager's stop and
  checkpoint requests), and exits as the child did: its exit code, or killed by the same signal;
- when it dies itself (the run-manager SIGKILLs the worker's process group), the server sees its socket
  close and SIGKILLs the child.

What differs from the native client: the interpreter is not the embedded CPython of `dflash-native-client`
and modules are imported before the job's environment is set (what is read at import time comes from the fork
server's environment), and the run-manager counts a `--worker-cmd` as its own version instead of probing the
client's. The tests that stop or kill a warm job signal the job, not its stand-in (whose pid the run-manager
reports): `job_pid()`, through `serving_pid` and `e2e_helpers.worker_process`.

Which tests run warm: one rule, `choose()`, for every launcher (tests/launchers.py: `Coordinator`, `RunManager`,
and what is built on them: the `start_coordinator` and `procs` fixtures, `e2e_helpers.run_one_job`). A launch
is a warm stand-in only when its call says `warm=True` (and `DFLASH_TEST_WARM_WORKERS` is not `0`, which makes
every launch real); without it the real process runs. A test that must run the real thing says which with
`@pytest.mark.real_process(KIND)`, KIND one of `REAL_KINDS`: `"native_client"` (the run-manager's worker in
`dflash-native-client`: the tests that signal, stop or inspect the worker process, check the worker's
environment or argv, enforce client versions, run TLS, ranks or the pipeline against it) or `"coordinator"`
(the console script `dflash-coordinator serve`: the crash test that SIGKILLs it, the database lock that names
its pid). tests/conftest.py tells this module which test is running and its marker, and `choose()` holds the
two together at every launch, failing the test with `RealProcessError`:

- a test marked `real_process(KIND)` that starts KIND as a warm stand-in (a `warm=True` would silently test
  the stand-in instead of the real process);
- a test that starts KIND as a real process without the marker (a forgotten `warm=True` would silently cost
  the suite its speed, and a reader could not tell that the test runs the real thing).

Both are checked at the launch, where the choice is made, not by watching processes afterwards: the check is
exact and costs nothing. Launches from module- or session-scoped fixtures are not checked (the `baseline` of
tests/e2e: one uninterrupted native run that tests of both kinds compare with; its docstring says why it is
real), nor are launches outside a test. tests/test_launchers.py shows each check failing.
"""

from __future__ import annotations

import array
import json
import os
import signal
import socket
import struct
import sys

FORWARDED = ("SIGTERM", "SIGINT", "SIGUSR1", "SIGUSR2", "SIGHUP", "SIGQUIT")
_HEADER = struct.Struct("!I")


# ---- the stand-in (the run-manager's worker command): stdlib only, started with `python -S` ---------------


def _client(path: str, argv: list[str]) -> None:
    module = "dflash_worker.job"
    if argv[:1] == ["-m"] and len(argv) > 1:  # `-m MODULE ARGS`: another `main(argv)`, as `python -m MODULE ARGS`
        module, argv = argv[1], argv[2:]  # (or `-m SCRIPT.py ARGS`, as `python SCRIPT.py ARGS`)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    payload = json.dumps({"module": module, "argv": argv, "cwd": os.getcwd(), "env": dict(os.environ)}).encode("utf-8")
    data = _HEADER.pack(len(payload)) + payload
    sent = conn.sendmsg([data], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", [0, 1, 2]))])
    conn.sendall(data[sent:])
    replies = conn.makefile("rb")
    first = replies.readline().split()
    if len(first) != 2 or first[0] != b"pid":
        sys.stderr.write(f"warm_worker: the server did not start the job ({first!r})\n")
        sys.exit(125)
    pid = int(first[1])
    # For the tests that signal the worker whose pid the run-manager reports (this stand-in's): `job_pid()`.
    with open(os.path.join(os.path.dirname(path), f"job-{os.getpid()}"), "w") as f:
        f.write(f"{pid}\n")

    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for name in FORWARDED:
        signal.signal(getattr(signal, name), forward)
    last = replies.readline().split()
    if len(last) == 2 and last[0] == b"exit":
        sys.exit(int(last[1]))
    if len(last) == 2 and last[0] == b"signal":
        sig = int(last[1])
        if sig != signal.SIGKILL:  # (SIGKILL's disposition cannot be set: it is always the default)
            signal.signal(sig, signal.SIG_DFL)
        os.kill(os.getpid(), sig)
    sys.stderr.write(f"warm_worker: lost the server before the job ended ({last!r})\n")
    sys.exit(125)


# ---- the server (forked from the pre-warmed fork server) --------------------------------------------------


def _recv_request(conn: socket.socket) -> tuple[dict, list[int]]:
    fds = array.array("i")
    msg, anc, _flags, _addr = conn.recvmsg(1 << 16, socket.CMSG_LEN(3 * fds.itemsize))
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - (len(data) % fds.itemsize)])
    while len(msg) < _HEADER.size:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the stand-in closed before its request")
        msg += more
    (size,) = _HEADER.unpack_from(msg)
    while len(msg) < _HEADER.size + size:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the stand-in closed mid-request")
        msg += more
    return json.loads(msg[_HEADER.size : _HEADER.size + size]), list(fds)


def _run_job(req: dict, fds: list[int], close: list) -> None:
    """In the forked child: become the job's process and run `MODULE.main(argv)`; never returns."""
    code = 1
    try:
        for s in close:
            s.close()
        for sig in range(1, signal.NSIG):  # as a fresh interpreter starts (Python's own SIGINT and SIGPIPE)
            if sig in (signal.SIGKILL, signal.SIGSTOP):
                continue
            try:
                signal.signal(sig, signal.SIG_DFL)
            except (OSError, ValueError):
                pass
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.signal(signal.SIGPIPE, signal.SIG_IGN)
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        import io

        sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
        sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", line_buffering=True, write_through=True)
        sys.stderr = io.TextIOWrapper(
            io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace", line_buffering=True, write_through=True
        )
        os.chdir(req["cwd"])
        os.environ.clear()
        os.environ.update(req["env"])
        if req["env"].get("OMP_NUM_THREADS", "").isdigit():
            import torch

            torch.set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
        from prewarmed import load_main  # a module, or a script's path (`-m bench/load.py`)

        main = load_main(req["module"], req["argv"])
        try:
            code = main()
        except SystemExit as exc:
            code = exc.code
        except BaseException:  # the interpreter's own report of an uncaught exception
            import traceback

            traceback.print_exc()
            code = 1
        if code is not None and not isinstance(code, int):  # as `sys.exit("message")`: printed, exit 1
            print(code, file=sys.stderr)
            code = 1
        code = code or 0  # a `main()` that returns None (torch.distributed.run's) exits 0, as `python -m` would
    finally:
        try:
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code if isinstance(code, int) else 1)


def _serve(path: str) -> None:
    """Accept stand-ins on `path`; fork a job per request; report each job's end; kill a job whose stand-in died.

    Single-threaded on purpose: a process with other threads must not fork (their locks stay held in the child)."""
    import selectors

    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    jobs: dict[int, socket.socket] = {}  # child pid -> its stand-in's connection
    by_conn: dict[socket.socket, int] = {}

    def stop(_signum, _frame):
        for pid in jobs:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        os._exit(0)

    signal.signal(signal.SIGTERM, stop)
    parent = os.getppid()
    while True:
        if os.getppid() != parent:  # the fork server is gone (its pytest worker died without stopping this one)
            stop(None, None)
        for key, _ in sel.select(timeout=0.05):
            sock = key.fileobj
            if sock is listener:
                conn, _ = listener.accept()
                try:
                    req, fds = _recv_request(conn)
                except (OSError, EOFError, ValueError) as exc:
                    sys.stderr.write(f"warm_worker: bad request: {exc}\n")
                    conn.close()
                    continue
                pid = os.fork()
                if pid == 0:
                    _run_job(req, fds, [listener, *by_conn, conn])
                for fd in fds:  # only the job holds the run-manager's pipes now: their EOF is the job's exit
                    os.close(fd)
                jobs[pid] = conn
                by_conn[conn] = pid
                try:
                    conn.sendall(f"pid {pid}\n".encode())
                except OSError:
                    os.kill(pid, signal.SIGKILL)
                sel.register(conn, selectors.EVENT_READ)
            else:  # a stand-in sends nothing after its request: readable means it is gone
                pid = by_conn.get(sock)
                try:
                    gone = sock.recv(1) == b""
                except OSError:
                    gone = True
                if gone:
                    sel.unregister(sock)
                    if pid is not None and pid in jobs:
                        try:
                            os.kill(pid, signal.SIGKILL)
                        except ProcessLookupError:
                            pass
        while jobs:
            try:
                pid, status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                break
            if pid == 0:
                break
            conn = jobs.pop(pid, None)
            if conn is None:
                continue
            by_conn.pop(conn, None)
            reply = f"signal {os.WTERMSIG(status)}\n" if os.WIFSIGNALED(status) else f"exit {os.waitstatus_to_exitcode(status)}\n"
            try:
                conn.sendall(reply.encode())
            except OSError:
                pass
            try:
                sel.unregister(conn)
            except (KeyError, ValueError):
                pass
            conn.close()


class WarmWorkers:
    """The server of this pytest worker, started on first use; `command()` is the `--worker-cmd` line."""

    _instance: WarmWorkers | None = None

    def __init__(self):
        import tempfile
        import time

        from prewarmed import _context

        self._dir = tempfile.mkdtemp(prefix="ww-")  # a short path: Unix socket names are limited to ~100 bytes
        self.socket_path = os.path.join(self._dir, "s")
        import atexit
        import shutil

        atexit.register(shutil.rmtree, self._dir, True)
        self.proc = _context().Process(target=_serve, args=(self.socket_path,), daemon=True)
        self.proc.start()
        end = time.monotonic() + 120
        while not os.path.exists(self.socket_path):
            if not self.proc.is_alive() or time.monotonic() > end:
                raise RuntimeError(f"the warm worker server did not start (exit {self.proc.exitcode})")
            time.sleep(0.02)

    @classmethod
    def get(cls) -> WarmWorkers:
        if cls._instance is None or not cls._instance.proc.is_alive():
            cls._instance = cls()
        return cls._instance

    def command(self) -> str:
        """The worker command line (the run-manager splits it on whitespace: no path here may hold a space)."""
        line = f"{sys.executable} -S {os.path.abspath(__file__)} {self.socket_path}"
        assert len(line.split()) == 4, f"a path with a space: {line}"
        return line


def is_stand_in(argv: list[str]) -> bool:
    """Whether a process's argv is this file run as a stand-in."""
    return len(argv) > 2 and argv[2] == os.path.abspath(__file__)


def job_pid(stand_in: int, timeout: float = 60.0) -> int:
    """The pid of the job that the stand-in `stand_in` runs (the run-manager reports the stand-in's pid as the
    worker's; a test that stops or kills the worker signals the job), by this pytest worker's server. Waits for
    the stand-in to record it (it does once the server has forked the job, which may already be running)."""
    import time

    inst = WarmWorkers._instance
    assert inst is not None, "no warm worker server in this process"
    end = time.monotonic() + timeout
    while True:
        try:
            with open(os.path.join(inst._dir, f"job-{stand_in}")) as f:
                return int(f.read())
        except (FileNotFoundError, ValueError):  # not yet written, or written halfway
            if time.monotonic() > end:
                raise
            time.sleep(0.01)


def serving_pid(pid: int, argv) -> int:
    """The process doing the work of the process `pid` started with `argv`: the job it runs when it is a stand-in
    (`command()`, `module_command()`), else `pid` itself (what a test signals to stop or kill it)."""
    return job_pid(pid) if is_stand_in([str(a) for a in argv]) else pid


def enabled() -> bool:
    """Whether a `warm=True` launch runs warm (`DFLASH_TEST_WARM_WORKERS=0`: never; every launch is then real)."""
    return os.environ.get("DFLASH_TEST_WARM_WORKERS", "1") != "0"


# ---- the rule: warm stand-ins on `warm=True` only, `real_process(KIND)` on the tests that need the real one ---

REAL_KINDS = {
    "native_client": "the native client (the run-manager's worker, `dflash-native-client`)",
    "coordinator": "the coordinator (`dflash-coordinator serve`)",
}


class RealProcessError(AssertionError):
    """A launch disagrees with the running test's `real_process` marker."""


_running: tuple[str, frozenset[str]] | None = None  # the test being set up or run: node id, kinds its marker names
_shared_setups = 0  # > 0 while a module- or session-scoped fixture is being set up


def marker_problem(marks: list[tuple]) -> str | None:
    """What is wrong with a test's `real_process` markers (each given as its args), or None."""
    for args in marks:
        if not args or any(a not in REAL_KINDS for a in args):
            return f"`real_process` takes one or more of {', '.join(f'`{k}`' for k in REAL_KINDS)}, got `{args}`"
    return None


def enter_test(nodeid: str, marks: list[tuple]) -> None:
    """tests/conftest.py: `nodeid` is being set up and run; `marks` are its `real_process` markers' args."""
    global _running
    _running = (nodeid, frozenset(a for args in marks for a in args))


def leave_test() -> None:
    global _running
    _running = None


def enter_shared_fixture() -> None:
    """tests/conftest.py: a module- or session-scoped fixture is being set up (its launches are not checked)."""
    global _shared_setups
    _shared_setups += 1


def leave_shared_fixture() -> None:
    global _shared_setups
    _shared_setups -= 1


def choose(warm: bool, kind: str) -> bool:
    """Whether a launcher starts `kind` (a key of `REAL_KINDS`) as a warm stand-in: when its call says `warm=True`
    and `enabled()`. Raises `RealProcessError` when that disagrees with the running test's `real_process` marker."""
    what = REAL_KINDS[kind]
    use = warm and enabled()
    if _running is None or _shared_setups or not enabled():
        return use
    nodeid, kinds = _running
    if use and kind in kinds:
        raise RealProcessError(
            f"test `{nodeid}` is marked `real_process(\"{kind}\")` but starts {what} as a warm stand-in (`warm=True`)"
            "\nhint: drop `warm=True` from that launch: the marker says this test must run the real process"
        )
    if not use and kind not in kinds:
        raise RealProcessError(
            f"test `{nodeid}` starts {what} as a real process but is not marked `real_process(\"{kind}\")`"
            f"\nhint: pass `warm=True` to the launcher, or mark the test `@pytest.mark.real_process(\"{kind}\")` if it must run the real one"
        )
    return use


def command() -> str:
    """`run-manager --worker-cmd` for a job in a warm fork."""
    return WarmWorkers.get().command()


def module_command(module: str, *argv: str) -> list[str]:
    """`python -m MODULE ARGV` as a warm job: the stand-in's command line (a process to Popen, signal and wait
    for; `job_pid(its pid)` is the job's). MODULE must have the `main` that `python -m MODULE` calls."""
    return [*command().split(), "-m", module, *argv]


def torchrun(nproc: int = 2) -> list[str]:
    """`torchrun --standalone --nproc-per-node N` whose agent and ranks are warm forks: append `-m MODULE ARGS`.
    The real launcher (`torch.distributed.run.main`, its elastic agent and rendezvous store) runs as a job of a
    stand-in, and `--no-python` runs the stand-in as each rank's command, with the rank's environment; the
    ranks are the children of the agent, `job_pid(stand-in pid)` (a fresh torchrun imports torch: ~4 CPU-s)."""
    launcher = ["torch.distributed.run", "--standalone", "--nproc-per-node", str(nproc), "--no-python"]
    return [*module_command(*launcher), *command().split()]


if __name__ == "__main__":
    _client(sys.argv[1], sys.argv[2:])
