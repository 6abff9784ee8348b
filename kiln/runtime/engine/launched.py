"""A step the engine launched whose tokens are not read back yet, and what the next step's placeholder inputs
take from it (async scheduling)."""

from __future__ import annotations

from dataclasses import dataclass

from kiln.runtime.core.request import PLACEHOLDER
from kiln.runtime.core.scheduler import SchedulerOutput
from kiln.runtime.engine.beam_stage import LaunchedBeams
from kiln.runtime.sampling.logit_rows import LogitRows
from kiln.runtime.sampling.sampler import DeviceSample
from kiln.runtime.worker.model_step import TokenFeed


@dataclass(frozen=True)
class Launched:
    """A step whose tokens are not read back yet."""

    schedule: SchedulerOutput
    request_ids: tuple[str, ...]  # the scheduled requests, in schedule order
    logits_offsets: tuple[int, ...]  # request i's sampled rows: [offsets[i], offsets[i + 1])
    sample: DeviceSample | None  # the sampled tokens, still on the device
    # Whether the next step may be scheduled before this one's tokens are read back (async scheduling):
    # nothing the next step's sampling needs depends on their values.
    feeds_forward: bool = False
    beams: LaunchedBeams | None = None  # the beam rows' candidates (beam search), still on the device
    logit_rows: LogitRows | None = None  # generation logits of the requests that asked, on their way to the host


def token_feed(scheduled: SchedulerOutput, previous: Launched | None) -> TokenFeed | None:
    """Where each request's PLACEHOLDER input comes from: its row among the previous step's samples."""
    if previous is None or previous.sample is None:
        return None
    offsets = previous.logits_offsets
    row_of = {rid: offsets[i] for i, rid in enumerate(previous.request_ids) if offsets[i + 1] > offsets[i]}
    rows = tuple(row_of[r.request_id] if r.token_ids and r.token_ids[-1] == PLACEHOLDER else -1
                 for r in scheduled.requests)
    return TokenFeed(previous.sample.token_ids, rows) if any(row >= 0 for row in rows) else None
