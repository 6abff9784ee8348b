"""EAGLE-3 tree drafts (eagle_topk > 1) on a tiny random Llama target, float32 on the CPU: greedy output identical
to decoding without speculation under tight limits (chunked prefill, preemption, prefix cache), seeded sampling
independent of the batch, every KV block back; the tree verifier's sampling rule against the target distribution
(chi-square); the tree-mask attention reference against a dense mask and the Triton kernel (interpreted); the KV
move; the config's refusals."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch
from model_factory import make_checkpoint
from test_eagle3 import LAYERS, TIGHT, _params, _prompts, assert_everything_back, write_head
from triton_interpret import needs_triton, run_interpreted

from kiln.plugins.attention import paged_attention_reference
from kiln.plugins.kv_move import move_kv_reference, move_kv_slots
from kiln.plugins.tree_mask import tree_visibility, verify_tree_mask
from kiln.runtime import LLM, SamplingParams
from kiln.runtime.speculative import SpeculativeConfig
from kiln.runtime.speculative.tree import TreeSearch, accepted_path, chain_view, kv_moves, sequential_rule


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    root = tmp_path_factory.mktemp("eagle3-tree-target")
    checkpoint, _ = make_checkpoint(root / "ckpt", num_hidden_layers=LAYERS, max_position_embeddings=512)
    return build_engine(checkpoint, root / "engine", BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=64),
                        progress=False)


@pytest.fixture(scope="module")
def reference(target):
    with LLM(target, **TIGHT) as llm:
        return [o.token_ids for o in llm.generate(_prompts(), [_params(i) for i in range(14)])]


def _spec(head: Path, k: int = 4, topk: int = 1, nodes: int | None = None) -> dict:
    spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": k, "eagle_topk": topk}
    return spec if nodes is None else {**spec, "num_draft_tokens": nodes}


def _plant_truth(proposer, sequences: list[list[int]]) -> None:
    """A random head's drafts are never accepted: along one path of each tree (the last node's), put the tokens
    that greedy decoding does produce next, so that paths other than the first children are accepted and their
    keys move."""
    propose = proposer.propose

    def planted(requests):
        proposals = propose(requests)
        for request in requests:
            proposal = proposals.get(request.request_id)
            if proposal is None or not proposal.parents:
                continue
            tokens = list(request.token_ids)
            full = next((s for s in sequences if s[:len(tokens)] == tokens), None)
            if full is None:
                continue
            truth, node, path = full[len(tokens):], len(proposal.parents) - 1, []
            while node >= 0:
                path.append(node)
                node = proposal.parents[node]
            for depth, node in enumerate(reversed(path)):
                if depth < len(truth):
                    proposal.token_ids[node] = truth[depth]
        return proposals

    proposer.propose = planted


@pytest.mark.parametrize("topk,nodes", [(1, None), (2, 6), (3, 8)])
def test_greedy_output_is_identical_to_decoding_without_speculation(target, reference, tmp_path, topk, nodes):
    head, _ = write_head(tmp_path / "head")
    with LLM(target, speculative_config=_spec(head, 4, topk, nodes), **TIGHT) as llm:
        _plant_truth(llm.engine.speculator.proposer, [p + r for p, r in zip(_prompts(), reference)])
        assert [o.token_ids for o in llm.generate(_prompts(), [_params(i) for i in range(14)])] == reference
        stats = assert_everything_back(llm)
        if nodes:
            assert stats["num_accepted_tokens"] > 0  # trees of `nodes` nodes were verified (fewer where a request's limits cut them)
            assert stats["num_draft_tokens"] > 4 * stats["num_drafts"]


def test_seeded_sampling_does_not_depend_on_the_batch(target, tmp_path):
    head, _ = write_head(tmp_path / "head")
    prompts = _prompts()
    seeded = SamplingParams(max_tokens=24, temperature=0.8, top_p=0.95, seed=1234, ignore_eos=True)
    others = SamplingParams(max_tokens=20, temperature=1.0, ignore_eos=True)
    with LLM(target, speculative_config=_spec(head, 3, 2, 5), num_kv_blocks=64) as llm:
        alone = llm.generate(prompts[2], seeded)[0].token_ids
        again = llm.generate(prompts[2], seeded)[0].token_ids
        batched = llm.generate(prompts[:6], [seeded if i == 2 else others for i in range(6)])[2].token_ids
        assert llm.speculation_stats()["num_drafts"] > 0
        kv = llm.kv_cache_stats()
        assert kv["free_blocks"] == kv["total_blocks"]
    assert alone == again == batched


def _chi_square_p_value(counts: list[int], probs: list[float]) -> float:
    """Pearson's test (Wilson-Hilferty's normal approximation of the chi-square tail)."""
    n = sum(counts)
    stat = sum((c - n * p) ** 2 / (n * p) for c, p in zip(counts, probs))
    dof = len(counts) - 1
    z = ((stat / dof) ** (1 / 3) - (1 - 2 / (9 * dof))) / math.sqrt(2 / (9 * dof))
    return 0.5 * math.erfc(z / math.sqrt(2))


def test_the_tree_sampling_rule_yields_the_target_distribution():
    """At a node of deterministic children (the head's top-k), try the children in order, accept x with
    probability p(x), else zero it and renormalize; none accepted: draw from the rest. The token a node yields
    must be distributed as p, whichever children it has (likely, unlikely, of probability 0)."""
    g = torch.Generator().manual_seed(11)
    p = torch.softmax(torch.randn(12, generator=g) * 1.5, -1)
    p[7] = 0.0
    p = p / p.sum()
    for children in ([int(p.argmax())], [3, 0, 5], [7, 2], list(range(11))):
        counts = [0] * 12
        for _ in range(6000):
            counts[sequential_rule(p, children, torch.rand(len(children), generator=g), g)] += 1
        assert counts[7] == 0
        support = [i for i in range(12) if p[i] > 0]
        assert _chi_square_p_value([counts[i] for i in support], [float(p[i]) for i in support]) > 1e-3, children


def test_walking_the_verdict_keeps_a_path_and_reads_as_a_chain():
    from kiln.runtime.sampling.sampler import SamplerOutput

    parents = [-1, -1, 0, 0, 1, 2, 5]  # depths 1 1 2 2 2 3 4
    drafts = [10, 11, 12, 13, 14, 15, 16]
    # root row -> 11 (node 1), node 1's row -> 14 (node 4), node 4's row -> 99: no child, the bonus
    rows = [11, 0, 14, 0, 0, 99, 0, 0]
    path = accepted_path(parents, drafts, rows)
    assert path == [1, 4]
    out = SamplerOutput(token_ids=[5, *rows, 6], logprobs=[0.0, *map(float, range(8)), 9.0])
    chain = chain_view(out, 1, 8, drafts, path)
    assert chain == [11, 14, -1, -1, -1, -1, -1]
    assert out.token_ids[:4] == [5, 11, 14, 99] and out.token_ids[-1] == 6 and sorted(out.token_ids[1:9]) == sorted(rows)
    assert out.logprobs[1:4] == [0.0, 2.0, 5.0]
    assert kv_moves(40, path) == [(42, 41), (45, 42)]
    assert accepted_path(parents, drafts, [10, 12, 0, 0, 0, 15, 16, 7]) == [0, 2]  # node 2's row says 0


def test_tree_search_keeps_the_best_nodes_as_a_tree():
    g = torch.Generator().manual_seed(2)
    search = TreeSearch(topk=3, max_depth=4, max_nodes=8)
    search.expand([-1], torch.randn(1, 50, generator=g).log_softmax(-1))
    while search.frontier:
        search.expand(search.frontier, torch.randn(len(search.frontier), 50, generator=g).log_softmax(-1))
    tokens, parents = search.result()
    assert len(tokens) == len(parents) == 8 and parents[0] == -1
    assert all(-1 <= p < i for i, p in enumerate(parents))
    assert max(len(search.path(i)) for i in range(len(search.nodes))) == 4


def _dense_tree_attention(q, k_cache, v_cache, tables, lens, starts, scale, trees):
    """Attention written out per query from the trees' parents (no bit masks), for the tree-mask reference."""
    out = torch.empty_like(q)
    block = k_cache.shape[1]
    for s, (tree, seq_len) in enumerate(zip(trees, lens.tolist())):
        lo, hi = int(starts[s]), int(starts[s + 1])
        n = hi - lo
        slots = [int(tables[s][p // block]) * block + p % block for p in range(seq_len)]
        k = k_cache.view(-1, *k_cache.shape[2:])[slots].repeat_interleave(q.shape[1] // k_cache.shape[2], 1)
        v = v_cache.view(-1, *v_cache.shape[2:])[slots].repeat_interleave(q.shape[1] // k_cache.shape[2], 1)
        for i in range(n):
            own = seq_len - n + i
            if isinstance(tree, list):  # query i: the root (0) or node i - 1; it sees the context and its path
                seen = set(range(seq_len - n)) | {seq_len - n}
                node = i - 1
                while node >= 0:
                    seen.add(seq_len - n + 1 + node)
                    node = tree[node]
            else:
                seen = set(range(own + 1))
            keys = sorted(seen)
            scores = torch.einsum("hd,khd->hk", q[lo + i].float(), k[keys].float()) * scale
            out[lo + i] = torch.einsum("hk,khd->hd", scores.softmax(-1), v[keys].float()).to(q.dtype)
    return out


def tree_batch(device="cpu", seed=0):
    """A mixed batch: trees (as a verify step lays them out), a prefill chunk, decodes, a fresh prompt."""
    g = torch.Generator().manual_seed(seed)
    heads, kv_heads, dim, block = 4, 2, 16, 4
    seqs = [(9, [-1, -1, 0, 0, 1, 2, -1]), (3, 5), (20, None), (0, 4), (5, [-1, 0, 1]), (70, [-1] * 3 + [0, 1, 2])]
    lens, news, masks, trees = [], [], [], []
    for context, tree in seqs:
        if isinstance(tree, list):
            n = len(tree) + 1
            masks += verify_tree_mask(tree)
        else:
            n = 1 if tree is None else tree
            masks += [0] * n
        trees.append(tree)
        lens.append(context + n)
        news.append(n)
    num_blocks = sum(-(-length // block) for length in lens) + 3
    k_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=g)
    v_cache = torch.randn(num_blocks, block, kv_heads, dim, generator=g)
    free = torch.randperm(num_blocks, generator=g).tolist()
    tables = [[free.pop() for _ in range(-(-length // block))] for length in lens]
    width = max(map(len, tables))
    tables = [t + [0] * (width - len(t)) for t in tables]
    starts = [0]
    for n in news:
        starts.append(starts[-1] + n)
    q = torch.randn(starts[-1], heads, dim, generator=g)
    i32 = dict(dtype=torch.int32, device=device)
    args = (q.to(device), k_cache.to(device), v_cache.to(device), torch.tensor(tables, **i32),
            torch.tensor(lens, **i32), torch.tensor(starts, **i32))
    return args, torch.tensor(masks, dtype=torch.int64, device=device), trees


def test_tree_mask_attention_reference_matches_a_dense_mask():
    args, tree_mask, trees = tree_batch()
    out = paged_attention_reference(*args, 0.25, 0, tree_mask=tree_mask)
    torch.testing.assert_close(out, _dense_tree_attention(*args, 0.25, trees), atol=1e-5, rtol=1e-5)
    causal = paged_attention_reference(*args, 0.25, 0)
    rows = tree_mask == 0  # causal rows are untouched; tree rows differ from causal ones
    torch.testing.assert_close(out[rows], causal[rows])
    assert not torch.allclose(out[~rows], causal[~rows])
    visible = tree_visibility(torch.tensor(verify_tree_mask([-1, 0, -1])), 6)
    assert visible.tolist() == [[True, True, True, False, False, False], [True, True, True, True, False, False],
                                [True, True, True, True, True, False], [True, True, True, False, False, True]]


@needs_triton
def test_tree_mask_triton_kernel_matches_the_reference_interpreted():
    run_interpreted(f"""
        import sys
        sys.path.insert(0, {str(Path(__file__).parent)!r})
        import torch
        from test_eagle3_tree import tree_batch
        from kiln.plugins.attention import paged_attention_reference
        from kiln.plugins.triton_attention import paged_attention_triton
        args, tree_mask, _ = tree_batch()
        for window in (0, 5):
            ref = paged_attention_reference(*args, 0.25, window, tree_mask=tree_mask)
            out = paged_attention_triton(*args, 0.25, window, tree_mask=tree_mask)
            torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
        # one token per sequence (the decode path's shape) with tree rows: the unified kernel still
        args, _, _ = tree_batch()
        q, k, v, tables, lens, _ = args
        one = torch.arange(lens.shape[0] + 1, dtype=torch.int32)
        single = torch.tensor([0, 0, 0, 0, -1, -3], dtype=torch.int64)  # tree rows that see all but a few keys
        ref = paged_attention_reference(q[:6].contiguous(), k, v, tables, lens, one, 0.25, 0, tree_mask=single)
        out = paged_attention_triton(q[:6].contiguous(), k, v, tables, lens, one, 0.25, 0, tree_mask=single)
        torch.testing.assert_close(out, ref, atol=2e-4, rtol=2e-4)
        print("ok")
    """)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_tree_mask_triton_kernel_matches_the_reference_cuda(dtype):
    from kiln.plugins.triton_attention import paged_attention_triton

    args, tree_mask, _ = tree_batch("cuda")
    args = (args[0].to(dtype), args[1].to(dtype), args[2].to(dtype), *args[3:])
    ref = paged_attention_reference(*args, 0.25, 0, tree_mask=tree_mask)
    out = paged_attention_triton(*args, 0.25, 0, tree_mask=tree_mask)
    tolerance = 2e-2 if dtype == torch.bfloat16 else 2e-4
    torch.testing.assert_close(out.float(), ref.float(), atol=tolerance, rtol=tolerance)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float8_e4m3fn])
def test_kv_move_matches_its_reference(dtype):
    g = torch.Generator().manual_seed(4)
    layers = tuple((torch.randn(6, 4, 2, 8, generator=g).to(dtype), torch.randn(6, 4, 2, 8, generator=g).to(dtype))
                   for _ in range(2))
    expected = tuple(tuple(t.clone() for t in pair) for pair in layers)
    src, dst = [9, 13, 14, 22], [8, 9, 10, 11]  # overlapping: slot 9 is read before it is written
    before = layers[0][1].view(-1, 2, 8)[9].clone()
    move_kv_slots(layers, src, dst)
    move_kv_reference(expected, src, dst)
    assert torch.equal(layers[0][1].view(-1, 2, 8)[8].view(torch.uint8), before.view(torch.uint8))
    for got, want in zip(layers, expected):
        for a, b in zip(got, want):
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def test_tree_options_are_checked_by_name(target, tmp_path):
    with pytest.raises(ValueError, match="eagle_topk 2 .* needs --speculative-mode eagle3; 'ngram'"):
        SpeculativeConfig(method="ngram", num_speculative_tokens=3, eagle_topk=2)
    with pytest.raises(ValueError, match=r"eagle_topk 0 must be an integer in \[1, 8\]"):
        SpeculativeConfig(method="eagle3", model="/h", num_speculative_tokens=3, eagle_topk=0)
    with pytest.raises(ValueError, match=r"num_draft_tokens 64 must be an integer in \[1, 63\]"):
        SpeculativeConfig(method="eagle3", model="/h", num_speculative_tokens=3, eagle_topk=2, num_draft_tokens=64)
    with pytest.raises(ValueError, match="num_draft_tokens 5 with eagle_topk 1 .* must equal"):
        SpeculativeConfig(method="eagle3", model="/h", num_speculative_tokens=3, num_draft_tokens=5)
    with pytest.raises(ValueError, match="eagle_topk 8 x .* = 120 nodes"):
        SpeculativeConfig(method="eagle3", model="/h", num_speculative_tokens=16, eagle_topk=8)
    with pytest.raises(ValueError, match="unknown keys"):
        SpeculativeConfig.from_dict({"method": "eagle3", "model": "/h", "num_speculative_tokens": 3, "topk": 2})
    spec = SpeculativeConfig.from_dict({"method": "eagle3", "model": "/h", "num_speculative_tokens": 5,
                                        "eagle_topk": 4, "num_draft_tokens": 16})
    assert (spec.is_tree, spec.max_draft_nodes) == (True, 16)
    assert SpeculativeConfig(method="eagle3", model="/h", num_speculative_tokens=5).max_draft_nodes == 5


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tree_greedy_output_is_identical_to_decoding_without_speculation(tmp_path):
    """On CUDA (the Triton kernel's tree mask, the KV move on the device), float32 as tests/test_eagle3.py's."""
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", num_hidden_layers=LAYERS, max_position_embeddings=512)
    engine = build_engine(checkpoint, tmp_path / "gpu", BuildConfig(device="cuda", dtype="float32", max_batch_size=8,
                                                                    max_num_tokens=64), progress=False)
    head, _ = write_head(tmp_path / "head")
    params = [_params(i) for i in range(14)]
    with LLM(engine, **TIGHT) as llm:
        reference = [o.token_ids for o in llm.generate(_prompts(), params)]
    with LLM(engine, speculative_config=_spec(head, 4, 3, 8), **TIGHT) as llm:
        _plant_truth(llm.engine.speculator.proposer, [p + r for p, r in zip(_prompts(), reference)])
        assert [o.token_ids for o in llm.generate(_prompts(), params)] == reference
        kv, proposer = llm.kv_cache_stats(), llm.engine.speculator.proposer
        assert kv["free_blocks"] == kv["total_blocks"]
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
        assert llm.speculation_stats()["num_accepted_tokens"] > 0


def test_tree_flags_reach_the_config_and_need_eagle3():
    import argparse

    from kiln.commands.runtime_args import add_runtime_args, runtime_options

    parser = argparse.ArgumentParser()
    add_runtime_args(parser)
    args = parser.parse_args(["--speculative-mode", "eagle3", "--speculative-model", "/heads/h",
                              "--num-speculative-tokens", "5", "--speculative-eagle-topk", "4",
                              "--speculative-num-draft-tokens", "8"])
    config = runtime_options(args).speculative_config
    assert (config.eagle_topk, config.num_draft_tokens, config.num_speculative_tokens) == (4, 8, 5)
    with pytest.raises(ValueError, match="--speculative-eagle-topk .* need --speculative-mode eagle3"):
        runtime_options(parser.parse_args(["--speculative-eagle-topk", "2"]))
