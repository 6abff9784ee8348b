"""Generation logits (`SamplingParams.return_generation_logits`): the raw logits rows of the requests that asked,
copied to the host before the sampler processes anything.

Only those rows are copied, and only in steps that have any; the copy is queued on the logits' stream at launch
(so the sampler's work never waits for it) and read back with the step's tokens, like `DeviceSample`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kiln.plugins.host_tensors import to_device


@dataclass(frozen=True)
class LogitRows:
    """Some rows of a step's logits, on their way to the host. `index`: a logits row -> its row of `values`."""

    index: dict[int, int]
    values: torch.Tensor  # [N, V] float32 on the host (filled once `to_host` returns)
    _done: torch.cuda.Event | None = field(default=None, repr=False, compare=False)

    def to_host(self) -> torch.Tensor:
        """The rows, [N, V] float32 on the host; waits for their copy only."""
        if self._done is not None:
            self._done.synchronize()
        return self.values

    def row(self, logits_row: int) -> torch.Tensor:
        """One logits row's values [V] (after `to_host`)."""
        return self.values[self.index[logits_row]]


def copy_rows(logits: torch.Tensor, rows: Sequence[int]) -> LogitRows | None:
    """logits: [R, V] float32, the step's sampled rows, as the model computed them. Queues the copy of `rows` to
    the host; None without any."""
    if not rows:
        return None
    picked = logits.index_select(0, to_device(list(rows), torch.int64, logits.device)).float()  # [N, V]
    if logits.device.type == "cpu":
        return LogitRows({r: i for i, r in enumerate(rows)}, picked)
    host = torch.empty(picked.shape, dtype=torch.float32, pin_memory=True)
    host.copy_(picked, non_blocking=True)
    done = torch.cuda.Event()
    done.record(torch.cuda.current_stream(logits.device))
    return LogitRows({r: i for i, r in enumerate(rows)}, host, done)
