"""Errors a front end turns into a 4xx/5xx answer (or the gRPC equivalent) while the server keeps serving."""

from __future__ import annotations


class RequestError(Exception):
    """A request the server refuses; `status` is the HTTP status, `param` the offending field if any."""

    status = 400
    grpc_code = "INVALID_ARGUMENT"
    openai_type = "invalid_request_error"

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param


class InvalidRequest(RequestError):
    pass


class Unauthorized(RequestError):
    status = 401
    grpc_code = "UNAUTHENTICATED"
    openai_type = "authentication_error"


class NotFound(RequestError):
    status = 404
    grpc_code = "NOT_FOUND"
    openai_type = "not_found_error"


class MethodNotAllowed(RequestError):
    status = 405
    grpc_code = "UNIMPLEMENTED"


class PayloadTooLarge(RequestError):
    status = 413
    grpc_code = "RESOURCE_EXHAUSTED"


class Unavailable(RequestError):
    """The server is shutting down (or not ready) and takes no new requests."""

    status = 503
    grpc_code = "UNAVAILABLE"
    openai_type = "service_unavailable"


class Overloaded(RequestError):
    """The queue of requests waiting for the engine is full; the client should retry later (Retry-After)."""

    status = 429
    grpc_code = "RESOURCE_EXHAUSTED"
    openai_type = "rate_limit_error"
    retry_after_s = 1


class RequestTimeout(RequestError):
    """The client did not send its request body in time."""

    status = 408
    grpc_code = "DEADLINE_EXCEEDED"


class UnsupportedMediaType(RequestError):
    """A Content-Encoding the server does not decode."""

    status = 415
    grpc_code = "INVALID_ARGUMENT"


class Forbidden(RequestError):
    """A request from a web page of another origin, or for a Host name this server does not answer to."""

    status = 403
    grpc_code = "PERMISSION_DENIED"
    openai_type = "permission_error"


class InternalError(RequestError):
    """Something went wrong inside kiln for this request alone (the engine went on serving the others)."""

    status = 500
    grpc_code = "INTERNAL"
    openai_type = "internal_error"
