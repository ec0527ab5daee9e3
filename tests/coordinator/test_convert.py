"""`coordinator.grpc.convert`: store records to `dflash.v1` messages and back, field by field (no server needed);
and `server.every`, the timer the periodic tasks run on."""

from __future__ import annotations

import asyncio
import logging

from dflash_worker.coordinator.artifacts.names import ArtifactRecord
from dflash_worker.coordinator.grpc import convert
from dflash_worker.coordinator.server import every
from dflash_worker.coordinator.store import Grant, JobRow, StoredArtifact
from dflash_worker.coordinator.store.provenance import InputSource
from dflash_worker.proto.dflash.v1 import admin_pb2

REC = ArtifactRecord(name="ck/manifest.json", kind="checkpoint", sha256="c" * 64, size_bytes=7, uri="dflash-artifact://r/j/1/ck/manifest.json", step=3)


def test_run_spec_data_fills_the_defaults_of_unset_fields():
    spec = convert.run_spec_data(admin_pb2.RunSpec(name="r", spec_json="{}", required_client_version="0.1.0"))
    assert (spec.checkpoint_policy, spec.max_local_ranks, spec.num_jobs, spec.required_features) == ("durable", 1, 1, ())
    full = admin_pb2.RunSpec(name="g", spec_json="{}", required_client_version="0.2.0", checkpoint_policy="ephemeral", max_local_ranks=2,
                             required_features=["cuda"], image="img", capture_shards=3, eval_shards=2)  # fmt: skip
    spec = convert.run_spec_data(full)
    assert (spec.checkpoint_policy, spec.max_local_ranks, spec.image) == ("ephemeral", 2, "img")
    assert spec.required_features[0] == "cuda"  # a graph run also requires the job-graph feature (`RunSpecData` adds it)
    assert (spec.capture_shards, spec.eval_shards) == (3, 2)


def test_lease_pb_rounds_the_ttl_up_and_carries_the_inputs():
    g = Grant(lease_id="l", run_id="r", job_id="j", attempt=2, spec_json="{}", ttl_seconds=0.2, resume_checkpoint=REC, checkpoint_policy="durable",
              local_ranks=1, required_features=("cpu",), required_client_version="0.1.0", image="", kind="train", inputs=(REC, REC))  # fmt: skip
    pb = convert.lease_pb(g)
    assert pb.ttl_seconds == 1 and pb.attempt == 2 and pb.kind == "train" and list(pb.required_features) == ["cpu"]
    assert pb.resume_checkpoint.sha256 == REC.sha256 and pb.resume_checkpoint.step == 3 and len(pb.inputs) == 2
    assert not convert.lease_pb(Grant(**{**g.__dict__, "resume_checkpoint": None, "ttl_seconds": 30.5})).HasField("resume_checkpoint")
    assert convert.lease_pb(Grant(**{**g.__dict__, "ttl_seconds": 30.5})).ttl_seconds == 31


def test_job_pb_and_stored_artifact_pb_carry_every_field():
    src = InputSource(role="input", job_id="j0", attempt=1, attempt_id="att-1", provider_id="prov-1", provider="box", attempt_state="succeeded",
                      artifacts=3, depth=1)  # fmt: skip
    j = JobRow(job_id="j", run_id="r", state="queued", attempts=0, kind="capture", shard_index=1, shard_count=4, needs=("j0",), waiting_for=("j0",),
               reason="", waiting_reason="waits", provenance=(src,), export=REC, artifact_count=2)  # fmt: skip
    pb = convert.job_pb(j)
    assert (pb.job_id, pb.state, pb.kind, pb.shard_index, pb.shard_count, pb.artifact_count) == ("j", "queued", "capture", 1, 4, 2)
    assert list(pb.needs) == ["j0"] and list(pb.waiting_for) == ["j0"] and pb.waiting_reason == "waits"
    assert pb.export.name == REC.name and not pb.HasField("publication")
    assert pb.provenance[0].provider == "box" and pb.provenance[0].attempt_state == "succeeded" and pb.provenance[0].artifacts == 3
    info = convert.stored_artifact_pb(StoredArtifact(job_id="j", attempt=2, attempt_state="failed", record=REC, created_unix=12.9))
    assert (info.job_id, info.attempt, info.attempt_state, info.created_unix, info.artifact.uri) == ("j", 2, "failed", 12, REC.uri)
    assert convert.artifact_pb(None) is None and convert.publication_pb(None) is None


def test_every_logs_a_failing_step_and_keeps_ticking(caplog):
    calls = []

    async def step():
        calls.append(len(calls))
        if len(calls) == 1:
            raise RuntimeError("boom")

    async def main():
        task = asyncio.create_task(every(0.01, step, "the step failed"))
        while len(calls) < 3:
            await asyncio.sleep(0.01)
        task.cancel()

    with caplog.at_level(logging.ERROR, logger="dflash_worker.coordinator"):
        asyncio.run(main())
    assert [r.getMessage() for r in caplog.records] == ["the step failed"]
    assert len(calls) >= 3
