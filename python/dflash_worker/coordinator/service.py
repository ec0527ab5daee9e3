"""gRPC servicers for `dflash.v1.ProviderService` and `dflash.v1.AdminService`.

These translate protobuf messages to and from the `Store`, validate every
field a client controls (unknown enum values included) and run the long-poll
for `AcquireLease`. Authentication happened in `auth.AuthInterceptor`;
`current_principal()` names the caller.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import queue
import threading
import time
import weakref
from collections.abc import AsyncIterator
from pathlib import Path

from ..errors import IdleError, InvalidRequestError, PermissionDeniedError, PolicyError, QuotaError
from ..proto.dflash.v1 import admin_pb2, admin_pb2_grpc, provider_pb2, provider_pb2_grpc
from .artifacts import (
    CHUNK_BYTES,
    MAX_MANIFEST_BYTES,
    ArtifactRecord,
    Claim,
    Staging,
    check_name,
    check_sha256,
    check_uint,
    parse_checkpoint_manifest,
)
from .auth import current_principal
from .blobs import BlobStore
from .directio import BackgroundWriter
from .policy import BACKENDS, PROTOCOL_VERSION, check_features, check_version
from .publish import PublishGate
from .store import Grant, LiveLease, Progress, ProviderRow, PublicationRow, Registration, RunRow, RunSpecData, Store, Upgrade

_LAUNCH_MODES = {provider_pb2.LAUNCH_MODE_DOCKER, provider_pb2.LAUNCH_MODE_NATIVE}
_PHASES = set(provider_pb2.Phase.values())
_OUTCOMES = {
    provider_pb2.ATTEMPT_OUTCOME_SUCCEEDED: "succeeded",
    provider_pb2.ATTEMPT_OUTCOME_FAILED: "failed",
    provider_pb2.ATTEMPT_OUTCOME_CANCELLED: "cancelled",
    provider_pb2.ATTEMPT_OUTCOME_RETRYABLE: "retryable",
}
_DIRECTIVES = {
    "continue": provider_pb2.DIRECTIVE_CONTINUE,
    "cancel": provider_pb2.DIRECTIVE_CANCEL,
    "checkpoint": provider_pb2.DIRECTIVE_CHECKPOINT_NOW,
}
MAX_METRICS = 64
DEFAULT_UPLOAD_IDLE_SECONDS = 60.0
MAX_UPLOADS_PER_ATTEMPT = 4

log = logging.getLogger("dflash_worker.coordinator")


def artifact_pb(a: ArtifactRecord | None) -> provider_pb2.Artifact | None:
    if a is None:
        return None
    return provider_pb2.Artifact(name=a.name, kind=a.kind, sha256=a.sha256, size_bytes=a.size_bytes, uri=a.uri, step=a.step)


def provider_pb(p: ProviderRow) -> admin_pb2.ProviderInfo:
    caps = provider_pb2.DeviceCapabilities.FromString(p.capabilities) if p.capabilities else None
    return admin_pb2.ProviderInfo(
        provider_id=p.provider_id,
        name=p.name,
        client_version=p.client_version,
        launch_mode=p.launch_mode,
        capabilities=caps,
        last_seen_unix=int(p.last_seen_unix or 0),
        identity=p.identity,
        revoked_unix=int(p.revoked_unix or 0),
        quarantined_unix=int(p.quarantined_unix or 0),
        quarantine_reason=p.quarantine_reason,
    )


def publication_pb(p: PublicationRow | None) -> admin_pb2.Publication | None:
    if p is None:
        return None
    e = p.evaluation
    return admin_pb2.Publication(
        published=p.published,
        verdict=p.verdict,
        reason=p.reason,
        decided_unix=int(p.decided_unix),
        override_unix=int(p.override_unix or 0),
        override_note=p.override_note,
        override_peer=p.override_peer,
        tau_released=float(e.get("tau_released", 0.0)),
        tau_trained=float(e.get("tau_trained", 0.0)),
        split=str(e.get("split", "")),
        tolerance=float(e.get("tolerance", 0.0)),
    )


def run_pb(run: RunRow) -> admin_pb2.Run:
    s = run.spec
    return admin_pb2.Run(
        run_id=run.run_id,
        spec=admin_pb2.RunSpec(
            name=s.name,
            spec_json=s.spec_json,
            required_client_version=s.required_client_version,
            checkpoint_policy=s.checkpoint_policy,
            max_local_ranks=s.max_local_ranks,
            required_features=list(s.required_features),
            image=s.image,
            num_jobs=s.num_jobs,
            capture_shards=s.capture_shards,
            eval_shards=s.eval_shards,
        ),
        approved_native_versions=list(run.approved_native_versions),
        created_unix=int(run.created_unix),
        job_states=run.job_states,
        failure=run.failure,
    )


class WorkSignal:
    """Wakes long-polling `AcquireLease` calls when jobs become leasable."""

    def __init__(self):
        self._event = asyncio.Event()

    def current(self) -> asyncio.Event:
        return self._event

    def notify(self) -> None:
        # Waiters hold the old event; setting it wakes them all, the next
        # round of waiters gets a fresh one.
        self._event.set()
        self._event = asyncio.Event()


class Artifacts:
    """Uploads, downloads and blob garbage collection, shared by both services.

    Blocking work (staging writes, hashing, blob-store calls) runs in worker
    threads; the event loop only moves chunks and touches SQLite briefly.
    """

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


class ProviderService(provider_pb2_grpc.ProviderServiceServicer):
    def __init__(
        self, store: Store, artifacts: Artifacts, work: WorkSignal, *, max_wait: float, retry_after: int, gate: PublishGate | None = None, heartbeat_latency=None
    ):
        # `heartbeat_latency`: a prometheus Histogram observed with each heartbeat's handling time.
        self.heartbeat_latency = heartbeat_latency
        self.store = store
        self.artifacts = artifacts
        self.gate = gate or PublishGate(store, artifacts.blobs)
        self.work = work
        self.max_wait = max_wait
        self.retry_after = retry_after

    @staticmethod
    def _provider_id() -> str:
        return current_principal().provider_id

    async def Register(self, request, context):
        pid = self._provider_id()
        if request.protocol_version != PROTOCOL_VERSION:
            raise PolicyError(
                f"`protocol_version` `{request.protocol_version[:40]}` is not supported; this coordinator speaks `{PROTOCOL_VERSION}`\n"
                "hint: install a run-manager that matches this coordinator"
            )
        if request.launch_mode not in _LAUNCH_MODES:
            raise InvalidRequestError(f"`launch_mode` {request.launch_mode} is not LAUNCH_MODE_DOCKER or LAUNCH_MODE_NATIVE")
        check_version(request.client_version, "client_version")
        if request.native_client_version:
            check_version(request.native_client_version, "native_client_version")
        caps = request.capabilities
        if caps.backend not in BACKENDS:
            raise InvalidRequestError(f"`capabilities.backend` `{caps.backend[:40]}` is not one of {list(BACKENDS)}")
        if caps.device_count > 1024:
            raise InvalidRequestError(f"`capabilities.device_count` {caps.device_count} is implausible (at most 1024)")
        if len(caps.platform) > 64:
            raise InvalidRequestError("`capabilities.platform` is longer than 64 characters")
        features = check_features(caps.features, "capabilities.features")
        if len(request.name) > 200:
            raise InvalidRequestError("`name` is longer than 200 characters")
        if any(ord(c) < 0x20 or 0x7F <= ord(c) < 0xA0 for c in request.name):
            # It would reach the admin's terminal raw through `providers list`.
            raise InvalidRequestError("`name` contains a control character")
        self.store.providers.register(
            pid,
            Registration(
                client_version=request.client_version,
                native_client_version=request.native_client_version,
                launch_mode=request.launch_mode,
                native=request.launch_mode == provider_pb2.LAUNCH_MODE_NATIVE,
                backend=caps.backend,
                device_count=caps.device_count,
                features=features,
                capabilities=caps.SerializeToString(deterministic=True),
                name=request.name or pid,
                memory_bytes=check_uint(caps.memory_bytes, "capabilities.memory_bytes"),
            ),
        )
        ttl = self.store.leases.lease_ttl
        return provider_pb2.RegisterResponse(
            provider_id=pid,
            lease_ttl_seconds=max(1, math.ceil(ttl)),
            heartbeat_interval_seconds=max(1, int(ttl // 3)),
        )

    async def AcquireLease(self, request, context):
        pid = self._provider_id()
        if request.provider_id != pid:
            raise PermissionDeniedError(f"`provider_id` `{request.provider_id[:80]}` is not the provider this token belongs to")
        loop = asyncio.get_running_loop()
        deadline = loop.time() + min(float(request.wait_seconds), self.max_wait)
        while True:
            event = self.work.current()
            result = self.store.leases.acquire(pid)
            if isinstance(result, Grant):
                return provider_pb2.AcquireLeaseResponse(lease=self._lease_pb(result))
            if isinstance(result, Upgrade):
                return provider_pb2.AcquireLeaseResponse(
                    upgrade_required=provider_pb2.UpgradeRequired(
                        required_client_version=result.required_client_version, message=result.message
                    )
                )
            remaining = deadline - loop.time()
            if remaining <= 0:
                return provider_pb2.AcquireLeaseResponse(no_work=provider_pb2.NoWork(retry_after_seconds=self.retry_after))
            try:
                await asyncio.wait_for(event.wait(), timeout=remaining)
            except TimeoutError:
                pass

    @staticmethod
    def _lease_pb(g: Grant) -> provider_pb2.Lease:
        return provider_pb2.Lease(
            lease_id=g.lease_id,
            run_id=g.run_id,
            job_id=g.job_id,
            attempt=g.attempt,
            spec_json=g.spec_json,
            ttl_seconds=max(1, math.ceil(g.ttl_seconds)),
            resume_checkpoint=artifact_pb(g.resume_checkpoint),
            checkpoint_policy=g.checkpoint_policy,
            local_ranks=g.local_ranks,
            required_features=list(g.required_features),
            required_client_version=g.required_client_version,
            image=g.image,
            kind=g.kind,
            shard_index=g.shard_index,
            shard_count=g.shard_count,
            inputs=[artifact_pb(a) for a in g.inputs],
        )

    async def Heartbeat(self, request_iterator, context):
        pid = self._provider_id()
        observe = self.heartbeat_latency.observe if self.heartbeat_latency is not None else None
        async for req in request_iterator:
            t0 = time.perf_counter()
            if req.phase not in _PHASES:
                raise InvalidRequestError(f"`phase` {req.phase} is not a known Phase value")
            if len(req.metrics) > MAX_METRICS:
                raise InvalidRequestError(f"`metrics` has {len(req.metrics)} entries; at most {MAX_METRICS} are allowed")
            if any(len(k) > 64 for k in req.metrics):
                raise InvalidRequestError("a `metrics` key is longer than 64 characters")
            progress = Progress(
                phase=req.phase,
                step=req.step,
                total_steps=req.total_steps,
                committed_step=req.committed_step,
                metrics={k: (v if math.isfinite(v) else None) for k, v in req.metrics.items()},
            )
            directive, expires = self.store.leases.heartbeat(pid, req.lease_id, progress)
            resp = provider_pb2.HeartbeatResponse(directive=_DIRECTIVES[directive], lease_expires_unix=int(expires))
            if observe is not None:
                observe(time.perf_counter() - t0)
            yield resp

    async def ReportArtifact(self, request, context):
        # A one-message upload: the same checks, staging and commit as UploadArtifact.
        pid = self._provider_id()
        claim = Claim.of(request.artifact)

        async def one():
            view = memoryview(request.content)
            for i in range(0, len(view), CHUNK_BYTES):
                yield bytes(view[i : i + CHUNK_BYTES])

        record = await self.artifacts.upload(pid, request.lease_id, claim, 0, one())
        return provider_pb2.ReportArtifactResponse(artifact=artifact_pb(record))

    async def UploadArtifact(self, request_iterator, context):
        pid = self._provider_id()
        it = aiter(request_iterator)
        first = await self.artifacts.next_message(it, "UploadArtifact")
        if first is None or first.WhichOneof("msg") != "header":
            raise InvalidRequestError("UploadArtifact: the first message must be a `header`")
        h = first.header
        claim = Claim.of(h.artifact)
        offset = check_uint(h.offset, "header.offset")

        async def chunks():
            while (msg := await self.artifacts.next_message(it, f"UploadArtifact `{claim.name}`")) is not None:
                if msg.WhichOneof("msg") != "chunk":
                    raise InvalidRequestError(f"UploadArtifact `{claim.name}`: after the header only `chunk` messages may follow")
                yield msg.chunk

        record = await self.artifacts.upload(pid, h.lease_id, claim, offset, chunks())
        return provider_pb2.UploadArtifactResponse(artifact=artifact_pb(record))

    async def UploadOffset(self, request, context):
        pid = self._provider_id()
        lease = self.store.leases.live_lease(pid, request.lease_id)
        claim = Claim.of(request.artifact)
        offset, committed = await self.artifacts.offset(lease, claim)
        return provider_pb2.UploadOffsetResponse(offset=offset, committed=committed)

    async def DownloadArtifact(self, request, context):
        pid = self._provider_id()
        lease = self.store.leases.live_lease(pid, request.lease_id)
        name = check_name(request.name)
        sha = check_sha256(request.sha256, "sha256")
        record = self.store.leases.find_input(lease.job_id, name, sha)
        async for msg in self.artifacts.stream(record, request.offset):
            yield msg

    async def FinishAttempt(self, request, context):
        pid = self._provider_id()
        outcome = _OUTCOMES.get(request.outcome)
        if outcome is None:
            raise InvalidRequestError(f"`outcome` {request.outcome} is not SUCCEEDED, FAILED, CANCELLED or RETRYABLE")
        lease = self.store.leases.live_lease(pid, request.lease_id)
        state = self.store.leases.finish(pid, request.lease_id, outcome, request.message)
        if state == "succeeded":
            # The regression gate decides before the provider hears back, so an admin who sees the
            # job succeeded also sees whether its export is published.
            await self.gate.decide_job(lease.job_id)
        return provider_pb2.FinishAttemptResponse(job_state=state)


class AdminService(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, store: Store, artifacts: Artifacts, gate: PublishGate | None = None):
        self.store = store
        self.artifacts = artifacts
        self.gate = gate or PublishGate(store, artifacts.blobs)

    async def CreateRun(self, request, context):
        s = request.spec
        spec = RunSpecData(
            name=s.name,
            spec_json=s.spec_json,
            required_client_version=s.required_client_version,
            checkpoint_policy=s.checkpoint_policy or "durable",
            max_local_ranks=s.max_local_ranks or 1,
            required_features=tuple(s.required_features),
            image=s.image,
            num_jobs=s.num_jobs or 1,
            capture_shards=s.capture_shards,
            eval_shards=s.eval_shards,
        )
        return admin_pb2.CreateRunResponse(run=run_pb(self.store.runs.create_run(spec)))

    async def ListRuns(self, request, context):
        runs, token = self.store.runs.list_runs(request.page_size, request.page_token)
        return admin_pb2.ListRunsResponse(runs=[run_pb(r) for r in runs], next_page_token=token)

    async def GetRun(self, request, context):
        run = self.store.runs.get_run(request.run_id)
        jobs, token = self.store.runs.run_jobs(request.run_id, request.page_size, request.page_token)
        # An export the gate left undecided: a graph run's train job whose run failed before its
        # evaluate job reported is decided (held back) now; one still waiting stays undecided.
        for i, j in enumerate(jobs):
            if j.kind == "train" and j.export is not None and j.publication is None:
                jobs[i] = dataclasses.replace(j, publication=await self.gate.decide_job(j.job_id))
        return admin_pb2.GetRunResponse(
            run=run_pb(run),
            jobs=[
                admin_pb2.JobInfo(
                    job_id=j.job_id,
                    state=j.state,
                    attempts=j.attempts,
                    artifact_count=j.artifact_count,
                    export=artifact_pb(j.export),
                    publication=publication_pb(j.publication),
                    kind=j.kind,
                    shard_index=j.shard_index,
                    shard_count=j.shard_count,
                    needs=list(j.needs),
                    waiting_for=list(j.waiting_for),
                    reason=j.reason,
                    waiting_reason=j.waiting_reason,
                    provenance=[admin_pb2.InputSource(**dataclasses.asdict(src)) for src in j.provenance],
                )
                for j in jobs
            ],
            next_page_token=token,
        )

    async def ListArtifacts(self, request, context):
        job_id = self.store.runs.job_of(request.run_id, request.job_id)
        rows, token = self.store.records.list_artifacts(job_id, all_attempts=request.all_attempts, page_size=request.page_size, page_token=request.page_token)
        return admin_pb2.ListArtifactsResponse(
            artifacts=[
                admin_pb2.ArtifactInfo(
                    job_id=r.job_id, attempt=r.attempt, attempt_state=r.attempt_state, artifact=artifact_pb(r.record), created_unix=int(r.created_unix)
                )
                for r in rows
            ],
            next_page_token=token,
        )

    async def DownloadArtifact(self, request, context):
        job_id = self.store.runs.job_of(request.run_id, request.job_id)
        name = check_name(request.name)
        sha = check_sha256(request.sha256, "sha256") if request.sha256 else ""
        record = self.store.records.find_record(job_id, name, sha)
        if record.kind == "export":
            self.store.publications.check_published(request.run_id, job_id)
        async for msg in self.artifacts.stream(record, request.offset):
            yield msg

    async def PublishRun(self, request, context):
        job_id = self.store.runs.job_of(request.run_id, request.job_id)
        if self.store.publications.publication(job_id) is None:
            await self.gate.decide_job(job_id)  # one a stopped coordinator left undecided
        pub = self.store.publications.publish_override(job_id, override=request.override, note=request.note, peer=context.peer() or "")
        if pub.override_unix is not None and request.override:
            log.warning("export of job `%s` (run `%s`) published by admin override from %s: %s", job_id, request.run_id, pub.override_peer, pub.override_note or "(no note)")
        return admin_pb2.PublishRunResponse(job_id=job_id, publication=publication_pb(pub))

    async def ApproveVersion(self, request, context):
        return admin_pb2.ApproveVersionResponse(run=run_pb(self.store.runs.approve_version(request.run_id, request.version)))

    async def CreateProvider(self, request, context):
        provider_id, token = self.store.credentials.create_provider(request.name)
        return admin_pb2.CreateProviderResponse(token=token, provider_id=provider_id)

    async def ListProviders(self, request, context):
        return admin_pb2.ListProvidersResponse(providers=[provider_pb(p) for p in self.store.providers.list_providers()])

    async def RevokeProvider(self, request, context):
        aborted = self.store.credentials.revoke_provider(request.provider_id)
        return admin_pb2.RevokeProviderResponse(provider=provider_pb(self.store.providers.get_provider(request.provider_id)), aborted_leases=aborted)

    async def RotateProviderToken(self, request, context):
        token, expires = self.store.credentials.rotate_token(request.provider_id, request.grace_seconds)
        return admin_pb2.RotateProviderTokenResponse(token=token, old_token_expires_unix=math.ceil(expires))

    async def CancelJob(self, request, context):
        return admin_pb2.CancelJobResponse(job_state=self.store.jobs.cancel_job(request.job_id))

    async def RequestCheckpoint(self, request, context):
        return admin_pb2.RequestCheckpointResponse(job_state=self.store.jobs.request_checkpoint(request.job_id))
