"""client.receive_download against streams from an honest, a cut and a lying coordinator: nothing wrong is kept."""

from __future__ import annotations

import hashlib

import pytest

from dflash_worker.coordinator.client import receive_download
from dflash_worker.errors import ConfigError
from dflash_worker.proto.dflash.v1 import provider_pb2

MiB = 1 << 20
DATA = bytes(range(256)) * (9 * MiB // 256) + b"tail"


def record(data: bytes = DATA, *, size: int | None = None, sha: str | None = None) -> provider_pb2.DownloadArtifactResponse:
    art = provider_pb2.Artifact(name="run/export/model.safetensors", kind="export", sha256=sha or hashlib.sha256(data).hexdigest(), size_bytes=len(data) if size is None else size)
    return provider_pb2.DownloadArtifactResponse(artifact=art)


def chunks(data: bytes, offset: int = 0, n: int = MiB):
    for i in range(offset, len(data), n):
        yield provider_pb2.DownloadArtifactResponse(chunk=data[i : i + n])


class Cut(Exception):
    """What a broken connection raises from the stream (grpc.RpcError in use)."""


def test_whole_download_is_verified_and_fsynced(tmp_path):
    part = tmp_path / "m.part"
    got = receive_download([record(), *chunks(DATA)], part, name="m")
    assert got.sha256 == hashlib.sha256(DATA).hexdigest()
    assert part.read_bytes() == DATA


def test_cut_stream_keeps_what_arrived_and_the_resume_completes(tmp_path):
    part = tmp_path / "m.part"
    cut_at = 5 * MiB + 4321

    def first():
        yield record()
        yield from chunks(DATA[:cut_at], n=MiB)
        raise Cut

    with pytest.raises(Cut):
        receive_download(first(), part, name="m")
    assert part.read_bytes() == DATA[:cut_at]
    # The resumed stream starts at the part's length; the bytes already there count toward the sha256.
    got = receive_download([record(), *chunks(DATA, cut_at)], part, name="m")
    assert got.size_bytes == len(DATA) and part.read_bytes() == DATA


@pytest.mark.parametrize(
    "messages, says",
    [
        (lambda: [*chunks(DATA)], "before its artifact header"),
        (lambda: [record(), record(), *chunks(DATA)], "second artifact header"),
        (lambda: [], "no artifact header"),
    ],
)
def test_malformed_streams_are_refused(tmp_path, messages, says):
    part = tmp_path / "m.part"
    with pytest.raises(ConfigError, match=says):
        receive_download(messages(), part, name="m")


@pytest.mark.parametrize(
    "messages, says",
    [
        # More bytes than the record says: nothing past it is written, and the file goes.
        (lambda: [record(size=len(DATA) - 1), *chunks(DATA)], f"received {len(DATA)} bytes"),
        # Fewer bytes than the record says.
        (lambda: [record(), *chunks(DATA[:-1])], f"received {len(DATA) - 1} bytes"),
        # The right length with other bytes.
        (lambda: [record(), *chunks(DATA[:-1] + b"X")], "with sha256"),
    ],
)
def test_lying_coordinator_leaves_nothing(tmp_path, messages, says):
    part = tmp_path / "m.part"
    with pytest.raises(ConfigError, match=says):
        receive_download(messages(), part, name="m")
    assert not part.exists()


def test_part_longer_than_the_artifact_is_refused_and_kept(tmp_path):
    part = tmp_path / "m.part"
    part.write_bytes(DATA + b"more")
    with pytest.raises(ConfigError, match="delete it and retry"):
        receive_download([record(), *chunks(DATA, len(DATA) + 4)], part, name="m")
    assert part.read_bytes() == DATA + b"more"
