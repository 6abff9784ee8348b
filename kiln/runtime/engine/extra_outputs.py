"""The engine's side of the outputs a request may ask for besides its tokens: prompt logprobs and context logits
(from the prompt rows, `sampling/prompt_logprobs.py`), generation logits (the raw sampled rows,
`sampling/logit_rows.py`) and performance metrics (`core/perf_metrics.py`). `LLMEngine` calls it when it launches
a step (`targets`, `store_prompt`, `copy_generation`) and completes one (`TrackedRequest.keep_generated`); while
no running request asks for generation logits or perf metrics, those cost an empty-set check a step.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence

import torch

from kiln.runtime.core.beam_search import beam_request_id
from kiln.runtime.core.request import Request
from kiln.runtime.core.scheduler import ScheduledRequest
from kiln.runtime.engine.tracked_request import TrackedRequest
from kiln.runtime.sampling.logit_rows import LogitRows, copy_rows
from kiln.runtime.sampling.prompt_logprobs import PromptLogprobs, PromptLogprobTarget


class ExtraOutputs:
    """Which running requests asked for generation logits or perf metrics (set when added, cleared on release)."""

    def __init__(self) -> None:
        self._generation: set[str] = set()  # request ids that return generation logits
        self._unscheduled: set[str] = set()  # requests with perf metrics not yet scheduled once

    def add(self, request: Request) -> None:
        params = request.sampling_params
        if params.return_generation_logits:
            self._generation.add(request.request_id)
        if params.return_perf_metrics:
            self._unscheduled.add(request.request_id)

    def release(self, request_id: str) -> None:
        self._generation.discard(request_id)
        self._unscheduled.discard(request_id)

    def targets(self, rows: Sequence[ScheduledRequest], requests: Sequence[Request],
                tracked: Mapping[str, TrackedRequest]) -> dict[str, PromptLogprobTarget]:
        """The step's prompt-logprob and context-logits targets: the rows that compute prompt positions (a
        beam-search request's prompt is its first beam's), so a request's decode steps keep the CUDA graphs;
        and the first step of each request with perf metrics recorded. `requests`: each row's owner."""
        if self._unscheduled:
            for r in requests:
                if r.request_id in self._unscheduled:
                    self._unscheduled.discard(r.request_id)
                    tracked[r.request_id].perf.scheduled()
        out = {}
        for row, r in zip(rows, requests):
            params = r.sampling_params
            # (params.needs_prompt_positions, spelled out: this runs for every row of every step)
            if (params.prompt_logprobs or params.return_context_logits) and \
                    row.start_position < row.num_prompt_tokens and \
                    row.request_id == r.table_ids[0]:
                out[row.request_id] = PromptLogprobTarget(r.prompt_token_ids, params.prompt_top_logprobs,
                                                          params.prompt_logprobs, params.return_context_logits)
        return out

    @staticmethod
    def store_prompt(results: dict[str, PromptLogprobs], owner: Callable[[str], TrackedRequest]) -> None:
        """A step's prompt logprobs and context logits into their requests."""
        for row_id, (first, values, tops, logits) in results.items():
            tracked = owner(row_id)
            if tracked.prompt_logprobs is not None:
                tracked.prompt_logprobs[first + 1:first + 1 + len(values)] = values
            if tops is not None:
                tracked.prompt_top_logprobs[first + 1:first + 1 + len(tops)] = tops
            if logits is not None:
                tracked.store_context_logits(first, logits)

    def copy_generation(self, logits: torch.Tensor, row_ids: Sequence[str],
                        owner: Callable[[str], TrackedRequest]) -> LogitRows | None:
        """Queues the host copy of the sampled rows of the requests that return generation logits (`row_ids`: the
        row id of each logits row); a beam's row is filed under the tokens its beam had (so each final beam finds
        the logits of each of its tokens, whichever beams they were chosen on)."""
        if not self._generation:
            return None
        wanted = self._generation
        rows = [i for i, rid in enumerate(row_ids) if rid in wanted or beam_request_id(rid) in wanted]
        copied = copy_rows(logits, rows)
        for i in rows:
            tracked = owner(row_ids[i])
            state = tracked.request.beams
            if state is not None:
                beam = state.search.running[state.table_ids.index(row_ids[i])]
                tracked.beam_logits[tuple(beam.token_ids)] = (copied, i)
        return copied
