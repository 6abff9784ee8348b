"""Mixed steps on the GPU: the decode rows' attention apart from the prompts', worked out once per step.

An eager step that carries prompt tokens beside running requests (in-flight batching: ~1,000 decode rows and a
few prompts at batch 1,024) would otherwise run all of them through the unified kernel, whose query tile is
sized to the step's average query count per sequence: a few query rows for the decode rows (most of the tile
padding) and so many tiles per prompt that each prompt's keys are read again for every few queries. Split, the
decode rows take the flash-decoding kernel (what a decode-only step's CUDA graph runs) and the prompts take the
unified kernel with tiles sized to their own query counts. On an H200 (Llama-3.1-8B shape, FP8 cache, 128 / 128
x 3000 at batch 1,024) the unified kernel took 830 us a layer in those steps.

The scheduler puts running requests first, so the decode rows are the step's leading sequences with one query
each; `DecodePrefix` is those and the rest's query starts rebased to its first token. Only where the kernels run
(a CUDA context) and the host lists are known (eager steps: `step_inputs.build_context`); never with tree drafts.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class DecodePrefix:
    """The step's first `num_decode` sequences have one query each (tokens [0, num_decode)); the rest's
    query starts are `rest_query_start_loc` ([S - num_decode + 1] int32, query_start_loc[num_decode:] -
    num_decode, on the device)."""

    num_decode: int
    rest_query_start_loc: torch.Tensor

    def attend(self, attention: Callable[..., torch.Tensor], q: torch.Tensor, block_tables: torch.Tensor,
               seq_lens: torch.Tensor, query_start_loc: torch.Tensor) -> torch.Tensor:
        """attention(q, block_tables, seq_lens, query_start_loc) over the decode rows and over the rest, in
        two calls; the outputs concatenated in the step's row order. q: [T, Hq, D] -> [T, Hq, D]."""
        d = self.num_decode
        head = attention(q[:d], block_tables[:d], seq_lens[:d], query_start_loc[:d + 1])  # [d, Hq, D]
        tail = attention(q[d:], block_tables[d:], seq_lens[d:], self.rest_query_start_loc)  # [T - d, Hq, D]
        return torch.cat((head, tail))


def decode_prefix(host_query_lens: Sequence[int] | None, query_start_loc: torch.Tensor,
                  has_tree: bool) -> DecodePrefix | None:
    """The split of a mixed step (module docstring); None where there is nothing to split: no host lists (a
    CUDA-graph context), tree drafts, or a step whose leading sequences are not decode rows or that has nothing
    but them. (`ForwardContext.decode_prefix` asks only for GPU steps: the reference groups decode rows itself.)"""
    if host_query_lens is None or has_tree:
        return None
    d = 0
    while d < len(host_query_lens) and host_query_lens[d] == 1:
        d += 1
    if d == 0 or d == len(host_query_lens):
        return None
    return DecodePrefix(d, query_start_loc[d:] - d)
