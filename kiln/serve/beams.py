"""Beam search at the servers' doors (Triton/KServe's beam_width, OpenAI's n with use_beam_search): the engine's
width limit, a request's width checked against it before anything runs, and a beam-search update's beams."""

from __future__ import annotations

from kiln.runtime.core.outputs import CompletionOutput
from kiln.serve.errors import InvalidRequest


def max_beam_width(llm) -> int:
    """The widest beam search the engine was built for (`kiln build --max-beam-width`, recorded in engine.json);
    1 for an engine (or a test's stand-in) that does not say."""
    try:
        return int(llm.engine.info.config.build.max_beam_width)
    except AttributeError:
        return 1


def check_beam_width(width: int, limit: int, field: str) -> None:
    """A 400 naming `field`, the limit and the build flag when `width` beams are more than the engine takes."""
    if width > limit:
        raise InvalidRequest(f"{field}={width} is more than this engine's max_beam_width={limit}: build the engine "
                             f"with `kiln build --max-beam-width {width}` (or more) to run {width} beams", field)


def returned_beams(output, count: int | None = None) -> list[CompletionOutput]:
    """The completions of an update (a RequestOutput, or the servers' cumulative view of a plain request), best
    first: its beams (the first `count` of them), or its one completion."""
    beams = getattr(output, "beam_outputs", None)
    if beams is not None:
        return list(beams[:count])
    logprobs = output.logprobs
    return [CompletionOutput(0, output.text, list(output.token_ids), sum(logprobs) if logprobs is not None else None,
                             logprobs, output.finish_reason,
                             generation_logits=getattr(output, "generation_logits", None))]
