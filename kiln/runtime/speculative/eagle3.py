"""EAGLE-3 as the proposer: a one-layer head over the target's own hidden states, in this process, with its own
paged KV cache in its own block manager.

The target keeps, for every token it computes, its residual streams entering three layers (low, middle,
high: `LocalExecutor.capture_hidden`); each step hands them here (`observe`) as [n, 3H] per request. The
head's position j reads token j + 1 and the target's features at position j (fused by `fc`), and predicts
token j + 2, so when the target has computed positions 0..N-2 of a request of N tokens, the head catches up on
the positions it has not computed (its KV cache), and the last of them (N-2, reading the request's last token)
gives the first draft. Each later draft reads the draft before it and the head's own hidden state (before its
final norm) at the position before. Features of drafts the target rejected are simply never read: the target
computes those positions again, and a request's positions are read only below its last token.

Greedy drafts are the argmax over the target vocabulary (the draft vocabulary placed by `d2t`); sampled drafts
come with q, the head's processed distribution, for the rejection rule. The head's cache is a prefix cache too:
head position j depends on tokens 0..j + 1 (and the target's adapter), so its blocks are hashed over the tokens
shifted by one, salted with the first token and chained under the request's LoRA adapter; a prompt whose prefix
the target finds cached (and so computes no features for) finds the head's KV of that prefix cached beside it.
Only blocks computed from real features from position 0 on are registered, and a request that must start over
does so in fresh blocks, so a shared block is never rewritten. A position whose features never came and whose
head block is not cached (evicted, or the head's cache had to drop the request) reads zeros: the drafts are
worse, never wrong. Steps that capture features run eagerly (no CUDA graphs), as verify steps already do.

The head's own steps run eagerly too, a host sync after each draft, except for greedy chains: the draft steps
after the catch-up of the requests whose draft is the plain argmax run on the device with no sync between them,
captured in CUDA graphs on CUDA (`eagle3_graphs.py`, `self.chain`), and trees: after the catch-up's root
expansion, a tree's rounds run on the device too, one read-back a proposal (`eagle3_tree_graphs.py`,
`self.tree_graphs`); trees it cannot take grow a round at a time (`eagle3_tree.grow`). A greedy chain's
catch-up of up to K + 1 positions joins its draft steps in one graph (`eagle3_proposal_graphs.py`), as a tree's
joins its root expansion and rounds (`eagle3_tree_proposals.py`).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kiln.engine_format import EngineError
from kiln.model_defs.layers.decoder import DecoderForCausalLM
from kiln.model_defs.layers.mla import MLAttention
from kiln.runtime.core.block_manager import BlockManager, CachedPrefix
from kiln.runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from kiln.runtime.sampling.sampler import Sampler, SamplingRow
from kiln.runtime.speculative.config import MAX_SPECULATIVE_TOKENS, SpeculativeConfig
from kiln.runtime.speculative.eagle3_graphs import ChainDraftGraphs, chain_for, draft_chains
from kiln.runtime.speculative.eagle3_head import Eagle3Head, load_head
from kiln.runtime.speculative.eagle3_proposal_graphs import ProposalGraphs, draft_proposals, proposals_for
from kiln.runtime.speculative.eagle3_tree import HeadTree, grow, new_tree
from kiln.runtime.speculative.eagle3_tree_graphs import TreeDraftGraphs, grow_trees, trees_for
from kiln.runtime.speculative.eagle3_tree_proposals import (
    TreeProposalGraphs,
    propose_trees,
    tree_proposals_for,
)
from kiln.runtime.speculative.proposer import DraftRequest, Proposal
from kiln.runtime.speculative.target_embedding import full_target_embedding
from kiln.runtime.worker.engine_loader import EngineInfo, RuntimeConfig
from kiln.runtime.worker.kv_cache import KVCache
from kiln.runtime.worker.step_inputs import pack_step

logger = logging.getLogger("kiln.runtime")


@dataclass
class _HeadSequence:
    """What the head's cache holds for a request: positions [0, done) computed from the request's own tokens
    (position j read token j + 1; `anchor` is token `done`, the last one read, to notice a change), of which
    [0, real) from the target's features (or found cached), none missing before them: what may be shared."""

    done: int = 0
    anchor: int = -1
    real: int = 0
    shared: int = 0  # its full blocks registered in the head's prefix cache (or found there)


@dataclass
class _Drafting:
    request: DraftRequest
    computed: int  # head positions already in its cache; catch-up runs up to len(token_ids) - 1
    features: torch.Tensor  # [N - 1 - computed at start, F]: the target's features of the positions to catch up
    first: int  # the head position features[0] belongs to
    drafts: list[int] = field(default_factory=list)
    probs: list[torch.Tensor] = field(default_factory=list)  # [V] float32 q per draft, when sampled
    hidden: torch.Tensor | None = None  # [1, H]: the head's prenorm hidden state at its last sampled position


class Eagle3Proposer:
    """`--speculative-mode eagle3 --speculative-model HEAD_DIR`: drafts from an EAGLE-3 head on the target's
    device, with `num_blocks` head KV blocks of `runtime.block_size` (the target's RuntimeConfig)."""

    def __init__(self, head: Eagle3Head, runtime: RuntimeConfig, num_blocks: int, device: torch.device,
                 topk: int = 1) -> None:
        self.head = head
        self.topk = topk  # > 1: tree drafts (eagle3_tree.py)
        self.runtime = runtime
        self.device = device
        self.blocks = BlockManager(num_blocks, runtime.block_size)  # a prefix cache of the head's KV (module doc)
        self.cache = KVCache(head.config.layer, num_blocks, runtime.block_size, head.fc.weight.dtype, device)
        self.num_features = 3 * head.config.target_hidden_size
        self.sampler = Sampler()
        self._sequences: dict[str, _HeadSequence] = {}
        self._trees: dict[str, HeadTree] = {}  # tree drafts: request id -> its tree, during a proposal
        # request id -> (first position, [n, F] features) per target step since its last proposal, oldest first.
        self._features: dict[str, list[tuple[int, torch.Tensor]]] = {}
        self.chain: ChainDraftGraphs | None = None  # greedy chain drafts on the device (eagle3_graphs.py)
        self.proposals: ProposalGraphs | None = None  # ... with the catch-up too (eagle3_proposal_graphs.py)
        self.tree_graphs: TreeDraftGraphs | None = None  # tree rounds on the device (eagle3_tree_graphs.py)
        self.tree_proposals: TreeProposalGraphs | None = None  # ... with the catch-up too (eagle3_tree_proposals.py)

    @classmethod
    def load(cls, head_dir: str, target: EngineInfo, runtime: RuntimeConfig, target_executor,
             config: SpeculativeConfig | None = None, *, verify_checksums: bool = True) -> Eagle3Proposer:
        """Reads the head (a checkpoint or a head engine, its files verified unless `verify_checksums` is False)
        next to the target's network (`target_executor`: a LocalExecutor, or a TPExecutor whose rank 0 runs here
        and hands out the features) and has the target capture the layers it reads. EngineError: tree drafts over
        a tensor-parallel target, a target whose network keeps no features, a head for another model."""
        tp = target.config.mapping.tp_size
        if tp > 1 and config is not None and config.is_tree:
            raise EngineError(f"eagle_topk {config.eagle_topk} (tree drafts) runs with one rank; the target engine "
                              f"{target.spec.engine_dir} is split over {tp} ranks (tensor parallelism), whose other "
                              f"ranks cannot verify a tree (its attention mask) nor move its accepted keys: use "
                              f"eagle_topk 1 (a chain)")
        runner = getattr(target_executor, "runner", None)
        model = getattr(runner, "model", None)
        if not isinstance(model, DecoderForCausalLM):
            raise EngineError(f"--speculative-mode eagle3: the target's network ({type(model).__name__}) does not "
                              f"hand out hidden states (a Llama-style decoder does)")
        if config is not None and config.is_tree and any(isinstance(m, MLAttention) for m in model.modules()):
            raise EngineError(f"eagle_topk {config.eagle_topk} (tree drafts): the target's multi-head latent "
                              f"attention does not read tree masks; use eagle_topk 1 (a chain)")
        # Under tensor parallelism rank 0 holds only its vocabulary shard of the embedding the head shares.
        embedding = full_target_embedding(target, model.model.embed_tokens.weight)  # [V, H]
        head = load_head(head_dir, target.model_config, embedding, target_spec=target.spec,
                         verify_checksums=verify_checksums)
        head.setup_rotary(runtime.max_seq_len, runtime.device)
        layers = head.config.feature_layers(target.model_config.num_layers)
        # As many blocks as the target's (one layer's worth), but no more than a full batch of full sequences
        # can use: the target's cache was sized before the head came.
        topk = 1 if config is None else config.eagle_topk
        per_sequence = -(-(runtime.max_seq_len + MAX_SPECULATIVE_TOKENS * topk) // runtime.block_size)
        num_blocks = min(target_executor.num_kv_blocks, runtime.max_batch_size * per_sequence)
        proposer = cls(head, runtime, num_blocks, runtime.device, topk)
        if config is not None and topk == 1:
            proposer.chain = chain_for(head, proposer.cache.layers, runtime, config.num_speculative_tokens - 1)
            proposer.proposals = proposals_for(proposer.chain, runtime, config.num_speculative_tokens,
                                               proposer.num_features)
        elif config is not None:
            proposer.tree_graphs = trees_for(head, proposer.cache.layers, runtime, topk,
                                             config.num_speculative_tokens - 1)
            proposer.tree_proposals = tree_proposals_for(proposer.tree_graphs, runtime,
                                                         config.num_speculative_tokens, proposer.num_features)
        try:
            target_executor.capture_hidden(layers, proposer.observe)
        except ValueError as e:
            raise EngineError(f"EAGLE-3 head {head_dir}: {e}") from None
        logger.info("EAGLE-3 head %s (draft vocabulary %d, target layers %s, %d KV blocks) proposes for the target",
                    head_dir, head.config.draft_vocab_size, list(layers), num_blocks)
        return proposer

    def observe(self, schedule: SchedulerOutput, aux_hidden: torch.Tensor) -> None:
        """A target step's features, [T, F] for its packed tokens (schedule order), kept per request."""
        offset = 0
        for r in schedule.requests:
            n = len(r.token_ids)
            self._features.setdefault(r.request_id, []).append((r.start_position, aux_hidden[offset:offset + n]))
            offset += n

    # ---- the Proposer protocol -----------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, requests: Sequence[DraftRequest]) -> dict[str, Proposal]:
        work = [w for w in (self._start(r) for r in requests) if w is not None]
        if not work:
            return {}
        if self.topk > 1:  # tree drafts
            self._trees = {w.request.request_id: new_tree(self, w) for w in work}
            # Whole proposals on the device where they can; the rest: catch-up, then rounds on the device where
            # they can, else a round at a time.
            work_left = (work if self.tree_proposals is None
                         else propose_trees(self.tree_proposals, self.blocks.block_table, self._trees, work))
            self._catch_up(work_left)
            if self.tree_graphs is not None:
                grow_trees(self.tree_graphs, self.blocks.block_table, self._trees, work_left)
            while growing := [w for w in work if self._trees[w.request.request_id].search.frontier]:
                grow(self, self._trees, growing)
            self._share(work)
            trees, self._trees = self._trees, {}
            proposals = {}
            for request_id, tree in trees.items():
                tokens, parents = tree.search.result()
                proposals[request_id] = Proposal(tokens, None, parents)
            return proposals
        # Whole proposals on the device where they can; the rest: catch-up, then chain steps or eager steps.
        work_left = work if self.proposals is None else draft_proposals(self.proposals, self.blocks.block_table, work)
        self._catch_up(work_left)
        rest = work_left if self.chain is None else draft_chains(self.chain, self.blocks.block_table, work_left)
        for _ in range(max((w.request.max_tokens for w in rest), default=1) - 1):
            self._decode([w for w in rest if len(w.drafts) < w.request.max_tokens])
        self._share(work)
        proposals = {}
        for w in work:
            probs = torch.stack(w.probs) if w.probs else None  # [k, V]
            proposals[w.request.request_id] = Proposal(w.drafts, probs)
        return proposals

    def accept_path(self, request_id: str, start: int, rows: list[int]) -> None:
        """A tree's verify step (computed at positions start..) kept `rows` of it, in order: its features of
        positions start, start + 1, ... are those rows' (the root's, then the accepted nodes')."""
        chunks = self._features.get(request_id)
        if chunks and chunks[-1][0] == start:
            chunks[-1] = (start, chunks[-1][1][rows])

    def release(self, request_id: str) -> None:
        self._features.pop(request_id, None)
        if self._sequences.pop(request_id, None) is not None:
            self.blocks.free(request_id)

    def shutdown(self) -> None:
        self._features.clear()
        if self.proposals is not None:
            self.proposals.release()
        if self.chain is not None:
            self.chain.release()
        if self.tree_proposals is not None:
            self.tree_proposals.release()
        if self.tree_graphs is not None:
            self.tree_graphs.release()

    # ---- one proposal --------------------------------------------------------------------------
    def _start(self, request: DraftRequest) -> _Drafting | None:
        """The positions the head must (re)compute and their features; None when the head's cache cannot hold
        the request (it is then not speculated this step)."""
        tokens = request.token_ids
        n = len(tokens)
        chunks = self._features.pop(request.request_id, [])
        if n < 2:
            return None
        seq = self._sequences.get(request.request_id)
        if seq is not None and (seq.done >= n or tokens[seq.done] != seq.anchor):
            self.blocks.free(request.request_id)  # start over in fresh blocks: shared ones are never rewritten
            seq = None
        prefix = CachedPrefix()
        if seq is None:
            seq = self._sequences[request.request_id] = _HeadSequence()
            prefix = self.blocks.find_cached_prefix(tokens[1:n], request.lora_int_id, _salt(tokens))
            seq.done = seq.real = prefix.num_tokens  # <= N-2: a prefix never covers the last position
            seq.shared = len(prefix.block_ids)
        # Position N-2 (reading the last token) is always computed: it gives the first draft.
        start = min(seq.done, n - 2)
        # Slots for positions 0..N-2 and for the drafts fed back (positions N-1 .. N+k-3).
        # (a tree feeds up to topk nodes a depth: eagle3_tree.py)
        if not self.blocks.allocate(request.request_id, n - 1 + (request.max_tokens - 1) * self.topk, prefix):
            # Its head cache goes (the next proposal starts over at position 0); the features kept stay.
            self.release(request.request_id)
            self._features[request.request_id] = chunks
            return None
        seq.done, seq.anchor = n - 1, tokens[n - 1]
        features, missing = self._gather(chunks, start, n - 1)
        if seq.real >= start:  # real features up to start: now up to the first recomputed position without any
            seq.real = missing
        # Position N-2's features stay: a request proposed for again with the same tokens (it was not scheduled
        # since) computes that position again.
        self._features[request.request_id] = [(n - 2, features[-1:])]
        return _Drafting(request, start, features, start)

    def _gather(self, chunks: list[tuple[int, torch.Tensor]], start: int, end: int) -> tuple[torch.Tensor, int]:
        """([end - start, F]: the latest features of positions start..end-1, zeros where none came; the first of
        those positions with none, end if every one came)."""
        out = torch.zeros(end - start, self.num_features, dtype=self.head.fc.weight.dtype, device=self.device)
        came = [False] * (end - start)
        for first, feats in chunks:  # oldest first: a later step's features of a position replace an earlier's
            lo, hi = max(first, start), min(first + len(feats), end)
            if lo < hi:
                out[lo - start:hi - start] = feats[lo - first:hi - first]
                came[lo - start:hi - start] = [True] * (hi - lo)
        return out, start + came.index(False) if False in came else end

    def _share(self, work: list[_Drafting]) -> None:
        """Registers each request's head blocks that real features filled (positions below N-1: drafts write past
        them) in the head's prefix cache, once a block is full (not every step: the tokens are sliced only then)."""
        bs = self.blocks.block_size
        for w in work:
            tokens = w.request.token_ids
            seq = self._sequences[w.request.request_id]
            full = min(seq.real, len(tokens) - 1) // bs
            if full > seq.shared:
                self.blocks.cache_full_blocks(w.request.request_id, tokens[1:full * bs + 1], full * bs,
                                              w.request.lora_int_id, _salt(tokens))
                seq.shared = full

    def _row(self, w: _Drafting) -> SamplingRow:
        row = w.request.row
        outputs = [*row.output_token_ids, *w.drafts] if w.drafts else row.output_token_ids
        return SamplingRow(row.params, row.prompt_token_ids, outputs, row.generator)

    def _catch_up(self, work: list[_Drafting]) -> None:
        """Computes each request's head positions up to N-2 in passes within the engine's limits; the pass that
        reaches N-2 samples the first draft."""
        todo = list(work)
        while todo:
            budget, batch = self.runtime.max_num_tokens, []
            for w in todo:
                if budget == 0 or len(batch) == self.runtime.max_batch_size:
                    break
                n = min(len(w.request.token_ids) - 1 - w.computed, budget)
                batch.append((w, n))
                budget -= n
            items, feats = [], []
            for w, n in batch:
                start, end = w.computed, w.computed + n
                last = end == len(w.request.token_ids) - 1
                # Head position j reads token j + 1.
                items.append(self._item(w, w.request.token_ids[start + 1:end + 1], start, 1 if last else 0))
                feats.append(w.features[start - w.first:end - w.first])
                w.computed = end
            self._run(items, torch.cat(feats), [w for w, _ in batch if w.computed == len(w.request.token_ids) - 1])
            todo = [w for w in todo if w.computed < len(w.request.token_ids) - 1]

    def _decode(self, work: list[_Drafting]) -> None:
        """One draft more for each request in `work`: its last draft and the head's hidden state before it."""
        for first in range(0, len(work), self.runtime.max_batch_size):
            chunk = work[first:first + self.runtime.max_batch_size]
            items = [self._item(w, (w.drafts[-1],), len(w.request.token_ids) + len(w.drafts) - 2, 1) for w in chunk]
            self._run(items, torch.cat([w.hidden for w in chunk]), chunk)

    def _item(self, w: _Drafting, tokens: Sequence[int], start: int, num_sampled: int) -> ScheduledRequest:
        request_id = w.request.request_id
        return ScheduledRequest(request_id, tuple(tokens), start, self.blocks.block_table(request_id),
                                len(w.request.row.prompt_token_ids), num_sampled)

    def _run(self, items: list[ScheduledRequest], features: torch.Tensor, sampled: list[_Drafting]) -> None:
        """One head step over `items` (features: [T, F] or [T, H], packed like the items' tokens); `sampled`:
        the requests whose item samples, in the items' order."""
        packed = pack_step(SchedulerOutput(tuple(items), ()), self.runtime.block_size, self.cache.layers, self.device)
        normed, prenorm = self.head(packed.input_ids, features, packed.context)  # [T, H] each
        if not sampled:
            return
        rows = packed.sample_rows  # [R]: one per sampled item
        logits = self.head.target_logits(normed[rows])  # [R, V]
        if self.topk > 1:  # the roots of trees: their children are the topk best tokens (eagle3_tree.py)
            logprobs, hidden = logits.log_softmax(-1), prenorm[rows]  # [R, V], [R, H]
            for i, w in enumerate(sampled):
                self._trees[w.request.request_id].take([-1], logprobs[i:i + 1], hidden[i:i + 1])
            return
        tokens, probs = self.sampler.draw_with_probs(logits, [self._row(w) for w in sampled])
        hidden = prenorm[rows]  # [R, H]
        for i, (w, token) in enumerate(zip(sampled, tokens.tolist())):
            w.drafts.append(token)
            w.hidden = hidden[i:i + 1]
            if probs is not None and not w.request.row.params.greedy:
                w.probs.append(probs[i])


def _salt(tokens: Sequence[int]) -> bytes:
    """What a head block's contents depend on besides the shifted tokens its hash chains: the first token."""
    return b"eagle3:%d" % tokens[0]
