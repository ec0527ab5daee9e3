"""gRPC servicers for `dflash.v1.ProviderService` and `dflash.v1.AdminService`.

These translate protobuf messages to and from the `Store`, validate every
field a client controls (unknown enum values included) and run the long-poll
for `AcquireLease`. Authentication happened in `auth.AuthInterceptor`;
`current_principal()` names the caller.
"""

from __future__ import annotations

import asyncio
import math

from ..errors import InvalidRequestError, PermissionDeniedError, PolicyError
from ..proto.dflash.v1 import admin_pb2, admin_pb2_grpc, provider_pb2, provider_pb2_grpc
from .artifacts import ArtifactRecord, ArtifactStore, check_kind, check_name, check_sha256
from .auth import current_principal
from .policy import BACKENDS, PROTOCOL_VERSION, check_features, check_version
from .store import Grant, Progress, ProviderRow, Registration, RunRow, RunSpecData, Store, Upgrade

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
        ),
        approved_native_versions=list(run.approved_native_versions),
        created_unix=int(run.created_unix),
        job_states=run.job_states,
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


class ProviderService(provider_pb2_grpc.ProviderServiceServicer):
    def __init__(self, store: Store, artifacts: ArtifactStore, work: WorkSignal, *, max_wait: float, retry_after: int):
        self.store = store
        self.artifacts = artifacts
        self.work = work
        self.max_wait = max_wait
        self.retry_after = retry_after
        self._artifact_lock = asyncio.Lock()

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
        self.store.register(
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
            ),
        )
        ttl = self.store.lease_ttl
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
            result = self.store.acquire(pid)
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
        )

    async def Heartbeat(self, request_iterator, context):
        pid = self._provider_id()
        async for req in request_iterator:
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
            directive, expires = self.store.heartbeat(pid, req.lease_id, progress)
            yield provider_pb2.HeartbeatResponse(directive=_DIRECTIVES[directive], lease_expires_unix=int(expires))

    async def ReportArtifact(self, request, context):
        pid = self._provider_id()
        lease = self.store.live_lease(pid, request.lease_id)
        a = request.artifact
        name = check_name(a.name)
        kind = check_kind(a.kind)
        sha = check_sha256(a.sha256)
        if request.content and a.uri:
            raise InvalidRequestError(f"artifact `{name}`: send either `content` or `artifact.uri`, not both")
        if not a.uri:
            # Verified before the idempotency check too: a repeat report with
            # the right hash but other bytes is refused, not silently accepted.
            await asyncio.to_thread(self.artifacts.check_content, name, request.content, sha, a.size_bytes)
        # One artifact write at a time: the check-then-write-then-record
        # sequence must not interleave for the same name.
        async with self._artifact_lock:
            existing = self.store.existing_artifact(lease.job_id, name, sha)
            if existing is not None:
                self.store.live_lease(pid, request.lease_id)
                return provider_pb2.ReportArtifactResponse(artifact=artifact_pb(existing))
            if a.uri:
                uri = await asyncio.to_thread(self.artifacts.verify_uri, name, a.uri, sha, a.size_bytes)
            else:
                uri = await asyncio.to_thread(
                    self.artifacts.store_inline, lease.run_id, lease.job_id, name, request.content, sha, a.size_bytes
                )
            record = ArtifactRecord(name=name, kind=kind, sha256=sha, size_bytes=a.size_bytes, uri=uri, step=a.step)
            # Re-checks the lease: it may have expired while the bytes were written.
            record = self.store.record_artifact(pid, request.lease_id, record)
        return provider_pb2.ReportArtifactResponse(artifact=artifact_pb(record))

    async def FinishAttempt(self, request, context):
        pid = self._provider_id()
        outcome = _OUTCOMES.get(request.outcome)
        if outcome is None:
            raise InvalidRequestError(f"`outcome` {request.outcome} is not SUCCEEDED, FAILED, CANCELLED or RETRYABLE")
        state = self.store.finish(pid, request.lease_id, outcome, request.message)
        return provider_pb2.FinishAttemptResponse(job_state=state)


class AdminService(admin_pb2_grpc.AdminServiceServicer):
    def __init__(self, store: Store):
        self.store = store

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
        )
        return admin_pb2.CreateRunResponse(run=run_pb(self.store.create_run(spec)))

    async def ListRuns(self, request, context):
        return admin_pb2.ListRunsResponse(runs=[run_pb(r) for r in self.store.list_runs()])

    async def GetRun(self, request, context):
        run = self.store.get_run(request.run_id)
        jobs = [
            admin_pb2.JobInfo(job_id=j.job_id, state=j.state, attempts=j.attempts, artifacts=[artifact_pb(a) for a in j.artifacts])
            for j in self.store.run_jobs(request.run_id)
        ]
        return admin_pb2.GetRunResponse(run=run_pb(run), jobs=jobs)

    async def ApproveVersion(self, request, context):
        return admin_pb2.ApproveVersionResponse(run=run_pb(self.store.approve_version(request.run_id, request.version)))

    async def CreateProvider(self, request, context):
        provider_id, token = self.store.create_provider(request.name)
        return admin_pb2.CreateProviderResponse(token=token, provider_id=provider_id)

    async def ListProviders(self, request, context):
        return admin_pb2.ListProvidersResponse(providers=[provider_pb(p) for p in self.store.list_providers()])

    async def RevokeProvider(self, request, context):
        aborted = self.store.revoke_provider(request.provider_id)
        return admin_pb2.RevokeProviderResponse(provider=provider_pb(self.store.get_provider(request.provider_id)), aborted_leases=aborted)

    async def RotateProviderToken(self, request, context):
        token, expires = self.store.rotate_token(request.provider_id, request.grace_seconds)
        return admin_pb2.RotateProviderTokenResponse(token=token, old_token_expires_unix=math.ceil(expires))

    async def CancelJob(self, request, context):
        return admin_pb2.CancelJobResponse(job_state=self.store.cancel_job(request.job_id))

    async def RequestCheckpoint(self, request, context):
        return admin_pb2.RequestCheckpointResponse(job_state=self.store.request_checkpoint(request.job_id))
