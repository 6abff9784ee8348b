"""What the runtime hands back for a request: each update holds everything so far, or with
SamplingParams.output_kind="delta" what is new since the previous update."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.runtime.core.request_failure import RequestFailure


@dataclass(frozen=True)
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    # With output_kind "delta", token_ids, text, logprobs and top_logprobs hold only what is new since the
    # previous update, and the prompt logprobs come in the first update only (None after it).
    token_ids: list[int]  # generated tokens so far (a final EOS / stop token included)
    text: str  # generated text so far; while streaming, text a stop string might still cut is held back
    finish_reason: str | None  # "stop" | "length" | "abort" | "error", None while running
    logprobs: list[float] | None = None  # per generated token, when SamplingParams.logprobs
    # per generated token, its top_logprobs most likely tokens {token id: logprob}, when asked
    top_logprobs: list[dict[int, float]] | None = None
    prompt_logprobs: list[float | None] | None = None  # per prompt token (None first), when asked
    # per prompt token (None first), the prompt_top_logprobs most likely tokens {token id: logprob} of the
    # model's distribution at that position, when asked
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    # With finish_reason "error": what went wrong for this request alone (the engine went on serving).
    error: RequestFailure | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
