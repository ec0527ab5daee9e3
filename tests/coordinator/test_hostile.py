"""Hostile and malformed input: each refused with its documented status code, nothing changed."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import grpc
import pytest
from coordinator_helpers import Provider, code_of, run_spec
from hypothesis import given, settings
from hypothesis import strategies as st

from dflash_worker.coordinator.artifacts.names import check_name
from dflash_worker.errors import DflashError, InvalidRequestError
from dflash_worker.proto.dflash.v1 import admin_pb2, admin_pb2_grpc, provider_pb2, provider_pb2_grpc

C = grpc.StatusCode


def _code(fn) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as e:
        fn()
    return code_of(e)


@pytest.fixture
def leased(coordinator, provider_factory):
    with coordinator.admin() as admin:
        run = admin.create_run(run_spec("hostile"))
    p = provider_factory()
    p.register()
    lease = p.acquire().lease
    return coordinator, p, lease, run


def test_authentication_and_permissions(coordinator, provider_factory):
    channel = grpc.insecure_channel(coordinator.address)
    prov_stub = provider_pb2_grpc.ProviderServiceStub(channel)
    admin_stub = admin_pb2_grpc.AdminServiceStub(channel)
    reg = provider_pb2.RegisterRequest(client_version="0.1.0", protocol_version="dflash.v1", launch_mode=1, capabilities=provider_pb2.DeviceCapabilities(backend="cpu"))
    with coordinator.admin() as admin:
        token = admin.create_provider("p")

    def md(value):
        return (("authorization", value),)

    # No token, unknown token, malformed headers: UNAUTHENTICATED.
    assert _code(lambda: prov_stub.Register(reg, timeout=5)) == C.UNAUTHENTICATED
    assert _code(lambda: admin_stub.ListRuns(admin_pb2.ListRunsRequest(), timeout=5)) == C.UNAUTHENTICATED
    for bad in ("Bearer not-a-token", "Bearer ", "Basic " + token, token, "Bearer " + token + "x"):
        assert _code(lambda: prov_stub.Register(reg, metadata=md(bad), timeout=5)) == C.UNAUTHENTICATED, bad
        assert _code(lambda: admin_stub.ListRuns(admin_pb2.ListRunsRequest(), metadata=md(bad), timeout=5)) == C.UNAUTHENTICATED, bad
    # Streams are guarded too.
    stream = prov_stub.Heartbeat(iter([provider_pb2.HeartbeatRequest(lease_id="x")]), timeout=5)
    assert _code(lambda: list(stream)) == C.UNAUTHENTICATED

    # Right token, wrong service: PERMISSION_DENIED both ways.
    assert _code(lambda: admin_stub.CreateProvider(admin_pb2.CreateProviderRequest(name="evil"), metadata=md("Bearer " + token), timeout=5)) == C.PERMISSION_DENIED
    assert _code(lambda: prov_stub.Register(reg, metadata=md("Bearer " + coordinator.admin_token), timeout=5)) == C.PERMISSION_DENIED
    # The scheme is case-insensitive, as HTTP says.
    assert prov_stub.Register(reg, metadata=md("bearer " + token), timeout=5).provider_id
    channel.close()

    # A provider may not poll as another provider.
    a, b = provider_factory("a"), provider_factory("b")
    a.register()
    b.register()
    b.provider_id = a.provider_id
    assert _code(lambda: b.acquire()) == C.PERMISSION_DENIED

    # Nobody got a provider out of the refused CreateProvider.
    with coordinator.admin() as admin:
        assert "evil" not in [p.name for p in admin.list_providers()]


def test_another_providers_lease_is_refused(leased, provider_factory):
    coordinator, p, lease, _ = leased
    thief = provider_factory("thief")
    thief.register()
    assert _code(lambda: thief.heartbeat_once(lease.lease_id)) == C.PERMISSION_DENIED
    assert _code(lambda: thief.upload(lease.lease_id, "x.bin", b"x")) == C.PERMISSION_DENIED
    assert _code(lambda: thief.upload(lease.lease_id, "x.bin", b"x")) == C.PERMISSION_DENIED
    assert _code(lambda: thief.download(lease.lease_id, "x.bin", "0" * 64)) == C.PERMISSION_DENIED
    assert _code(lambda: thief.finish(lease.lease_id)) == C.PERMISSION_DENIED
    # Unknown leases are stale by definition.
    assert _code(lambda: p.heartbeat_once("lease-0000")) == C.ABORTED
    assert _code(lambda: p.finish("lease-0000")) == C.ABORTED
    assert p.finish(lease.lease_id) == "succeeded"


BAD_NAMES = ["", "..", "../escape.bin", "a/../../b", "/etc/passwd", "a\\b", "..\\x", "a\x00b", "a//b", "./a", "a/.", "a/", "x\n", "a\x9bb", "x" * 256, "d/" + "é" * 128]


def test_bad_artifact_names_are_refused(leased):
    coordinator, p, lease, run = leased

    def files():
        return {x for x in coordinator.workdir.rglob("*") if not x.name.startswith("stderr-") and not x.name.endswith(("-wal", "-shm"))}

    before = files()
    for name in BAD_NAMES:
        assert _code(lambda: p.upload(lease.lease_id, name, b"payload")) == C.INVALID_ARGUMENT, repr(name)
        assert _code(lambda: p.upload(lease.lease_id, name, b"payload")) == C.INVALID_ARGUMENT, repr(name)
    assert files() == before
    assert not (coordinator.workdir.parent / "escape.bin").exists()
    # Valid strings that cannot both be paths: `a` then `a/b` (and the other way round).
    p.upload(lease.lease_id, "a", b"file")
    assert _code(lambda: p.upload(lease.lease_id, "a/b", b"under a file")) == C.INVALID_ARGUMENT
    p.upload(lease.lease_id, "d/e", b"file")
    assert _code(lambda: p.upload(lease.lease_id, "d", b"over a directory")) == C.INVALID_ARGUMENT
    with coordinator.admin() as admin:
        assert sorted(a.artifact.name for a in admin.list_artifacts(run.run_id, all_attempts=True)) == ["a", "d/e"]


def test_bad_artifact_contents_are_refused(leased, tmp_path):
    coordinator, p, lease, run = leased
    data = b"real bytes"
    good_sha = hashlib.sha256(data).hexdigest()
    assert _code(lambda: p.upload(lease.lease_id, "a.bin", data, sha256=hashlib.sha256(b"other").hexdigest())) == C.INVALID_ARGUMENT
    assert _code(lambda: p.upload(lease.lease_id, "a.bin", data, sha256="xyz")) == C.INVALID_ARGUMENT
    assert _code(lambda: p.upload(lease.lease_id, "a.bin", data, sha256=good_sha + "\n")) == C.INVALID_ARGUMENT  # refused before staging
    assert _code(lambda: p.upload(lease.lease_id, "a.bin", data, size=len(data) + 1)) == C.FAILED_PRECONDITION  # short: resumable
    assert _code(lambda: p.upload(lease.lease_id, "a.bin", data, size=len(data) - 1)) == C.INVALID_ARGUMENT  # past the size
    assert _code(lambda: p.upload(lease.lease_id, "a.bin", data, kind="weights")) == C.INVALID_ARGUMENT
    # uint64 values SQLite cannot hold are refused before a byte is stored.
    assert _code(lambda: p.upload(lease.lease_id, "a.bin", data, step=1 << 63)) == C.INVALID_ARGUMENT
    assert _code(lambda: p.upload(lease.lease_id, "a.bin", data, size=(1 << 64) - 1)) == C.INVALID_ARGUMENT

    # Any `uri` is refused: the coordinator never reads a file a provider names, and
    # the refusal says nothing about that file (no sha256, no size, not whether it exists).
    secret = coordinator.workdir / "coordinator.db"
    for uri in (secret.as_uri(), (tmp_path / "missing.bin").as_uri(), "http://evil.example/x.bin", "file://evil.example/x.bin"):
        for sha in (good_sha, hashlib.sha256(secret.read_bytes()).hexdigest()):
            with pytest.raises(grpc.RpcError) as e:
                p.upload(lease.lease_id, "b.bin", b"", sha256=sha, size=secret.stat().st_size, uri=uri)
            assert code_of(e) == C.INVALID_ARGUMENT
            assert e.value.details() == _URI_REFUSED.format(name="b.bin"), e.value.details()

    with coordinator.admin() as admin:
        assert admin.list_artifacts(run.run_id, all_attempts=True) == []


_URI_REFUSED = (
    "artifact `{name}`: `artifact.uri` must be empty; the coordinator records only bytes it received\n"
    "hint: upload the file with UploadArtifact (run-manager does)"
)


def test_oversized_messages_are_refused(start_coordinator):
    coord = start_coordinator("--max-message-bytes", "65536", warm=True)
    with coord.admin() as admin:
        admin.create_run(run_spec("big"))
        p = Provider(coord.address, admin.create_provider("p"))
    p.register()
    lease = p.acquire().lease
    big = os.urandom(100_000)
    assert _code(lambda: p.upload(lease.lease_id, "big.bin", big)) == C.RESOURCE_EXHAUSTED
    # Under the limit it works, and the lease survived the refusal.
    small = os.urandom(30_000)
    assert p.upload(lease.lease_id, "small.bin", small).sha256 == hashlib.sha256(small).hexdigest()
    with coord.admin() as admin:
        spec = run_spec("huge-spec", spec_json='{"x": "' + "a" * 100_000 + '"}')
        with pytest.raises(DflashError) as e:
            admin.create_run(spec)
        assert e.value.grpc_code == C.RESOURCE_EXHAUSTED
    p.close()


def _admin_code(admin, fn) -> str:
    with pytest.raises(DflashError) as e:
        fn(admin)
    return type(e.value).__name__


MALFORMED_SPECS = ["{", "[]", '"text"', "null", '{"a": 1, "a": 2}', '{"lr": NaN}', '{"lr": Infinity}', "", "{} {}", "[" * 5000 + "]" * 5000]


def test_malformed_spec_json_is_refused(coordinator):
    channel = grpc.insecure_channel(coordinator.address)
    stub = admin_pb2_grpc.AdminServiceStub(channel)
    md = (("authorization", f"Bearer {coordinator.admin_token}"),)
    for spec_json in MALFORMED_SPECS:
        with pytest.raises(grpc.RpcError) as e:
            stub.CreateRun(admin_pb2.CreateRunRequest(spec=run_spec("bad", spec_json=spec_json)), metadata=md, timeout=5)
        assert code_of(e) == C.INVALID_ARGUMENT, spec_json[:20]
        assert "spec_json" in e.value.details()
    assert list(stub.ListRuns(admin_pb2.ListRunsRequest(), metadata=md, timeout=5).runs) == []
    channel.close()


def test_bad_run_fields_and_ids(coordinator):
    with coordinator.admin() as admin:
        for kw in (
            dict(required_client_version="latest"),
            dict(required_client_version=""),
            dict(checkpoint_policy="sometimes"),
            dict(name=""),
            dict(num_jobs=100_000),
            dict(required_features=["has space"]),
        ):
            spec = run_spec(**{"name": "bad", **kw})
            assert _admin_code(admin, lambda a: a.create_run(spec)) == "InvalidRequestError", kw
        admin.create_run(run_spec("dup"))
        assert _admin_code(admin, lambda a: a.create_run(run_spec("dup"))) == "ConflictError"
        assert _admin_code(admin, lambda a: a.get_run("run-nope")) == "NotFoundError"
        assert _admin_code(admin, lambda a: a.cancel_job("job-nope")) == "NotFoundError"
        assert _admin_code(admin, lambda a: a.approve_version("run-nope", "1.0.0")) == "NotFoundError"
        run = admin.list_runs()[0]
        assert _admin_code(admin, lambda a: a.approve_version(run.run_id, "../../x")) == "InvalidRequestError"
        job = admin.get_run(run.run_id).jobs[0]
        assert _admin_code(admin, lambda a: a.request_checkpoint(job.job_id)) == "PolicyError"  # queued, not leased


def test_unknown_enum_values_and_bad_registration(coordinator, provider_factory):
    p = provider_factory()

    def reg(**kw):
        base = dict(client_version="0.1.0", protocol_version="dflash.v1", launch_mode=provider_pb2.LAUNCH_MODE_DOCKER, capabilities=provider_pb2.DeviceCapabilities(backend="cuda", device_count=1))
        base.update(kw)
        return lambda: p.stub.Register(provider_pb2.RegisterRequest(**base), metadata=p.metadata, timeout=5)

    assert _code(reg(launch_mode=7)) == C.INVALID_ARGUMENT
    assert _code(reg(launch_mode=0)) == C.INVALID_ARGUMENT
    assert _code(reg(client_version="banana")) == C.INVALID_ARGUMENT
    assert _code(reg(native_client_version="1")) == C.INVALID_ARGUMENT
    assert _code(reg(capabilities=provider_pb2.DeviceCapabilities(backend="tpu"))) == C.INVALID_ARGUMENT
    assert _code(reg(capabilities=provider_pb2.DeviceCapabilities(backend="cuda", features=["x" * 500]))) == C.INVALID_ARGUMENT
    assert _code(reg(protocol_version="dflash.v2")) == C.FAILED_PRECONDITION
    # AcquireLease before a successful Register is a precondition failure.
    with coordinator.admin() as admin:
        admin.create_run(run_spec("enums"))
    unregistered = provider_factory("fresh")
    with coordinator.admin() as admin:
        ids = {x.name: x.provider_id for x in admin.list_providers()}
    unregistered.provider_id = ids["fresh"]
    assert _code(lambda: unregistered.acquire()) == C.FAILED_PRECONDITION

    p.register()
    lease = p.acquire().lease
    hb = p.heartbeats()
    with pytest.raises(grpc.RpcError) as e:
        hb.send_raw(provider_pb2.HeartbeatRequest(lease_id=lease.lease_id, phase=99))
    assert code_of(e) == C.INVALID_ARGUMENT
    for outcome in (0, 42):
        assert _code(lambda: p.finish(lease.lease_id, outcome)) == C.INVALID_ARGUMENT
    # The lease is still live after all that.
    assert p.finish(lease.lease_id) == "succeeded"


@pytest.mark.parametrize("field", ["step", "total_steps", "committed_step"])
def test_a_heartbeat_uint64_past_what_sqlite_holds_is_invalid_argument_naming_the_field(leased, field):
    """A lying provider's step >= 2**63 was an OverflowError in the store: INTERNAL, the stream broken."""
    coordinator, p, lease, _ = leased
    for value in (2**63, 2**64 - 1):
        hb = p.heartbeats()
        with pytest.raises(grpc.RpcError) as e:
            hb.send_raw(provider_pb2.HeartbeatRequest(lease_id=lease.lease_id, phase=provider_pb2.PHASE_TRAIN, **{field: value}))
        assert code_of(e) == C.INVALID_ARGUMENT and f"`{field}` is {value}" in e.value.details(), e.value.details()
    # the largest value SQLite holds is stored as it is, and the lease lives on
    assert p.heartbeat_once(lease.lease_id, step=2**63 - 1, committed_step=0).directive == provider_pb2.DIRECTIVE_CONTINUE
    assert p.finish(lease.lease_id) == "succeeded"


def test_a_nested_uint64_past_what_sqlite_holds_is_named_by_its_path(leased):
    _, p, lease, _ = leased
    art = provider_pb2.Artifact(name="report.json", kind="report", sha256="0" * 64, size_bytes=2**64 - 1)
    with pytest.raises(grpc.RpcError) as e:  # a unary call
        p.stub.UploadOffset(provider_pb2.UploadOffsetRequest(lease_id=lease.lease_id, artifact=art), metadata=p.metadata, timeout=10)
    assert code_of(e) == C.INVALID_ARGUMENT and f"`artifact.size_bytes` is {2**64 - 1}" in e.value.details(), e.value.details()
    with pytest.raises(grpc.RpcError) as e:  # a stream's first message, two levels down
        p.upload(lease.lease_id, "report.json", b"{}", sha256="0" * 64, size=2**64 - 1)
    assert code_of(e) == C.INVALID_ARGUMENT and f"`header.artifact.size_bytes` is {2**64 - 1}" in e.value.details(), e.value.details()


def test_garbage_bytes_do_not_hurt_the_server(coordinator, provider_factory):
    p = provider_factory()
    raw = p.channel.unary_unary("/dflash.v1.ProviderService/Register", request_serializer=None, response_deserializer=None)
    for junk in (b"\xff\xff\xff\xff", b"\x0a\xff\xff\xff\xff\x0f", os.urandom(64)):
        with pytest.raises(grpc.RpcError) as e:
            raw(junk, metadata=p.metadata, timeout=5)
        assert code_of(e) == C.INVALID_ARGUMENT
    unknown = p.channel.unary_unary("/dflash.v1.ProviderService/Nope", request_serializer=None, response_deserializer=None)
    assert _code(lambda: unknown(b"", metadata=p.metadata, timeout=5)) == C.UNIMPLEMENTED
    assert p.register().provider_id  # still serving


@settings(max_examples=300, deadline=None)
@given(st.lists(st.sampled_from(list("ab./\\\x00-_~:") + ["..", "é"]), max_size=20).map("".join))
def test_accepted_names_stay_inside_the_namespace(name):
    root = Path("/srv/artifacts/run/job")
    try:
        check_name(name)
    except InvalidRequestError:
        return
    resolved = Path(os.path.normpath(root / name))
    assert resolved.is_relative_to(root) and resolved != root
    assert "\\" not in name and "\x00" not in name and not name.startswith("/")
