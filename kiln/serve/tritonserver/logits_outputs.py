"""TensorRT-LLM's logits and perf-metrics outputs of the Triton model: `context_logits` [batch, prompt_len, vocab]
and `generation_logits` [batch, beam, len, vocab] FP32 (zero-padded to the longest row), and per row the
`return_perf_metrics` outputs (`kv_cache_*` blocks, `*_time_ns` nanoseconds since the epoch, speculative
decoding's draft counts), names and types as TensorRT-LLM's Triton backend sends them.

A row is a list of beams (`request.Beam`, duck-typed here): each carries its generation logits, and the row's
context logits and perf metrics (`RequestOutput`'s, see core/perf_metrics.py).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

# output name -> (KServe datatype, the RequestPerfMetrics attribute it shows)
PERF_OUTPUTS: dict[str, tuple[str, str]] = {
    "kv_cache_alloc_new_blocks": ("INT32", "kv_cache_alloc_new_blocks"),
    "kv_cache_reused_blocks": ("INT32", "kv_cache_reused_blocks"),
    "kv_cache_alloc_total_blocks": ("INT32", "kv_cache_alloc_total_blocks"),
    "arrival_time_ns": ("INT64", "arrival_time_ns"),
    "first_scheduled_time_ns": ("INT64", "first_scheduled_time_ns"),
    "first_token_time_ns": ("INT64", "first_token_time_ns"),
    "last_token_time_ns": ("INT64", "last_token_time_ns"),
    "acceptance_rate": ("FP32", "acceptance_rate"),
    "total_accepted_draft_tokens": ("INT32", "total_accepted_draft_tokens"),
    "total_draft_tokens": ("INT32", "total_draft_tokens"),
}
LOGITS_OUTPUTS = ("context_logits", "generation_logits")
EXTRA_OUTPUTS = (*LOGITS_OUTPUTS, *PERF_OUTPUTS)
_NUMPY = {"INT32": np.int32, "INT64": np.int64, "FP32": np.float32}


def extra_output(name: str, grid: Sequence[Sequence]) -> np.ndarray:
    """Output `name` (one of EXTRA_OUTPUTS) of every row (`grid`: each row's beams, padded to one width). A row
    that did not ask (or a padding beam) gets zeros."""
    if name == "context_logits":
        return _stack([row[0].context_logits if row else None for row in grid], 2)
    if name == "generation_logits":
        width = max((len(row) for row in grid), default=1)
        per_row = [[b.generation_logits for b in row] for row in grid]
        length = max((len(t) for row in per_row for t in row if t is not None), default=0)
        vocab = max((t.shape[1] for row in per_row for t in row if t is not None and t.ndim == 2), default=0)
        array = np.zeros((len(grid), width, length, vocab), dtype=np.float32)
        for i, row in enumerate(per_row):
            for j, t in enumerate(row):
                if t is not None and t.numel():
                    array[i, j, :t.shape[0], :t.shape[1]] = t.numpy()
        return array
    datatype, attribute = PERF_OUTPUTS[name]
    values = []
    for row in grid:
        metrics = row[0].perf_metrics if row else None
        value = getattr(metrics, attribute, None) if metrics is not None else None
        values.append([0 if value is None else value])
    return np.array(values, dtype=_NUMPY[datatype]).reshape(len(grid), 1)


def _stack(tensors: Sequence, dims: int) -> np.ndarray:
    """[len, V] tensors (or None) -> [B, max len, max V] float32, zero-padded."""
    shapes = [t.shape for t in tensors if t is not None]
    length = max((s[0] for s in shapes), default=0)
    vocab = max((s[1] for s in shapes), default=0)
    array = np.zeros((len(tensors), length, vocab), dtype=np.float32)
    for i, t in enumerate(tensors):
        if t is not None:
            array[i, :t.shape[0], :t.shape[1]] = t.numpy()
    return array


def generate_fields(beams: Sequence, single: bool) -> dict:
    """The generate extension's JSON fields for one row's extra outputs (those it asked for): perf metrics as
    numbers, logits as nested lists (`single`: no beam dimension, as without beam search)."""
    first = beams[0] if beams else None
    body: dict = {}
    if first is None:
        return body
    if first.perf_metrics is not None:
        body.update({name: extra_output(name, [beams])[0, 0].item() for name in PERF_OUTPUTS})
    if first.context_logits is not None:
        body["context_logits"] = first.context_logits.tolist()
    if first.generation_logits is not None:
        rows = [b.generation_logits.tolist() if b.generation_logits is not None else [] for b in beams]
        body["generation_logits"] = rows[0] if single else rows
    return body


def streamed(output, num_new: int, first: bool) -> dict:
    """A streamed response's `Beam` fields beyond text, ids and logprobs (those the request asked for): the
    generation logits of its `num_new` newest tokens, the context logits in the `first` response only (as
    TensorRT-LLM streams them), the perf metrics so far. `output`: the request's cumulative output."""
    fields: dict = {}
    logits = getattr(output, "generation_logits", None)
    if logits is not None:
        fields["generation_logits"] = logits[max(0, len(logits) - num_new):]
    context = getattr(output, "context_logits", None)
    if context is not None and first:
        fields["context_logits"] = context
    perf = getattr(output, "perf_metrics", None)
    if perf is not None:
        fields["perf_metrics"] = perf
    return fields
