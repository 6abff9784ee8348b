"""Beam search's device side: each beam row's best continuations by cumulative logprob.

HF's beam search adds each beam's running score to the log_softmax of its logits (float32) and takes the best
K of all beams' continuations; the best K overall are among each row's best K, so each row's top K is all the
host needs (`core/beam_search.py` merges them). The copies to the host are queued when the candidates are made,
like `DeviceSample`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kiln.plugins.host_tensors import to_device


@dataclass(frozen=True)
class BeamCandidates:
    """Per beam row (the rows `beam_candidates` was given, in order): its K best continuations, best first."""

    scores: list[list[float]]  # running score + the token's logprob (float32 values)
    token_ids: list[list[int]]
    logprobs: list[list[float]]  # the token's own logprob


@dataclass(frozen=True)
class DeviceBeamCandidates:
    """`BeamCandidates` still on the logits' device; `to_host` waits for them only."""

    scores: torch.Tensor  # [N, K] float32
    token_ids: torch.Tensor  # [N, K] int64
    logprobs: torch.Tensor  # [N, K] float32
    _host: tuple = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        host = tuple(t.to("cpu", non_blocking=True) for t in (self.scores, self.token_ids, self.logprobs))
        done = None
        if self.scores.device.type == "cuda":
            done = torch.cuda.Event()
            done.record(torch.cuda.current_stream(self.scores.device))
        object.__setattr__(self, "_host", (host, done))

    def to_host(self) -> BeamCandidates:
        (scores, token_ids, logprobs), done = self._host
        if done is not None:
            done.synchronize()
        return BeamCandidates(scores.tolist(), token_ids.tolist(), logprobs.tolist())


def beam_candidates(logits: torch.Tensor, rows: Sequence[int], running_scores: Sequence[float],
                    k: int) -> DeviceBeamCandidates:
    """logits: [R, V] float32, the step's sampled rows; rows: the N beam rows among them; running_scores: each
    one's beam score (float32 values); k: continuations per row. Queues the top k of log_softmax(logits) +
    score per row."""
    index = to_device(list(rows), torch.int64, logits.device)  # [N]
    log_probs = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # [N, V]
    scores = to_device(list(running_scores), torch.float32, logits.device)  # [N]
    top = (log_probs + scores[:, None]).topk(min(k, log_probs.shape[1]), dim=-1)  # ([N, k], [N, k])
    return DeviceBeamCandidates(top.values, top.indices, log_probs.gather(1, top.indices))
