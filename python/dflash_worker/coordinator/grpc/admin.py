"""`dflash.v1.AdminService`: what the admin CLI (`client.AdminClient`) calls.

Runs, providers and their tokens, artifact listings and downloads, the regression gate's
override, job steering. The auth interceptor admitted only the admin token; the store checks
what the request names (runs, jobs, providers), so each handler is a call and a conversion
(`convert`).
"""

from __future__ import annotations

import dataclasses
import logging
import math

from ...proto.dflash.v1 import admin_pb2, admin_pb2_grpc
from ..artifacts.names import check_name, check_sha256
from ..artifacts.publish import PublishGate
from ..store import Store
from .convert import audit_pb, job_pb, provider_pb, publication_pb, run_pb, run_spec_data, stored_artifact_pb
from .uploads import Artifacts

log = logging.getLogger("dflash_worker.coordinator")


class AdminService(admin_pb2_grpc.AdminServiceServicer):
    """The admin RPCs, over the same store and upload engine as `ProviderService`."""

    def __init__(self, store: Store, artifacts: Artifacts, gate: PublishGate | None = None):
        self.store = store
        self.artifacts = artifacts
        self.gate = gate or PublishGate(store, artifacts.blobs)

    async def CreateRun(self, request, context):
        return admin_pb2.CreateRunResponse(run=run_pb(self.store.runs.create_run(run_spec_data(request.spec))))

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
        return admin_pb2.GetRunResponse(run=run_pb(run), jobs=[job_pb(j) for j in jobs], next_page_token=token)

    async def ListArtifacts(self, request, context):
        job_id = self.store.runs.job_of(request.run_id, request.job_id)
        rows, token = self.store.records.list_artifacts(job_id, all_attempts=request.all_attempts, page_size=request.page_size, page_token=request.page_token)
        return admin_pb2.ListArtifactsResponse(artifacts=[stored_artifact_pb(r) for r in rows], next_page_token=token)

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

    async def UnquarantineProvider(self, request, context):
        entry = self.store.providers.unquarantine(request.provider_id, reason=request.reason, peer=context.peer() or "")
        log.warning("provider `%s` unquarantined by an admin from %s: %s", request.provider_id, entry.peer, entry.reason)
        return admin_pb2.UnquarantineProviderResponse(provider=provider_pb(self.store.providers.get_provider(request.provider_id)), audit=audit_pb(entry))

    async def CancelJob(self, request, context):
        return admin_pb2.CancelJobResponse(job_state=self.store.jobs.cancel_job(request.job_id))

    async def RequestCheckpoint(self, request, context):
        return admin_pb2.RequestCheckpointResponse(job_state=self.store.jobs.request_checkpoint(request.job_id))
