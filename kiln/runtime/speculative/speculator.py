"""The engine's side of speculative decoding: drafts before each schedule, the sampled rows of a verify step,
the acceptance counters.

A decoding request with K drafts is scheduled with 1 + K positions (its last token, then the drafts), every
one sampled. Sampled position j decides on draft j + 1 as if drafts 1..j had been accepted: its sampling row
sees them as output tokens (penalties, min_tokens). The engine keeps the tokens up to the first position
whose token differs from its draft; that token, the target's own, ends the step's list.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import torch

from kiln.runtime.core.request import Request, RequestStatus
from kiln.runtime.core.scheduler import ScheduledRequest
from kiln.runtime.sampling.sampler import SamplingRow
from kiln.runtime.speculative.config import SpeculativeConfig
from kiln.runtime.speculative.proposer import DraftRequest, Proposer
from kiln.runtime.speculative.rejection import DraftRows
from kiln.runtime.speculative.stats import SpeculationStats
from kiln.runtime.speculative.tree import accepted_path, chain_view, kv_moves, path_to
from kiln.runtime.worker.step_inputs import slot_of


def verification_rows(items: Sequence[ScheduledRequest], offsets: Sequence[int],
                      row_of: Callable[[str], SamplingRow]) -> list[SamplingRow]:
    """The sampling row of every sampled position of a step: request i's rows offsets[i]..offsets[i+1]; its
    j-th row sees the request's first j drafts as output (a tree's node row: the path down to the node)."""
    rows: list[SamplingRow] = []
    for i, item in enumerate(items):
        count = offsets[i + 1] - offsets[i]
        if not count:
            continue
        base = row_of(item.request_id)
        drafts, parents = item.draft_token_ids, item.draft_parents
        rows.append(base)
        for j in range(1, count):
            seen = [drafts[node] for node in path_to(parents, j - 1)] if parents else drafts[:j]
            rows.append(SamplingRow(base.params, base.prompt_token_ids, [*base.output_token_ids, *seen],
                                    base.generator) if seen else base)
    return rows


def num_accepted(drafts: Sequence[int], tokens: Sequence[int]) -> int:
    """How many drafts the target's tokens (one per sampled position) accept: the length of the agreeing prefix."""
    for i, (draft, token) in enumerate(zip(drafts, tokens)):
        if draft != token:
            return i
    return min(len(drafts), len(tokens))


class Speculator:
    """Owns the proposer; `max_seq_len`: the engine's (a verify step never goes past it)."""

    def __init__(self, config: SpeculativeConfig, proposer: Proposer, max_seq_len: int, *,
                 move_kv: Callable[[list[int], list[int]], None] | None = None, block_size: int = 1) -> None:
        self.config = config
        self.proposer = proposer
        self.max_seq_len = max_seq_len
        # Tree drafts: moves the target's KV from slots to slots (an accepted path's keys to consecutive ones).
        self.move_kv, self.block_size = move_kv, block_size
        self.stats = SpeculationStats(config.num_speculative_tokens)
        self._probs: dict[str, torch.Tensor] = {}  # request id -> [k, V] q of its current drafts, when sampled

    def max_drafts(self, request: Request) -> int:
        """How many drafts a request may verify in its next step: none unless it is decoding (its only
        uncomputed token is its last) and unconstrained; never so many that the step could pass max_tokens
        or max_seq_len (a step yields at most drafts + 1 tokens)."""
        params = request.sampling_params
        if (request.status != RequestStatus.RUNNING or request.num_tokens - request.num_computed_tokens != 1
                or params.guided_decoding is not None):
            return 0
        k = self.config.num_speculative_tokens
        if params.num_speculative_tokens is not None:
            k = min(k, params.num_speculative_tokens)
        return max(0, min(k, params.max_tokens - len(request.output_token_ids) - 1,
                          self.max_seq_len - request.num_tokens - 1))

    def propose(self, running: Sequence[Request], row_of: Callable[[str], SamplingRow]) -> None:
        """Sets every running request's `draft_token_ids` for the next schedule (empty where none)."""
        wanted, by_id = [], {}
        for request in running:
            request.draft_token_ids, request.draft_parents = [], []
            self._probs.pop(request.request_id, None)
            k = self.max_drafts(request)
            if k:
                by_id[request.request_id] = request
                wanted.append(DraftRequest(request.request_id, request.all_token_ids, k, row_of(request.request_id),
                                           self._max_nodes(request), request.lora_int_id))
        if not wanted:
            return
        for request_id, proposal in self.proposer.propose(wanted).items():
            request = by_id[request_id]
            if proposal.parents is not None:  # a tree: a prefix of its nodes is a tree
                nodes = self._max_nodes(request)
                request.draft_token_ids = list(proposal.token_ids[:nodes])
                request.draft_parents = list(proposal.parents[:nodes])
                continue
            request.draft_token_ids = list(proposal.token_ids[:self.max_drafts(request)])
            if proposal.probs is not None and request.draft_token_ids:
                self._probs[request_id] = proposal.probs

    def _max_nodes(self, request: Request) -> int:
        """Tree drafts: the nodes a request may verify (their keys stay below max_seq_len); 0 for a chain."""
        if not self.config.is_tree:
            return 0
        return max(0, min(self.config.max_draft_nodes, self.max_seq_len - request.num_tokens - 1))

    def draft_rows(self, items: Sequence[ScheduledRequest], offsets: Sequence[int], vocab_size: int,
                   device: torch.device) -> DraftRows | None:
        """The drafts a step verifies, by sampled row, with the q of sampled drafts; None when it verifies none."""
        token_ids = [-1] * offsets[-1]
        with_probs: list[tuple[int, torch.Tensor]] = []
        for i, item in enumerate(items):
            drafts = item.draft_token_ids
            if not drafts:
                continue
            first = offsets[i]
            token_ids[first:first + len(drafts)] = drafts
            q = self._probs.get(item.request_id)
            if q is not None:
                with_probs.append((first, q[:len(drafts)]))
        if all(t < 0 for t in token_ids):
            return None
        probs, rows = None, set()
        if with_probs:
            probs = torch.zeros(len(token_ids), vocab_size, dtype=torch.float32, device=device)  # [R, V]
            for first, q in with_probs:
                probs[first:first + len(q)] = q
                rows.update(range(first, first + len(q)))
        return DraftRows(token_ids, probs, frozenset(rows))

    def record(self, drafts: Sequence[int], tokens: Sequence[int]) -> None:
        """Counts one request's verify step: its drafts and the target's tokens at its sampled positions."""
        self.stats.record(len(drafts), num_accepted(drafts, tokens))

    def verified(self, item: ScheduledRequest, out, first_row: int) -> Sequence[int]:
        """A verify step of `item` read back (`out`: the step's SamplerOutput, its rows from first_row): counts it
        and returns the drafts the engine checks its tokens against. A tree's accepted path is handed back as a
        chain (tree.chain_view reorders the rows), its keys moved to consecutive slots and the proposer told."""
        drafts, parents = item.draft_token_ids, item.draft_parents
        rows = len(drafts) + 1
        if not parents:
            self.record(drafts, out.token_ids[first_row:first_row + rows])
            return drafts
        path = accepted_path(parents, drafts, out.token_ids[first_row:first_row + rows])
        self.stats.record(len(drafts), len(path))
        moves = kv_moves(item.start_position, path)
        if moves and self.move_kv is not None:
            self.move_kv([slot_of(item.block_ids, src, self.block_size) for src, _ in moves],
                         [slot_of(item.block_ids, dst, self.block_size) for _, dst in moves])
        accept = getattr(self.proposer, "accept_path", None)
        if accept is not None:
            accept(item.request_id, item.start_position, [0, *(1 + i for i in path)])
        return chain_view(out, first_row, rows, drafts, path)

    def release(self, request_id: str) -> None:
        self._probs.pop(request_id, None)
        self.proposer.release(request_id)

    def shutdown(self) -> None:
        self.proposer.shutdown()


def speculation_runtime(config: SpeculativeConfig, target, runtime):
    """The target's RuntimeConfig (`runtime`, of the `EngineInfo` `target`) with what its runner needs to know
    before it captures graphs: verify steps of 1 + max_draft_nodes tokens a request, chains or trees, and the
    layers an EAGLE-3 head reads (from the head's config)."""
    layers = ()
    if config.method == "eagle3":
        from kiln.runtime.speculative.eagle3_head import head_feature_layers

        layers = head_feature_layers(config.model, target.model_config.num_layers)
    return dataclasses.replace(runtime, verify_tokens=1 + config.max_draft_nodes, verify_tree=config.is_tree,
                               feature_layers=tuple(layers))


def make_speculator(config: SpeculativeConfig, target, runtime, *, create_executor,
                    verify_checksums: bool = True, target_executor=None) -> Speculator:
    """The speculator `config` asks for, its proposer loaded for the target engine (`EngineInfo`) and its
    `RuntimeConfig`: a draft engine on the same device, an EAGLE-3 head over `target_executor`'s network (which
    then hands it each step's hidden states), or n-gram lookup. `create_executor(info, runtime)` makes the
    draft engine's executor (`draft_model.ExecutorFactory`; passed in so that this package never imports the
    engine factory, which imports the engine)."""
    if config.method == "ngram":
        from kiln.runtime.speculative.ngram import NgramProposer

        proposer = NgramProposer(config.ngram_min, config.ngram_max)
    elif config.method == "eagle3":
        from kiln.runtime.speculative.eagle3 import Eagle3Proposer

        proposer = Eagle3Proposer.load(config.model, target, runtime, target_executor, config,
                                       verify_checksums=verify_checksums)
        if config.is_tree:  # the accepted path's keys move to consecutive slots after each verify step
            from kiln.plugins.kv_move import move_kv_slots

            layers = target_executor.runner.kv_cache.layers
            return Speculator(config, proposer, runtime.max_seq_len, block_size=runtime.block_size,
                              move_kv=lambda src, dst: move_kv_slots(layers, src, dst))
    else:
        from kiln.runtime.speculative.draft_model import DraftModelProposer

        proposer = DraftModelProposer.load(config.model, target, runtime, create_executor=create_executor,
                                           verify_checksums=verify_checksums)
    return Speculator(config, proposer, runtime.max_seq_len)
