"""What the runtime hands back for a request: each update holds everything so far, or with
SamplingParams.output_kind="delta" what is new since the previous update."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from kiln.runtime.core.perf_metrics import RequestPerfMetrics
from kiln.runtime.core.request_failure import RequestFailure


@dataclass(frozen=True)
class CompletionOutput:
    """One completion of a request (vLLM's CompletionOutput): the one of a plain request, or one beam of a
    beam search. `index`: its rank, 0 the best. `cumulative_logprob`: the sum of its tokens' logprobs (None for
    a plain request without logprobs); a beam's `score` is that over length ** length_penalty."""

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None
    logprobs: list[float] | None
    finish_reason: str | None
    score: float | None = None  # beam search: what the beams are ranked by
    # SamplingParams.return_generation_logits: a float32 torch.Tensor [len(token_ids), vocab], the raw logits
    # each token was chosen from (TensorRT-LLM's CompletionOutput.generation_logits); None when not asked.
    generation_logits: Any = None


@dataclass(frozen=True)
class RequestMetrics:
    """Where a request's cached prompt tokens (`RequestOutput.num_cached_tokens`) came from: the device pool,
    the host tier or the disk tier (`kv_offloading_size`, `kv_offloading_dir`); the rest were computed."""

    num_cached_tokens_device: int = 0
    num_cached_tokens_host: int = 0
    num_cached_tokens_disk: int = 0

    @classmethod
    def of(cls, request) -> RequestMetrics:
        """From a scheduled `Request` (core/request.py)."""
        host, disk = request.num_cached_host_tokens, request.num_cached_disk_tokens
        return cls(request.num_cached_prompt_tokens - host - disk, host, disk)


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
    # Beam search: the B beams, best first (the fields above describe the first); None for a plain request.
    beam_outputs: list[CompletionOutput] | None = None
    # SamplingParams.return_context_logits: a float32 torch.Tensor [len(prompt_token_ids), vocab], the raw logits
    # at every prompt position (TensorRT-LLM's name), once the prompt is computed (with output_kind "delta" in
    # that update only); shared, not copied: read it, do not write it. None when not asked.
    context_logits: Any = None
    # SamplingParams.return_generation_logits: [len(token_ids), vocab] float32 for the tokens above (a plain
    # request's; a beam's are its CompletionOutput's).
    generation_logits: Any = None
    perf_metrics: RequestPerfMetrics | None = None  # SamplingParams.return_perf_metrics: timings, KV-cache reuse
    metrics: RequestMetrics = RequestMetrics()  # num_cached_tokens by tier

    @property
    def outputs(self) -> list[CompletionOutput]:
        """The completions, best first: one for a plain request (these fields), B for beam search. Each
        update of a beam search holds the current best B beams whole, whatever output_kind."""
        if self.beam_outputs is not None:
            return list(self.beam_outputs)
        cumulative = sum(self.logprobs) if self.logprobs is not None else None
        return [CompletionOutput(0, self.text, list(self.token_ids), cumulative, self.logprobs, self.finish_reason,
                                 generation_logits=self.generation_logits)]

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None
