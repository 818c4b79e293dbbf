"""Domain errors with one mapping to gRPC status codes and HTTP statuses.

Every role raises these; the gRPC interceptor (services/common/grpc_server.py) and the
Flask JSON error helpers translate them, so a bad input is INVALID_ARGUMENT/400
and an unknown adapter NOT_FOUND/404 everywhere, never a blanket INTERNAL/500.
"""

from __future__ import annotations

import math

import grpc


class TesseraError(Exception):
    """Base class: a client-visible failure with a status code."""

    grpc_code: grpc.StatusCode = grpc.StatusCode.INTERNAL
    http_status: int = 500
    error_type: str = "internal_error"

    def __init__(self, message: str, *, param: str | None = None, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after_s = retry_after_s

    def retry_after_header(self) -> str | None:
        """When to retry, for both doors (HTTP `Retry-After`, gRPC trailing metadata `retry-after`):
        whole seconds, at least 1, on overload and unavailability; None for errors a retry cannot fix."""
        if self.grpc_code not in (grpc.StatusCode.RESOURCE_EXHAUSTED, grpc.StatusCode.UNAVAILABLE):
            return None
        return str(max(1, math.ceil(self.retry_after_s or 1)))


class InvalidArgument(TesseraError):
    grpc_code = grpc.StatusCode.INVALID_ARGUMENT
    http_status = 400
    error_type = "invalid_request_error"


class PayloadTooLarge(InvalidArgument):
    """Bad input by size (an image over the byte limit): 413 over HTTP, INVALID_ARGUMENT over gRPC."""

    http_status = 413


class NotFound(TesseraError):
    grpc_code = grpc.StatusCode.NOT_FOUND
    http_status = 404
    error_type = "not_found_error"


class AlreadyExists(TesseraError):
    grpc_code = grpc.StatusCode.ALREADY_EXISTS
    http_status = 409
    error_type = "conflict_error"


class FailedPrecondition(TesseraError):
    grpc_code = grpc.StatusCode.FAILED_PRECONDITION
    http_status = 409
    error_type = "conflict_error"


class AdapterLoadFailed(FailedPrecondition):
    """A worker could not load a registered adapter (checksum mismatch, unreadable or invalid stored
    files): the request is fine, the stored adapter is not, and retrying cannot help until an admin
    registers it again, hence FAILED_PRECONDITION / 409."""


class Unauthenticated(TesseraError):
    grpc_code = grpc.StatusCode.UNAUTHENTICATED
    http_status = 401
    error_type = "authentication_error"


class PermissionDenied(TesseraError):
    grpc_code = grpc.StatusCode.PERMISSION_DENIED
    http_status = 403
    error_type = "permission_error"


class ResourceExhausted(TesseraError):
    grpc_code = grpc.StatusCode.RESOURCE_EXHAUSTED
    http_status = 429
    error_type = "overloaded_error"


class Unavailable(TesseraError):
    grpc_code = grpc.StatusCode.UNAVAILABLE
    http_status = 503
    error_type = "service_unavailable_error"


class DeadlineExceeded(TesseraError):
    grpc_code = grpc.StatusCode.DEADLINE_EXCEEDED
    http_status = 504
    error_type = "timeout_error"


class RequestTimeout(DeadlineExceeded):
    """The client's own request did not arrive in time (a slow upload): 408 over HTTP."""

    http_status = 408


class Internal(TesseraError):
    pass


_BY_GRPC_CODE: dict[grpc.StatusCode, type[TesseraError]] = {
    cls.grpc_code: cls
    for cls in (InvalidArgument, NotFound, AlreadyExists, FailedPrecondition, Unauthenticated,
                PermissionDenied, ResourceExhausted, Unavailable, DeadlineExceeded)
}


def from_rpc_error(err: grpc.RpcError, context: str) -> TesseraError:
    """Translate a failed downstream call (e.g. gateway -> worker) into a domain error.

    CANCELLED from a peer that went away is reported as UNAVAILABLE: for the
    caller the server is gone, not its own request cancelled.
    """
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = (err.details() if hasattr(err, "details") else None) or str(code)
    cls = _BY_GRPC_CODE.get(code, Unavailable if code in (grpc.StatusCode.CANCELLED, grpc.StatusCode.UNKNOWN) else Internal)
    return cls(f"{context}: {details}" if cls in (Unavailable, Internal) else details)
