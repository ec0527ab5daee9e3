"""Least privilege against a compromised worker, checked from the worker process itself.

A worker parses untrusted data; in native launch mode it runs as the run-manager's user, so it can read
its parent's `/proc/PPID/cmdline` (any process can) and `/proc/PPID/environ` (a process of the same user,
while the parent is dumpable). The run-manager reads its provider token into memory, overwrites it in its
original environment and argument blocks (what those files show) and makes itself non-dumpable
(`run-manager/src/lockdown.rs`). Here a real run-manager gets a real provider token through
`DFLASH_PROVIDER_TOKEN`, `--token` or `--token-file` and runs a `noop` job against a real coordinator;
while the worker runs, neither its own command line and environment nor its parent's hold the token (nor
the token file's path). The job succeeding shows the token held in memory still authenticates.

As root the tests read every file (root is not stopped by non-dumpable), so what they check is the scrub;
as another user the parent's environment cannot be read at all, which is the point too.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
from e2e_helpers import client_version
from launchers import NATIVE_CLIENT, wait_until

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(sys.platform != "linux", reason="reads /proc"),
    pytest.mark.real_process("native_client"),  # the native worker's own /proc files
]

# Slow enough (about 4 s) that the worker is surely alive while its parent is read.
NOOP_SPEC = {"stages": ["noop"], "noop": {"steps": 40, "step_seconds": 0.1, "checkpoint_every": 10}}

SOURCE_LINES = {"env": "`DFLASH_PROVIDER_TOKEN`", "flag": "`--token`", "file": "token file"}


def _started(v: dict) -> bool:
    return str(v.get("message", "")).startswith("worker started")


def read(path: str) -> bytes | None:
    """The file's bytes; `None` where this user may not read it (a non-dumpable parent's environ)."""
    try:
        return Path(path).read_bytes()
    except PermissionError:
        assert os.geteuid() != 0, f"root cannot read `{path}`"
        return None


def parent_pid(pid: int) -> int:
    # The command name (field 2) may hold spaces and parentheses: count from the last `)`.
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def descendants(pid: int) -> list[int]:
    """`pid`'s live children, their children, and so on."""
    children: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                children.setdefault(parent_pid(int(d.name)), []).append(int(d.name))
            except (OSError, ValueError, IndexError):
                continue
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        out.extend(children.get(p, []))
        todo.extend(children.get(p, []))
    return out


@pytest.mark.parametrize("source", ["env", "flag", "file"])
def test_worker_finds_no_secret_in_its_own_or_its_parents_proc_files(tmp_path, procs, binaries, source):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, warm=True)
    name = f"box-hygiene-{source}"
    token = coord.provider_token(name)
    run_id = coord.create_run(f"hygiene-{source}", NOOP_SPEC, client_version=client_version())
    token_file = tmp_path / "provider-token-file"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    args, env = {
        "env": ([], {"DFLASH_PROVIDER_TOKEN": token}),
        "flag": (["--token", token], {}),
        "file": (["--token-file", str(token_file)], {}),
    }[source]
    secrets = [token] + ([str(token_file)] if source == "file" else [])
    rm = procs.run_manager(tmp_path / "work", "--coordinator", coord.address, "--name", name, "--max-jobs", "1", *args, extra_env=env)
    line = rm.wait_for("the connection line", lambda v: "provider token from" in str(v.get("message", "")))
    assert SOURCE_LINES[source] in line["message"], line

    worker = int(rm.wait_for("the worker to start", _started)["pid"])
    # /proc/PID/cmdline reads empty while the process is between fork and a finished exec.
    argv = wait_until(lambda: read(f"/proc/{worker}/cmdline"), timeout=10, what="the worker's command line")
    assert Path(argv.split(b"\0")[0].decode()).name == NATIVE_CLIENT.name, argv
    ppid = parent_pid(worker)
    assert ppid == rm.proc.pid, (ppid, rm.proc.pid)

    # Everything the worker (and anything it started) can read about itself and its parent.
    seen: dict[str, bytes | None] = {}
    for pid in [worker, *descendants(worker)]:
        for what in ("cmdline", "environ"):
            try:
                seen[f"/proc/{pid}/{what}"] = read(f"/proc/{pid}/{what}")
            except (FileNotFoundError, ProcessLookupError):
                assert pid != worker, f"the worker {pid} ended too soon"
    for what in ("cmdline", "environ"):
        seen[f"/proc/{ppid}/{what}"] = read(f"/proc/{ppid}/{what}")
    assert seen[f"/proc/{worker}/environ"], "the worker's environment read empty"
    assert seen[f"/proc/{ppid}/cmdline"], "the run-manager's command line read empty"
    if os.geteuid() == 0:
        assert seen[f"/proc/{ppid}/environ"], "the run-manager's environment read empty"
    # Paths only in the message: the files' contents are this machine's environment.
    leaks = [
        f"`{path}` holds {'the token' if secret == token else 'the token file path'}"
        for path, data in seen.items()
        for secret in secrets
        if data is not None and secret.encode() in data
    ]
    assert not leaks, leaks
    # Nor does the worker hold the token file open.
    for fd in Path(f"/proc/{worker}/fd").iterdir():
        try:
            assert os.readlink(fd) != str(token_file), f"the worker holds the token file open as fd {fd.name}"
        except FileNotFoundError:
            continue

    rc = rm.wait()
    assert rc == 0, f"stdout:\n{rm.stdout}\nstderr:\n{rm.text()}"
    (job,) = coord.show(run_id)["jobs"]
    assert job["state"] == "succeeded", job
