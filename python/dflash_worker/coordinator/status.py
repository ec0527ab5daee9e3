"""The one place that maps `dflash_worker.errors` exceptions to gRPC status codes."""

from __future__ import annotations

import errno
import sqlite3

import grpc

from ..errors import (
    AuthenticationError,
    ConfigError,
    ConflictError,
    DataError,
    DflashError,
    IdleError,
    InvalidRequestError,
    NotFoundError,
    PermissionDeniedError,
    PolicyError,
    QuotaError,
    RateLimitedError,
    StaleLeaseError,
    StorageError,
)

# First match wins; order subclasses before their bases.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (AuthenticationError, grpc.StatusCode.UNAUTHENTICATED),
    (PermissionDeniedError, grpc.StatusCode.PERMISSION_DENIED),
    (RateLimitedError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (QuotaError, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (StorageError, grpc.StatusCode.UNAVAILABLE),
    (IdleError, grpc.StatusCode.DEADLINE_EXCEEDED),
    (InvalidRequestError, grpc.StatusCode.INVALID_ARGUMENT),
    (ConfigError, grpc.StatusCode.INVALID_ARGUMENT),
    (DataError, grpc.StatusCode.INVALID_ARGUMENT),
    (NotFoundError, grpc.StatusCode.NOT_FOUND),
    (ConflictError, grpc.StatusCode.ALREADY_EXISTS),
    (StaleLeaseError, grpc.StatusCode.ABORTED),
    (PolicyError, grpc.StatusCode.FAILED_PRECONDITION),
    # Any other deliberate refusal is a precondition the caller can read about.
    (DflashError, grpc.StatusCode.FAILED_PRECONDITION),
)


def storage_failure(exc: BaseException) -> bool:
    """Whether `exc` is the coordinator's own storage failing (a full disk, an I/O error), not a bug."""
    if isinstance(exc, sqlite3.OperationalError):
        text = str(exc).lower()
        return "full" in text or "disk i/o" in text or "readonly" in text or "unable to open" in text
    return isinstance(exc, OSError) and exc.errno in (errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS)


def status_for(exc: BaseException) -> grpc.StatusCode:
    """gRPC status code for an exception (INTERNAL for anything unexpected)."""
    if storage_failure(exc):
        # Retryable: the caller keeps its work and tries again once space is freed.
        return grpc.StatusCode.UNAVAILABLE
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code
    return grpc.StatusCode.INTERNAL


# The reverse direction, for clients: a refused call becomes the matching error class.
# RESOURCE_EXHAUSTED is left out: grpc also answers it for an oversized message, so a
# client cannot tell a rate limit from it by the code alone (`grpc_code` still says it).
_ERRORS: dict[grpc.StatusCode, type[DflashError]] = {
    grpc.StatusCode.UNAUTHENTICATED: AuthenticationError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidRequestError,
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.ALREADY_EXISTS: ConflictError,
    grpc.StatusCode.ABORTED: StaleLeaseError,
    grpc.StatusCode.FAILED_PRECONDITION: PolicyError,
}


def error_for(code: grpc.StatusCode, message: str) -> DflashError:
    """The `DflashError` a client raises for a call refused with `code`."""
    from ..errors import CoordinatorError

    err = _ERRORS.get(code, CoordinatorError)(message)
    err.grpc_code = code  # the exact code, for callers that retry on UNAVAILABLE
    return err
