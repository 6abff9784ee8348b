"""A draft model as the proposer: a second, smaller kiln engine with the same vocabulary, run by the same
runtime on the same device, with its own paged KV cache.

Each step it first catches up on the tokens the target accepted since its last proposal (the whole prompt
for a new request, in chunks within its own limits), which also yields the first draft, then decodes the
rest one token per request per pass, as an ordinary batch. What it computed for drafts the target
rejected is found by comparing tokens at the next proposal and recomputed; its KV cache is bookkeeping
of its own (no prefix cache), and a request it cannot hold is simply not speculated.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from kiln.engine_format import EngineError
from kiln.runtime.core.block_manager import BlockManager
from kiln.runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from kiln.runtime.sampling.sampler import Sampler, SamplingRow
from kiln.runtime.speculative.proposer import DraftRequest, Proposal
from kiln.runtime.worker.engine_loader import EngineInfo, RuntimeConfig, load_engine_info, resolve_runtime
from kiln.runtime.worker.executor import Executor
from kiln.runtime.worker.model_step import StepInput

# Makes the executor of an engine (engine_factory.create_executor). Passed in by the factory rather than
# imported: the factory imports the engine, which imports the speculator, which loads this proposer.
ExecutorFactory = Callable[[EngineInfo, RuntimeConfig], Executor]

logger = logging.getLogger("kiln.runtime")


@dataclass
class _Sequence:
    """What the draft cache holds for a request: the tokens whose KV it computed, in order."""

    tokens: list[int] = field(default_factory=list)
    confirmed: int = 0  # tokens[:confirmed] are known to be the request's own tokens


@dataclass
class _Drafting:
    request: DraftRequest
    computed: int  # tokens of request.token_ids already in the draft cache
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # [V] float32 q per draft, when sampled


def check_draft(draft: EngineInfo, target: EngineInfo, target_runtime: RuntimeConfig) -> None:
    """Refuses a draft engine the target cannot verify: another vocabulary, or limits below the target's."""
    dv, tv = draft.model_config.vocab_size, target.model_config.vocab_size
    if dv != tv:
        raise EngineError(f"draft engine {draft.spec.engine_dir} has a vocabulary of {dv} tokens but the target "
                          f"engine {target.spec.engine_dir} has {tv}: a draft model must share the target's "
                          f"tokenizer and vocabulary")
    built = draft.config.build
    if built.max_seq_len < target_runtime.max_seq_len:
        raise EngineError(f"draft engine {draft.spec.engine_dir} was built with max_seq_len {built.max_seq_len}, "
                          f"below the target's {target_runtime.max_seq_len}: rebuild the draft with --max-seq-len "
                          f"{target_runtime.max_seq_len}")


class DraftModelProposer:
    """`--speculative-model DIR`: proposals sampled from a draft engine loaded on the target's device."""

    def __init__(self, executor, runtime: RuntimeConfig) -> None:
        self.executor = executor
        self.runtime = runtime
        self.blocks = BlockManager(executor.num_kv_blocks, runtime.block_size, enable_prefix_caching=False)
        self.sampler = Sampler()
        self._sequences: dict[str, _Sequence] = {}

    @classmethod
    def load(cls, engine_dir: str, target: EngineInfo, target_runtime: RuntimeConfig, *,
             create_executor: ExecutorFactory, verify_checksums: bool = True) -> DraftModelProposer:
        """Loads the draft engine on the target's device with limits no larger than the target's;
        `create_executor` makes its executor (the engine factory's)."""
        try:
            info = load_engine_info(engine_dir, verify_checksums=verify_checksums)
        except EngineError as e:
            raise EngineError(f"--speculative-model: {e}") from None
        check_draft(info, target, target_runtime)
        built = info.config.build
        if info.config.mapping.tp_size > 1:
            raise EngineError(f"draft engine {engine_dir} is split over {info.config.mapping.tp_size} ranks: build "
                              f"the draft with --tp-size 1 (it runs on rank 0's device)")
        runtime = resolve_runtime(info, device=target_runtime.device,
                                  max_batch_size=min(built.max_batch_size, target_runtime.max_batch_size),
                                  max_num_tokens=min(built.max_num_tokens, target_runtime.max_num_tokens),
                                  enable_prefix_caching=False,
                                  kv_cache_memory_fraction=target_runtime.kv_cache_memory_fraction,
                                  cuda_graphs=target_runtime.cuda_graphs)
        proposer = cls(create_executor(info, runtime), runtime)
        logger.info("draft engine %s (%s, %d KV blocks) proposes for the target", engine_dir,
                    info.spec.architecture, proposer.executor.num_kv_blocks)
        return proposer

    # ---- the Proposer protocol -----------------------------------------------------------------
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Proposal]:
        work = [w for w in (self._start(r) for r in requests) if w is not None]
        if not work:
            return {}
        self._catch_up(work)
        for _ in range(max(w.request.max_tokens for w in work) - 1):
            self._decode([w for w in work if len(w.drafts) < w.request.max_tokens])
        proposals = {}
        for w in work:
            self._sequences[w.request.request_id].tokens = [*w.request.token_ids, *w.drafts[:-1]]
            probs = torch.stack(w.probs) if w.probs else None  # [k, V]
            proposals[w.request.request_id] = Proposal(w.drafts, probs)
        return proposals

    def release(self, request_id: str) -> None:
        if self._sequences.pop(request_id, None) is not None:
            self.blocks.free(request_id)

    def shutdown(self) -> None:
        self.executor.shutdown()

    # ---- one proposal --------------------------------------------------------------------------
    def _start(self, request: DraftRequest) -> _Drafting | None:
        """Finds how much of the request the draft cache still holds and reserves room for its drafts; None
        when the cache cannot hold it (the request is then not speculated this step)."""
        seq = self._sequences.setdefault(request.request_id, _Sequence())
        tokens, mine = request.token_ids, seq.tokens
        valid = seq.confirmed
        limit = min(len(mine), len(tokens) - 1)  # the last token is never in the cache yet
        while valid < limit and mine[valid] == tokens[valid]:
            valid += 1
        seq.tokens = mine[:valid]
        seq.confirmed = valid
        # Slots for every token and for the drafts fed back (all but the last draft).
        if not self.blocks.allocate(request.request_id, len(tokens) + request.max_tokens - 1):
            self.release(request.request_id)
            return None
        return _Drafting(request, valid)

    def _row(self, w: _Drafting) -> SamplingRow:
        row = w.request.row
        outputs = [*row.output_token_ids, *w.drafts] if w.drafts else row.output_token_ids
        return SamplingRow(row.params, row.prompt_token_ids, outputs, row.generator)

    def _catch_up(self, work: list[_Drafting]) -> None:
        """Computes each request's tokens the draft has not seen, in passes within the draft's limits; the
        pass that reaches a request's last token samples its first draft."""
        todo = list(work)
        while todo:
            budget, batch = self.runtime.max_num_tokens, []
            for w in todo:
                if budget == 0 or len(batch) == self.runtime.max_batch_size:
                    break
                n = min(len(w.request.token_ids) - w.computed, budget)
                batch.append((w, n))
                budget -= n
            items = []
            for w, n in batch:
                start, end = w.computed, w.computed + n
                items.append(self._item(w, w.request.token_ids[start:end], start,
                                        1 if end == len(w.request.token_ids) else 0))
                w.computed = end
            self._run(items, [w for w, _ in batch if w.computed == len(w.request.token_ids)])
            todo = [w for w in todo if w.computed < len(w.request.token_ids)]

    def _decode(self, work: list[_Drafting]) -> None:
        """One draft token more for each request in `work`: its previous draft goes in."""
        for first in range(0, len(work), self.runtime.max_batch_size):
            chunk = work[first:first + self.runtime.max_batch_size]
            items = [self._item(w, (w.drafts[-1],), len(w.request.token_ids) + len(w.drafts) - 1, 1)
                     for w in chunk]
            self._run(items, chunk)

    def _item(self, w: _Drafting, tokens: Sequence[int], start: int, num_sampled: int) -> ScheduledRequest:
        request_id = w.request.request_id
        return ScheduledRequest(request_id, tuple(tokens), start, self.blocks.block_table(request_id),
                                len(w.request.row.prompt_token_ids), num_sampled)

    def _run(self, items: list[ScheduledRequest], sampled: list[_Drafting]) -> None:
        """Runs one draft step; `sampled`: the requests whose item samples, in the items' order."""
        result = self.executor.execute(StepInput(SchedulerOutput(tuple(items), ())))
        if not sampled:
            return
        tokens, probs = self.sampler.draw_with_probs(result.logits, [self._row(w) for w in sampled])
        for i, (w, token) in enumerate(zip(sampled, tokens.tolist())):
            w.drafts.append(token)
            if probs is not None and not w.request.row.params.greedy:
                w.probs.append(probs[i])
