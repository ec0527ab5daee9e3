"""Issue 34 item 2: verification by replay of capture jobs (a run's `verify_fraction`).

Scripted providers on the real gRPC API of a coordinator process. A graph run whose spec says
`verify_fraction` gets a `verify` job for that share of its capture jobs; it needs the capture job,
train needs it, and it is never leased to the provider whose attempt produced the capture. The
verifier uploads its recomputed shards under `verify/` + the producer's names: the same digests let
train start; another digest is disputed until a third provider recomputes the same (issue 57 item 2;
tests/coordinator/test_verify_tiebreak.py), then discards the producer's attempt, requeues the capture
job (not on the producer), makes the verify job wait for the redo, and quarantines the producer (leased
nothing, shown by `providers list`, the status page and /metrics).
"""

from __future__ import annotations

import json

import pytest
from coordinator_helpers import SPEC, Provider, run_spec
from test_metrics import scrape, v
from test_status_page import get

from dflash_worker.coordinator.policy import JOB_GRAPH_FEATURE
from dflash_worker.coordinator.store import RunSpecData
from dflash_worker.errors import InvalidRequestError

FEATURES = ("flash_attention_2", JOB_GRAPH_FEATURE)
SHARD = b"honest features " * 64
SIDECAR = b'{"sha256": "honest"}'


@pytest.fixture
def coordinator(start_coordinator):
    """With the status page and /metrics."""
    return start_coordinator("--http-listen", "127.0.0.1:0", warm=True)


def _spec(**extra) -> str:
    return json.dumps({**json.loads(SPEC), **extra})


def _providers(provider_factory, *names: str, backend: str = "cuda") -> list[Provider]:
    out = []
    for name in names:
        p = provider_factory(name)
        p.register(name=name, features=FEATURES, backend=backend)
        out.append(p)
    return out


def _jobs(admin, run_id: str) -> dict[tuple[str, int], object]:
    """By (kind, shard): a capture's verify job, not the train replay's (created last; tests/coordinator/test_verify_train.py)."""
    out = {}
    for j in admin.get_run(run_id).jobs:
        out.setdefault((j.kind, j.shard_index), j)
    return out


def _prepare(p: Provider) -> None:
    lease = p.acquire().lease
    assert lease.kind == "prepare"
    p.upload(lease.lease_id, "data/manifest.json", b'{"examples": 3}', kind="manifest")
    assert p.finish(lease.lease_id) == "succeeded"


def _capture(p: Provider, shard: bytes = SHARD, sidecar: bytes = SIDECAR):
    lease = p.acquire().lease
    assert lease.kind == "capture", lease
    p.upload(lease.lease_id, "capture/shard-00000.safetensors", shard, kind="capture")
    p.upload(lease.lease_id, "capture/shard-00000.json", sidecar, kind="capture")
    assert p.finish(lease.lease_id) == "succeeded"
    return lease


def _verify(p: Provider, shard: bytes = SHARD, sidecar: bytes = SIDECAR, *, expect: str):
    lease = p.acquire().lease
    assert lease.kind == "verify", lease
    names = {a.name for a in lease.inputs}
    assert {"capture/shard-00000.safetensors", "capture/shard-00000.json", "data/manifest.json"} <= names
    p.upload(lease.lease_id, "verify/capture/shard-00000.safetensors", shard, kind="capture")
    p.upload(lease.lease_id, "verify/capture/shard-00000.json", sidecar, kind="capture")
    assert p.finish(lease.lease_id) == expect
    return lease


def _no_work(p: Provider) -> bool:
    return p.acquire().WhichOneof("result") == "no_work"


def test_verify_fraction_is_checked_and_selects_a_deterministic_share():
    base = dict(name="r", required_client_version="0.1.0")
    with pytest.raises(InvalidRequestError, match="verify_fraction` must be a number from 0 to 1"):
        RunSpecData(**base, spec_json=_spec(verify_fraction=1.5), capture_shards=2)
    with pytest.raises(InvalidRequestError, match="verify_fraction` must be a number"):
        RunSpecData(**base, spec_json=_spec(verify_fraction="all"), capture_shards=2)
    with pytest.raises(InvalidRequestError, match="spot-checks the capture jobs of a job graph"):
        RunSpecData(**base, spec_json=_spec(verify_fraction=0.5))
    spec = RunSpecData(**base, spec_json=_spec(verify_fraction=0.25), capture_shards=8)
    picked = spec.verified_shards("run-a")
    assert len(picked) == 2 and picked == spec.verified_shards("run-a")
    assert any(spec.verified_shards(f"run-{i}") != picked for i in range(20))  # depends on the run, not fixed
    assert RunSpecData(**base, spec_json=SPEC, capture_shards=8).verified_shards("run-a") == []
    graph = RunSpecData(**base, spec_json=_spec(verify_fraction=1), capture_shards=2).graph("run-a")
    kinds = [k for k, *_ in graph]
    assert kinds == ["prepare", "capture", "capture", "train", "evaluate", "verify", "verify", "verify"]
    assert graph[5][1:] == (0, 2, (0, 1)) and graph[6][1:] == (1, 2, (0, 2))
    assert graph[3][3] == (0, 1, 2, 5, 6)  # train needs both verify jobs
    assert graph[7][1:] == (0, 1, (0, 1, 2, 3)) and graph[4][3] == (0, 3, 7)  # the train replay: evaluate needs it


def test_a_matching_verify_lets_train_start_and_is_never_leased_to_the_producer(coordinator, provider_factory):
    producer, verifier, mps = _providers(provider_factory, "producer", "verifier", "mps-box")
    mps.register(name="mps-box", features=FEATURES, backend="mps")
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("verify-match", spec_json=_spec(verify_fraction=1), capture_shards=1))
        _prepare(producer)
        _capture(producer)
        jobs = _jobs(admin, run.run_id)
        assert jobs[("verify", 0)].waiting_for == [] and jobs[("train", 0)].waiting_for == [jobs[("verify", 0)].job_id]
        # Neither the producer nor a provider of another backend gets the verify job (nor train, which waits for it).
        assert _no_work(producer) and _no_work(mps)
        why = _jobs(admin, run.run_id)[("verify", 0)].waiting_reason
        assert "only to a provider other than the one that produced its capture (or its training), on the same backend" in why, why
        lease = _verify(verifier, expect="succeeded")
        assert lease.shard_index == 0 and lease.shard_count == 1
        train = producer.acquire().lease
        assert train.kind == "train"
        # Train's inputs are the capture's records and prepare's, never the verifier's recomputations.
        assert sorted(a.name for a in train.inputs) == ["capture/shard-00000.json", "capture/shard-00000.safetensors", "data/manifest.json"]
        assert all(not p.quarantined_unix for p in admin.list_providers())


def test_a_mismatch_discards_the_capture_requeues_it_elsewhere_and_quarantines_the_producer(coordinator, provider_factory):
    hostile, verifier, third = _providers(provider_factory, "hostile", "verifier", "third")
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("verify-mismatch", spec_json=_spec(verify_fraction=1, trust_inputs="any"), capture_shards=1))
        _prepare(hostile)
        forged = _capture(hostile, shard=b"scaled features " * 64, sidecar=b'{"sha256": "forged, matching"}')
        verify = _verify(verifier, expect="queued")  # disputed: a tie-break settles it
        assert not [p for p in admin.list_providers() if p.quarantined_unix]
        _verify(third, expect="queued")  # the same bytes as the verifier's: it waits for the capture job's redo
        jobs = _jobs(admin, run.run_id)
        cap, ver, train = jobs[("capture", 0)], jobs[("verify", 0)], jobs[("train", 0)]
        assert cap.state == "queued" and "recomputed capture job" in cap.reason and cap.attempts == 1
        assert ver.state == "queued" and ver.waiting_for == [cap.job_id]
        assert train.state == "queued" and set(train.waiting_for) == {cap.job_id, ver.job_id}

        # The hostile provider is quarantined: leased nothing, visible to the admin.
        (q,) = [p for p in admin.list_providers() if p.quarantined_unix]
        assert q.provider_id == hostile.provider_id
        assert verify.job_id in q.quarantine_reason and forged.job_id in q.quarantine_reason and "capture/shard-00000" in q.quarantine_reason
        assert _no_work(hostile)

        # The capture is redone on another provider from nothing: the forged shards are not handed on (even under `any`).
        redo = third.acquire().lease
        assert (redo.kind, redo.job_id, redo.attempt) == ("capture", forged.job_id, 2)
        assert not [a for a in redo.inputs if a.kind == "capture"]
        third.upload(redo.lease_id, "capture/shard-00000.safetensors", SHARD, kind="capture")
        third.upload(redo.lease_id, "capture/shard-00000.json", SIDECAR, kind="capture")
        assert third.finish(redo.lease_id) == "succeeded"
        # The redo is verified too, by anyone but its producer (the verifier of the first round may).
        assert _no_work(third)
        _verify(verifier, expect="succeeded")
        train_lease = third.acquire().lease
        assert train_lease.kind == "train"
        shard = [a for a in train_lease.inputs if a.name == "capture/shard-00000.safetensors"]
        assert len(shard) == 1 and shard[0].size_bytes == len(SHARD)

    # /metrics and the status page say so.
    samples = scrape(coordinator)
    assert v(samples, "dflash_providers", state="quarantined") == 1
    assert v(samples, "dflash_verify_mismatches_total") == 1
    assert v(samples, "dflash_attempts_ended_total", state="mismatch") == 1  # the tie-breaker's
    assert v(samples, "dflash_attempts_ended_total", state="disputed") == 1
    snap = json.loads(get(coordinator, "/api/status", token=coordinator.admin_token)[2])
    (shown,) = [p for p in snap["providers"] if p["provider_id"] == hostile.provider_id]
    assert "recomputed capture job" in shown["quarantined"]
    page = get(coordinator, "/status.html", token=coordinator.admin_token)[2].decode()
    assert "quarantined</span>" in page


def test_a_verifier_that_recomputes_nothing_is_retried_and_the_producer_stays_trusted(coordinator, provider_factory):
    producer, lazy, verifier = _providers(provider_factory, "producer", "lazy", "verifier")
    with coordinator.admin() as admin:
        admin.create_run(run_spec("verify-lazy", spec_json=_spec(verify_fraction=1), capture_shards=1))
        _prepare(producer)
        _capture(producer)
        lease = lazy.acquire().lease
        assert lease.kind == "verify"
        assert lazy.finish(lease.lease_id) == "queued"  # no recomputation uploaded: not a verdict
        assert not [p for p in admin.list_providers() if p.quarantined_unix]
        _verify(verifier, expect="succeeded")


def test_the_quarantined_provider_s_other_unused_captures_are_redone_too(coordinator, provider_factory):
    hostile, verifier, third = _providers(provider_factory, "hostile", "verifier", "third")
    with coordinator.admin() as admin:
        spec = RunSpecData(name="x", required_client_version="0.1.0", spec_json=_spec(verify_fraction=0.5), capture_shards=2)
        run = admin.create_run(run_spec("verify-others", spec_json=_spec(verify_fraction=0.5), capture_shards=2))
        (checked,) = spec.verified_shards(run.run_id)
        _prepare(hostile)
        for _ in range(2):
            lease = hostile.acquire().lease
            assert lease.kind == "capture"
            body = SHARD if lease.shard_index != checked else b"forged" * 10
            hostile.upload(lease.lease_id, f"capture/shard-{lease.shard_index:05d}.safetensors", body, kind="capture")
            assert hostile.finish(lease.lease_id) == "succeeded"
        lease = verifier.acquire().lease
        assert (lease.kind, lease.shard_index) == ("verify", checked)
        verifier.upload(lease.lease_id, f"verify/capture/shard-{checked:05d}.safetensors", SHARD, kind="capture")
        assert verifier.finish(lease.lease_id) == "queued"  # disputed
        lease = third.acquire().lease
        assert (lease.kind, lease.shard_index) == ("verify", checked)  # the tie-break
        third.upload(lease.lease_id, f"verify/capture/shard-{checked:05d}.safetensors", SHARD, kind="capture")
        assert third.finish(lease.lease_id) == "queued"  # settled against the producer
        jobs = _jobs(admin, run.run_id)
        assert jobs[("capture", 0)].state == jobs[("capture", 1)].state == "queued"
        assert len(jobs[("train", 0)].waiting_for) == 3
