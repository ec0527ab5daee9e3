"""A real S3-compatible server for tests: moto's standalone server as a subprocess on 127.0.0.1.

A subprocess (not moto's in-process mocks, not `ThreadedMotoServer`) so the code
under test talks HTTP to another process exactly as it would to S3, and a test
can SIGKILL it mid-request and start it again on the same port. moto keeps its
state in memory: a restarted server has no buckets and no objects.
"""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

try:
    import moto.server  # noqa: F401

    HAVE_MOTO = True
except ImportError:
    HAVE_MOTO = False

NO_MOTO = "moto is not installed (`make install` puts moto[s3] and flask into the environment)"
START_TIMEOUT = 30.0


# Runs `python -m moto.server ARGS` after asking Linux to SIGKILL it when its parent (the test
# process) dies, so a killed pytest leaves no server behind. Set in the child itself: no
# preexec_fn, which is unsafe in a process with threads.
_BOOT = """
import ctypes, runpy, signal, sys
if sys.platform == "linux":
    try:
        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass
sys.argv[0] = "moto.server"
runpy.run_module("moto.server", run_name="__main__", alter_sys=True)
"""


def free_port() -> int:
    """A TCP port nothing listens on now (the OS picks it; another process could take it before we do)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def aws_test_env() -> dict[str, str | None]:
    """Environment for boto3 in tests: dummy credentials, no profile or config file, no metadata lookups.

    ``AWS_EC2_METADATA_DISABLED`` and the cleared container variables keep botocore from asking
    169.254.169.254 or a container endpoint for credentials: a test reaches loopback only.
    ``None`` means "unset".
    """
    return {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_SESSION_TOKEN": None,
        "AWS_PROFILE": None,
        "AWS_DEFAULT_PROFILE": None,
        "AWS_CONFIG_FILE": os.devnull,
        "AWS_SHARED_CREDENTIALS_FILE": os.devnull,
        "AWS_ENDPOINT_URL": None,
        "AWS_ENDPOINT_URL_S3": None,
        "AWS_DEFAULT_REGION": None,
        "AWS_REGION": None,
        "AWS_EC2_METADATA_DISABLED": "true",
        "AWS_CONTAINER_CREDENTIALS_RELATIVE_URI": None,
        "AWS_CONTAINER_CREDENTIALS_FULL_URI": None,
    }


class MotoServer:
    """moto's server (``python -m moto.server``) on 127.0.0.1:`port`; `kill` and `start` again keep the port (and lose the state)."""

    def __init__(self, log_dir: Path, port: int | None = None) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_dir = log_dir
        self.proc: subprocess.Popen | None = None
        self.starts = 0

    def start(self) -> MotoServer:
        assert self.proc is None, "already running"
        self.starts += 1
        log = open(self.log_dir / f"moto-{self.port}-{self.starts}.log", "wb")
        with log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", _BOOT, "-H", "127.0.0.1", "-p", str(self.port)],
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        deadline = time.monotonic() + START_TIMEOUT
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"moto server exited with {self.proc.returncode}; see {log.name}")
            try:
                # moto's own health endpoint; any answer means it serves requests.
                with urllib.request.urlopen(f"{self.url}/moto-api/", timeout=1):
                    return self
            except OSError:
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(f"moto server did not answer on {self.url} within {START_TIMEOUT:.0f} s; see {log.name}") from None
                time.sleep(0.05)

    def kill(self) -> None:
        """SIGKILL, as a crash or a power cut would: no request is finished, nothing is flushed."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
        self.proc.wait(timeout=10)
        self.proc = None
