"""EAGLE-3 tree proposals in one graph (runtime/speculative/eagle3_tree_proposals.py: the catch-up after a verify
step, the root's expansion and the rounds), on the CPU: after a first proposal, requests that gained 1..K + 1 tokens
get exactly the trees (tokens, parents) and head keys of the eager catch-up + rounds, at topk 2 and 4, depths 2 to
5, across KV block boundaries; padding rows (what a captured graph of a larger size adds) change nothing; longer
catch-ups and trees of depth 1 keep the other path; greedy output equals decoding without speculation, every head
block back. On CUDA: the same with the captured graphs replayed."""

from __future__ import annotations

import pytest
import torch
from test_eagle3 import VOCAB, graph_test_engine
from test_eagle3_tree_graphs import K, assert_same_kv, tree_llm, trees_and_keys

from kiln.runtime import SamplingParams
from kiln.runtime.sampling.sampler import SamplingRow
from kiln.runtime.speculative.eagle3_tree_proposals import TreeProposalGraphs
from kiln.runtime.speculative.proposer import DraftRequest

# Trees of depth up to K = 5; catch-ups of up to K + 1 = 6 positions; KV blocks of 4 tokens.


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    return graph_test_engine(tmp_path_factory.mktemp("eagle3-tree-proposals"))


@pytest.fixture(scope="module", params=[2, 4])
def llm(engine, tmp_path_factory, request):
    with tree_llm(engine, tmp_path_factory.mktemp("eagle3-tree-proposals-head"), request.param) as llm:
        yield llm


# (tokens at the first proposal, tokens gained since, depth, node budget); one row samples (trees take the
# head's top-k children whatever the sampling).
_SPECS = [(3, 1, K, 8), (7, 6, K, 16), (12, 3, 3, 8), (21, 4, 4, 16), (30, 2, 2, 8), (9, 5, 1, 8), (14, 6, K, 16),
          (5, 7, K, 8)]


def _request(i: int, tokens: list[int], depth: int, nodes: int) -> DraftRequest:
    params = (SamplingParams(max_tokens=64, temperature=1.0, seed=5) if i == 6
              else SamplingParams(max_tokens=64, temperature=0))
    prompt = tokens[:2]
    generator = torch.Generator() if params.seed is not None else None
    return DraftRequest(f"r{i}", tokens, depth, SamplingRow(params, prompt, tokens[2:], generator), max_nodes=nodes)


def _rounds(proposer, graphs: TreeProposalGraphs | None) -> tuple[dict, dict, list[int]]:
    """Two proposals from scratch with `graphs` (None: the eager catch-up + the rounds' path): the first over
    _SPECS' requests, the second after each gained its tokens (with features for them, as a target step hands
    over). Returns the second's trees (request id -> (tokens, parents)), each request's head keys and values
    ([layers, 2, keys, Hk, D] over every key that proposal may write), and the rows each `graphs.propose` took."""
    g = torch.Generator().manual_seed(11)
    first = [torch.randint(2, VOCAB, (n + m,), generator=g).tolist() for n, m, _, _ in _SPECS]
    for i in range(len(_SPECS)):
        proposer.release(f"r{i}")
    proposer.cache.storage.zero_()
    rows: list[int] = []
    kept = proposer.tree_proposals
    proposer.tree_proposals = graphs
    if graphs is not None:
        graphs.propose = lambda batch: rows.append(len(batch)) or TreeProposalGraphs.propose(graphs, batch)
    try:
        proposer.propose([_request(i, t[:n], d, b) for i, (t, (n, _, d, b)) in enumerate(zip(first, _SPECS))])
        later = [_request(i, t, d, b) for i, (t, (_, _, d, b)) in enumerate(zip(first, _SPECS))]
        for r, (n, m, _, _) in zip(later, _SPECS):  # the target's features of the positions the head catches up on
            feats = torch.randn(m, proposer.num_features, generator=g).to(proposer.head.fc.weight.dtype)
            proposer._features.setdefault(r.request_id, []).append((n - 1, feats))
        proposals = proposer.propose(later)
    finally:
        proposer.tree_proposals = kept
        if graphs is not None:
            del graphs.propose
    trees, kv = trees_and_keys(proposer, later, proposals)
    return trees, kv, rows


def test_whole_proposals_give_the_eager_trees_and_keys(llm):
    proposer = llm.engine.speculator.proposer
    graphs = proposer.tree_proposals
    assert isinstance(graphs, TreeProposalGraphs) and graphs.q == K + 1 and not graphs._graphs
    eager, eager_kv, _ = _rounds(proposer, None)
    whole, whole_kv, rows = _rounds(proposer, graphs)
    # First proposal: the requests of at most 7 tokens (a catch-up of <= 6) and depth > 1 (r0, r1, r7); second:
    # every request but r5 (depth 1) and r7 (7 tokens gained: a catch-up of 7).
    assert rows == [3, 6]
    assert whole == eager
    assert any(len(set(parents)) > 2 for _, parents in eager.values())  # real trees, not chains
    assert_same_kv(whole_kv, eager_kv)


class _EagerGraph:
    """Stands in for a captured graph on the CPU: a replay runs the same function over the graph's padded size."""

    def __init__(self, graphs: TreeProposalGraphs, size: int) -> None:
        self.graphs, self.size = graphs, size

    def replay(self) -> None:
        self.graphs._outputs[self.size] = self.graphs._propose(self.size)


def test_padding_rows_change_nothing(llm):
    """As a captured graph runs: the batch padded to the next captured size (3 rows -> 4, 6 -> 8), every row through
    every round (rows past their depth, and padding rows, write nothing)."""
    proposer = llm.engine.speculator.proposer
    graphs = proposer.tree_proposals
    assert 3 not in graphs.trees.sizes and 6 not in graphs.trees.sizes
    eager, eager_kv, _ = _rounds(proposer, None)
    graphs._graphs = {s: _EagerGraph(graphs, s) for s in graphs.trees.sizes}
    try:
        padded, padded_kv, rows = _rounds(proposer, graphs)
        assert rows == [3, 6] and graphs.replays == 2
    finally:
        graphs._graphs, graphs._outputs, graphs.replays = {}, {}, 0
    assert padded == eager
    assert_same_kv(padded_kv, eager_kv)


def test_rows_whose_rope_needs_per_length_tables_keep_the_other_path(llm, monkeypatch):
    proposer = llm.engine.speculator.proposer
    eager, _, _ = _rounds(proposer, None)
    monkeypatch.setattr(proposer.head.rotary, "needs_per_length_tables", lambda length: length > 22)
    mixed, _, rows = _rounds(proposer, proposer.tree_proposals)
    assert rows == [3, 3]  # second proposal: not r3, r4, r6 (their last round at positions 26, 31, 22); r5, r7 as before
    assert mixed == eager
