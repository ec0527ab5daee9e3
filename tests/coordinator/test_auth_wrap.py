"""auth._wrap: both handler kinds admit (or refuse), set the principal and map errors the same way (no server needed)."""

from __future__ import annotations

import asyncio

import grpc
import pytest

from dflash_worker.coordinator import auth
from dflash_worker.coordinator.store import Principal
from dflash_worker.errors import AuthenticationError, NotFoundError

METHOD = "/dflash.v1.ProviderService/Test"
PRINCIPAL = Principal(admin=False, provider_id="p-1")


class FakeContext:
    def __init__(self):
        self.aborted: tuple[grpc.StatusCode, str] | None = None

    async def abort(self, code, details):
        self.aborted = (code, details)
        raise grpc.aio.AbortError()


def _handler(kind: str, behaviour):
    """A wrapped handler of `kind` whose inner behaviour is `behaviour(request)`."""
    if kind == "unary":

        async def inner(request, context):
            return behaviour(request)

        return grpc.unary_unary_rpc_method_handler(inner, request_deserializer=bytes, response_serializer=bytes)

    async def inner_stream(request_iterator, context):
        async for request in request_iterator:
            yield behaviour(request)

    return grpc.stream_stream_rpc_method_handler(inner_stream, request_deserializer=bytes, response_serializer=bytes)


def _admit(refusal=None):
    """An admission that lets PRINCIPAL in, or raises `refusal`."""

    def admit(context):
        if refusal is not None:
            raise refusal
        return PRINCIPAL

    return admit


def _call(kind: str, behaviour, refusal=None, request=b"x"):
    """(responses, context) of one call to the wrapped handler with `request`; responses None when aborted."""
    wrapped = auth._wrap(_handler(kind, behaviour), METHOD, _admit(refusal))
    ctx = FakeContext()

    async def go():
        if kind == "unary":
            return [await wrapped.unary_unary(request, ctx)]

        async def requests():
            yield request

        return [r async for r in wrapped.stream_stream(requests(), ctx)]

    try:
        return asyncio.run(go()), ctx
    except grpc.aio.AbortError:
        return None, ctx


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_the_principal_is_set_for_the_handler(kind):
    responses, ctx = _call(kind, lambda request: auth.current_principal())
    assert responses == [PRINCIPAL] and ctx.aborted is None


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_a_refusal_aborts_before_the_handler_runs(kind):
    ran = []
    responses, ctx = _call(kind, ran.append, refusal=AuthenticationError("no token"))
    assert responses is None and ran == []
    assert ctx.aborted == (grpc.StatusCode.UNAUTHENTICATED, "no token")


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_a_dflash_error_maps_to_its_code(kind):
    def behaviour(request):
        raise NotFoundError("no run `r-1`")

    assert _call(kind, behaviour)[1].aborted == (grpc.StatusCode.NOT_FOUND, "no run `r-1`")


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_an_unexpected_error_is_internal_and_hides_its_message(kind):
    def behaviour(request):
        raise RuntimeError("secret detail")

    assert _call(kind, behaviour)[1].aborted == (grpc.StatusCode.INTERNAL, "internal error; see the coordinator log")


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_an_undecodable_request_is_invalid_argument(kind):
    # What the tolerant deserializer returns for bytes that are no protobuf message.
    bad = auth._Undecodable(ValueError("truncated"))
    responses, ctx = _call(kind, lambda request: request, request=bad)
    assert responses is None
    assert ctx.aborted == (grpc.StatusCode.INVALID_ARGUMENT, "`/dflash.v1.ProviderService/Test` request is not a valid protobuf message: truncated")


def test_out_of_range_uint64s_are_found_with_their_path():
    from dflash_worker.proto.dflash.v1 import admin_pb2, provider_pb2

    big = 2**63
    assert auth.out_of_range_field(provider_pb2.HeartbeatRequest(step=2**63 - 1, metrics={"loss": 1.0})) is None
    assert auth.out_of_range_field(provider_pb2.HeartbeatRequest(committed_step=big)) == ("committed_step", big)
    nested = provider_pb2.UploadOffsetRequest(artifact=provider_pb2.Artifact(step=big))
    assert auth.out_of_range_field(nested) == ("artifact.step", big)
    header = provider_pb2.UploadArtifactRequest(header=provider_pb2.UploadHeader(artifact=provider_pb2.Artifact(step=big)))
    assert auth.out_of_range_field(header) == ("header.artifact.step", big)
    caps = provider_pb2.RegisterRequest(capabilities=provider_pb2.DeviceCapabilities(memory_bytes=2**64 - 1))
    assert auth.out_of_range_field(caps) == ("capabilities.memory_bytes", 2**64 - 1)
    listed = provider_pb2.Lease(inputs=[provider_pb2.Artifact(step=1), provider_pb2.Artifact(size_bytes=big)])
    assert auth.out_of_range_field(listed) == ("inputs[1].size_bytes", big)
    # every uint64 of both services' request messages is reached: set each one past the limit
    for module in (provider_pb2, admin_pb2):
        for message in module.DESCRIPTOR.message_types_by_name.values():
            for fd in message.fields:
                if fd.type == fd.TYPE_UINT64 and not auth._repeated(fd):
                    msg = getattr(module, message.name)(**{fd.name: big})
                    assert auth.out_of_range_field(msg) == (fd.name, big), (message.name, fd.name)


@pytest.mark.parametrize("kind", ["unary", "stream"])
def test_a_request_with_an_out_of_range_uint64_never_reaches_the_handler(kind):
    from dflash_worker.proto.dflash.v1 import provider_pb2

    seen = []
    responses, ctx = _call(kind, seen.append, request=provider_pb2.HeartbeatRequest(step=2**64 - 1))
    assert responses is None
    assert seen == [] and ctx.aborted[0] == grpc.StatusCode.INVALID_ARGUMENT and "`step` is 18446744073709551615" in ctx.aborted[1]
