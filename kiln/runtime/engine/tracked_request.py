"""What the engine keeps for a request besides the scheduler's state: its text, its generator and the
logprobs it asked for, and how they become a RequestOutput."""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from kiln.runtime.core.outputs import RequestMetrics, RequestOutput
from kiln.runtime.core.perf_metrics import PerfRecorder, RequestPerfMetrics
from kiln.runtime.core.request import Request
from kiln.runtime.core.request_failure import RequestFailure
from kiln.runtime.engine.beam_output import beam_request_output
from kiln.runtime.engine.detokenizer import IncrementalDetokenizer
from kiln.runtime.sampling.logit_rows import LogitRows
from kiln.runtime.sampling.sampler import SamplingRow


@dataclass(eq=False)
class TrackedRequest:
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None  # the request's own, when it has a seed (on the runtime device)
    logprobs: list[float] | None
    prompt_logprobs: list[float | None] | None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None
    # output_kind "delta": how many tokens and characters of text earlier updates handed out
    sent_tokens: int = 0
    sent_text: int = 0
    num_updates: int = 0
    # Set when something went wrong for this request alone; the engine ends it with finish_reason "error".
    failure: RequestFailure | None = None
    # What it asked for besides its tokens (extra_outputs.py): context logits [prompt, V] and how many prompt
    # positions hold theirs; per generated token its raw logits [V]; a beam search's logits rows by the tokens
    # their beam had (LogitRows, row); its perf metrics so far.
    context_logits: torch.Tensor | None = None
    context_filled: int = 0
    generation_logits: list[torch.Tensor] | None = None
    beam_logits: dict[tuple[int, ...], tuple[LogitRows, int]] | None = None
    perf: PerfRecorder | None = None
    block_size: int = 0

    @classmethod
    def start(cls, request: Request, tokenizer, device: torch.device, block_size: int = 0) -> TrackedRequest:
        """The engine-side state of a request just added (`block_size`: the KV cache's, for perf metrics)."""
        params, num_prompt = request.sampling_params, request.num_prompt_tokens
        generator = None
        if params.seed is not None:
            generator = torch.Generator(device=device)
            generator.manual_seed(params.seed)
        return cls(
            request=request,
            detokenizer=IncrementalDetokenizer(tokenizer, request.prompt_token_ids, params.stop,
                                               skip_special_tokens=params.skip_special_tokens),
            generator=generator,
            logprobs=[] if params.logprobs else None,
            top_logprobs=[] if params.top_logprobs else None,
            prompt_logprobs=[None] * num_prompt if params.prompt_logprobs else None,
            prompt_top_logprobs=[None] * num_prompt if params.prompt_top_logprobs else None,
            generation_logits=[] if params.return_generation_logits and request.beams is None else None,
            beam_logits={} if params.return_generation_logits and request.beams is not None else None,
            perf=PerfRecorder.start() if params.return_perf_metrics else None,
            block_size=block_size,
        )

    def store_context_logits(self, first: int, logits: torch.Tensor) -> None:
        """Context logits of prompt positions first, first + 1, ... (a step's chunk; [k, V] on the host)."""
        if self.context_logits is None:
            self.context_logits = torch.empty(self.request.num_prompt_tokens, logits.shape[1], dtype=torch.float32)
        self.context_logits[first:first + len(logits)] = logits
        self.context_filled = max(self.context_filled, first + len(logits))

    def keep_generated(self, rows: LogitRows | None, first_row: int, tokens: Sequence[int],
                       drafts: Sequence[int]) -> None:
        """After a step kept `tokens` of this request (sampled at logits rows first_row, first_row + 1, ...;
        `drafts`: the drafts they verified): their generation logits and the perf metrics' times."""
        if self.generation_logits is not None and rows is not None:
            rows.to_host()
            self.generation_logits.extend(rows.row(first_row + k) for k in range(len(tokens)))
        if self.perf is not None:
            accepted = sum(1 for _ in itertools.takewhile(lambda pair: pair[0] == pair[1], zip(tokens, drafts)))
            self.perf.tokens(len(drafts), accepted)

    def extras(self, first: int, end: int, with_prompt: bool) -> dict:
        """The output's context logits (with the prompt's part, once every position has them), generation logits
        of tokens [first, end) and perf metrics, as RequestOutput's keyword arguments (none not asked for)."""
        out: dict = {}
        if self.context_logits is not None and with_prompt and self.context_filled == self.request.num_prompt_tokens:
            out["context_logits"] = self.context_logits
        if self.generation_logits is not None:
            out["generation_logits"] = stack_rows(self.generation_logits[first:end])
        if self.perf is not None:
            out["perf_metrics"] = self.perf_metrics()
        return out

    def perf_metrics(self) -> RequestPerfMetrics | None:
        r = self.request
        if self.perf is None:
            return None
        return self.perf.snapshot(r.num_cached_prompt_tokens, r.num_computed_tokens, max(1, self.block_size))

    def sampling_row(self) -> SamplingRow:
        r = self.request
        return SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, self.generator)

    def output(self, upto: int | None = None) -> RequestOutput:
        """The request's output so far (lists copied: the caller may keep it), or with output_kind "delta" what
        is new since the previous call: tokens up to `upto` (the tokens an update covers; default all)."""
        r = self.request
        if r.beams is not None:  # beam search: its beams whole, whatever output_kind
            return beam_request_output(self)
        text = self.detokenizer.readable_text(r.status.finished)  # never cut later: what was sent stays its prefix
        if r.sampling_params.output_kind != "delta":
            return self._window(0, len(r.output_token_ids), text, with_prompt=True)
        first = self.sent_tokens
        self.sent_tokens = max(first, len(r.output_token_ids) if upto is None else upto)
        new_text, self.sent_text = text[self.sent_text:], max(self.sent_text, len(text))
        # Prompt logprobs are complete before the first update: they go in that one only.
        prompt_update, self.num_updates = self.num_updates == 0, self.num_updates + 1
        return self._window(first, self.sent_tokens, new_text, with_prompt=prompt_update)

    def _window(self, first: int, end: int, text: str, with_prompt: bool) -> RequestOutput:
        """An output of generated tokens [first, end) (and their logprobs), `text`, and the prompt's logprobs
        when `with_prompt`; every list a copy."""
        r = self.request
        finished = r.status.finished

        def part(values):  # per generated token, like token_ids
            return values[first:end] if values is not None else None

        def prompt(values):  # per prompt token
            return list(values) if values is not None and with_prompt else None

        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=r.output_token_ids[first:end],
            text=text,
            finish_reason=r.status.value if finished else None,
            logprobs=part(self.logprobs),
            top_logprobs=part(self.top_logprobs),
            prompt_logprobs=prompt(self.prompt_logprobs),
            prompt_top_logprobs=prompt(self.prompt_top_logprobs),
            num_cached_tokens=r.num_cached_prompt_tokens,
            metrics=RequestMetrics.of(r),
            error=self.failure if finished else None,
            **self.extras(first, end, with_prompt),
        )


def stack_rows(rows: Sequence[torch.Tensor]) -> torch.Tensor:
    """Logits rows [V] each -> [len, V] float32 ([0, 0] without any)."""
    return torch.stack(list(rows)) if rows else torch.empty(0, 0, dtype=torch.float32)
