"""A beam-search request's update: its beams as `CompletionOutput`s, best first, each decoded whole (beams are
re-ranked and forked every step, so no beam's text grows one token at a time)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kiln.runtime.core.beam_search import Hypothesis, f32
from kiln.runtime.core.outputs import CompletionOutput, RequestMetrics, RequestOutput
from kiln.runtime.engine.detokenizer import PROMPT_CONTEXT_TOKENS


def decode_beam(tokenizer, prompt: Sequence[int], tokens: Sequence[int], skip_special_tokens: bool) -> str:
    """The text of a beam's tokens, decoded after the prompt's last tokens as the incremental detokenizer does
    (so a first token's leading space survives); "" without a tokenizer."""
    if tokenizer is None or not tokens:
        return ""
    context = list(prompt[-PROMPT_CONTEXT_TOKENS:])
    backend = getattr(tokenizer, "backend_tokenizer", None)

    def decode(ids: list[int]) -> str:
        if backend is not None:
            return backend.decode(ids, skip_special_tokens=skip_special_tokens)
        return tokenizer.decode(ids, skip_special_tokens=skip_special_tokens, clean_up_tokenization_spaces=False)

    return decode(context + list(tokens))[len(decode(context)):]


def beam_request_output(tracked) -> RequestOutput:
    """The update of beam-search request `tracked` (a TrackedRequest): while it runs, the running beams (best
    cumulative logprob first); once it ended, the `n` best finished beams. The top-level fields describe the
    first one."""
    request = tracked.request
    search = request.beams.search
    finished = request.status.finished
    if finished:
        beams = search.results()
    else:
        length = len(search.running[0].token_ids)
        denominator = f32(max(length, 1) ** search.length_penalty)
        beams = [Hypothesis(tuple(b.token_ids), b.score, f32(b.score / denominator), tuple(b.logprobs), "")
                 for b in search.running]
    completions = [_completion(tracked, i, h, finished) for i, h in enumerate(beams)]
    best = completions[0]
    return RequestOutput(
        request_id=request.request_id,
        prompt_token_ids=request.prompt_token_ids,
        token_ids=list(best.token_ids),
        text=best.text,
        finish_reason=request.status.value if finished else None,
        logprobs=list(best.logprobs) if best.logprobs is not None else None,
        num_cached_tokens=request.num_cached_prompt_tokens,
        metrics=RequestMetrics.of(request),
        error=tracked.failure if finished else None,
        beam_outputs=completions,
        generation_logits=best.generation_logits,
        **{k: v for k, v in tracked.extras(0, 0, True).items() if k != "generation_logits"},
    )


def _completion(tracked, index: int, beam: Hypothesis, finished: bool) -> CompletionOutput:
    request = tracked.request
    params = request.sampling_params
    tokens = list(beam.token_ids)
    text_tokens = tokens
    if beam.finish_reason == "stop" and beam.stop_string is None and tokens:
        text_tokens = tokens[:-1]  # EOS or a stop token id: its text is not shown, as for a plain request
    text = decode_beam(tracked.detokenizer.tokenizer, request.prompt_token_ids, text_tokens,
                       params.skip_special_tokens)
    if beam.stop_string is not None:  # the text ends right before the stop string, as for a plain request
        at = text.find(beam.stop_string)
        text = text[:at] if at >= 0 else text
    return CompletionOutput(index=index, text=text, token_ids=tokens, cumulative_logprob=beam.cumulative_logprob,
                            logprobs=list(beam.logprobs) if params.logprobs else None,
                            finish_reason=(beam.finish_reason or None) if finished else None, score=beam.score,
                            generation_logits=_generation_logits(tracked, tokens))


def _generation_logits(tracked, tokens: list[int]):
    """A beam's generation logits [len, V] (None unless asked): token i's row was filed under the tokens before
    it (`ExtraOutputs.copy_generation`)."""
    if tracked.beam_logits is None:
        return None
    rows = []
    for i in range(len(tokens)):
        copied, row = tracked.beam_logits[tuple(tokens[:i])]
        copied.to_host()
        rows.append(copied.row(row))
    return torch.stack(rows) if rows else torch.empty(0, 0, dtype=torch.float32)
