"""Least privilege for the worker, read from the worker process itself: the run-manager joins a real
coordinator with the provider token (and other credentials) in its environment, and the live
`dflash-native-client` process's `/proc/PID/environ` holds none of their names or values.

(Docker mode is checked in `run-manager/tests/integration.rs`, `docker_mode_runs_the_image_with_a_hardened_container`:
the recorded `docker run` arguments pass no secret with `--env`, and the docker CLI's environment holds none.)
"""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest
from e2e_helpers import client_version, cmdline
from launchers import NATIVE_CLIENT, VENV, wait_until

pytestmark = pytest.mark.slow

# Slow enough (about 4 s) that the worker is surely alive when its environment is read.
NOOP_SPEC = {"stages": ["noop"], "noop": {"steps": 40, "step_seconds": 0.1, "checkpoint_every": 10}}


def _started(v: dict) -> bool:
    return str(v.get("message", "")).startswith("worker started")


def environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    return dict(item.split("=", 1) for item in raw.decode(errors="replace").split("\0") if "=" in item)


def process_group(pgid: int) -> list[int]:
    """Every live process in process group `pgid` (the worker is its group's leader; its children too)."""
    pids = []
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                fields = (d / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[2]) == pgid:
                pids.append(int(d.name))
    return pids


@pytest.mark.real_process("native_client")  # the native worker's own environment and argv
def test_native_worker_environment_holds_no_secret(tmp_path, procs, binaries):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, warm=True)
    token = coord.provider_token("box-env")
    run_id = coord.create_run("worker-env", NOOP_SPEC, client_version=client_version())
    token_file = tmp_path / "token"
    token_file.write_text(token + "\n")
    token_file.chmod(0o600)
    secrets_env = {
        "DFLASH_PROVIDER_TOKEN": token,
        "DFLASH_PROVIDER_TOKEN_FILE": str(token_file),
        "DFLASH_ADMIN_TOKEN": coord.admin_token,
        "AWS_SECRET_ACCESS_KEY": "aws-" + secrets.token_hex(12),
        "MY_API_TOKEN": "api-" + secrets.token_hex(12),
    }
    # The run-manager's environment: the harness's clean one plus the credentials.
    rm = procs.run_manager(tmp_path / "work", "--coordinator", coord.address, "--name", "box-env", "--max-jobs", "1", extra_env=secrets_env)
    # The run-manager holds them only until it starts: it scrubs its own environment then
    # (test_e2e_token_hygiene.py reads it); this test is about what the worker is given.

    started = rm.wait_for("the worker to start", _started)
    worker = int(started["pid"])
    # /proc/PID/cmdline reads empty while the process is between fork and a finished exec.
    argv = wait_until(lambda: [a for a in [cmdline(worker)] if a and a[0]], timeout=10, what="the worker's command line")[0]
    assert Path(argv[0]).name == NATIVE_CLIENT.name, argv
    # The token came from the file (it outranks the environment variable).
    assert rm.wait_for("the connection line", lambda v: "provider token from token file" in str(v.get("message", "")))

    envs = wait_until(lambda: {pid: environ(pid) for pid in process_group(worker)} or None, timeout=30, what="the worker's environment")
    assert worker in envs, envs.keys()
    for pid, env in envs.items():
        raw = "\0".join(f"{k}={v}" for k, v in env.items())
        for name, value in secrets_env.items():
            assert name not in env, f"`{name}` reached worker process {pid}: {sorted(env)}"
            assert value not in raw, f"the value of `{name}` reached worker process {pid}"
        assert not any(k.startswith("AWS_") or k.endswith(("_TOKEN", "_KEY")) or "SECRET" in k for k in env), sorted(env)
    # What it does get: enough to find its Python and run unbuffered.
    env = envs[worker]
    assert env.get("PYTHONUNBUFFERED") == "1" and env.get("VIRTUAL_ENV") == str(VENV), sorted(env)
    assert env.get("PATH") == os.environ.get("PATH"), sorted(env)

    rc = rm.wait()
    assert rc == 0, f"stdout:\n{rm.stdout}\nstderr:\n{rm.text()}"
    (job,) = coord.show(run_id)["jobs"]
    assert job["state"] == "succeeded", job
