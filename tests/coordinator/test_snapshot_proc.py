"""The status page's snapshot process (`coordinator.web.snapshot_proc`): the child's answer is byte for byte
what the coordinator would build itself, it cannot write the database, a dead or lying child is replaced
(the page answers 503 meanwhile), and it goes when the coordinator goes, even by SIGKILL."""

from __future__ import annotations

import asyncio
import os
import signal
import sqlite3
import sys
import time

import pytest
from coordinator_helpers import register_provider
from launchers import wait_until

from dflash_worker.coordinator.store import Progress, RunSpecData, Store, StoreReader
from dflash_worker.coordinator.web import page
from dflash_worker.coordinator.web import snapshot as snap_mod
from dflash_worker.coordinator.web.snapshot_proc import SnapshotProcess, SnapshotUnavailable, render
from dflash_worker.proto.dflash.v1 import provider_pb2 as pb


@pytest.fixture
def store(tmp_path):
    s = Store(tmp_path / "c.db", lease_ttl=1000)
    pid = register_provider(s, "box <b>")
    s.runs.create_run(RunSpecData(name="snap & co", spec_json="{}", required_client_version="0.1.0", num_jobs=3))
    g = s.leases.acquire(pid)
    s.leases.heartbeat(pid, g.lease_id, Progress(phase=pb.PHASE_TRAIN, step=3, total_steps=9, metrics={"loss": 1.5, "tokens_per_s": 99.0}))
    yield s
    s.close()


def test_the_child_answers_what_the_coordinator_would_build(store):
    now = time.time()
    expected = render(store, now)  # in this process, on the writer's own connection
    assert expected[1] == page.render_status(snap_mod.snapshot(store, now=now)).encode()
    assert b"snap &amp; co" in expected[1] and b"box &lt;b&gt;" in expected[1]

    async def go():
        proc = SnapshotProcess(store.path)
        try:
            got = await proc.take(now)
            assert proc.pid not in (None, os.getpid())
            return got
        finally:
            await proc.close()

    assert asyncio.run(go()) == expected


def test_the_childs_connection_cannot_write(store):
    reader = StoreReader.open(store.path)
    try:
        assert reader.publication("nope") is None
        with pytest.raises(sqlite3.OperationalError, match="readonly"):
            reader.db.execute("DELETE FROM runs")
    finally:
        reader.db.close()
    assert store.db.execute("SELECT COUNT(*) FROM runs").fetchone()[0] == 1


def test_a_killed_child_is_replaced_and_a_lying_one_is_refused(store, monkeypatch):
    async def go():
        proc = SnapshotProcess(store.path, timeout=10)
        try:
            first = await proc.take(1.0)
            os.kill(proc.pid, signal.SIGKILL)
            await asyncio.sleep(0.2)
            for _ in range(2):  # the request that finds it dead may fail; the next starts a new child
                try:
                    again = await proc.take(1.0)
                    break
                except SnapshotUnavailable as exc:
                    assert "starts it again" in str(exc)
            else:
                pytest.fail("no new snapshot process")
            assert again == first and proc.started == 2
        finally:
            await proc.close()

    asyncio.run(go())

    async def liar(script: str, timeout: float = 10):
        proc = SnapshotProcess(store.path, timeout=timeout)

        async def start():
            proc._proc = await asyncio.create_subprocess_exec(sys.executable, "-c", script, stdin=asyncio.subprocess.PIPE,
                                                              stdout=asyncio.subprocess.PIPE)  # fmt: skip
            proc.started += 1
            return proc._proc

        monkeypatch.setattr(proc, "_start", start)
        try:
            with pytest.raises(SnapshotUnavailable) as err:
                await proc.take(1.0)
            assert proc._proc is None  # killed, not reused
            return str(err.value)
        finally:
            await proc.close()

    # a frame that claims 2**60 bytes, one cut short, one that never comes
    huge = "import sys; sys.stdin.readline(); sys.stdout.buffer.write((2**60).to_bytes(8, 'big') * 2); sys.stdout.flush(); sys.stdin.read()"
    assert "an answer of" in asyncio.run(liar(huge))
    short = "import sys; sys.stdin.readline(); sys.stdout.buffer.write((10).to_bytes(8, 'big') * 2 + b'abc'); sys.stdout.flush()"
    assert "failed" in asyncio.run(liar(short))
    silent = "import sys; sys.stdin.read()"
    assert "did not answer in time" in asyncio.run(liar(silent, timeout=1))


def test_the_child_goes_when_the_coordinator_is_sigkilled(start_coordinator):
    import urllib.request

    from dflash_worker.testing.procs import alive, children

    coord = start_coordinator("--http-listen", "127.0.0.1:0", warm=True)
    req = urllib.request.Request(coord.info["http_address"] + "/status.html", headers={"Authorization": f"Bearer {coord.admin_token}"})
    with urllib.request.urlopen(req, timeout=30) as r:
        assert r.status == 200 and b"Providers" in r.read()
    (child,) = children(coord.pid)
    coord.kill()
    assert wait_until(lambda: not alive(child), timeout=10), "the snapshot process outlived the coordinator"
