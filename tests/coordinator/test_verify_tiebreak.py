"""Issue 57 item 2: a verify job's disagreement is settled by a tie-break, not believed.

Scripted providers on the real gRPC API of a coordinator process, with made-up verdicts: a verify attempt that
recomputes other bytes than the producer uploaded ends `disputed`; nobody is quarantined and train (which needs the
verify job) is not leased until a provider that is neither the producer nor a disputing verifier, on the same
backend, replays the same unit. Two that agree stand (the producer counts as one); whoever disagrees with them is
quarantined. With no such provider the verify job waits and `runs show` says why.
"""

from __future__ import annotations

import json

import pytest
from coordinator_helpers import Provider, run_spec
from test_metrics import scrape, v
from test_status_page import get
from test_tokens import cli
from test_verify_replay import SHARD, SIDECAR, _capture, _jobs, _no_work, _prepare, _providers, _spec

FORGED = b"scaled features " * 64
OTHER = b"other features! " * 64


@pytest.fixture
def coordinator(start_coordinator):
    """With the status page and /metrics."""
    return start_coordinator("--http-listen", "127.0.0.1:0", warm=True)


def _verify(p: Provider, shard: bytes, *, expect: str, index: int = 0):
    """Take the next lease (a verify job of capture shard `index`) and report `shard` as its recomputation."""
    lease = p.acquire().lease
    assert (lease.kind, lease.shard_index) == ("verify", index), lease
    p.upload(lease.lease_id, f"verify/capture/shard-{index:05d}.safetensors", shard, kind="capture")
    p.upload(lease.lease_id, f"verify/capture/shard-{index:05d}.json", SIDECAR, kind="capture")
    assert p.finish(lease.lease_id) == expect
    return lease


def _quarantined(admin) -> dict[str, str]:
    return {p.provider_id: p.quarantine_reason for p in admin.list_providers() if p.quarantined_unix}


def _attempt_id(coord, job_id: str, number: int) -> str:
    """The id of attempt `number` of job `job_id`."""
    ((attempt_id,),) = coord._query("SELECT attempt_id FROM attempts WHERE job_id=? AND number=?", job_id, number)
    return attempt_id


def _states(coord, job_id: str) -> list[str]:
    return [s for _, s, _ in coord.attempt_messages(job_id)]


def test_a_lying_verifier_is_outvoted_quarantined_and_its_other_verdicts_redone(coordinator, provider_factory, capsys):
    producer, liar, third = _providers(provider_factory, "producer", "liar", "third")
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("liar", spec_json=_spec(verify_fraction=1), capture_shards=2))
        _prepare(producer)
        for _ in range(2):
            lease = producer.acquire().lease
            assert lease.kind == "capture"
            producer.upload(lease.lease_id, f"capture/shard-{lease.shard_index:05d}.safetensors", SHARD, kind="capture")
            producer.upload(lease.lease_id, f"capture/shard-{lease.shard_index:05d}.json", SIDECAR, kind="capture")
            assert producer.finish(lease.lease_id) == "succeeded"
        honest_verdict = _verify(liar, SHARD, expect="succeeded", index=0)  # honest once
        lie = _verify(liar, FORGED, expect="queued", index=1)  # then it lies: disputed

        # Disputed, not believed: nobody is quarantined, the capture stands unverified, train is not leased.
        assert _quarantined(admin) == {}
        jobs = _jobs(admin, run.run_id)
        cap, ver, train = jobs[("capture", 1)], jobs[("verify", 1)], jobs[("train", 0)]
        assert cap.state == "succeeded" and ver.state == "queued" and ver.waiting_for == []
        assert ver.job_id in train.waiting_for
        (msg,) = [m for _, s, m in coordinator.attempt_messages(lie.job_id) if s == "disputed"]
        assert "disputed: recomputed other bytes for `capture/shard-00001.safetensors`" in msg and producer.provider_id in msg
        why = ver.waiting_reason
        assert why.startswith("waiting for a tie-break: ") and liar.provider_id in why and producer.provider_id in why and "third can" in why, why
        rc, out, err = cli(capsys, coordinator, "runs", "show", run.run_id)
        assert rc == 0 and "waiting for a tie-break" in out, err
        # Neither side of the dispute gets the tie-break (nor train).
        assert _no_work(producer) and _no_work(liar)

        # The third provider recomputes the producer's bytes: the producer stands, the liar is quarantined.
        _verify(third, SHARD, expect="succeeded", index=1)
        q = _quarantined(admin)
        assert list(q) == [liar.provider_id]
        assert "was outvoted" in q[liar.provider_id] and "recomputed the producer's bytes" in q[liar.provider_id] and third.provider_id in q[liar.provider_id]
        assert _states(coordinator, lie.job_id) == ["overruled", "succeeded"]
        assert _no_work(liar)
        # Its honest-looking verdict on shard 0 is not trusted either: redone by another provider.
        assert _states(coordinator, honest_verdict.job_id) == ["discarded"]
        assert _jobs(admin, run.run_id)[("capture", 0)].state == _jobs(admin, run.run_id)[("capture", 1)].state == "succeeded"
        _verify(third, SHARD, expect="succeeded", index=0)
        assert producer.acquire().lease.kind == "train"

    samples = scrape(coordinator)
    assert v(samples, "dflash_verifiers_overruled_total") == 1 and v(samples, "dflash_verify_mismatches_total") == 0
    assert v(samples, "dflash_attempts_ended_total", state="disputed") == 1
    # Audited: the quarantine is in the audit log, on the status page.
    snap = json.loads(get(coordinator, "/api/status", token=coordinator.admin_token)[2])
    assert [(a["action"], a["provider"]) for a in snap["audit"]] == [("quarantine", "liar")]


def test_with_no_third_provider_the_verify_job_waits_and_says_why(coordinator, provider_factory):
    producer, liar, mps = _providers(provider_factory, "producer", "liar", "mps-box")
    mps.register(name="mps-box", features=("flash_attention_2", "job_graph"), backend="mps")
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("no-third", spec_json=_spec(verify_fraction=1), capture_shards=1))
        _prepare(producer)
        _capture(producer)
        _verify(liar, FORGED, expect="queued")
        # Another backend's provider cannot break the tie; the two in dispute may not.
        assert _no_work(mps) and _no_work(producer) and _no_work(liar)
        ver = _jobs(admin, run.run_id)[("verify", 0)]
        assert "waiting for a tie-break" in ver.waiting_reason and "backend `cuda`" in ver.waiting_reason
        assert ver.waiting_reason.endswith(": no live provider is one\nhint: start a provider on backend `cuda` (a new one: `dflash-coordinator providers create NAME`)")
        assert _quarantined(admin) == {}


def test_two_verifiers_that_agree_quarantine_the_producer_and_a_third_view_is_overruled(coordinator, provider_factory):
    """The producer forged its shard; the first verifier recomputes the honest bytes (disputed), a second reports yet
    other bytes (agrees with nobody: disputed too), a third the honest bytes: the producer and the second are quarantined."""
    hostile, v1, v2, v3 = _providers(provider_factory, "hostile", "v1", "v2", "v3")
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("three-ways", spec_json=_spec(verify_fraction=1), capture_shards=1))
        _prepare(hostile)
        forged = _capture(hostile, shard=FORGED)
        first = _verify(v1, SHARD, expect="queued")
        assert _no_work(v1)
        _verify(v2, OTHER, expect="queued")
        assert _quarantined(admin) == {}
        why = _jobs(admin, run.run_id)[("verify", 0)].waiting_reason
        assert v1.provider_id in why and v2.provider_id in why and "v3 can" in why, why
        assert _no_work(v2)
        _verify(v3, SHARD, expect="queued")  # agrees with v1: settled against the producer, which is redone

        q = _quarantined(admin)
        assert set(q) == {hostile.provider_id, v2.provider_id}
        assert first.job_id in q[hostile.provider_id] and forged.job_id in q[hostile.provider_id] and v3.provider_id in q[hostile.provider_id]
        assert "recomputed the same bytes" in q[hostile.provider_id]
        assert "recomputed the same bytes as another verifier, unlike both" in q[v2.provider_id]
        assert _states(coordinator, first.job_id) == ["mismatch", "overruled", "mismatch"]
        assert f"settled against the producer by attempt `{_attempt_id(coordinator, first.job_id, 3)}` of provider `{v3.provider_id}`" in (
            coordinator.attempt_messages(first.job_id)[0][2]
        )
        assert _states(coordinator, forged.job_id) == ["discarded"]
        jobs = _jobs(admin, run.run_id)
        assert jobs[("capture", 0)].state == "queued" and jobs[("verify", 0)].waiting_for == [forged.job_id]
        # The redo (by v1) is verified by a provider other than its producer; the earlier disputes are closed.
        redo = v1.acquire().lease
        assert (redo.kind, redo.attempt) == ("capture", 2)
        v1.upload(redo.lease_id, "capture/shard-00000.safetensors", SHARD, kind="capture")
        v1.upload(redo.lease_id, "capture/shard-00000.json", SIDECAR, kind="capture")
        assert v1.finish(redo.lease_id) == "succeeded"
        _verify(v3, SHARD, expect="succeeded")
    samples = scrape(coordinator)
    assert v(samples, "dflash_verify_mismatches_total") == 1 and v(samples, "dflash_verifiers_overruled_total") == 1


def test_a_dispute_over_an_attempt_discarded_meanwhile_is_closed(coordinator, provider_factory):
    """The producer is quarantined through another shard while a dispute over its first shard is open: its unused
    capture is discarded and redone, the open dispute is closed (`discarded`), and its verifier may check the redo."""
    hostile, v1, v2 = _providers(provider_factory, "hostile", "v1", "v2")
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("moot", spec_json=_spec(verify_fraction=1), capture_shards=2))
        _prepare(hostile)
        for _ in range(2):
            lease = hostile.acquire().lease
            hostile.upload(lease.lease_id, f"capture/shard-{lease.shard_index:05d}.safetensors", FORGED, kind="capture")
            assert hostile.finish(lease.lease_id) == "succeeded"
        d0 = _verify(v1, SHARD, expect="queued", index=0)  # disputed
        _verify(v1, SHARD, expect="queued", index=1)  # disputed
        _verify(v2, SHARD, expect="queued", index=0)  # settles shard 0 against the producer: it is quarantined
        assert set(_quarantined(admin)) == {hostile.provider_id}
        jobs = _jobs(admin, run.run_id)
        ver1 = jobs[("verify", 1)]
        assert jobs[("capture", 1)].state == "queued"  # its other capture, unused, is redone too
        assert _states(coordinator, ver1.job_id) == ["discarded"]
        assert "the attempt it disputed was discarded" in coordinator.attempt_messages(ver1.job_id)[0][2]
        assert _states(coordinator, d0.job_id) == ["mismatch", "mismatch"]


def test_a_lying_replay_of_training_is_outvoted_and_evaluate_starts(coordinator, provider_factory):
    """The same for the train replay: the liar reports other trained weights for the selected checkpoint; evaluate
    waits (nobody quarantined) until a third provider replays the same span and recomputes the producer's bytes."""
    from test_verify_train import SELECTED, _files, _replay, _train, _upstream
    from test_verify_train import _jobs as _train_jobs
    from test_verify_train import _providers as _cuda_providers

    producer, liar, third = _cuda_providers(provider_factory, "producer", "liar", "third")
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("replay-liar", spec_json=_spec(verify_fraction=1), capture_shards=1))
        _upstream(producer, third)
        _train(producer)
        lie = _replay(liar, expect="queued", files={**_files(SELECTED, where="liar"), "trainable.safetensors": b"made up " * 32})
        jobs = _train_jobs(admin, run.run_id)
        assert _quarantined(admin) == {} and lie.job_id in jobs["evaluate"].waiting_for
        assert "waiting for a tie-break" in jobs["replay"].waiting_reason and "third can" in jobs["replay"].waiting_reason
        assert _no_work(producer) and _no_work(liar)
        _replay(third, expect="succeeded")
        assert list(_quarantined(admin)) == [liar.provider_id]
        assert "run/checkpoints/step-00000008/trainable.safetensors" in _quarantined(admin)[liar.provider_id]
        assert _states(coordinator, lie.job_id) == ["overruled", "succeeded"]
        assert _states(coordinator, _train_jobs(admin, run.run_id)["train"].job_id) == ["succeeded"]
        assert producer.acquire().lease.kind == "evaluate"
