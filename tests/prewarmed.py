"""Run a command-line `main` in a fresh process forked from a pre-warmed interpreter.

`python -m dflash_worker.cli train ...` spends about 3.7 CPU-seconds importing torch (the PyPI
CUDA build maps ~3 GB of libraries) and transformers' model modules before it does anything; the
suite ran ~90 such commands per `make test`, about a quarter of its CPU. `run_main` runs the same
`main(argv)` in a real child process with its own cwd, environment, stdout, stderr and exit
code, forked from a `multiprocessing` fork server that imported those modules once per pytest
worker (`set_forkserver_preload`). Nothing is shared with the test process: the child is a copy
of the fork server, which never runs a command itself.

What differs from a fresh interpreter, and where tests keep the real thing:
- modules are imported before the command's environment is set, so variables read at import time
  come from the fork server's (started with this process's environment plus `HF_HUB_OFFLINE=1`);
  `OMP_NUM_THREADS` and `PYTHONWARNINGS=ignore` are applied in the child explicitly;
- `atexit` handlers do not run (the child leaves with `os._exit` after flushing stdout and stderr).
The console script and the interpreter start are run for real by `tests/test_packaging.py` and
by the tests marked `real_process` (tests/warm_worker.py: the native client a run-manager starts,
the coordinator's console script); `torchrun` ranks and the tests that signal a process keep
`subprocess`. `CommandServer` puts a stand-in `dflash-worker` on `PATH` for the shell
blocks of `tests/docs/test_training_quickstart.py`.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import json
import multiprocessing
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

# What the fork server imports once: the heavy third-party modules and every command module.
PRELOAD = [
    "numpy",
    "torch",
    "safetensors.torch",
    "transformers",
    "transformers.models.qwen3.modeling_qwen3",
    "transformers.models.qwen3_moe.modeling_qwen3_moe",
    "transformers.models.qwen3_5.modeling_qwen3_5",
    "transformers.models.qwen3_5_moe.modeling_qwen3_5_moe",
    "tqdm",
    "dflash_worker.cli",
    "dflash_worker.coordinator.cli",
    "dflash_worker.capture",
    "dflash_worker.train",
    "dflash_worker.evaluate",
    "dflash_worker.export",
    "dflash_worker.model",
    "dflash_worker.weights",
    "dflash_worker.data",
    "dflash_worker.recipe",
    "dflash_worker.dist",
    "dflash_worker.worker.events",
    "dflash_worker.worker.stages",
    "dflash_worker.job",
    "matplotlib.pyplot",  # the evaluation report's plot (tests/warm_worker.py runs whole jobs)
]

_lock = threading.Lock()
_ctx = None


def _context():
    global _ctx
    with _lock:
        if _ctx is None:
            from dflash_worker.cli import COMMANDS

            ctx = multiprocessing.get_context("forkserver")
            ctx.set_forkserver_preload(PRELOAD + [f"dflash_worker.commands.{mod}" for mod, _ in COMMANDS.values()])
            # the fork server is started with this process's environment: what is read at import
            # time (transformers' hub mode) is decided here, once
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
            _ctx = ctx
        return _ctx


def load_main(target: str, argv: list[str]):
    """`MODULE.main` or, for a path ending in `.py` (a script under bench/), that script's `main`, as a call
    with `argv`; sets `sys.argv` as `python -m MODULE ARGV` / `python SCRIPT ARGV` would (a script's
    directory first on `sys.path`). A `main()` without parameters reads `sys.argv` itself (argparse)."""
    if target.endswith(".py"):
        sys.path.insert(0, os.path.dirname(target))
        spec = importlib.util.spec_from_file_location(f"__script_{Path(target).stem}__", target)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses and pickling look the module up
        spec.loader.exec_module(mod)
    else:
        mod = importlib.import_module(target)
    sys.argv = [mod.__file__, *argv]
    takes_argv = bool(inspect.signature(mod.main).parameters)
    return (lambda: mod.main(argv)) if takes_argv else mod.main


def _child(module: str, argv: list[str], cwd: str, env: dict[str, str], out: str, err: str, stdin: str | None) -> None:
    """The forked process: become the command's process, run `module.main(argv)`, exit with its code."""
    for fd, path, mode in ((0, stdin or os.devnull, os.O_RDONLY), (1, out, os.O_WRONLY), (2, err, os.O_WRONLY)):
        f = os.open(path, mode)
        os.dup2(f, fd)
        os.close(f)
    sys.stdin = open(0, encoding="utf-8", closefd=False)
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if env.get("PYTHONWARNINGS") == "ignore":
        import warnings

        warnings.simplefilter("ignore")
    if env.get("OMP_NUM_THREADS", "").isdigit():
        import torch

        torch.set_num_threads(int(env["OMP_NUM_THREADS"]))
    main = load_main(module, argv)
    try:
        code = main()
    except SystemExit as exc:  # argparse's exits and `--version`
        code = exc.code
    except BaseException:  # the interpreter's own report of an uncaught exception
        import traceback

        traceback.print_exc()
        code = 1
    if code is not None and not isinstance(code, int):
        print(code, file=sys.stderr)
        code = 1
    sys.exit(code or 0)


def run_main(module: str, argv, *, cwd=None, env=None, timeout: float = 600, input: str | None = None) -> subprocess.CompletedProcess:
    """`python -m MODULE ARGV` with `MODULE.main`, as `subprocess.run(..., capture_output=True, text=True)`
    would return it (raises `subprocess.TimeoutExpired` after killing the child)."""
    argv = [str(a) for a in argv]
    env = dict(os.environ if env is None else env)
    with tempfile.TemporaryDirectory(prefix="prewarmed-") as tmp:
        out, err = Path(tmp, "stdout"), Path(tmp, "stderr")
        out.touch()
        err.touch()
        stdin = None
        if input is not None:
            stdin = Path(tmp, "stdin")
            stdin.write_text(input, encoding="utf-8")
        args = (module, argv, str(Path(cwd or os.getcwd()).resolve()), env, str(out), str(err), stdin and str(stdin))
        proc = _context().Process(target=_child, args=args)  # not daemonic: a command may start processes
        proc.start()
        proc.join(timeout)
        if proc.exitcode is None:
            proc.kill()
            proc.join()
            raise subprocess.TimeoutExpired([sys.executable, "-m", module, *argv], timeout, out.read_bytes(), err.read_bytes())
        return subprocess.CompletedProcess(  # killed by a signal: negative, as subprocess reports it
            [sys.executable, "-m", module, *argv], proc.exitcode,
            out.read_text(encoding="utf-8", errors="replace"), err.read_text(encoding="utf-8", errors="replace"),
        )  # fmt: skip


def run_script(script: Path | str, argv, **kw) -> subprocess.CompletedProcess:
    """`python SCRIPT ARGV` for a script with `main(argv)` (the benchmarks under bench/), as `run_main`:
    the script is loaded in the forked child (its directory first on `sys.path`) and its `main` called."""
    return run_main(str(Path(script).resolve()), argv, **kw)


def worker_cli(*argv, **kw) -> subprocess.CompletedProcess:
    """`dflash-worker ARGV` (`python -m dflash_worker.cli`) in a pre-warmed fork."""
    return run_main("dflash_worker.cli", argv, **kw)


def coordinator_cli(*argv, **kw) -> subprocess.CompletedProcess:
    """`dflash-coordinator ARGV` (`python -m dflash_worker.coordinator`) in a pre-warmed fork."""
    return run_main("dflash_worker.coordinator.cli", argv, **kw)


class CommandServer:
    """`dflash-worker` for the shell scripts a test runs: a stand-in script in `bindir` (put it first on
    `PATH`) that sends its argv, cwd and environment over a Unix socket to this server, which runs the
    command with `worker_cli` and sends back the exit code, stdout and stderr (written once the command
    ends; the stand-in does not forward stdin or signals). Use as a context manager."""

    def __init__(self, bindir: Path, timeout: float = 600):
        self.bindir, self.timeout = Path(bindir), timeout
        self._dir = tempfile.mkdtemp(prefix="pw-")  # a short path: Unix socket names are limited to ~100 bytes
        self.socket_path = os.path.join(self._dir, "s")
        self._listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._listener.bind(self.socket_path)
        self._listener.listen(8)
        self.calls: list[list[str]] = []
        self.bindir.mkdir(parents=True, exist_ok=True)
        shim = self.bindir / "dflash-worker"
        shim.write_text(_SHIM.format(python=sys.executable, socket=self.socket_path), encoding="utf-8")
        shim.chmod(0o755)
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._listener.accept()
            except OSError:  # closed
                return
            threading.Thread(target=self._serve, args=(conn,), daemon=True).start()

    def _serve(self, conn: socket.socket) -> None:
        with conn:
            raw = b"".join(iter(lambda: conn.recv(1 << 16), b""))
            try:
                req = json.loads(raw)
                self.calls.append(req["argv"])
                res = worker_cli(*req["argv"], cwd=req["cwd"], env=req["env"], timeout=self.timeout)
                code = res.returncode if res.returncode >= 0 else 128 - res.returncode
                reply = {"code": code, "stdout": res.stdout, "stderr": res.stderr}
            except Exception as exc:  # noqa: BLE001 (the stand-in reports it as the command's failure)
                reply = {"code": 125, "stdout": "", "stderr": f"prewarmed: {type(exc).__name__}: {exc}\n"}
            conn.sendall(json.dumps(reply).encode("utf-8"))

    def __enter__(self) -> CommandServer:
        return self

    def __exit__(self, *exc) -> None:
        self._listener.close()
        shutil.rmtree(self._dir, ignore_errors=True)


_SHIM = '''#!{python} -I
"""dflash-worker, run by the test's pre-warmed command server (tests/prewarmed.py)."""
import json, os, socket, sys
s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
s.connect({socket!r})
s.sendall(json.dumps({{"argv": sys.argv[1:], "cwd": os.getcwd(), "env": dict(os.environ)}}).encode("utf-8"))
s.shutdown(socket.SHUT_WR)
reply = json.loads(b"".join(iter(lambda: s.recv(1 << 16), b"")))
sys.stdout.write(reply["stdout"])
sys.stderr.write(reply["stderr"])
sys.exit(reply["code"])
'''
