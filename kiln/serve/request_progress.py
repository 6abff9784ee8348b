"""A request's updates added up, for the servers.

The engine hands the servers only what each step added (SamplingParams.output_kind "delta"), so a stream
costs the engine thread per new token, not a copy of the output so far every step. The front ends still
read a cumulative output now and then (the final answer, `include_stop_str_in_output`, tool calls parsed
from the text so far): `CumulativeOutput` gives RequestOutput's fields as of one update and copies the
token list, text and logprobs out of the progress only when they are read.
"""

from __future__ import annotations

from functools import cached_property

from kiln.runtime.core.outputs import RequestOutput


class RequestProgress:
    """Everything a request's delta updates have brought so far."""

    def __init__(self) -> None:
        self.first: RequestOutput | None = None  # the prompt's fields (and prompt logprobs) come with it
        self.token_ids: list[int] = []
        self.logprobs: list[float] | None = None  # None unless the request asked for them
        self.top_logprobs: list[dict[int, float]] | None = None
        self.num_cached_tokens = 0
        self.metrics = None  # RequestOutput.metrics: the cached tokens by tier
        self._text: list[str] = []  # pieces, joined when read
        self.text_len = 0
        # What a request may ask for besides its tokens: context logits (first update), generation logits rows
        # (per update, joined when read) and its latest perf metrics.
        self.context_logits = None
        self.generation_logits: list | None = None
        self.perf_metrics = None

    def add(self, out: RequestOutput) -> CumulativeOutput:
        """Adds one delta update; returns the cumulative output as of it."""
        if self.first is None:
            self.first = out
            self.logprobs = None if out.logprobs is None else []
            self.top_logprobs = None if out.top_logprobs is None else []
        self.token_ids.extend(out.token_ids)
        if out.text:
            self._text.append(out.text)
            self.text_len += len(out.text)
        if self.logprobs is not None:
            self.logprobs.extend(out.logprobs or ())
        if self.top_logprobs is not None:
            self.top_logprobs.extend(out.top_logprobs or ())
        self.num_cached_tokens = out.num_cached_tokens
        self.metrics = out.metrics
        if out.context_logits is not None:
            self.context_logits = out.context_logits
        if out.generation_logits is not None:  # a cumulative view reads its first rows only: appending is safe
            if self.generation_logits is None:
                self.generation_logits = []
            self.generation_logits.append(out.generation_logits)
        if out.perf_metrics is not None:
            self.perf_metrics = out.perf_metrics
        return CumulativeOutput(self, len(self.token_ids), self.text_len, out.finish_reason)

    def text(self, length: int) -> str:
        """The first `length` characters of the text so far."""
        if len(self._text) > 1:
            self._text = ["".join(self._text)]
        return self._text[0][:length] if self._text else ""


class CumulativeOutput:
    """RequestOutput's fields for a request as of one of its updates (duck-typed: the front ends read
    attributes). The cheap ones are plain; token_ids, text, logprobs and top_logprobs are copied out of the
    progress when first read."""

    def __init__(self, progress: RequestProgress, num_tokens: int, text_len: int, finish_reason: str | None):
        self._progress = progress
        self._num_tokens = num_tokens
        self._text_len = text_len
        first = progress.first
        self.request_id = first.request_id
        self.prompt_token_ids = first.prompt_token_ids
        self.prompt_logprobs = first.prompt_logprobs
        self.prompt_top_logprobs = first.prompt_top_logprobs
        self.num_cached_tokens = progress.num_cached_tokens
        self.metrics = progress.metrics
        self.finish_reason = finish_reason
        self.context_logits = progress.context_logits
        self.perf_metrics = progress.perf_metrics

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    @cached_property
    def token_ids(self) -> list[int]:
        return self._progress.token_ids[:self._num_tokens]

    @cached_property
    def text(self) -> str:
        return self._progress.text(self._text_len)

    @cached_property
    def logprobs(self) -> list[float] | None:
        values = self._progress.logprobs
        return None if values is None else values[:self._num_tokens]

    @cached_property
    def top_logprobs(self) -> list[dict[int, float]] | None:
        values = self._progress.top_logprobs
        return None if values is None else values[:self._num_tokens]

    @cached_property
    def generation_logits(self):
        """[tokens so far, V] float32 (a torch.Tensor), when the request asked for them."""
        parts = self._progress.generation_logits
        if parts is None:
            return None
        import torch  # only requests that asked for logits get here

        parts = [p for p in parts if p.numel()]
        joined = torch.cat(parts) if parts else torch.empty(0, 0)
        return joined[:self._num_tokens]
