"""The coordinator on its S3 backend: a real coordinator process, moto's S3 server as a real process.

An upload is killed midway (the client's stream is cut), the coordinator is SIGKILLed
and restarted on the same database, the upload resumes from the offset the
coordinator reports and lands in the bucket as a multipart object; downloads
(provider and admin) give back the same bytes. With the S3 server gone, uploads
are UNAVAILABLE (the provider keeps its file and retries), not INTERNAL.
"""

from __future__ import annotations

import hashlib
import os

import boto3
import grpc
import pytest
from coordinator_helpers import Provider, run_spec
from s3_server import HAVE_MOTO, NO_MOTO, MotoServer, aws_test_env

from dflash_worker.proto.dflash.v1 import provider_pb2

pytestmark = pytest.mark.skipif(not HAVE_MOTO, reason=NO_MOTO)
MiB = 1 << 20


@pytest.fixture
def s3(tmp_path, monkeypatch):
    for name, value in aws_test_env().items():
        if value is None:
            monkeypatch.delenv(name, raising=False)
        else:
            monkeypatch.setenv(name, value)
    server = MotoServer(tmp_path).start()
    yield server
    server.kill()


def _bucket(server: MotoServer, name: str):
    client = boto3.client("s3", endpoint_url=server.url, region_name="us-east-1")
    client.create_bucket(Bucket=name)
    return client


def _cut_after(lease_id: str, art: provider_pb2.Artifact, data: bytes, n_chunks: int):
    """Requests that stop with an exception after `n_chunks` chunks: grpc cancels the call, as a killed client would."""
    yield provider_pb2.UploadArtifactRequest(header=provider_pb2.UploadHeader(lease_id=lease_id, artifact=art))
    for i in range(n_chunks):
        yield provider_pb2.UploadArtifactRequest(chunk=data[i * MiB : (i + 1) * MiB])
    raise ConnectionResetError("client killed")


def test_upload_killed_midway_resumes_across_a_coordinator_restart_into_s3(s3, start_coordinator):
    client = _bucket(s3, "dflash-test")
    coord = start_coordinator("--artifact-store", "s3://dflash-test/art", "--s3-endpoint-url", s3.url, warm=True)
    assert coord.info["artifacts"].startswith("s3://dflash-test/art")
    with coord.admin() as admin:
        run = admin.create_run(run_spec("s3"))
        token = admin.create_provider("p")
    p = Provider(coord.address, token)
    p.register()
    lease = p.acquire().lease
    data = os.urandom(20 * MiB)  # above the 8 MiB multipart threshold
    sha = hashlib.sha256(data).hexdigest()
    art = provider_pb2.Artifact(name="run/export/model.safetensors", kind="export", sha256=sha, size_bytes=len(data))

    with pytest.raises(grpc.RpcError):
        p.stub.UploadArtifact(_cut_after(lease.lease_id, art, data, 12), metadata=p.metadata, timeout=30)
    off = p.upload_offset(lease.lease_id, art.name, data, kind="export")
    assert not off.committed and 0 < off.offset <= 12 * MiB
    assert client.list_objects_v2(Bucket="dflash-test").get("KeyCount", 0) == 0, "nothing partial is visible"

    # The coordinator dies and comes back on the same database: the staged bytes survive.
    coord.kill()
    coord.start()
    p.close()
    p = Provider(coord.address, token)
    off2 = p.upload_offset(lease.lease_id, art.name, data, kind="export")
    assert (off2.offset, off2.committed) == (off.offset, False)
    rec = p.upload(lease.lease_id, art.name, data, kind="export", offset=off2.offset)
    assert rec.sha256 == sha

    (obj,) = client.list_objects_v2(Bucket="dflash-test", Prefix="art/")["Contents"]
    assert obj["Size"] == len(data) and obj["Key"].endswith(sha)
    assert "-" in obj["ETag"], f"expected a multipart upload, ETag {obj['ETag']}"
    header, body = p.download(lease.lease_id, art.name, sha)
    assert hashlib.sha256(body).hexdigest() == sha and header.size_bytes == len(data)
    assert p.finish(lease.lease_id) == "succeeded"
    with coord.admin() as admin:
        out = coord.workdir / "fetched.bin"
        admin.publish_run(run.run_id, override=True, note="test: no evaluation")  # the regression gate held it back
        admin.download(run.run_id, art.name, out)
        assert hashlib.sha256(out.read_bytes()).hexdigest() == sha
    assert not list((coord.workdir / "staging").rglob("*.part"))
    p.close()


def test_an_unreachable_s3_store_is_unavailable_and_the_upload_lands_when_it_returns(s3, start_coordinator):
    _bucket(s3, "flaky")
    coord = start_coordinator("--artifact-store", "s3://flaky", "--s3-endpoint-url", s3.url, warm=True)
    with coord.admin() as admin:
        admin.create_run(run_spec("flaky"))
        p = Provider(coord.address, admin.create_provider("p"))
    p.register()
    lease = p.acquire().lease
    data = os.urandom(3 * MiB)
    s3.kill()
    with pytest.raises(grpc.RpcError) as e:
        p.upload(lease.lease_id, "export.bin", data, kind="export", timeout=60)
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE, e.value.details()
    assert "s3://flaky" in e.value.details()
    # The store comes back (moto starts empty: the bucket is made again); the same upload lands.
    s3.start()
    _bucket(s3, "flaky")
    off = p.upload_offset(lease.lease_id, "export.bin", data, kind="export")
    rec = p.upload(lease.lease_id, "export.bin", data, kind="export", offset=off.offset)
    assert rec.sha256 == hashlib.sha256(data).hexdigest()
    assert p.download(lease.lease_id, "export.bin", rec.sha256)[1] == data
    p.close()


def test_a_coordinator_whose_bucket_is_missing_refuses_to_start(s3, start_coordinator):
    with pytest.raises(RuntimeError) as e:
        start_coordinator("--artifact-store", "s3://no-such-bucket", "--s3-endpoint-url", s3.url, warm=True)
    assert "no-such-bucket" in str(e.value) and "Traceback" not in str(e.value), e.value
