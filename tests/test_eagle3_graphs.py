"""EAGLE-3 greedy chain drafts on the device (runtime/speculative/eagle3_graphs.py), on the CPU: the device steps
(`_draft_steps`, eager) give exactly the drafts and head keys of the eager per-step path (`_decode`) for a batch
of requests at different lengths whose drafts cross KV block boundaries, padding rows (what a captured graph of a
larger size adds) change nothing, and rows the plain argmax would not draft (sampled, penalties) keep the eager
path. On CUDA: greedy output with the captured chain equals decoding without speculation, and the graphs run."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from test_eagle3 import VOCAB, cuda_greedy_case, graph_test_engine, write_head

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.sampling.sampler import SamplingRow
from kiln.runtime.speculative.eagle3_graphs import (
    ChainDraftGraphs,
    _draft_steps,
    chain_row,
    draft_argmax,
    draft_chains,
)
from kiln.runtime.speculative.proposer import DraftRequest
from kiln.runtime.worker.step_inputs import slots_of

K = 6  # five chain steps after the first draft; KV blocks of 4 tokens, so every chain crosses a block


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return graph_test_engine(tmp_path_factory.mktemp("eagle3-graphs"))


@pytest.fixture(scope="module")
def llm(engine, tmp_path_factory):
    head, _ = write_head(tmp_path_factory.mktemp("eagle3-graphs-head") / "head")
    with LLM(engine, speculative_config={"method": "eagle3", "model": str(head), "num_speculative_tokens": K}) as llm:
        yield llm


def _requests(extra: bool = True) -> list[DraftRequest]:
    """Greedy requests of 3..30 tokens wanting 1..K drafts; with `extra`, a sampled and a penalized one too."""
    g = torch.Generator().manual_seed(11)
    greedy = SamplingParams(max_tokens=64, temperature=0)
    specs = [(3, K, greedy), (7, K, greedy), (12, 3, greedy), (21, 5, greedy), (30, 1, greedy), (9, 2, greedy)]
    if extra:
        specs += [(14, K, SamplingParams(max_tokens=64, temperature=1.0, seed=5)),
                  (17, K, dataclasses.replace(greedy, repetition_penalty=1.3))]
    out = []
    for i, (n, k, params) in enumerate(specs):
        tokens = torch.randint(2, VOCAB, (n,), generator=g).tolist()
        prompt = tokens[:max(1, n - 2)]  # a couple of output tokens
        generator = torch.Generator() if params.seed is not None else None
        out.append(DraftRequest(f"r{i}", tokens, k, SamplingRow(params, prompt, tokens[len(prompt):], generator)))
    return out


def _propose(proposer, requests, chain):
    """Drafts and each request's head keys and values after proposing from scratch with `chain` (None: the eager
    steps): request id -> [layers, 2, positions, Hk, D], every position its proposal computed. Checks that no
    other slot was written."""
    for r in requests:
        proposer.release(r.request_id)
    proposer.cache.storage.zero_()
    proposer.chain = chain
    whole, proposer.proposals = proposer.proposals, None  # the chain alone (eagle3_proposal_graphs: its own test)
    try:
        proposals = proposer.propose(requests)
    finally:
        proposer.proposals = whole
    return _drafts_and_kv(proposer, requests, proposals)


def _drafts_and_kv(proposer, requests, proposals):
    flat = proposer.cache.storage.flatten(2, 3)  # [layers, 2, slots, Hk, D]
    written = torch.zeros(flat.shape[2], dtype=torch.bool)
    kv = {}
    for r in requests:
        n = len(r.token_ids) - 1 + r.max_tokens - 1  # catch-up to N-2, then a step per draft after the first
        slots = torch.tensor(slots_of(proposer.blocks.block_table(r.request_id), 0, n, proposer.runtime.block_size))
        kv[r.request_id] = flat[:, :, slots].clone()
        written[slots] = True
        proposer.release(r.request_id)
    assert not flat[:, :, ~written].any()
    return {k: p.token_ids for k, p in proposals.items()}, kv


def test_whole_proposals_give_the_eager_drafts_and_keys(llm):
    """eagle3_proposal_graphs on the CPU (its function run eagerly): after a proposal for each request's first
    tokens, the next one catches up 3 positions (a verify step that kept 2 drafts) and drafts in one pass;
    drafts and head keys equal the eager per-step path's, for every greedy row (sampled and penalized rows keep
    eagle3.py's path)."""
    proposer = llm.engine.speculator.proposer
    chain, whole = proposer.chain, proposer.proposals
    assert whole is not None and whole.chain is chain and whole.q == K + 1 and not whole._graphs
    requests = _requests()
    earlier = [dataclasses.replace(r, token_ids=r.token_ids[:-3]) for r in requests]

    def run(with_graphs: bool):
        for r in requests:
            proposer.release(r.request_id)
        proposer.cache.storage.zero_()
        proposer.chain, proposer.proposals = (chain, whole) if with_graphs else (None, None)
        try:
            proposer.propose(earlier)
            return _drafts_and_kv(proposer, requests, proposer.propose(requests))
        finally:
            proposer.chain, proposer.proposals = chain, whole

    eager, eager_cache = run(False)
    rows = []
    whole.propose = lambda batch: rows.append(len(batch)) or type(whole).propose(whole, batch)
    try:
        got, got_cache = run(True)
    finally:
        del whole.propose
    assert rows == [2, 6]  # first the two catch-ups of <= K + 1 positions, then all six of 3 positions
    assert got == eager
    _assert_same_kv(got_cache, eager_cache)


def _assert_same_kv(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for request_id in a:
        torch.testing.assert_close(a[request_id], b[request_id], atol=1e-5, rtol=1e-5)


class _EagerGraph:
    """Stands in for a captured graph on the CPU: a replay runs the same steps over the graph's padded size."""

    def __init__(self, chain: ChainDraftGraphs, size: int) -> None:
        self.chain, self.size = chain, size

    def replay(self) -> None:
        self.chain._steps(self.size, self.chain.steps)


def _as_if_captured(chain: ChainDraftGraphs) -> None:
    chain._graphs = {s: _EagerGraph(chain, s) for s in chain.sizes}
    chain._outputs = {s: chain._drafts[:s, :chain.steps] for s in chain.sizes}


def test_chain_steps_give_the_eager_steps_drafts_and_keys(llm):
    proposer = llm.engine.speculator.proposer
    chain = proposer.chain
    assert isinstance(chain, ChainDraftGraphs) and chain.steps == K - 1 and not chain._graphs
    requests = _requests()
    eager, eager_cache = _propose(proposer, requests, None)
    rows = []
    chain.draft = lambda first, *args: rows.append(len(first)) or ChainDraftGraphs.draft(chain, first, *args)
    try:
        chained, chained_cache = _propose(proposer, requests, chain)
    finally:
        del chain.draft
        proposer.chain = chain
    assert rows == [5]  # the greedy rows wanting 2 drafts or more
    assert chained == eager
    assert [len(eager[r.request_id]) for r in requests] == [r.max_tokens for r in requests]
    _assert_same_kv(chained_cache, eager_cache)


def test_padding_rows_change_nothing(llm):
    """As a captured graph runs: the batch padded to the next captured size (5 chain rows -> 8)."""
    proposer = llm.engine.speculator.proposer
    chain = proposer.chain
    requests = _requests(extra=False)
    assert 5 not in chain.sizes
    eager, eager_cache = _propose(proposer, requests, None)
    _as_if_captured(chain)
    try:
        padded, padded_cache = _propose(proposer, requests, chain)
        assert chain.replays == 1
    finally:
        chain._graphs, chain._outputs, chain.replays = {}, {}, 0
        proposer.chain = chain
    assert padded == eager
    _assert_same_kv(padded_cache, eager_cache)


def test_draft_steps_rows_are_independent_of_dead_and_padding_rows(llm):
    """`_draft_steps` directly: a row's drafts are the same alone and beside a row that wants fewer steps and a
    padding row (no step), which write keys at their live positions only and none at all."""
    proposer = llm.engine.speculator.proposer
    chain, head = proposer.chain, proposer.head
    g = torch.Generator().manual_seed(2)
    proposer.blocks.allocate("x", 40)
    proposer.blocks.allocate("y", 8)
    tables = [list(proposer.blocks.block_table(r)) for r in ("x", "y")]
    try:
        def run(rows: list[tuple[int, int, int, int]], state: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            """rows: (first token, position, steps wanted, table) -> (drafts [n, K-1], the head cache after)."""
            proposer.cache.storage.zero_()
            n = len(rows)
            ints = torch.tensor([[r[0] for r in rows], [r[1] for r in rows], [5] * n, [r[2] for r in rows]])
            table = torch.zeros(n, 10, dtype=torch.int32)
            for i, r in enumerate(rows):
                table[i, :len(tables[r[3]])] = torch.tensor(tables[r[3]], dtype=torch.int32)
            drafts = torch.zeros(n, K - 1, dtype=torch.int64)
            with torch.inference_mode():
                out = _draft_steps(head, proposer.cache.layers, ints, table, state.clone(), drafts,
                                   torch.arange(n + 1, dtype=torch.int32), size=n, steps=K - 1,
                                   block_size=chain.block_size, in_draft_order=chain._in_draft_order)
            return out, proposer.cache.storage.clone()

        state = torch.randn(3, head.config.layer.hidden_size, generator=g)
        alone, alone_cache = run([(17, 10, K - 1, 0)], state[:1])
        mixed, mixed_cache = run([(17, 10, K - 1, 0), (40, 3, 2, 1), (0, 0, 0, 1)], state)
        assert torch.equal(mixed[0], alone[0])
        assert alone.unique().numel() > 1  # real drafts, not a constant
        # The second row wrote keys at its positions 3 and 4 only; the padding row none (the first row's keys are
        # the same up to the float noise of a larger batch).
        differs = ((mixed_cache - alone_cache).abs() > 1e-5).permute(2, 3, 0, 1, 4, 5).flatten(2).any(-1)  # [blocks, block_size]
        slots = {b * 4 + o for b, o in differs.nonzero().tolist()}
        assert slots == {tables[1][0] * 4 + 3, tables[1][1] * 4 + 0}
    finally:
        proposer.blocks.free("x")
        proposer.blocks.free("y")


def test_only_plain_argmax_rows_take_the_chain(llm, monkeypatch):
    proposer = llm.engine.speculator.proposer
    rows = {r.request_id: r.row for r in _requests()}
    assert [chain_row(row) for row in rows.values()] == [True] * 6 + [False, False]
    for bias in ({"logit_bias": {3: 1.0}}, {"frequency_penalty": 0.5}, {"presence_penalty": 0.2}):
        assert not chain_row(SamplingRow(SamplingParams(temperature=0, **bias), [1], []))

    class Drafting:  # what eagle3._Drafting offers draft_chains
        def __init__(self, request):
            self.request, self.drafts = request, [7]
            self.hidden = torch.zeros(1, proposer.head.config.layer.hidden_size)

    requests = _requests()
    for r in requests:
        proposer.blocks.allocate(r.request_id, len(r.token_ids) - 1 + r.max_tokens - 1)
    try:
        work = [Drafting(r) for r in requests]
        rest = draft_chains(proposer.chain, proposer.blocks.block_table, work)
    finally:
        for r in requests:
            proposer.blocks.free(r.request_id)
    assert [w.request.request_id for w in rest] == ["r4", "r6", "r7"]  # one draft wanted; sampled; penalized
    assert [len(w.drafts) for w in work] == [r.max_tokens if r.request_id not in ("r6", "r7") else 1
                                             for r in requests]

    # A head whose rope needs per-length tables (dynamic NTK past its context) keeps the eager path there.
    rotary = proposer.head.rotary
    monkeypatch.setattr(rotary, "needs_per_length_tables", lambda length: length > 20)
    for r in requests:
        proposer.blocks.allocate(r.request_id, len(r.token_ids) - 1 + r.max_tokens - 1)
    try:
        rest = draft_chains(proposer.chain, proposer.blocks.block_table, [Drafting(r) for r in requests])
    finally:
        for r in requests:
            proposer.blocks.free(r.request_id)
    assert [w.request.request_id for w in rest] == ["r3", "r4", "r6", "r7"]  # r3: 21 tokens + 4 drafts


def test_the_argmax_over_the_draft_vocabulary_is_the_target_vocabularys(llm):
    head = llm.engine.speculator.proposer.head
    assert llm.engine.speculator.proposer.chain._in_draft_order  # the published maps increase
    normed = torch.randn(16, head.config.layer.hidden_size, generator=torch.Generator().manual_seed(4))
    with torch.inference_mode():
        expected = head.target_logits(normed).argmax(-1)
        assert torch.equal(draft_argmax(head, normed, True), expected)
        assert torch.equal(draft_argmax(head, normed, False), expected)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_captured_chains_keep_greedy_output(tmp_path):
    """On CUDA with graphs: greedy output equals decoding without speculation, and the chain and whole-proposal
    graphs replay."""
    engine, head, prompts, params, reference = cuda_greedy_case(tmp_path)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4}
    with LLM(engine, speculative_config=spec) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == reference
        chain, whole = llm.engine.speculator.proposer.chain, llm.engine.speculator.proposer.proposals
        assert chain._graphs and chain.replays > 0  # the first proposals: catch-ups of whole prompts
        assert whole._graphs and whole.replays > 0  # the later ones: catch-up + chain in one graph
        assert llm.speculation_stats()["num_drafts"] > 0
