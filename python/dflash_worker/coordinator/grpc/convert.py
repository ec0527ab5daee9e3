"""Store records to `dflash.v1` messages and back: the one place a protobuf message is built from a
record or a record from a message, so both services (and their tests) read the same field map.

Pure functions, no I/O: `provider.py` and `admin.py` call them after validating what a client sent.
"""

from __future__ import annotations

import dataclasses
import math

from ...proto.dflash.v1 import admin_pb2, provider_pb2
from ..artifacts.names import ArtifactRecord
from ..store import AuditRow, Grant, JobRow, ProviderRow, PublicationRow, RunRow, RunSpecData, StoredArtifact


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
        last_unquarantine=audit_pb(p.last_unquarantine),
    )


def audit_pb(a: AuditRow | None) -> admin_pb2.AuditRecord | None:
    if a is None:
        return None
    return admin_pb2.AuditRecord(
        created_unix=int(a.created_unix), action=a.action, provider_id=a.provider_id, reason=a.reason, peer=a.peer, detail=a.detail
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


def lease_pb(g: Grant) -> provider_pb2.Lease:
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


def job_pb(j: JobRow) -> admin_pb2.JobInfo:
    return admin_pb2.JobInfo(
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


def stored_artifact_pb(r: StoredArtifact) -> admin_pb2.ArtifactInfo:
    return admin_pb2.ArtifactInfo(
        job_id=r.job_id, attempt=r.attempt, attempt_state=r.attempt_state, artifact=artifact_pb(r.record), created_unix=int(r.created_unix)
    )


def run_spec_data(s: admin_pb2.RunSpec) -> RunSpecData:
    """The run a `CreateRun` asks for, its unset fields at their defaults (`RunSpecData` checks the rest)."""
    return RunSpecData(
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
