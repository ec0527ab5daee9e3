"""Server interceptor: bearer-token authentication and error-to-status mapping.

Every call must carry ``authorization: Bearer <token>``. Provider tokens may
call ``ProviderService``; the admin token may call ``AdminService``; any
other combination is refused before the handler runs (UNAUTHENTICATED for a
missing or unknown token, PERMISSION_DENIED for a valid token on the wrong
service). The interceptor wraps each handler so that the caller's identity
is available to it (`current_principal`) and so that `DflashError`s raised
inside are turned into status codes by `status.status_for`.
"""

from __future__ import annotations

import contextlib
import contextvars
import logging
from collections.abc import Callable

import grpc

from ..errors import AuthenticationError, DflashError, InvalidRequestError, PermissionDeniedError
from .status import status_for
from .store import Principal

log = logging.getLogger("dflash_worker.coordinator")

PROVIDER_SERVICE = "dflash.v1.ProviderService"
ADMIN_SERVICE = "dflash.v1.AdminService"

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


def authorize(method: str, token: str | None, lookup: Callable[[str], Principal | None]) -> Principal:
    """Who may call `method` ("/package.Service/Method") with `token`; raises if nobody."""
    if token is None:
        raise AuthenticationError("missing `authorization: Bearer <token>` metadata")
    principal = lookup(token)
    if principal is None:
        raise AuthenticationError("unknown bearer token\nhint: ask the coordinator's admin for a provider token")
    service = method.split("/")[1] if method.count("/") >= 2 else ""
    if service == ADMIN_SERVICE and not principal.admin:
        raise PermissionDeniedError("admin calls need the admin token")
    if service == PROVIDER_SERVICE and principal.admin:
        raise PermissionDeniedError("provider calls need a provider token, not the admin token")
    if service not in (ADMIN_SERVICE, PROVIDER_SERVICE):
        raise PermissionDeniedError(f"unknown service `{service}`")
    return principal


async def _abort(context, exc: BaseException, method: str):
    code = status_for(exc)
    if code is grpc.StatusCode.INTERNAL:
        log.error("internal error in %s", method, exc_info=exc)
        await context.abort(code, "internal error; see the coordinator log")
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


def _check(request, method: str):
    if isinstance(request, _Undecodable):
        raise InvalidRequestError(f"`{method}` request is not a valid protobuf message: {request.error}")
    return request


async def _checked(request_iterator, method: str):
    async for request in request_iterator:
        yield _check(request, method)


@contextlib.asynccontextmanager
async def _serving(context, method: str, principal: Principal | None, refusal: DflashError | None):
    """Around one call's handler: refuse it, or set the principal and map what it raises to a status code."""
    if refusal is not None:
        await _abort(context, refusal, method)
    _principal.set(principal)
    try:
        yield
    except grpc.aio.AbortError:
        raise
    except Exception as exc:  # noqa: BLE001 - mapped to a status code
        await _abort(context, exc, method)


def _wrap(handler: grpc.RpcMethodHandler, method: str, principal: Principal | None, refusal: DflashError | None):
    """A handler of the same kind as `handler` that sets the principal and maps errors."""

    if handler.request_streaming and handler.response_streaming:
        inner_stream = handler.stream_stream

        async def stream_stream(request_iterator, context):
            async with _serving(context, method, principal, refusal):
                async for response in inner_stream(_checked(request_iterator, method), context):
                    yield response

        behaviour, make_handler = stream_stream, grpc.stream_stream_rpc_method_handler
    elif not handler.request_streaming and not handler.response_streaming:
        inner_unary = handler.unary_unary

        async def unary_unary(request, context):
            async with _serving(context, method, principal, refusal):
                return await inner_unary(_check(request, method), context)

        behaviour, make_handler = unary_unary, grpc.unary_unary_rpc_method_handler
    else:
        raise AssertionError(f"{method}: dflash.v1 has no unary-stream or stream-unary methods")
    return make_handler(
        behaviour, request_deserializer=_tolerant(handler.request_deserializer), response_serializer=handler.response_serializer
    )


class AuthInterceptor(grpc.aio.ServerInterceptor):
    """Authenticates every call and maps handler errors to status codes."""

    def __init__(self, lookup: Callable[[str], Principal | None]):
        self._lookup = lookup

    async def intercept_service(self, continuation, handler_call_details):
        handler = await continuation(handler_call_details)
        if handler is None:
            return None
        method = handler_call_details.method
        principal, refusal = None, None
        try:
            principal = authorize(method, bearer_token(handler_call_details.invocation_metadata), self._lookup)
        except DflashError as exc:
            refusal = exc
        return _wrap(handler, method, principal, refusal)
