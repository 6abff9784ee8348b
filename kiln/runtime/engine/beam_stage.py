"""The engine's side of beam search: a beam-search request's rows in a step, their candidates, the search step
after it and its updates. `LLMEngine` calls it at four points (rows to sample, `launch`, `complete`, `emit`);
the bookkeeping is `core/beam_search.py`, the device side `sampling/beam_candidates.py`.

Each running beam is a row of the step, named by its block table id; a step that reaches the end of the beams'
tokens (all of them at once: they advance in lockstep) gives each row its K best continuations, the search
picks the beams that run on and the block tables fork to match.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import torch

from kiln.runtime.core.beam_search import BeamState, Candidate, Finish, beam_request_id, merge_candidates
from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.outputs import RequestOutput
from kiln.runtime.core.request import RequestStatus
from kiln.runtime.core.sampling_params import SamplingParams
from kiln.runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from kiln.runtime.engine.beam_output import decode_beam
from kiln.runtime.engine.tracked_request import TrackedRequest
from kiln.runtime.sampling.beam_candidates import DeviceBeamCandidates, beam_candidates
from kiln.runtime.sampling.sampler import SamplingRow

_GREEDY = SamplingParams(temperature=0.0)


@dataclass(frozen=True)
class LaunchedBeams:
    """A step's beam candidates, still on the device, and which of their rows is each beam row's."""

    candidates: DeviceBeamCandidates
    rows: dict[str, int]  # row id -> its row of `candidates`  # what the sampler does with a beam's row (its token is not used)


def check_beam_search(params: SamplingParams, max_beam_width: int, runtime, speculator) -> None:
    """Raises ValueError when the engine cannot run `params`' beam search: wider than the engine was built for
    (`--max-beam-width`), than a step's rows or tokens, or on an engine that speculates."""
    width = params.n
    if width > max_beam_width:
        raise ValueError(f"n={width} beams exceeds this engine's max_beam_width={max_beam_width}: rebuild it with "
                         f"`kiln build --max-beam-width {width}` (or more)")
    for name in ("max_batch_size", "max_num_tokens"):
        if width > getattr(runtime, name):
            raise ValueError(f"n={width} beams exceeds {name}={getattr(runtime, name)}: every beam is a row of "
                             f"each step")
    if speculator is not None:
        raise ValueError("use_beam_search is not supported on an engine that speculates (speculative_config)")


def start_beams(request_id: str, params: SamplingParams, eos_token_ids: frozenset[int]) -> BeamState | None:
    """A new request's beams (None without beam search)."""
    return BeamState.start(request_id, params, eos_token_ids) if params.use_beam_search else None


class BeamStage:
    """Beam search in the engine's step: `max_seq_len` ends a beam like max_tokens; `blocks`: the engine's
    BlockManager, whose tables the beams fork."""

    def __init__(self, blocks: BlockManager, max_seq_len: int) -> None:
        self.blocks = blocks
        self.max_seq_len = max_seq_len
        self._updated: list[TrackedRequest] = []  # requests a step advanced, whose updates `emit` makes

    def owner(self, row_id: str, tracked: Mapping[str, TrackedRequest]) -> TrackedRequest:
        """The request a scheduled row belongs to: itself, or the request of a beam."""
        found = tracked.get(row_id)
        if found is None:
            found = tracked[beam_request_id(row_id)]
        return found

    def sampling_row(self, row_id: str, tracked: Mapping[str, TrackedRequest]) -> SamplingRow:
        """The sampler's row of a scheduled row; a beam's is greedy (the search picks its tokens instead)."""
        owner = self.owner(row_id, tracked)
        if owner.request.beams is None:
            return owner.sampling_row()
        r = owner.request
        return SamplingRow(_GREEDY, r.prompt_token_ids, r.output_token_ids, None)

    def launch(self, logits: torch.Tensor, row_ids: Sequence[str],
               tracked: Mapping[str, TrackedRequest]) -> LaunchedBeams | None:
        """Queues the candidates of the step's beam rows (`row_ids`: the owner of each logits row); None
        without any."""
        rows, scores, k = [], [], 0
        for i, row_id in enumerate(row_ids):
            if row_id in tracked:
                continue
            state = self.owner(row_id, tracked).request.beams
            beam = state.search.running[state.table_ids.index(row_id)]
            rows.append(i)
            scores.append(beam.score)
            k = max(k, state.search.num_candidates)
        if not rows:
            return None
        return LaunchedBeams(beam_candidates(logits, rows, scores, k), {row_ids[i]: n for n, i in enumerate(rows)})

    def complete(self, schedule: SchedulerOutput, launched: LaunchedBeams | None,
                 tracked: Mapping[str, TrackedRequest]) -> list[tuple[str, RequestStatus]]:
        """After a step: advances each beam-search request it ran (in lockstep), and where the step sampled runs
        the search step and forks the beams' tables. Returns the requests whose search ended, with how."""
        host = launched.candidates.to_host() if launched is not None else None
        index = launched.rows if launched is not None else {}
        groups: dict[str, list[ScheduledRequest]] = {}
        for item in schedule.requests:
            owner = beam_request_id(item.request_id) if item.request_id not in tracked else None
            if owner is not None:
                groups.setdefault(owner, []).append(item)
        endings = []
        for request_id, items in groups.items():
            owner = tracked.get(request_id)
            if owner is None or owner.request.status != RequestStatus.RUNNING:
                continue  # ended (aborted) while the step ran
            if [item.request_id for item in items] != owner.request.beams.table_ids:
                raise RuntimeError(f"request {request_id}: the step's beam rows are not its beams' tables")
            rows = [index.get(item.request_id, -1) for item in items]
            if self._advance(owner, len(items[0].token_ids), rows, host):
                best = owner.request.beams.search.results()[0]
                endings.append((request_id, RequestStatus.FINISHED_STOPPED if best.finish_reason == "stop"
                                else RequestStatus.FINISHED_LENGTH))
        return endings

    def _advance(self, tracked: TrackedRequest, num_new: int, rows: list[int], host) -> bool:
        """One request's beams after a step that computed `num_new` tokens of each; True when its search ended."""
        request = tracked.request
        state = request.beams
        before = request.num_computed_tokens
        request.num_computed_tokens += num_new
        size = self.blocks.block_size
        if request.num_computed_tokens // size > before // size:
            for k, table_id in enumerate(state.table_ids):
                tokens = state.token_slice(k, request.prompt_token_ids, 0, request.num_tokens)
                self.blocks.cache_full_blocks(table_id, tokens, request.num_computed_tokens, request.lora_int_id)
        if rows[0] < 0:
            return False  # a prefill chunk: nothing sampled yet
        search = state.search
        candidates = merge_candidates([host.scores[r] for r in rows], [host.token_ids[r] for r in rows],
                                      [host.logprobs[r] for r in rows], search.num_candidates)
        parents = state.table_ids
        chosen = search.step(candidates, self._finish_rule(tracked))
        state.fork(self.blocks, chosen, parents)
        request.output_token_ids = state.output_token_ids
        if tracked.perf is not None:
            tracked.perf.tokens()
        self._updated.append(tracked)
        return search.done

    def _finish_rule(self, tracked: TrackedRequest):
        """Whether a continuation ends its beam: a stop token id (EOS unless ignore_eos), a stop string its
        token completes, or the length limit."""
        request = tracked.request
        params = request.sampling_params
        running = request.beams.search.running
        stop_ids = set(params.stop_token_ids) | (set() if params.ignore_eos else set(request.eos_token_ids))
        tokenizer = tracked.detokenizer.tokenizer
        texts: dict[int, str] = {}

        def text_of(tokens: list[int]) -> str:
            return decode_beam(tokenizer, request.prompt_token_ids, tokens, params.skip_special_tokens)

        def finish_of(c: Candidate) -> Finish:
            parent = running[c.parent].token_ids
            if c.token in stop_ids:
                return "stop", None
            if params.stop and tokenizer is not None:
                before = texts.get(c.parent)
                if before is None:
                    before = texts[c.parent] = text_of(parent)
                after = text_of([*parent, c.token])
                for s in params.stop:
                    if after.find(s, max(0, len(before) - len(s) + 1)) >= 0:
                        return "stop", s
            if len(parent) + 1 >= params.max_tokens or request.num_prompt_tokens + len(parent) + 1 >= self.max_seq_len:
                return "length", None
            return None

        return finish_of

    def emit(self, final_only: bool) -> list[RequestOutput]:
        """The updates of the beam-search requests the last step advanced (ended ones included): each holds
        the current beams whole; with `final_only` (or their output_kind "final_only") only the final one."""
        updated, self._updated = self._updated, []
        outputs = []
        for tracked in updated:
            request = tracked.request
            if not request.status.finished and (final_only or request.sampling_params.output_kind == "final_only"):
                continue
            outputs.append(tracked.output())
        return outputs
