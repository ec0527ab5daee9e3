"""Server interceptor: who is calling, may they, and error-to-status mapping.

Every call must carry ``authorization: Bearer <token>``. Provider tokens may
call ``ProviderService``; the admin token may call ``AdminService``; any
other combination is refused before the handler runs (UNAUTHENTICATED for a
missing, unknown, revoked or expired token, PERMISSION_DENIED for a valid
token on the wrong service). Under mutual TLS a provider call's client
certificate must name the token's provider: its subject CommonName must equal
the name the provider was created with (the TLS handshake has already checked
that a CA the coordinator trusts issued it).

Admission runs inside the wrapped handler (`_serving`), where the call's
context gives the peer address and the TLS auth context. `Gate.admit`
decides; a `FailureLimiter` counts failed authentications per peer address and,
past its limit, refuses that peer's calls (RESOURCE_EXHAUSTED, with a `retry
after` hint) before any token is looked at, until its window ends. A
throttled peer is refused even with a good token: otherwise the throttle would
not slow a guesser down, as a right guess would still get through. The cost is
that providers behind one NAT address share a budget; the defaults (20
failures a minute) leave room for a few misconfigured machines.

Every request message (each one of a stream too) is checked before its handler sees it: a uint64
field anywhere in it (nested, repeated, map values) above 2**63-1, which the store's signed 64-bit
SQLite integers cannot hold, is refused with INVALID_ARGUMENT naming the field's path.

The wrapper also makes the caller's identity available to the handler
(`current_principal`) and turns `DflashError`s raised inside it into status
codes through `status.status_for`.
"""

from __future__ import annotations

import contextlib
import contextvars
import ipaddress
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import grpc

from ..errors import AuthenticationError, InvalidRequestError, PermissionDeniedError, RateLimitedError
from .status import status_for, storage_failure
from .store import Principal

log = logging.getLogger("dflash_worker.coordinator")

PROVIDER_SERVICE = "dflash.v1.ProviderService"
ADMIN_SERVICE = "dflash.v1.AdminService"

DEFAULT_FAILURE_LIMIT = 20
DEFAULT_FAILURE_WINDOW = 60.0
# Peers whose failures are remembered at once; the least recently failing is
# forgotten first (a few hundred bytes each, so about 3 MB at most).
MAX_TRACKED_PEERS = 10_000

_principal: contextvars.ContextVar[Principal] = contextvars.ContextVar("dflash_principal")


def current_principal() -> Principal:
    """The authenticated caller of the RPC being served."""
    return _principal.get()


def bearer_token(metadata) -> str | None:
    """The token of the first `authorization: Bearer ...` entry, if any."""
    for key, value in metadata or ():
        if key == "authorization":
            if isinstance(value, bytes):
                return None
            scheme, _, token = value.partition(" ")
            if scheme.lower() == "bearer" and token.strip():
                return token.strip()
            return None
    return None


def authorize(method: str, token: str | None, authenticate: Callable[[str], Principal]) -> Principal:
    """Who may call `method` ("/package.Service/Method") with `token`; raises if nobody.

    `authenticate` maps a token to its principal or raises `AuthenticationError`.
    """
    if token is None:
        raise AuthenticationError("missing `authorization: Bearer <token>` metadata")
    principal = authenticate(token)
    service = method.split("/")[1] if method.count("/") >= 2 else ""
    if service == ADMIN_SERVICE and not principal.admin:
        raise PermissionDeniedError("admin calls need the admin token")
    if service == PROVIDER_SERVICE and principal.admin:
        raise PermissionDeniedError("provider calls need a provider token, not the admin token")
    if service not in (ADMIN_SERVICE, PROVIDER_SERVICE):
        raise PermissionDeniedError(f"unknown service `{service}`")
    return principal


def certificate_name(auth_context: dict) -> str | None:
    """The subject CommonName of the call's client certificate (None without one)."""
    names = auth_context.get("x509_common_name") or []
    return names[0].decode("utf-8", "replace") if names else None


def check_identity(principal: Principal, auth_context: dict) -> None:
    """Under mTLS: the client certificate must name the provider the token belongs to."""
    cn = certificate_name(auth_context)
    if cn is None:
        raise AuthenticationError("the client certificate has no subject CommonName; under mutual TLS it must be the provider's name")
    if cn != principal.name:
        raise AuthenticationError(
            f"the client certificate's CN `{cn[:200]}` and the token's provider `{principal.name}` disagree\n"
            "hint: a provider's certificate CN must be the name it was created with (`dflash-coordinator providers create NAME`)"
        )


def peer_key(peer: str) -> str:
    """What a rate limit counts against: the peer's IP without its port; IPv6 by its /64 (one site's addresses).

    `peer` is grpc's form: `ipv4:1.2.3.4:5678`, `ipv6:[::1]:5678`, `unix:...`.
    """
    kind, _, rest = peer.partition(":")
    if kind not in ("ipv4", "ipv6"):
        return kind or peer[:64]
    host = rest.rpartition(":")[0].strip("[]").partition("%")[0]
    try:
        addr = ipaddress.ip_address(host)
    except ValueError:
        return host[:64]
    if isinstance(addr, ipaddress.IPv6Address):
        if addr.ipv4_mapped is not None:
            return str(addr.ipv4_mapped)
        return str(ipaddress.IPv6Network(f"{addr}/64", strict=False))
    return str(addr)


class FailureLimiter:
    """Failed authentications per peer in a fixed window that starts at the peer's first failure.

    Once a peer has `limit` failures in its window, `check` refuses it until
    the window ends; then it starts afresh. `limit` 0 turns the limiter off.
    Memory is bounded by `max_peers`.
    """

    def __init__(self, *, limit: int = DEFAULT_FAILURE_LIMIT, window: float = DEFAULT_FAILURE_WINDOW, max_peers: int = MAX_TRACKED_PEERS, clock: Callable[[], float] = time.monotonic):
        self.limit = limit
        self.window = window
        self.max_peers = max_peers
        self.clock = clock
        # peer -> (window start, failures), least recently failing first.
        self._peers: OrderedDict[str, tuple[float, int]] = OrderedDict()

    def __len__(self) -> int:
        return len(self._peers)

    def check(self, peer: str) -> None:
        """Raise `RateLimitedError` if `peer` is over its limit."""
        entry = self._peers.get(peer)
        if entry is None or not self.limit:
            return
        start, failures = entry
        left = start + self.window - self.clock()
        if left <= 0:
            del self._peers[peer]
        elif failures >= self.limit:
            raise RateLimitedError(
                f"too many failed authentications from `{peer}` ({failures} in {self.window:g} s); retry after {math.ceil(left)} s\n"
                "hint: check the provider token (`--token`) and, under mutual TLS, that the certificate CN is the provider's name"
            )

    def failed(self, peer: str) -> None:
        """Count one failed authentication from `peer`."""
        if not self.limit:
            return
        now = self.clock()
        start, failures = self._peers.pop(peer, (now, 0))
        if now - start >= self.window:
            start, failures = now, 0
        failures += 1
        self._peers[peer] = (start, failures)
        if failures == self.limit:
            log.warning("peer `%s` failed authentication %d times in %g s; refusing its calls until its window ends", peer, failures, self.window)
        while len(self._peers) > self.max_peers:
            self._peers.popitem(last=False)


@dataclass
class Gate:
    """Admits one call: rate limit, bearer token, service, and under mTLS the certificate's identity."""

    authenticate: Callable[[str], Principal]
    limiter: FailureLimiter
    mtls: bool = False

    def admit(self, method: str, metadata, context) -> Principal:
        peer = peer_key(context.peer() or "")
        self.limiter.check(peer)
        try:
            principal = authorize(method, bearer_token(metadata), self.authenticate)
            if self.mtls and not principal.admin:
                check_identity(principal, context.auth_context())
        except AuthenticationError:
            self.limiter.failed(peer)
            raise
        return principal


async def _abort(context, exc: BaseException, method: str):
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("internal error in %s", method, exc_info=exc)
        await context.abort(code, "internal error; see the coordinator log")
    if storage_failure(exc):
        log.error("storage failure in %s: %s", method, exc)
        await context.abort(code, f"coordinator storage failed: {exc}\nhint: retry later; the coordinator's disk may be full")
    await context.abort(code, str(exc))


class _Undecodable:
    """Stands in for a request whose bytes are not a valid protobuf message."""

    def __init__(self, error: Exception):
        self.error = error


def _tolerant(deserializer):
    # grpc reports a deserializer exception as UNKNOWN; catching it here lets
    # the handler answer INVALID_ARGUMENT like any other malformed field.
    def deserialize(data: bytes):
        try:
            return deserializer(data)
        except Exception as exc:  # noqa: BLE001 - protobuf raises DecodeError (and others on odd input)
            return _Undecodable(exc)

    return deserialize


# Every integer the store keeps goes into a SQLite INTEGER (signed 64-bit): a uint64 above this
# would raise OverflowError deep in a handler (an INTERNAL error, a broken heartbeat stream).
MAX_STORED_INT = 2**63 - 1


def _unsigned_64(fd) -> bool:
    return fd.type in (fd.TYPE_UINT64, fd.TYPE_FIXED64)


def _repeated(fd) -> bool:
    flag = getattr(fd, "is_repeated", None)  # protobuf >= 5.29; `label` before
    return bool(flag) if flag is not None else fd.label == fd.LABEL_REPEATED


def out_of_range_field(message, prefix: str = "") -> tuple[str, int] | None:
    """(field path, value) of the first uint64 in `message`, nested messages, repeated fields and maps
    included, that exceeds `MAX_STORED_INT`; None when every one fits."""
    for fd, value in message.ListFields():
        name = prefix + fd.name
        if fd.type == fd.TYPE_MESSAGE and fd.message_type.GetOptions().map_entry:
            key_fd, value_fd = fd.message_type.fields_by_name["key"], fd.message_type.fields_by_name["value"]
            for k, v in value.items():
                if _unsigned_64(key_fd) and k > MAX_STORED_INT:
                    return f"{name} key", k
                if value_fd.type == value_fd.TYPE_MESSAGE:
                    found = out_of_range_field(v, f"{name}[{k!r}].")
                    if found is not None:
                        return found
                elif _unsigned_64(value_fd) and v > MAX_STORED_INT:
                    return f"{name}[{k!r}]", v
        elif fd.type == fd.TYPE_MESSAGE:
            for i, m in enumerate(value) if _repeated(fd) else [(None, value)]:
                found = out_of_range_field(m, f"{name}[{i}]." if i is not None else f"{name}.")
                if found is not None:
                    return found
        elif _unsigned_64(fd):
            for i, v in enumerate(value) if _repeated(fd) else [(None, value)]:
                if v > MAX_STORED_INT:
                    return (f"{name}[{i}]" if i is not None else name), v
    return None


def _check(request, method: str):
    """A decoded request whose every uint64 fits the store, or InvalidRequestError naming the field."""
    if isinstance(request, _Undecodable):
        raise InvalidRequestError(f"`{method}` request is not a valid protobuf message: {request.error}")
    if hasattr(request, "ListFields"):  # a protobuf message (the wrapper's own tests pass bytes)
        found = out_of_range_field(request)
        if found is not None:
            name, value = found
            raise InvalidRequestError(f"`{method}` request: `{name}` is {value}; at most 2**63-1 ({MAX_STORED_INT}) is allowed")
    return request


async def _checked(request_iterator, method: str):
    async for request in request_iterator:
        yield _check(request, method)


Admit = Callable[[object], Principal]


@contextlib.asynccontextmanager
async def _serving(context, method: str, admit: Admit):
    """Around one call's handler: admit the caller (or refuse the call), set the principal, map what it raises to a status code."""
    try:
        principal = admit(context)
    except Exception as exc:  # noqa: BLE001 - a refusal maps to its code, a bug to INTERNAL
        await _abort(context, exc, method)
    _principal.set(principal)
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to a status code
        await _abort(context, exc, method)


def _wrap(handler: grpc.RpcMethodHandler, method: str, admit: Admit):
    """A handler of the same kind as `handler` that admits the caller, sets the principal and maps errors."""

    if handler.request_streaming and handler.response_streaming:
        inner_stream = handler.stream_stream

        async def stream_stream(request_iterator, context):
            async with _serving(context, method, admit):
                async for response in inner_stream(_checked(request_iterator, method), context):
                    yield response

        behaviour, make_handler = stream_stream, grpc.stream_stream_rpc_method_handler
    elif not handler.request_streaming and not handler.response_streaming:
        inner_unary = handler.unary_unary

        async def unary_unary(request, context):
            async with _serving(context, method, admit):
                return await inner_unary(_check(request, method), context)

        behaviour, make_handler = unary_unary, grpc.unary_unary_rpc_method_handler
    elif handler.request_streaming:
        inner_stream_unary = handler.stream_unary

        async def stream_unary(request_iterator, context):
            async with _serving(context, method, admit):
                return await inner_stream_unary(_checked(request_iterator, method), context)

        behaviour, make_handler = stream_unary, grpc.stream_unary_rpc_method_handler
    else:
        inner_unary_stream = handler.unary_stream

        async def unary_stream(request, context):
            async with _serving(context, method, admit):
                async for response in inner_unary_stream(_check(request, method), context):
                    yield response

        behaviour, make_handler = unary_stream, grpc.unary_stream_rpc_method_handler
    return make_handler(
        behaviour, request_deserializer=_tolerant(handler.request_deserializer), response_serializer=handler.response_serializer
    )


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Wraps every handler so that `gate` admits its caller and its errors become status codes."""

    def __init__(self, gate: Gate):
        self._gate = gate

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        metadata = handler_call_details.invocation_metadata
        return _wrap(handler, method, lambda context: self._gate.admit(method, metadata, context))
