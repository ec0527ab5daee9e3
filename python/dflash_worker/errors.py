"""Error hierarchy. Every user-facing failure raises a subclass of `DflashError`.

Messages follow the house style: lowercase, values in backticks, the file, line
or tensor named, and a ``hint:`` line where the fix is known. The CLI prints
them without a traceback and exits with code 1.
"""

from __future__ import annotations


class DflashError(Exception):
    """Root of every error this package raises on purpose."""

    exit_code = 1


class ConfigError(DflashError, ValueError):
    """A recipe, config.json or command-line value is invalid."""


class CheckpointError(DflashError):
    """A checkpoint file or directory is unreadable, corrupt or mismatched."""


class FamilyError(DflashError):
    """A target/draft pair does not belong together, or a family is unknown."""


class DataError(DflashError):
    """Training data is malformed; names file and line."""


class DeviceError(DflashError):
    """A required device backend is missing or unusable."""


class ResumeError(DflashError):
    """A run cannot be resumed (incompatible recipe, data or draft)."""


class ExportError(DflashError):
    """An export was refused (non-finite tensors, scope violation, ...)."""


class CoordinatorError(DflashError):
    """A coordinator request was refused; each subclass maps to one gRPC status code."""


class InvalidRequestError(CoordinatorError, ValueError):
    """A request field is malformed (names the field); INVALID_ARGUMENT."""


class NotFoundError(CoordinatorError):
    """A run, job, provider or lease id is unknown; NOT_FOUND."""


class ConflictError(CoordinatorError):
    """A name is taken or an artifact was already reported with other bytes; ALREADY_EXISTS."""


class PolicyError(CoordinatorError):
    """A request is well formed but refused by policy or state; FAILED_PRECONDITION."""


class StaleLeaseError(CoordinatorError):
    """A write names a lease that is not its job's live lease; ABORTED (the holder must stop)."""


class AuthenticationError(CoordinatorError):
    """No bearer token, or an unknown one; UNAUTHENTICATED."""


class PermissionDeniedError(CoordinatorError):
    """A valid token that may not make this call; PERMISSION_DENIED."""


class RateLimitedError(CoordinatorError):
    """A peer failed authentication too often and is refused for a while; RESOURCE_EXHAUSTED."""


class QuotaError(CoordinatorError):
    """A run's or attempt's artifact quota (bytes or records) would be passed; RESOURCE_EXHAUSTED naming the limit."""


class StorageError(CoordinatorError):
    """The coordinator's own storage failed (disk full, object store unreachable); UNAVAILABLE: retry later."""


class IdleError(CoordinatorError):
    """A streamed call sent nothing for the server's idle limit and was cut; DEADLINE_EXCEEDED."""
