"""UploadOffset while a cut upload of the same file is still writing what it buffered."""

from __future__ import annotations

import asyncio
import hashlib
import os
import threading

import pytest
from coordinator_helpers import store_lease

from dflash_worker.coordinator.artifacts.blobs import LocalBlobStore
from dflash_worker.coordinator.artifacts.names import Claim
from dflash_worker.coordinator.artifacts.staging import Staging
from dflash_worker.coordinator.grpc.uploads import Artifacts
from dflash_worker.coordinator.store import Store
from dflash_worker.errors import PolicyError

KiB = 1 << 10


def _artifacts(tmp_path, monkeypatch, *, idle_seconds: float = 30.0):
    """An `Artifacts` over a real store and staging area whose disk writes wait for `gate` (a slow disk)."""
    store = Store(tmp_path / "c.db")
    pid, _, grant, lease = store_lease(store)
    gate = threading.Event()
    real_write = Staging.write

    def slow_write(f, hasher, chunk):
        gate.wait(timeout=60)
        real_write(f, hasher, chunk)

    monkeypatch.setattr(Staging, "write", staticmethod(slow_write))
    art = Artifacts(store, LocalBlobStore(tmp_path / "blobs"), Staging(tmp_path / "staging", blob_dir=tmp_path / "blobs"), idle_seconds=idle_seconds)
    return store, (pid, grant.lease_id, lease), art, gate


def _claim(data: bytes) -> Claim:
    return Claim(name="export/model.bin", kind="export", sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), step=0)


async def _cut_upload(art: Artifacts, held, claim: Claim, chunks: list[bytes]) -> asyncio.Task:
    """Start an upload that sends `chunks` and then goes silent; returns its task once every chunk was handed over."""
    sent = asyncio.Event()

    async def stream():
        for c in chunks:
            yield c
        sent.set()
        await asyncio.Event().wait()  # the provider went silent; its stream is cut by cancelling the handler

    task = asyncio.create_task(art.upload(held[0], held[1], claim, 0, stream()))
    await sent.wait()
    return task


def test_upload_offset_waits_for_a_cut_upload_to_write_what_it_buffered(tmp_path, monkeypatch):
    """The handler of a cut stream still writes its queued chunks after the cut: UploadOffset answers after them,
    so a resume from its answer neither overlaps nor skips a byte (the race a clean-clone CI run hit once)."""
    store, held, art, gate = _artifacts(tmp_path, monkeypatch)
    data = os.urandom(5 * 256 * KiB)
    claim = _claim(data)
    lease = held[2]
    chunks = [data[i : i + 256 * KiB] for i in range(0, 3 * 256 * KiB, 256 * KiB)]

    async def scenario():
        upload = await _cut_upload(art, held, claim, chunks)
        upload.cancel()  # what grpc does to the handler when the provider's stream breaks
        asked = asyncio.create_task(art.offset(lease, claim))
        await asyncio.sleep(0.2)
        on_disk_while_writing = art.staging.offset(lease.attempt_id, claim)
        waited = not asked.done()
        gate.set()  # the disk catches up
        offset = await asked
        with pytest.raises(asyncio.CancelledError):
            await upload
        return on_disk_while_writing, waited, offset

    try:
        on_disk_while_writing, waited, offset = asyncio.run(scenario())
        assert on_disk_while_writing < 3 * 256 * KiB, "the setup must hold buffered chunks unwritten at the cut"
        assert waited, "UploadOffset answered while the cut upload was still writing"
        assert offset == (3 * 256 * KiB, False)
        assert art.staging.offset(lease.attempt_id, claim) == 3 * 256 * KiB

        async def resume():
            async def rest():
                yield data[offset[0] :]

            return await art.upload(held[0], held[1], claim, offset[0], rest())

        record = asyncio.run(resume())
        assert record.sha256 == claim.sha256 and record.size_bytes == len(data)
    finally:
        store.close()


def test_upload_offset_answers_after_a_bounded_wait_while_an_upload_stays_live(tmp_path, monkeypatch):
    """An upload still receiving (not cut) holds its staged file: UploadOffset waits a bounded time, then answers
    what is staged, and a second stream of the file is refused while the first lasts."""
    store, held, art, gate = _artifacts(tmp_path, monkeypatch, idle_seconds=0.1)
    gate.set()
    data = os.urandom(2 * 256 * KiB)
    claim = _claim(data)
    lease = held[2]
    monkeypatch.setattr(art, "idle_seconds", -4.9)  # the wait is idle_seconds + 5 s: 0.1 s here

    async def second_stream():
        yield data

    async def scenario():
        upload = await _cut_upload(art, held, claim, [data[: 256 * KiB]])
        try:
            offset, committed = await art.offset(lease, claim)
            assert not upload.done(), "the live upload must still be running"
            assert not committed and offset == art.staging.offset(lease.attempt_id, claim)
            with pytest.raises(PolicyError, match="another upload of it is in progress"):
                await art.upload(held[0], held[1], claim, offset, second_stream())
        finally:
            upload.cancel()
            with pytest.raises(asyncio.CancelledError):
                await upload
        return await art.offset(lease, claim)

    try:
        assert asyncio.run(scenario()) == (256 * KiB, False)
    finally:
        store.close()
