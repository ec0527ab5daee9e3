"""Issue 34 item 2: verification by replay of training (a run's `verify_fraction`, part 2).

Scripted providers on the real gRPC API of a coordinator process. A graph run with a `verify_fraction` gets,
besides its capture verify jobs, one verify job that needs train and that every evaluate job needs. It is
never leased to the train job's producer nor to another backend; its lease hands it prepare's and the
captures' records and the train job's `run/selection.json` (never the producer's export, which it recomputes),
and as its resume checkpoint the producer's checkpoint it replays from (step 0 at fraction 1; the newest one
at least `fraction` x T steps before the selected step T otherwise), whose files it may download. The
verifier uploads checkpoint T's files and the export under `verify/`; the files that record paths
(`manifest.json`, `state.json`) are not compared. Equal digests let evaluate start; another digest
is disputed until a third provider's replay agrees (issue 57 item 2; tests/coordinator/test_verify_tiebreak.py),
then discards the train attempt, requeues train elsewhere (its checkpoints not handed on), makes evaluate and
the verify job wait for the redo, and quarantines the producer; a verifier that uploads nothing is retried.
"""

from __future__ import annotations

import json

import pytest
from coordinator_helpers import SPEC, Provider, run_spec
from test_metrics import scrape, v

from dflash_worker.coordinator.policy import JOB_GRAPH_FEATURE
from dflash_worker.coordinator.store import RunSpecData
from dflash_worker.coordinator.store.verify import replay_start
from dflash_worker.errors import InvalidRequestError

FEATURES = ("flash_attention_2", JOB_GRAPH_FEATURE)
STEPS = (2, 4, 6, 8)  # the producer's checkpoints; the coordinator keeps the newest 2 (6 and 8)
SELECTED = 8


@pytest.fixture
def coordinator(start_coordinator):
    """With /metrics."""
    return start_coordinator("--http-listen", "127.0.0.1:0", warm=True)


def _spec(**extra) -> str:
    return json.dumps({**json.loads(SPEC), **extra})


def _providers(provider_factory, *names: str) -> list[Provider]:
    out = []
    for name in names:
        p = provider_factory(name)
        p.register(name=name, features=FEATURES, backend="mps" if name == "mps-box" else "cuda")
        out.append(p)
    return out


def _files(step: int, *, where: str = "", weights: bytes = b"") -> dict[str, bytes]:
    """A checkpoint's files; `where` stands for the job directory the paths in state.json name."""
    return {
        "trainable.safetensors": weights or f"weights at {step} ".encode() * 32,
        "optimizer.pt": f"adam at {step}".encode(),
        "rng.json": f'{{"step": {step}}}'.encode(),
        "state.json": f'{{"step": {step}, "recipe": "{where}/run"}}'.encode(),
    }


EXPORT = {"model.safetensors": b"exported weights " * 32, "config.json": b'{"arch": "dflash2"}'}


def _upstream(producer: Provider, verifier: Provider) -> None:
    """Prepare and the capture on `producer`, the capture's verify job on `verifier`: train is ready."""
    lease = producer.acquire().lease
    assert lease.kind == "prepare"
    producer.upload(lease.lease_id, "data/manifest.json", b'{"examples": 3}', kind="manifest")
    assert producer.finish(lease.lease_id) == "succeeded"
    lease = producer.acquire().lease
    assert lease.kind == "capture"
    producer.upload(lease.lease_id, "capture/shard-00000.safetensors", b"features" * 8, kind="capture")
    assert producer.finish(lease.lease_id) == "succeeded"
    lease = verifier.acquire().lease
    assert lease.kind == "verify" and not lease.HasField("resume_checkpoint")
    verifier.upload(lease.lease_id, "verify/capture/shard-00000.safetensors", b"features" * 8, kind="capture")
    assert verifier.finish(lease.lease_id) == "succeeded"


def _train(p: Provider, *, tamper: bool = False, selected: int = SELECTED):
    """A train attempt: checkpoints at STEPS (the selected one's weights scaled when `tamper`), the export, the selection."""
    lease = p.acquire().lease
    assert lease.kind == "train", lease
    for step in STEPS:
        weights = b"scaled by 0.5 " * 32 if tamper and step == selected else b""
        p.checkpoint(lease.lease_id, f"run/checkpoints/step-{step:08d}", _files(step, where=p.provider_id, weights=weights), step=step)
    for name, body in EXPORT.items():
        p.upload(lease.lease_id, f"run/export/{name}", body if not tamper or name != "model.safetensors" else b"tampered", kind="export", step=selected)
    p.upload(lease.lease_id, "run/export/manifest.json", f'{{"dir": "{p.provider_id}"}}'.encode(), kind="export", step=selected)
    p.upload(lease.lease_id, "run/selection.json", f'{{"step": {selected}}}'.encode(), kind="manifest", step=selected)
    assert p.finish(lease.lease_id) == "succeeded"
    return lease


def _replay(p: Provider, *, expect: str, files: dict[str, bytes] | None = None, export: dict[str, bytes] | None = None, step: int = SELECTED):
    """The verifier's uploads: checkpoint `step`'s files (its own paths in state.json and the manifest) and the export."""
    lease = p.acquire().lease
    assert lease.kind == "verify", lease
    for name, body in (files if files is not None else _files(step, where=p.provider_id)).items():
        p.upload(lease.lease_id, f"verify/run/checkpoints/step-{step:08d}/{name}", body, kind="manifest", step=step)
    for name, body in {**(EXPORT if export is None else export), "manifest.json": f'{{"dir": "{p.provider_id}"}}'.encode()}.items():
        p.upload(lease.lease_id, f"verify/run/export/{name}", body, kind="manifest", step=step)
    assert p.finish(lease.lease_id) == expect
    return lease


def _jobs(admin, run_id: str) -> dict[str, object]:
    """The train replay's verify job as `replay` (the last job), the other kinds by kind (shard 0)."""
    jobs = list(admin.get_run(run_id).jobs)
    out = {"replay": jobs[-1]}
    for j in jobs[:-1]:
        out.setdefault(j.kind, j)
    return out


def test_the_replay_starts_from_the_newest_held_checkpoint_at_least_the_fraction_back():
    assert replay_start(8, [6, 4, 2], 1.0) == 0  # the whole run, from the released draft
    assert replay_start(8, [6, 4, 2], 0.25) == 6
    assert replay_start(8, [6, 4, 2], 0.3) == 4  # ceil(2.4) = 3 steps back at least
    assert replay_start(8, [6], 0.5) == 0  # 4 was rotated away: from step 0
    assert replay_start(8, [7], 0.01) == 7  # at least one step


def test_a_run_that_trains_on_several_ranks_is_refused_a_replay():
    base = dict(name="r", required_client_version="0.1.0", capture_shards=1, max_local_ranks=2)
    with pytest.raises(InvalidRequestError, match="replays the train job on one rank; this run trains on 2"):
        RunSpecData(**base, spec_json=_spec(verify_fraction=0.5))
    RunSpecData(**base, spec_json=_spec(verify_fraction=0.5, placement={"train": {"local_ranks": 1}}))
    RunSpecData(**base, spec_json=_spec())


def test_the_replay_is_scheduled_after_train_never_on_its_producer_and_evaluate_waits_for_it(coordinator, provider_factory):
    producer, verifier, mps = _providers(provider_factory, "producer", "verifier", "mps-box")
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("replay-scheduled", spec_json=_spec(verify_fraction=0.25), capture_shards=1))
        _upstream(producer, verifier)
        jobs = _jobs(admin, run.run_id)
        assert (jobs["replay"].kind, jobs["replay"].shard_index) == ("verify", 0)
        assert jobs["replay"].job_id in jobs["evaluate"].waiting_for and jobs["train"].job_id in jobs["replay"].waiting_for
        train = _train(producer)
        # Neither the producer nor another backend's provider gets the replay (nor evaluate, which waits for it).
        assert producer.acquire().WhichOneof("result") == mps.acquire().WhichOneof("result") == "no_work"
        why = _jobs(admin, run.run_id)["replay"].waiting_reason
        assert "other than the one that produced its capture (or its training)" in why, why
        lease = verifier.acquire().lease
        assert (lease.kind, lease.job_id) == ("verify", jobs["replay"].job_id)
        # Handed: prepare's and the capture's records and the selection, never the producer's export.
        assert sorted(a.name for a in lease.inputs) == ["capture/shard-00000.safetensors", "data/manifest.json", "run/selection.json"]
        # Fraction 0.25 of 8 steps: from the producer's checkpoint of step 6, which it may download.
        assert (lease.resume_checkpoint.name, lease.resume_checkpoint.step) == ("run/checkpoints/step-00000006/manifest.json", 6)
        assert train.job_id in lease.resume_checkpoint.uri
        _, body = verifier.download(lease.lease_id, "run/checkpoints/step-00000006/trainable.safetensors", _sha(_files(6)["trainable.safetensors"]))
        assert body == _files(6)["trainable.safetensors"]
        assert verifier.finish(lease.lease_id) == "queued"  # uploaded nothing: retried, not a verdict
        assert not [p for p in admin.list_providers() if p.quarantined_unix]


def _sha(b: bytes) -> str:
    import hashlib

    return hashlib.sha256(b).hexdigest()


def test_an_honest_training_replayed_lets_evaluate_start(coordinator, provider_factory):
    producer, verifier = _providers(provider_factory, "producer", "verifier")
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("replay-honest", spec_json=_spec(verify_fraction=1), capture_shards=1))
        _upstream(producer, verifier)
        _train(producer)
        lease = _replay(verifier, expect="succeeded")  # state.json and the manifests differ (paths): not compared
        assert not lease.HasField("resume_checkpoint")  # fraction 1: from step 0
        assert _jobs(admin, run.run_id)["evaluate"].waiting_for == []
        assert producer.acquire().lease.kind == "evaluate"
        assert not [p for p in admin.list_providers() if p.quarantined_unix]


@pytest.mark.parametrize("what", ["checkpoint", "export"])
def test_a_tampered_training_is_discarded_redone_elsewhere_and_its_producer_quarantined(coordinator, provider_factory, what):
    hostile, verifier, third = _providers(provider_factory, "hostile", "verifier", "third")
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec(f"replay-{what}", spec_json=_spec(verify_fraction=1, trust_inputs="any"), capture_shards=1))
        _upstream(third, verifier)  # (a quarantined provider's captures that train has not used yet would be redone too)
        forged = _train(hostile, tamper=True)
        # The verifier's honest bytes: the checkpoint differs, or (the checkpoint left honest) only the export.
        files = _files(SELECTED, where="verifier") if what == "checkpoint" else {**_files(SELECTED, where="verifier"), "trainable.safetensors": b"scaled by 0.5 " * 32}
        verify = _replay(verifier, expect="queued", files=files)  # disputed: a tie-break settles it
        assert not [p for p in admin.list_providers() if p.quarantined_unix]
        assert "waiting for a tie-break" in _jobs(admin, run.run_id)["replay"].waiting_reason
        assert verifier.acquire().WhichOneof("result") == "no_work"
        _replay(third, expect="queued", files=files)  # the same bytes as the verifier's: it waits for the train job's redo
        jobs = _jobs(admin, run.run_id)
        train, replay, evaluate = jobs["train"], jobs["replay"], jobs["evaluate"]
        assert train.state == "queued" and "recomputed train job" in train.reason and train.attempts == 1
        assert replay.state == "queued" and replay.waiting_for == [train.job_id]
        assert set(evaluate.waiting_for) == {train.job_id, replay.job_id}
        (q,) = [p for p in admin.list_providers() if p.quarantined_unix]
        assert q.provider_id == hostile.provider_id and verify.job_id in q.quarantine_reason and forged.job_id in q.quarantine_reason
        named = "run/checkpoints/step-00000008/trainable.safetensors" if what == "checkpoint" else "run/export/model.safetensors"
        assert named in q.quarantine_reason
        assert hostile.acquire().WhichOneof("result") == "no_work"

        # Redone elsewhere from nothing: the discarded attempt's checkpoints are not handed on (even under `any`).
        redo = third.acquire().lease
        assert (redo.kind, redo.job_id, redo.attempt) == ("train", forged.job_id, 2)
        assert not redo.HasField("resume_checkpoint")
        for step in STEPS:
            third.checkpoint(redo.lease_id, f"run/checkpoints/step-{step:08d}", _files(step, where="third"), step=step)
        for name, body in EXPORT.items():
            third.upload(redo.lease_id, f"run/export/{name}", body, kind="export", step=SELECTED)
        third.upload(redo.lease_id, "run/selection.json", f'{{"step": {SELECTED}}}'.encode(), kind="manifest", step=SELECTED)
        assert third.finish(redo.lease_id) == "succeeded"
        # The redo is replayed too, by anyone but its producer.
        assert third.acquire().WhichOneof("result") == "no_work"
        _replay(verifier, expect="succeeded")
        assert third.acquire().lease.kind == "evaluate"

    samples = scrape(coordinator)
    assert v(samples, "dflash_providers", state="quarantined") == 1
    assert v(samples, "dflash_verify_mismatches_total") == 1
    assert v(samples, "dflash_attempts_ended_total", state="mismatch") == 1  # the tie-breaker's
    assert v(samples, "dflash_attempts_ended_total", state="disputed") == 1
    assert v(samples, "dflash_verifiers_overruled_total") == 0
