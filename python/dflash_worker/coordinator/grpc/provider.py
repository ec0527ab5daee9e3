"""`dflash.v1.ProviderService`: what a run-manager calls (register, lease, heartbeat, upload, download, finish).

The servicer validates every field a provider controls (unknown enum values included), runs the
long-poll for `AcquireLease` (woken by `WorkSignal` when jobs become leasable) and hands uploads
and downloads to the upload engine (`uploads.Artifacts`). Authentication happened in
`auth.AuthInterceptor`; `current_principal()` names the caller.
"""

from __future__ import annotations

import asyncio
import math
import time

from ...errors import InvalidRequestError, PermissionDeniedError, PolicyError
from ...proto.dflash.v1 import provider_pb2, provider_pb2_grpc
from ..artifacts.names import Claim, check_name, check_sha256, check_uint
from ..artifacts.publish import PublishGate
from ..auth import current_principal
from ..policy import BACKENDS, PROTOCOL_VERSION, check_features, check_version
from ..store import Grant, Progress, Registration, Store, Upgrade
from .convert import artifact_pb, lease_pb
from .uploads import Artifacts

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


class ProviderService(provider_pb2_grpc.ProviderServiceServicer):
    """The provider-facing RPCs; one instance serves every provider (the caller is `current_principal()`)."""

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
                return provider_pb2.AcquireLeaseResponse(lease=lease_pb(result))
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
