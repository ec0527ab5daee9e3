"""The status page's snapshot, built in a process of its own so the coordinator's event loop never does it.

Why a process: a page refresh reads a few hundred rows and renders them (the snapshot of
`snapshot`, then `page.status_parts`), a few milliseconds of Python. On the coordinator's event
loop that is time no heartbeat is answered, however finely it is sliced, and on a thread it
would hold the same interpreter lock. A child process does it on another core: the loop only
writes one request line and reads the answer from a pipe.

The child (``python -m dflash_worker.coordinator.web.snapshot_proc DB``) opens the database
read-only (``mode=ro``: it cannot write a byte) and answers each request line ``NOW\\n``
(the Unix time to compute ages and ETAs at) with a frame: two 8-byte big-endian lengths, the
snapshot as JSON (sorted keys, what `/api/status` serves) and the rendered fragment (what
`/status.html` serves). Each snapshot is one read transaction, so the page is consistent as
of one moment. The child runs at `NICE` (lower priority than the coordinator): on a
host whose cores are busy the page refreshes later, heartbeats do not wait for it. The
child exits when its stdin closes, so a coordinator that dies (even by
SIGKILL) takes it along.

`SnapshotProcess` is the coordinator's side: one request at a time, the child started on
first use and started again after it dies; a child that does not answer within `timeout`
is killed and the request fails (the page answers 503 and the next refresh tries again).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import struct
import sys
import time
from pathlib import Path

log = logging.getLogger("dflash_worker.coordinator")

_HEADER = struct.Struct(">QQ")
# The child's scheduling priority: on a busy coordinator host, heartbeats win the CPU and the page waits.
NICE = 10
# A snapshot is bounded (`snapshot.MAX_*`); an answer this large is not one.
MAX_FRAME = 256 * 1024 * 1024


class SnapshotUnavailable(RuntimeError):
    """The snapshot process could not answer (it died, hung or sent something that is not a frame)."""


def render(view, now: float) -> tuple[bytes, bytes]:
    """(snapshot JSON, rendered fragment) of `view` at time `now`, as the page serves them."""
    from . import page
    from .snapshot import snapshot

    snap = snapshot(view, now=now)
    return json.dumps(snap, sort_keys=True).encode(), page.render_status(snap).encode()


def frame(snap_json: bytes, html: bytes) -> bytes:
    return _HEADER.pack(len(snap_json), len(html)) + snap_json + html


def serve(db_path: Path, stdin=None, stdout=None) -> int:
    """The child's loop: one frame per request line until stdin closes."""
    if stdin is None:  # the child itself (not a test calling in): the page yields the CPU to heartbeats
        os.nice(NICE)
    stdin = stdin or sys.stdin.buffer
    stdout = stdout or sys.stdout.buffer
    from ..store import StoreReader

    view = StoreReader.open(db_path)
    for line in stdin:
        try:
            now = float(line.strip())
        except ValueError:
            now = time.time()
        view.db.execute("BEGIN")  # one read transaction: the whole page as of one moment
        try:
            snap_json, html = render(view, now)
        finally:
            view.db.execute("COMMIT")
        stdout.write(frame(snap_json, html))
        stdout.flush()
    return 0


class SnapshotProcess:
    """The coordinator's handle on the snapshot child (module docstring)."""

    def __init__(self, db_path: Path, *, timeout: float = 30.0):
        self.db_path = Path(db_path)
        self.timeout = timeout
        self._proc: asyncio.subprocess.Process | None = None
        self._lock = asyncio.Lock()
        self.started = 0  # children started so far (a restart counts)

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def _start(self) -> asyncio.subprocess.Process:
        # the child imports this very package, wherever it was imported from
        root = str(Path(__file__).resolve().parents[3])
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p))
        self._proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dflash_worker.coordinator.web.snapshot_proc", str(self.db_path),
            stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE, env=env,
        )
        self.started += 1
        return self._proc

    async def take(self, now: float | None = None) -> tuple[bytes, bytes]:
        """(snapshot JSON, fragment HTML) at `now` (default: the current time); `SnapshotUnavailable` when the child fails."""
        async with self._lock:
            proc = self._proc if self._proc is not None and self._proc.returncode is None else await self._start()
            try:
                return await asyncio.wait_for(self._ask(proc, time.time() if now is None else now), self.timeout)
            except (TimeoutError, asyncio.IncompleteReadError, ConnectionError, SnapshotUnavailable) as exc:
                await self._kill(proc)
                what = "did not answer in time" if isinstance(exc, TimeoutError) else f"failed ({exc or type(exc).__name__})"
                raise SnapshotUnavailable(f"the status page's snapshot process {what}; the next refresh starts it again") from None

    @staticmethod
    async def _ask(proc: asyncio.subprocess.Process, now: float) -> tuple[bytes, bytes]:
        assert proc.stdin is not None and proc.stdout is not None
        proc.stdin.write(f"{now!r}\n".encode())
        await proc.stdin.drain()
        n_json, n_html = _HEADER.unpack(await proc.stdout.readexactly(_HEADER.size))
        if n_json + n_html > MAX_FRAME:
            raise SnapshotUnavailable(f"an answer of {n_json + n_html} bytes")
        body = await proc.stdout.readexactly(n_json + n_html)
        return body[:n_json], body[n_json:]

    async def _kill(self, proc: asyncio.subprocess.Process) -> None:
        if proc.returncode is None:
            proc.kill()
            await proc.wait()
        if self._proc is proc:
            self._proc = None

    async def close(self) -> None:
        """Stop the child: stdin closed (it exits), killed if it has not within a few seconds."""
        async with self._lock:
            proc, self._proc = self._proc, None
            if proc is None or proc.returncode is not None:
                return
            assert proc.stdin is not None
            proc.stdin.close()
            try:
                await asyncio.wait_for(proc.wait(), 5.0)
            except TimeoutError:
                log.warning("the snapshot process did not exit when asked; killing it")
                proc.kill()
                await proc.wait()


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 1:
        print("usage: python -m dflash_worker.coordinator.web.snapshot_proc DB", file=sys.stderr)
        return 2
    try:
        return serve(Path(args[0]))
    except (BrokenPipeError, KeyboardInterrupt):
        return 0


if __name__ == "__main__":
    sys.exit(main())
