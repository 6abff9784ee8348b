"""A Triton request's beams: its beam_width checked against the engine's limit, and an update's beams as its
outputs show them. Shared by kiln serve's front ends and the Triton model (so no aiohttp, no EngineService)."""

from __future__ import annotations

from collections.abc import Sequence

from kiln.serve.beams import check_beam_width, max_beam_width, returned_beams
from kiln.serve.errors import InvalidRequest
from kiln.serve.tritonserver.request import Beam, TritonRequest


def check_beam_widths(llm, rows: Sequence[TritonRequest]) -> None:
    """Every row's beam_width within the engine's max_beam_width (a 400 naming the input, the limit and
    `kiln build --max-beam-width`), before any row runs."""
    limit = max_beam_width(llm)
    for i, row in enumerate(rows):
        try:
            check_beam_width(row.beam_width, limit, "beam_width")
        except InvalidRequest as e:
            if len(rows) > 1:
                e.message = f"batch row {i}: {e.message}"
            raise


def beams_of(request: TritonRequest, output, whole: bool = True) -> list[Beam]:
    """An update's beams as the request's outputs show them (the first num_return_sequences of a beam search's).
    `whole`: a final answer, each beam after the prompt (text and ids) unless exclude_input_in_output; else a
    streamed update's beams, never with the prompt."""
    prompt = whole and not request.exclude_input
    beams = []
    for b in returned_beams(output, request.num_return_sequences):
        logprobs = list(b.logprobs or []) if request.return_log_probs else []
        cum = b.cumulative_logprob if request.return_log_probs and b.cumulative_logprob is not None else None
        beams.append(Beam((request.prompt if prompt else "") + b.text,
                          [*(output.prompt_token_ids if prompt else ()), *b.token_ids], logprobs, cum,
                          b.generation_logits, getattr(output, "context_logits", None),
                          getattr(output, "perf_metrics", None)))
    return beams
