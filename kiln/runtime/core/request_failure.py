"""One request that cannot go on, told apart from an engine that cannot go on.

Anything that goes wrong for a single request (its grammar allows no token, its matcher refuses a token, its
text cannot be decoded) ends that request alone with finish_reason "error" and a `RequestFailure` in its
last output; the engine keeps serving the others. Plain Python: the scheduler's side imports it too.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class RequestFailure:
    """Why a request ended with finish_reason "error". `client_error`: the request's own input caused it (a
    constraint that leads nowhere), so a server answers 4xx; else it is kiln's fault (5xx for that request)."""

    message: str
    client_error: bool = False


class RequestFailed(Exception):
    """Raised by a per-request hook (a token masker, a detokenizer) for one request; the engine catches it, ends
    that request with its `failure` and goes on. `AsyncLLM.generate` raises it to the request's caller."""

    def __init__(self, request_id: str, failure: RequestFailure) -> None:
        super().__init__(failure.message)
        self.request_id = request_id
        self.failure = failure


class EngineDeadError(RuntimeError):
    """The engine as a whole has stopped (a tensor-parallel rank died, the engine thread crashed, shutdown):
    every request still running gets this, and no new one is taken."""
