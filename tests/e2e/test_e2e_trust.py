"""Issue 34 with the real pipeline: a hostile provider (a scripted client on the coordinator's gRPC API)
takes the job first, uploads a checkpoint whose manifest claims step 2**62 (every listed file uploaded and
hashing right) and ends its attempt RETRYABLE. An honest run-manager then finishes the job `succeeded`,
with an export byte-identical to an uninterrupted run's: by default (`trust_inputs = "own"`) it is never
handed the lie; under `any` it is, and its worker skips it with a warning and starts from the beginning."""

from __future__ import annotations

import hashlib
import json

import grpc
import pytest
from e2e_helpers import client_version, export_model, local_path, sha256_file

from dflash_worker.proto.dflash.v1 import provider_pb2, provider_pb2_grpc

pytestmark = pytest.mark.slow

LIE_DIR = "run/checkpoints/step-99999999"


def _hostile_attempt(address: str, token: str) -> str:
    """Lease the job, upload a train checkpoint claiming step 2**62, end RETRYABLE; returns the job id."""
    channel = grpc.insecure_channel(address)
    stub = provider_pb2_grpc.ProviderServiceStub(channel)
    md = (("authorization", f"Bearer {token}"),)
    try:
        caps = provider_pb2.DeviceCapabilities(backend="cpu", device_count=1, memory_bytes=8 << 30, platform="linux-x86_64")
        reg = stub.Register(
            provider_pb2.RegisterRequest(client_version=client_version(), protocol_version="dflash.v1", launch_mode=provider_pb2.LAUNCH_MODE_DOCKER,
                                         capabilities=caps, name="hostile"),
            metadata=md, timeout=10,
        )  # fmt: skip
        lease = stub.AcquireLease(provider_pb2.AcquireLeaseRequest(provider_id=reg.provider_id, wait_seconds=10), metadata=md, timeout=30).lease
        assert lease.lease_id, "the hostile provider got no lease"

        def upload(name: str, data: bytes, kind: str, step: int) -> None:
            art = provider_pb2.Artifact(name=name, kind=kind, sha256=hashlib.sha256(data).hexdigest(), size_bytes=len(data), step=step)
            msgs = [provider_pb2.UploadArtifactRequest(header=provider_pb2.UploadHeader(lease_id=lease.lease_id, artifact=art)),
                    provider_pb2.UploadArtifactRequest(chunk=data)]  # fmt: skip
            stub.UploadArtifact(iter(msgs), metadata=md, timeout=30)

        files = {f: f"lies about {f}".encode() for f in ("trainable.safetensors", "optimizer.pt", "rng.json", "state.json")}
        for f, data in files.items():
            upload(f"{LIE_DIR}/{f}", data, "checkpoint_file", 2**62)
        manifest = {"format": "dflash-worker-train-checkpoint/1", "step": 2**62,
                    "files": {f: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for f, d in files.items()}}  # fmt: skip
        upload(f"{LIE_DIR}/manifest.json", json.dumps(manifest).encode(), "checkpoint", 2**62)
        done = stub.FinishAttempt(
            provider_pb2.FinishAttemptRequest(lease_id=lease.lease_id, outcome=provider_pb2.ATTEMPT_OUTCOME_RETRYABLE, message="crashed, supposedly"),
            metadata=md, timeout=10,
        )  # fmt: skip
        assert done.job_state == "queued"
        return lease.job_id
    finally:
        channel.close()


@pytest.mark.parametrize("trust", [None, "any"])
def test_an_honest_provider_finishes_after_a_hostile_attempt_with_the_uninterrupted_export(tmp_path, procs, spec, baseline, trust):
    coord = procs.coordinator(tmp_path / "coord", lease_ttl=10, warm=True)
    run_id = coord.create_run("trust", {**spec, **({"trust_inputs": trust} if trust else {})}, client_version=client_version())
    job_id = _hostile_attempt(coord.address, coord.provider_token("hostile"))

    work = tmp_path / "honest" / "work"
    rm = procs.run_manager(work, "--coordinator", coord.address, "--token", coord.provider_token("honest"), "--max-jobs", "1", warm=True)
    assert rm.wait(timeout=600) == 0, rm.text()
    shown = coord.show(run_id)
    (job,) = shown["jobs"]
    assert (job["job_id"], job["state"], job["attempts"]) == (job_id, "succeeded", 2), json.dumps(job, indent=1)
    resuming = [v for v in rm.messages() if str(v.get("message", "")).startswith("resuming from")]
    skipped = [v for v in rm.messages() if "skipped resume checkpoint" in str(v.get("message", ""))]
    if trust is None:  # never handed the lie
        assert not resuming and not skipped and job.get("provenance", []) == [], (resuming, skipped, job.get("provenance"))
    else:  # handed it, recorded whose it is, and skipped it without failing the job
        assert resuming and skipped and "no valid `step`" in skipped[0]["message"], rm.text()[-4000:]
        (src,) = job["provenance"]
        assert (src["role"], src["provider"], src["attempt"], src["attempt_state"]) == ("resume", "hostile", 1, "retryable"), src
    job_dir = (work / "jobs" / job_id).resolve()
    assert sha256_file(local_path(job_dir, export_model(job))) == baseline.export_sha256
