"""EAGLE-3 tree drafts grown on the device (runtime/speculative/eagle3_tree_graphs.py), on the CPU: the device rounds
(`_tree_steps`, eager) give exactly the trees (tokens, parents) and head keys of the eager rounds (eagle3_tree.grow
+ TreeSearch.result) for requests of different lengths, depths up to 5 and budgets of 8 and 16 nodes, at topk 2
and 4, across KV block boundaries; padding rows (what a captured graph of a larger size adds) change nothing;
greedy output with the device trees (and whole tree proposals, eagle3_tree_proposals) equals decoding without
speculation, every head block back. On CUDA: the same with the captured graphs replayed."""

from __future__ import annotations

import heapq

import pytest
import torch
from test_eagle3 import VOCAB, cuda_greedy_case, graph_test_engine, write_head

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.sampling.sampler import SamplingRow
from kiln.runtime.speculative.eagle3_tree_graphs import TreeDraftGraphs, best_k
from kiln.runtime.speculative.eagle3_tree_proposals import TreeProposalGraphs
from kiln.runtime.speculative.proposer import DraftRequest
from kiln.runtime.worker.step_inputs import slots_of

K = 5  # trees of depth up to 5: four rounds after the root's expansion; KV blocks of 4 tokens


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return graph_test_engine(tmp_path_factory.mktemp("eagle3-tree-graphs"))


def tree_llm(engine, root, topk: int) -> LLM:
    """An LLM over `engine` drafting trees of depth K and 16 nodes, `topk` children a node, with a random head
    written under `root` (also test_eagle3_tree_proposals')."""
    head, _ = write_head(root / "head")
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K, "eagle_topk": topk,
            "num_draft_tokens": 16}
    return LLM(engine, speculative_config=spec)


@pytest.fixture(scope="module", params=[2, 4])
def llm(engine, tmp_path_factory, request):
    with tree_llm(engine, tmp_path_factory.mktemp("eagle3-tree-graphs-head"), request.param) as llm:
        yield llm


def _requests() -> list[DraftRequest]:
    """Requests of 3..30 tokens wanting trees of depth 1..K and 8 or 16 nodes (one sampled: trees take the head's
    top-k children whatever the sampling)."""
    g = torch.Generator().manual_seed(11)
    greedy = SamplingParams(max_tokens=64, temperature=0)
    specs = [(3, K, 8, greedy), (7, K, 16, greedy), (12, 3, 8, greedy), (21, 4, 16, greedy), (30, 2, 8, greedy),
             (9, 1, 8, greedy), (14, K, 16, SamplingParams(max_tokens=64, temperature=1.0, seed=5))]
    out = []
    for i, (n, depth, nodes, params) in enumerate(specs):
        tokens = torch.randint(2, VOCAB, (n,), generator=g).tolist()
        prompt = tokens[:max(1, n - 2)]
        generator = torch.Generator() if params.seed is not None else None
        out.append(DraftRequest(f"r{i}", tokens, depth, SamplingRow(params, prompt, tokens[len(prompt):], generator),
                                max_nodes=nodes))
    return out


def test_the_next_frontier_is_tree_searchs_with_ties():
    """best_k against TreeSearch's own pick, on scores with many exact ties (and -inf)."""
    g = torch.Generator().manual_seed(5)
    for k in (2, 3, 4, 8):
        scores = torch.randint(0, 4, (20, k * k), generator=g).double() - 0.5
        scores[3, :3] = float("-inf")
        got = best_k(scores, k).tolist()
        for row, picked in zip(scores.tolist(), got):
            assert picked == sorted(heapq.nlargest(k, range(k * k), key=lambda i: (row[i], -i)))


def _propose(proposer, requests, graphs):
    """Trees and each request's head keys and values after proposing from scratch with `graphs` (None: the eager
    rounds): request id -> (tokens, parents), request id -> [layers, 2, keys, Hk, D] over every key its proposal
    may write. Checks that no other slot was written."""
    for r in requests:
        proposer.release(r.request_id)
    proposer.cache.storage.zero_()
    # The rounds alone here: whole proposals on the device (eagle3_tree_proposals) have their own tests.
    kept, proposer.tree_graphs = proposer.tree_graphs, graphs
    kept_proposals, proposer.tree_proposals = proposer.tree_proposals, None
    try:
        proposals = proposer.propose(requests)
    finally:
        proposer.tree_graphs, proposer.tree_proposals = kept, kept_proposals
    return trees_and_keys(proposer, requests, proposals)


def trees_and_keys(proposer, requests, proposals) -> tuple[dict, dict]:
    """The proposals' trees (request id -> (tokens, parents)) and each request's head keys and values (request id
    -> [layers, 2, keys, Hk, D] over every key its proposal may write); checks that no other slot was written and
    releases the requests."""
    flat = proposer.cache.storage.flatten(2, 3)  # [layers, 2, slots, Hk, D]
    written = torch.zeros(flat.shape[2], dtype=torch.bool)
    kv = {}
    for r in requests:
        n = len(r.token_ids) - 1 + (r.max_tokens - 1) * proposer.topk  # own positions, then the fed nodes
        slots = torch.tensor(slots_of(proposer.blocks.block_table(r.request_id), 0, n, proposer.runtime.block_size))
        kv[r.request_id] = flat[:, :, slots].clone()
        written[slots] = True
        proposer.release(r.request_id)
    assert not flat[:, :, ~written].any()
    return {k: (p.token_ids, p.parents) for k, p in proposals.items()}, kv


def assert_same_kv(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for request_id in a:
        torch.testing.assert_close(a[request_id], b[request_id], atol=1e-5, rtol=1e-5)


def _counting(graphs: TreeDraftGraphs) -> list[int]:
    rows: list[int] = []
    graphs.grow = lambda tokens, *args: rows.append(len(tokens)) or TreeDraftGraphs.grow(graphs, tokens, *args)
    return rows


def test_device_rounds_give_the_eager_trees_and_keys(llm):
    proposer = llm.engine.speculator.proposer
    graphs = proposer.tree_graphs
    assert isinstance(graphs, TreeDraftGraphs) and graphs.steps == K - 1 and not graphs._graphs
    requests = _requests()
    eager, eager_cache = _propose(proposer, requests, None)
    rows = _counting(graphs)
    try:
        grown, grown_cache = _propose(proposer, requests, graphs)
    finally:
        del graphs.grow
    assert rows == [6]  # every request but the one of depth 1 (its root's children are the whole tree)
    assert grown == eager
    k = proposer.topk  # a tree keeps its budget, or all the nodes its depth grew
    assert [len(eager[r.request_id][0]) for r in requests] == [min(r.max_nodes, k + (r.max_tokens - 1) * k * k)
                                                               for r in requests]
    assert any(len(set(parents)) > 2 for _, parents in eager.values())  # real trees, not chains
    assert_same_kv(grown_cache, eager_cache)


class _EagerGraph:
    """Stands in for a captured graph on the CPU: a replay runs the same rounds over the graph's padded size."""

    def __init__(self, graphs: TreeDraftGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs._steps(self.size, self.graphs.steps)


def test_padding_rows_change_nothing(llm):
    """As a captured graph runs: the batch padded to the next captured size (5 tree rows -> 8), every row run
    for all the rounds (rows past their depth write nothing)."""
    proposer = llm.engine.speculator.proposer
    graphs = proposer.tree_graphs
    requests = [r for r in _requests() if r.max_tokens > 1][:5]
    assert 5 not in graphs.sizes
    eager, eager_cache = _propose(proposer, requests, None)
    graphs._graphs = {s: _EagerGraph(graphs, s) for s in graphs.sizes}
    graphs._outputs = {s: graphs._pool[:s] for s in graphs.sizes}
    try:
        padded, padded_cache = _propose(proposer, requests, graphs)
        assert graphs.replays == 1
    finally:
        graphs._graphs, graphs._outputs, graphs.replays = {}, {}, 0
    assert padded == eager
    assert_same_kv(padded_cache, eager_cache)


def test_rows_the_device_cannot_take_keep_the_eager_rounds(llm, monkeypatch):
    """A head whose rope needs per-length tables (dynamic NTK past its context) there grows those trees eagerly."""
    proposer = llm.engine.speculator.proposer
    graphs = proposer.tree_graphs
    requests = _requests()
    eager, _ = _propose(proposer, requests, None)
    monkeypatch.setattr(proposer.head.rotary, "needs_per_length_tables", lambda length: length > 22)
    rows = _counting(graphs)
    try:
        mixed, _ = _propose(proposer, requests, graphs)
    finally:
        del graphs.grow
    assert rows == [4]  # not r3 (21 tokens, 3 rounds: position 22) nor r4 (30 tokens); r5 wants none
    assert mixed == eager


def test_greedy_output_with_device_trees_is_identical_to_decoding_without_speculation(engine, llm):
    g = torch.Generator().manual_seed(3)
    prompts = [torch.randint(2, VOCAB, (3 + 7 * i,), generator=g).tolist() for i in range(5)]
    params = [SamplingParams(max_tokens=12 + i, temperature=0, ignore_eos=True) for i in range(5)]
    with LLM(engine) as plain:
        reference = [o.token_ids for o in plain.generate(prompts, params)]
    proposer = llm.engine.speculator.proposer
    rows, whole = _counting(proposer.tree_graphs), []  # the rounds alone, and whole proposals
    graphs = proposer.tree_proposals
    graphs.propose = lambda batch: whole.append(len(batch)) or TreeProposalGraphs.propose(graphs, batch)
    try:
        assert [o.token_ids for o in llm.generate(prompts, params)] == reference
    finally:
        del proposer.tree_graphs.grow, graphs.propose
    assert sum(rows) > 0 and sum(whole) > 0 and llm.speculation_stats()["num_drafts"] > 0
    kv = llm.kv_cache_stats()
    assert kv["free_blocks"] == kv["total_blocks"]
    assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
    assert not proposer._sequences


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("topk,nodes", [(2, 8), (4, 16)])
def test_cuda_captured_trees_keep_greedy_output(tmp_path, topk, nodes):
    """On CUDA with graphs: greedy output equals decoding without speculation, and the tree graphs replay."""
    engine, head, prompts, params, reference = cuda_greedy_case(tmp_path)
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": K, "eagle_topk": topk,
            "num_draft_tokens": nodes}
    with LLM(engine, speculative_config=spec) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == reference
        proposer = llm.engine.speculator.proposer
        graphs, whole = proposer.tree_graphs, proposer.tree_proposals  # first proposals, then whole ones
        assert graphs._graphs and graphs.replays > 0 and whole._graphs and whole.replays > 0
        assert llm.speculation_stats()["num_drafts"] > 0
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
