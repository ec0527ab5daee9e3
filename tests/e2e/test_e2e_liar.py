"""Issue 34, holes 2, 4 and 6 with the real pipeline: one provider lies every way in turn, each time in an
attempt it ends RETRYABLE, and then an honest run-manager finishes the job `succeeded` with an export
byte-identical to an uninterrupted run's.

The liar is a scripted client on the coordinator's gRPC API (`coordinator_helpers.Provider`). Its attempts:

1. (hole 6) a heartbeat whose `step` is 2**63, past what SQLite holds: INVALID_ARGUMENT naming the field
   (it was an OverflowError, INTERNAL, and the stream broke); the lease lives on. (hole 4) Two uploads that
   each declare 3 H bytes against a 4 H attempt quota (H: what the honest attempt uploads), the first cut
   short: its staged bytes count, so the second is refused before a byte is stored (it was admitted).
2. to 4. (hole 4) each records 2 H bytes: three such attempts pass the 4 H run quota, but an attempt that
   did not succeed no longer holds the run's quota, so they are admitted and the honest attempt after them
   too.
4. also (hole 2) uploads a well-formed checkpoint, the uninterrupted run's newest with its trained weights
   scaled by 0.5 and its manifest rewritten to hash right. Under the default `trust_inputs = "own"` the
   honest attempt is never handed it (under `any` it resumed from it, trained no step, and published an
   export derived from the tampered weights)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import grpc
import pytest
from e2e_helpers import client_version, export_model, local_path, sha256_file
from launchers import wait_until

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "coordinator"))
from coordinator_helpers import Provider, artifact  # noqa: E402

from dflash_worker.proto.dflash.v1 import provider_pb2  # noqa: E402

pytestmark = pytest.mark.slow

RETRYABLE = provider_pb2.ATTEMPT_OUTCOME_RETRYABLE


def _honest_bytes(baseline) -> int:
    """H: the bytes the uninterrupted run's job recorded."""
    (job,) = baseline.summary["jobs"]
    return sum(int(a["size_bytes"]) for a in job["artifacts"])


def _tampered_checkpoint(baseline) -> tuple[int, dict[str, bytes]]:
    """The uninterrupted run's newest checkpoint, trained weights x 0.5, manifest rewritten to hash right."""
    from safetensors import safe_open
    from safetensors.torch import save

    job_dir = baseline.work / "jobs" / baseline.summary["jobs"][0]["job_id"]
    ckpt = sorted((job_dir / "run" / "checkpoints").glob("step-*"))[-1]
    manifest = json.loads((ckpt / "manifest.json").read_text())
    files = {name: (ckpt / name).read_bytes() for name in manifest["files"]}
    with safe_open(str(ckpt / "trainable.safetensors"), "pt") as f:
        tensors = {k: f.get_tensor(k) * 0.5 for k in f.keys()}  # noqa: SIM118
        meta = f.metadata()
    files["trainable.safetensors"] = save(tensors, metadata=meta)
    assert files["trainable.safetensors"] != (ckpt / "trainable.safetensors").read_bytes()
    manifest["files"] = {n: {"sha256": hashlib.sha256(d).hexdigest(), "size": len(d)} for n, d in files.items()}
    files["manifest.json"] = json.dumps(manifest, sort_keys=True, indent=1).encode()
    return int(manifest["step"]), files


def _cut_upload(p: Provider, lease_id: str, name: str, declared: int, sent: bytes) -> None:
    """An upload declaring `declared` bytes that sends `sent` and is cut (grpc cancels the call)."""
    art = artifact(name, b"", kind="export", sha256="0" * 64, size=declared)

    def requests():
        yield provider_pb2.UploadArtifactRequest(header=provider_pb2.UploadHeader(lease_id=lease_id, artifact=art))
        yield provider_pb2.UploadArtifactRequest(chunk=sent)
        raise ConnectionResetError("the liar drops the connection")

    with pytest.raises(grpc.RpcError):
        p.stub.UploadArtifact(requests(), metadata=p.metadata, timeout=30)


def test_a_provider_that_lies_every_way_then_an_honest_one_finishes_with_the_uninterrupted_export(tmp_path, procs, spec, baseline):
    h = _honest_bytes(baseline)
    quota = 4 * h
    coord = procs.coordinator(
        tmp_path / "coord", lease_ttl=10, serve_args=("--quota-attempt-bytes", str(quota), "--quota-run-bytes", str(quota)), warm=True
    )
    run_id = coord.create_run("liar", spec, client_version=client_version())
    liar = Provider(coord.address, coord.provider_token("liar"))
    liar.register(name="liar", client_version=client_version(), backend="cpu", features=(), memory_bytes=8 << 30)
    try:
        # attempt 1: hole 6, then hole 4's partial uploads
        lease = liar.acquire(wait=10).lease
        job_id = lease.job_id
        with pytest.raises(grpc.RpcError) as e:
            liar.heartbeats().send_raw(provider_pb2.HeartbeatRequest(lease_id=lease.lease_id, phase=provider_pb2.PHASE_TRAIN, step=2**63))
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT and f"`step` is {2**63}" in e.value.details(), e.value.details()
        assert liar.heartbeat_once(lease.lease_id, step=1).directive == provider_pb2.DIRECTIVE_CONTINUE  # the lease lives on
        _cut_upload(liar, lease.lease_id, "run/export/a.bin", 3 * h, b"\0" * min(h, 1 << 20))
        with pytest.raises(grpc.RpcError) as e:
            liar.upload(lease.lease_id, "run/export/b.bin", b"\1" * (3 * h), kind="export")
        assert e.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED and "declared by uploads staged or in progress" in e.value.details(), e.value.details()
        assert liar.finish(lease.lease_id, RETRYABLE, "crashed, supposedly") == "queued"
        staging = coord.workdir / "staging"
        wait_until(lambda: not list(staging.glob("*/*.part")), what="the ended attempt's staged upload to go")  # its share goes with it

        # attempts 2-4: hole 4, records that would fill the run's quota; the last also hole 2's checkpoint
        step, files = _tampered_checkpoint(baseline)
        for n in (2, 3, 4):
            lease = liar.acquire(wait=10).lease
            assert (lease.job_id, lease.attempt) == (job_id, n), lease
            liar.upload(lease.lease_id, f"run/export/filler-{n}.bin", bytes([n]) * (2 * h), kind="export")
            if n == 4:
                directory = f"run/checkpoints/step-{step:08d}"
                for name, data in files.items():
                    if name != "manifest.json":
                        liar.upload(lease.lease_id, f"{directory}/{name}", data, kind="checkpoint_file", step=step)
                liar.upload(lease.lease_id, f"{directory}/manifest.json", files["manifest.json"], kind="checkpoint", step=step)
            assert liar.finish(lease.lease_id, RETRYABLE, "crashed, supposedly") == "queued"
    finally:
        liar.close()

    work = tmp_path / "honest" / "work"
    rm = procs.run_manager(work, "--coordinator", coord.address, "--token", coord.provider_token("honest"), "--max-jobs", "1", warm=True)
    assert rm.wait(timeout=600) == 0, rm.text()[-4000:]
    (job,) = coord.show(run_id)["jobs"]
    assert (job["job_id"], job["state"], job["attempts"]) == (job_id, "succeeded", 5), json.dumps(job, indent=1)
    assert not [v for v in rm.messages() if str(v.get("message", "")).startswith("resuming from")], "handed the liar's checkpoint"
    assert job.get("provenance", []) == [], job.get("provenance")
    job_dir = (work / "jobs" / job_id).resolve()
    assert sha256_file(local_path(job_dir, export_model(job))) == baseline.export_sha256
