"""Issue 34: a failed attempt's checkpoints and capture shards never decide a job's result unless the run says so.

A hostile provider is a scripted client on the real gRPC API of a coordinator process: it takes a
lease, uploads a checkpoint whose manifest claims step 2**62, a plausible checkpoint (weights scaled
by 0.5: to the coordinator, just other bytes) or forged capture shards with matching sidecars, and
ends its attempt RETRYABLE. The next attempt, on an honest provider, is not handed them under the
default `trust_inputs` (`own`), nor under `succeeded`; it is under `any`; the provider that produced
them gets its own back under `own`. Every lease's inputs are recorded with the attempt and provider
that produced them (`JobInfo.provenance`), transitively through the attempts that handed them on.
"""

from __future__ import annotations

import hashlib
import json
import sqlite3

import pytest
from coordinator_helpers import SPEC, Provider, registration, run_spec

from dflash_worker.coordinator.artifacts.names import Claim
from dflash_worker.coordinator.policy import JOB_GRAPH_FEATURE
from dflash_worker.coordinator.store import RunSpecData, Store
from dflash_worker.errors import InvalidRequestError
from dflash_worker.proto.dflash.v1 import provider_pb2

RETRYABLE = provider_pb2.ATTEMPT_OUTCOME_RETRYABLE
GRAPH_FEATURES = ("flash_attention_2", JOB_GRAPH_FEATURE)


def _spec(trust: str | None, **extra) -> str:
    doc = {**json.loads(SPEC), **extra}
    if trust is not None:
        doc["trust_inputs"] = trust
    return json.dumps(doc)


def _hostile_checkpoint(p: Provider, lease_id: str, lie: str) -> provider_pb2.Artifact:
    """What a lying provider uploads as its checkpoint: a manifest claiming step 2**62, or weights scaled by 0.5."""
    if lie == "step-2**62":
        return p.checkpoint(lease_id, "run/checkpoints/step-99999999", {"trainable.safetensors": b"\0" * 64}, step=2**62)
    return p.checkpoint(lease_id, "run/checkpoints/step-00000002", {"trainable.safetensors": b"scaled by 0.5" * 8}, step=2)


def _providers(coordinator, provider_factory, features=("flash_attention_2",)) -> tuple[Provider, Provider]:
    hostile, honest = provider_factory("hostile"), provider_factory("honest")
    hostile.register(name="hostile", features=features)
    honest.register(name="honest", features=features)
    return hostile, honest


def _job(admin, run_id: str, job_id: str):
    (job,) = [j for j in admin.get_run(run_id).jobs if j.job_id == job_id]
    return job


def _sources(job) -> list[tuple]:
    return [(s.role, s.provider, s.attempt, s.attempt_state, s.artifacts, s.depth) for s in job.provenance]


@pytest.mark.parametrize("lie", ["step-2**62", "scaled-weights"])
def test_a_failed_attempt_s_checkpoint_is_not_handed_to_another_provider_by_default(coordinator, provider_factory, lie):
    hostile, honest = _providers(coordinator, provider_factory)
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("default-trust"))
        bad_lease = hostile.acquire().lease
        bad = _hostile_checkpoint(hostile, bad_lease.lease_id, lie)
        assert hostile.finish(bad_lease.lease_id, RETRYABLE, "crashed, supposedly") == "queued"

        # The honest provider's attempt starts from nothing: the hostile attempt never succeeded.
        lease = honest.acquire().lease
        assert (lease.job_id, lease.attempt) == (bad_lease.job_id, 2)
        assert not lease.HasField("resume_checkpoint"), lease.resume_checkpoint
        assert _sources(_job(admin, run.run_id, lease.job_id)) == []
        honest.checkpoint(lease.lease_id, "run/checkpoints/step-00000001", {"trainable.safetensors": b"honest"}, step=1)
        assert honest.finish(lease.lease_id, RETRYABLE, "preempted") == "queued"

        # A provider resuming its own crashed work is handed its own checkpoint back (`own`): it could
        # have sent the same bytes in a successful attempt anyway. The provenance says whose it is.
        again = hostile.acquire().lease
        assert again.attempt == 3 and again.resume_checkpoint == bad
        assert _sources(_job(admin, run.run_id, again.job_id)) == [("resume", "hostile", 1, "retryable", 1, 1)]
        assert hostile.finish(again.lease_id, RETRYABLE, "again") == "queued"
        # ... and the honest one its own, never the hostile one's higher step.
        last = honest.acquire().lease
        assert last.attempt == 4 and last.resume_checkpoint.name == "run/checkpoints/step-00000001/manifest.json"
        assert honest.finish(last.lease_id) == "succeeded"
        job = _job(admin, run.run_id, last.job_id)
        assert _sources(job) == [("resume", "honest", 2, "retryable", 1, 1)]
        assert job.provenance[0].provider_id == honest.provider_id and job.provenance[0].job_id == last.job_id


@pytest.mark.parametrize("trust", ["any", "succeeded"])
def test_the_run_policy_decides_whose_checkpoints_are_handed_on(coordinator, provider_factory, trust):
    hostile, honest = _providers(coordinator, provider_factory)
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec(f"trust-{trust}", spec_json=_spec(trust)))
        bad_lease = hostile.acquire().lease
        bad = _hostile_checkpoint(hostile, bad_lease.lease_id, "step-2**62")
        assert hostile.finish(bad_lease.lease_id, RETRYABLE, "crashed") == "queued"
        lease = honest.acquire().lease
        if trust == "any":  # today's behaviour, by choice: recorded, and shown as untrusted
            assert lease.resume_checkpoint == bad
            assert honest.finish(lease.lease_id) == "succeeded"
            job = _job(admin, run.run_id, lease.job_id)
            assert _sources(job) == [("resume", "hostile", 1, "retryable", 1, 1)]
            assert job.provenance[0].attempt_id and job.provenance[0].provider_id == hostile.provider_id
        else:  # nobody's failed attempt, not even the provider's own
            assert not lease.HasField("resume_checkpoint")
            assert honest.finish(lease.lease_id, RETRYABLE, "lost") == "queued"
            assert not hostile.acquire().lease.HasField("resume_checkpoint")


def _graph_until_capture(admin, hostile: Provider, trust: str | None):
    """A `--capture-shards 1` run whose prepare job the hostile provider did honestly; returns (run, capture lease)."""
    run = admin.create_run(run_spec(f"graph-{trust}", spec_json=_spec(trust), capture_shards=1))
    prep = hostile.acquire().lease
    hostile.upload(prep.lease_id, "data/manifest.json", b'{"examples": 3}', kind="manifest")
    assert hostile.finish(prep.lease_id) == "succeeded"
    cap = hostile.acquire().lease
    assert cap.kind == "capture" and [a.name for a in cap.inputs] == ["data/manifest.json"]
    return run, cap


FORGED = {"capture/shard-00000.safetensors": b"features scaled by 0.5", "capture/shard-00000.json": b'{"sha256": "matches the forged shard"}'}


@pytest.mark.parametrize("trust", [None, "any"])
def test_forged_capture_shards_of_a_failed_attempt_are_not_reused_by_default(coordinator, provider_factory, trust):
    hostile, honest = _providers(coordinator, provider_factory, features=GRAPH_FEATURES)
    with coordinator.admin() as admin:
        run, cap = _graph_until_capture(admin, hostile, trust)
        for name, data in FORGED.items():
            hostile.upload(cap.lease_id, name, data, kind="capture")
        assert hostile.finish(cap.lease_id, RETRYABLE, "crashed after two shards") == "queued"

        again = honest.acquire().lease
        assert (again.job_id, again.attempt) == (cap.job_id, 2)
        handed = {a.name: a.sha256 for a in again.inputs if a.kind == "capture"}
        if trust is None:
            assert handed == {}
            return
        assert handed == {n: hashlib.sha256(d).hexdigest() for n, d in FORGED.items()}
        # The honest capture keeps them (they verify against their sidecars) and reports them as its own.
        for name, data in FORGED.items():
            honest.upload(again.lease_id, name, data, kind="capture")
        assert honest.finish(again.lease_id) == "succeeded"
        train = honest.acquire().lease
        assert train.kind == "train"
        # The train job's provenance names the hostile attempt, through the capture attempt that handed its shards on.
        got = _sources(_job(admin, run.run_id, train.job_id))
        assert got[0] == ("input", "hostile", 1, "retryable", 2, 2), got
        assert sorted(got[1:]) == [("input", "honest", 2, "succeeded", 2, 1), ("input", "hostile", 1, "succeeded", 1, 1)], got


def test_trust_inputs_must_be_one_of_the_policies(coordinator):
    with coordinator.admin() as admin:
        for bad in ("all", "", 3, None):
            with pytest.raises(InvalidRequestError) as e:  # the admin client's mapping of INVALID_ARGUMENT
                admin.create_run(run_spec(f"bad-{bad}", spec_json=json.dumps({"trust_inputs": bad})))
            assert "(INVALID_ARGUMENT): `spec.spec_json.trust_inputs` must be one of `succeeded`, `own`, `any`" in str(e.value), e.value
        for good in ("own", "succeeded", "any"):
            assert admin.create_run(run_spec(f"good-{good}", spec_json=_spec(good))).run_id


REG = registration()


def test_a_version_6_database_gets_the_safe_default(tmp_path):
    """Schema 6 handed every attempt's checkpoints to anyone: its runs are migrated to `own`."""
    path = tmp_path / "coordinator.db"
    store = Store(path)
    a, _ = store.credentials.create_provider("a")
    b, _ = store.credentials.create_provider("b")
    store.providers.register(a, REG)
    store.providers.register(b, REG)
    run = store.runs.create_run(RunSpecData(name="old", spec_json=SPEC, required_client_version="0.1.0"))
    store.db.execute("UPDATE runs SET trust_inputs='any'")  # what schema 6 did, whatever the column says
    g = store.leases.acquire(a)
    store.records.record(store.leases.live_lease(a, g.lease_id), Claim(name="ck/manifest.json", kind="checkpoint", sha256="c" * 64, size_bytes=2, step=3))
    store.leases.finish(a, g.lease_id, "retryable", "lost")
    store.close()
    db = sqlite3.connect(path, isolation_level=None)
    db.execute("DROP TABLE attempt_inputs")
    db.execute("ALTER TABLE runs DROP COLUMN trust_inputs")
    for col in ("quarantined_unix", "quarantine_reason"):  # nor what schema 8 added (verification by replay)
        db.execute(f"ALTER TABLE providers DROP COLUMN {col}")
    db.execute("DROP TABLE audit_log")  # nor what schema 9 added
    db.execute("UPDATE meta SET value='6' WHERE key='schema_version'")
    db.close()

    store = Store(path)
    try:
        assert store.runs.get_run(run.run_id).spec.trust_inputs == "own"
        assert store.leases.acquire(b).resume_checkpoint is None
    finally:
        store.close()
