"""What the engine keeps for a request besides the scheduler's state: its text, its generator and the
logprobs it asked for, and how they become a RequestOutput."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .detokenizer import IncrementalDetokenizer
from .outputs import RequestOutput
from .request import Request
from .sampler import SamplingRow


@dataclass(eq=False)
class TrackedRequest:
    request: Request
    detokenizer: IncrementalDetokenizer
    generator: torch.Generator | None  # the request's own, when it has a seed (on the runtime device)
    logprobs: list[float] | None
    prompt_logprobs: list[float | None] | None
    top_logprobs: list[dict[int, float]] | None = None
    prompt_top_logprobs: list[dict[int, float] | None] | None = None

    @classmethod
    def start(cls, request: Request, tokenizer, device: torch.device) -> TrackedRequest:
        """The engine-side state of a request just added."""
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
        )

    def sampling_row(self) -> SamplingRow:
        r = self.request
        return SamplingRow(r.sampling_params, r.prompt_token_ids, r.output_token_ids, self.generator)

    def output(self) -> RequestOutput:
        """The request's cumulative output so far (lists copied: the caller may keep it)."""
        r = self.request
        finished = r.status.finished

        def copied(values):
            return list(values) if values is not None else None

        return RequestOutput(
            request_id=r.request_id,
            prompt_token_ids=r.prompt_token_ids,
            token_ids=list(r.output_token_ids),
            text=self.detokenizer.readable_text(finished),
            finish_reason=r.status.value if finished else None,
            logprobs=copied(self.logprobs),
            top_logprobs=copied(self.top_logprobs),
            prompt_logprobs=copied(self.prompt_logprobs),
            prompt_top_logprobs=copied(self.prompt_top_logprobs),
            num_cached_tokens=r.num_cached_prompt_tokens,
        )
