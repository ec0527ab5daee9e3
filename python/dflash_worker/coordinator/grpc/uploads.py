"""The upload engine: uploads, resumable offsets, downloads and blob garbage collection, shared by both services.

An upload is admitted (quotas, free space, one stream per staged file, at most
`MAX_UPLOADS_PER_ATTEMPT` at once per attempt), received into staging (never a byte past
the declared size), verified (sha256) and committed to the blob store, then recorded
(`artifacts.staging` has the three steps' rules). A cut upload resumes from `UploadOffset`.
Downloads stream a blob from an offset. Blocking work (staging writes, hashing, blob-store
calls) runs in worker threads (`_Writer`, `_Reader`); the event loop only moves chunks and
touches SQLite briefly.
"""

from __future__ import annotations

import asyncio
import contextlib
import queue
import threading
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

from ...errors import IdleError, InvalidRequestError, PolicyError, QuotaError
from ...proto.dflash.v1 import provider_pb2
from ..artifacts.blobs import BlobStore
from ..artifacts.directio import BackgroundWriter
from ..artifacts.names import CHUNK_BYTES, MAX_MANIFEST_BYTES, ArtifactRecord, Claim, check_uint, parse_checkpoint_manifest
from ..artifacts.staging import Staging
from ..store import LiveLease, Store
from .convert import artifact_pb

DEFAULT_UPLOAD_IDLE_SECONDS = 60.0
MAX_UPLOADS_PER_ATTEMPT = 4


class Artifacts:
    """Uploads, downloads and blob garbage collection, shared by both services (the module docstring has the steps)."""

    def __init__(self, store: Store, blobs: BlobStore, staging: Staging, *, idle_seconds: float = DEFAULT_UPLOAD_IDLE_SECONDS):
        self.store = store
        self.blobs = blobs
        self.staging = staging
        self.idle_seconds = idle_seconds
        # Staged files being written now, by attempt: path -> declared size.
        self._inflight: dict[str, dict[Path, int]] = {}
        # Set when the upload writing that staged file has ended (its bytes all written).
        self._ended: dict[Path, asyncio.Event] = {}
        # Bytes received (staged) and sent (downloads) since start, for `metrics`.
        self.bytes_in = 0
        self.bytes_out = 0
        # One commit or deletion of a blob at a time, per sha256.
        self._blob_locks: weakref.WeakValueDictionary[str, asyncio.Lock] = weakref.WeakValueDictionary()

    def _blob_lock(self, sha256: str) -> asyncio.Lock:
        # Weakly held: a lock lives while a commit or deletion of that blob uses it.
        lock = self._blob_locks.get(sha256)
        if lock is None:
            lock = self._blob_locks[sha256] = asyncio.Lock()
        return lock

    async def next_message(self, it: AsyncIterator, what: str):
        """The stream's next message, None at its end; DEADLINE_EXCEEDED after the idle limit."""
        try:
            return await asyncio.wait_for(anext(it, None), timeout=self.idle_seconds)
        except TimeoutError:
            raise IdleError(f"{what}: nothing arrived for {self.idle_seconds:g} s; the upload was cut (what arrived is kept for a resume)") from None

    async def offset(self, lease: LiveLease, claim: Claim) -> tuple[int, bool]:
        """How far the staged copy of `claim` has come; waits for an upload of it still in progress to end.

        A cut stream's handler may still be writing the chunks it buffered when
        the provider asks (`_Writer` is a few chunks behind the network): the
        answer counts them all, or a resume from it would overlap what lands.
        An upload still receiving after the idle limit (+5 s) is a live stream
        (a cut one would have ended): the answer is what is staged now, and the
        upload's admission refuses a second stream of the file while it lasts.
        """
        ended = self._ended.get(self.staging.path(lease.attempt_id, claim))
        if ended is not None:
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(ended.wait(), timeout=self.idle_seconds + 5.0)
        if self.store.records.recorded(lease.attempt_id, claim) is not None:
            return claim.size_bytes, True
        return self.staging.offset(lease.attempt_id, claim), False

    def admit(self, lease: LiveLease, claim: Claim, offset: int) -> Path:
        """Check an upload before a byte is stored; returns its staging path (now busy)."""
        if offset > claim.size_bytes:
            raise InvalidRequestError(f"artifact `{claim.name}`: `offset` {offset} is past `size_bytes` {claim.size_bytes}")
        if claim.kind == "checkpoint" and claim.size_bytes > MAX_MANIFEST_BYTES:
            raise InvalidRequestError(f"checkpoint `{claim.name}` is {claim.size_bytes} bytes; a checkpoint manifest is at most {MAX_MANIFEST_BYTES}")
        self.store.records.check_name_free(lease.attempt_id, claim.name)
        path = self.staging.path(lease.attempt_id, claim)
        inflight = self._inflight.setdefault(lease.attempt_id, {})
        if path in inflight:
            raise PolicyError(f"artifact `{claim.name}`: another upload of it is in progress\nhint: wait for it to end, then resume from UploadOffset")
        if len(inflight) >= MAX_UPLOADS_PER_ATTEMPT:
            raise QuotaError(f"artifact `{claim.name}`: this attempt already has {len(inflight)} uploads in progress; at most {MAX_UPLOADS_PER_ATTEMPT} at once")
        # Staged uploads (in progress, or stopped short and not swept yet) count with their declared sizes.
        self.store.records.check_quota(lease, claim, staged=self.staging.staged(lease.run_id, lease.attempt_id, path))
        self.staging.check_space(claim, offset)
        self.staging.reserve(lease.run_id, lease.attempt_id, claim)
        inflight[path] = claim.size_bytes
        self._ended[path] = asyncio.Event()
        return path

    def release(self, lease: LiveLease, path: Path) -> None:
        inflight = self._inflight.get(lease.attempt_id, {})
        inflight.pop(path, None)
        if not inflight:
            self._inflight.pop(lease.attempt_id, None)
        ended = self._ended.pop(path, None)
        if ended is not None:
            ended.set()

    async def receive(self, lease: LiveLease, claim: Claim, offset: int, chunks: AsyncIterator[bytes]) -> None:
        """Stage `chunks` from `offset`; refuse a byte past the declared size; verify sha256 when complete."""
        f, hasher = await asyncio.to_thread(self.staging.open, lease.attempt_id, claim, offset)
        writer = _Writer(f, hasher)
        received = offset
        try:
            async for chunk in chunks:
                if len(chunk) > CHUNK_BYTES:
                    raise InvalidRequestError(f"artifact `{claim.name}`: a chunk of {len(chunk)} bytes; at most {CHUNK_BYTES} per message")
                if received + len(chunk) > claim.size_bytes:
                    await writer.close(sync=False)
                    await asyncio.to_thread(self.staging.discard, lease.attempt_id, claim)
                    raise InvalidRequestError(
                        f"artifact `{claim.name}`: more bytes arrived than the declared `size_bytes` {claim.size_bytes}; the upload was discarded"
                    )
                if chunk:
                    await writer.put(chunk)
                    received += len(chunk)
                    self.bytes_in += len(chunk)
        finally:
            await writer.close(sync=received == claim.size_bytes)
        if received < claim.size_bytes:
            raise PolicyError(
                f"artifact `{claim.name}`: the stream ended after {received} of {claim.size_bytes} bytes\nhint: resume from offset {received}"
            )
        digest = hasher.hexdigest() if hasher is not None else await asyncio.to_thread(self.staging.digest, lease.attempt_id, claim)
        if digest != claim.sha256:
            await asyncio.to_thread(self.staging.discard, lease.attempt_id, claim)
            raise InvalidRequestError(
                f"artifact `{claim.name}`: the uploaded bytes have sha256 `{digest}`, the header claims `{claim.sha256}`; the upload was discarded"
            )

    async def commit(self, pid: str, lease_id: str, lease: LiveLease, claim: Claim) -> ArtifactRecord:
        """Store a verified staged upload as a blob and record it; the staged copy goes."""
        path = self.staging.path(lease.attempt_id, claim)
        if claim.kind == "checkpoint":
            files = parse_checkpoint_manifest(claim.name, await asyncio.to_thread(path.read_bytes))
            missing = self.store.records.missing_checkpoint_file(lease.attempt_id, claim.name, files)
            if missing is not None:
                raise PolicyError(
                    f"checkpoint `{claim.name}` lists `{missing}`, which this attempt has not uploaded with that sha256 and size\n"
                    "hint: upload every file a checkpoint manifest lists (kind `checkpoint_file`) before the manifest"
                )
        async with self._blob_lock(claim.sha256):
            await asyncio.to_thread(self.blobs.put, path, claim.sha256, claim.size_bytes)
            try:
                # The lease may have ended while the bytes were stored: check again.
                lease = self.store.leases.live_lease(pid, lease_id)
                record = self.store.records.record(lease, claim)
            except BaseException:
                # Stored but not recorded: the janitor deletes the blob unless a record names it.
                self.store.records.garbage.add(claim.sha256)
                raise
        await asyncio.to_thread(self.staging.discard, lease.attempt_id, claim)
        return record

    async def upload(self, pid: str, lease_id: str, claim: Claim, offset: int, chunks: AsyncIterator[bytes]) -> ArtifactRecord:
        lease = self.store.leases.live_lease(pid, lease_id)
        existing = self.store.records.recorded(lease.attempt_id, claim)
        if existing is not None:
            return existing
        path = self.admit(lease, claim, offset)
        try:
            await self.receive(lease, claim, offset, chunks)
            return await self.commit(pid, lease_id, lease, claim)
        finally:
            self.release(lease, path)

    async def stream(self, record: ArtifactRecord, offset: int):
        """DownloadArtifact's messages: the record, then its blob from `offset` in chunks."""
        check_uint(offset, "offset")
        if offset > record.size_bytes:
            raise InvalidRequestError(f"`offset` {offset} is past the end of `{record.name}` ({record.size_bytes} bytes)")
        # `read` opens the blob when called (a HEAD and a GET on S3): off the loop too.
        chunks = await asyncio.to_thread(self.blobs.read, record.sha256, offset, CHUNK_BYTES)
        yield provider_pb2.DownloadArtifactResponse(artifact=artifact_pb(record))
        reader = _Reader(chunks)
        try:
            while (chunk := await reader.next()) is not None:
                self.bytes_out += len(chunk)
                yield provider_pb2.DownloadArtifactResponse(chunk=chunk)
        finally:
            reader.stop()

    async def collect_garbage(self) -> int:
        """Delete blobs no record refers to, and staged uploads of ended or idle attempts; returns blobs deleted."""
        deleted = 0
        for sha in self.store.records.take_garbage():
            async with self._blob_lock(sha):
                if self.store.records.referenced(sha):
                    continue
                await asyncio.to_thread(self.blobs.delete, sha)
                deleted += 1
        ended, self.store.jobs.ended_attempts = self.store.jobs.ended_attempts, set()
        for attempt_id in ended:
            if attempt_id not in self._inflight:
                await asyncio.to_thread(self.staging.drop_attempt, attempt_id)
        busy = {p for paths in self._inflight.values() for p in paths}
        await asyncio.to_thread(self.staging.sweep, max(self.idle_seconds * 2, 60.0), self.store.leases.live_attempt_ids(), busy)
        return deleted


class _Writer:
    """Writes and hashes one upload's chunks on a thread of its own (`BackgroundWriter`), a few chunks behind the network.

    The event loop only hands chunks over (blocking, off the loop, when the
    writer is 4 chunks behind), so receiving the next chunk overlaps writing
    and hashing the last one; memory stays at 4 chunks.
    """

    def __init__(self, f, hasher):
        self.w = BackgroundWriter(lambda chunk: Staging.write(f, hasher, chunk), lambda sync: Staging.close(f, sync=sync), name="upload-writer")

    async def put(self, chunk: bytes) -> None:
        if not self.w.try_put(chunk):
            await asyncio.to_thread(self.w.put, chunk)

    async def close(self, *, sync: bool) -> None:
        """Wait for the queued chunks, close the file (fsynced when `sync`); raise the writer's error."""
        await asyncio.to_thread(self.w.finish, sync=sync)


class _Reader:
    """Reads a blob's chunks on a thread of its own, up to `DEPTH` chunks ahead of the network."""

    DEPTH = 4
    _END = object()

    def __init__(self, chunks):
        self.chunks = chunks
        self.q: queue.Queue = queue.Queue(maxsize=self.DEPTH)
        self.stopping = threading.Event()
        self.thread = threading.Thread(target=self._run, name="download-reader", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        try:
            for chunk in self.chunks:
                while not self.stopping.is_set():
                    try:
                        self.q.put(chunk, timeout=0.5)
                        break
                    except queue.Full:
                        continue
                if self.stopping.is_set():
                    return
            self.q.put(self._END)
        except BaseException as exc:  # noqa: BLE001 - raised on the loop by next()
            self.q.put(exc)
        finally:
            close = getattr(self.chunks, "close", None)
            if close is not None:
                close()

    async def next(self) -> bytes | None:
        try:
            item = self.q.get_nowait()
        except queue.Empty:
            item = await asyncio.to_thread(self.q.get)
        if item is self._END:
            return None
        if isinstance(item, BaseException):
            raise item
        return item

    def stop(self) -> None:
        """The client went away (or the stream ended): the thread stops within half a second."""
        self.stopping.set()
