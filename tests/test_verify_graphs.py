"""Speculative decoding's verify graphs (runtime/worker/verify_graphs.py): their layout of Q rows a sequence,
padding included, computes what the packed eager step computes. On the CPU the uncaptured graphs run their
forward eagerly over the same staged buffers, so the layout (padding rows, shifted tree masks, the sequences'
lengths) is checked here against `pack_step` on a tiny random Llama; on CUDA the captured graphs give the
tokens of decoding without speculation (gpu tests)."""

from __future__ import annotations

import dataclasses

import pytest
import torch
from model_factory import make_checkpoint

from kiln.runtime import LLM, SamplingParams
from kiln.runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from kiln.runtime.worker.block_table_mirror import BlockTableMirror
from kiln.runtime.worker.engine_loader import load_engine_info, load_network
from kiln.runtime.worker.kv_cache import KVCache, rank_cache_config
from kiln.runtime.worker.step_inputs import pack_step
from kiln.runtime.worker.verify_graphs import (
    VERIFY_MAX_TOKENS,
    VerifyGraphs,
    _shift_mask,
    verify_batch,
    verify_sizes,
)

BS = 4
Q = 5
LAYERS = (1, 2)  # features kept, as an EAGLE-3 head would ask
CPU = torch.device("cpu")


@pytest.fixture(scope="module")
def engine(tmp_path_factory):
    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    root = tmp_path_factory.mktemp("verify-graphs")
    checkpoint, _ = make_checkpoint(root / "ckpt", num_hidden_layers=3, max_position_embeddings=256)
    return build_engine(checkpoint, root / "engine", BuildConfig(dtype="float32", max_batch_size=8, max_num_tokens=64),
                        progress=False)


@pytest.fixture(scope="module")
def network(engine):
    model = load_network(load_engine_info(engine), CPU)
    model.setup_rotary(256, CPU)
    return model


def _request(rid: str, tokens, start: int, blocks, parents=(), sampled: int | None = None) -> ScheduledRequest:
    return ScheduledRequest(rid, tuple(tokens), start, tuple(blocks), 7, len(tokens) if sampled is None else sampled,
                            draft_parents=tuple(parents))


def _eager(model, cache, step: SchedulerOutput):
    """(logits [R, V], features [T, F] of every packed token) of the packed eager step."""
    packed = pack_step(step, BS, cache.layers, CPU, mirror=BlockTableMirror())
    context = dataclasses.replace(packed.context, capture_layers=LAYERS, captured={})
    hidden = model(packed.input_ids, context)
    return model.compute_logits(hidden[packed.sample_rows]), torch.cat([context.captured[i] for i in LAYERS], -1)


@pytest.mark.parametrize("tree", [False, True])
@torch.inference_mode()
def test_verify_rows_with_padding_compute_what_the_packed_step_computes(network, tree):
    """Requests of 1..Q tokens (drafts of every count, one without), a tree of Q tokens and (tree graphs) one of
    fewer, whose masks shift past its padding keys: logits and features equal the eager packed step's, and the
    KV cache holds the same values afterwards (padding wrote nothing)."""
    model = network
    cache = KVCache(rank_cache_config(model.config, None), 40, BS, torch.float32, CPU)
    g = torch.Generator().manual_seed(0)
    lengths = {"a": 13, "b": 9, "c": 6, "d": 11}
    blocks = {rid: list(range(8 * i, 8 * i + 8)) for i, rid in enumerate(lengths)}
    prompts = {rid: torch.randint(2, 100, (n,), generator=g).tolist() for rid, n in lengths.items()}
    prefill = SchedulerOutput(tuple(_request(rid, prompts[rid], 0, blocks[rid], sampled=1) for rid in lengths), ())
    _eager(model, cache, prefill)
    draft = lambda n: torch.randint(2, 100, (n,), generator=g).tolist()  # noqa: E731
    requests = [_request("a", draft(4), 13, blocks["a"]), _request("b", draft(1), 9, blocks["b"])]
    if tree:
        requests += [_request("c", draft(5), 6, blocks["c"], parents=(-1, -1, 0, 1)),
                     _request("d", draft(3), 11, blocks["d"], parents=(-1, -1))]
    else:
        requests += [_request("c", draft(5), 6, blocks["c"]), _request("d", draft(2), 11, blocks["d"])]
    step = SchedulerOutput(tuple(requests), ())
    before = [t.clone() for layer in cache.layers for t in layer]
    want_logits, want_features = _eager(model, cache, step)
    after_eager = [t.clone() for layer in cache.layers for t in layer]
    for t, b in zip((t for layer in cache.layers for t in layer), before):
        t.copy_(b)

    graphs = VerifyGraphs(model, cache.layers, tokens_per_seq=Q, max_batch_size=8, max_num_tokens=64,
                          max_blocks_per_seq=16, block_size=BS, device=CPU, tree=tree, capture_layers=LAYERS)
    batch = verify_batch(step, BS, model, {}, Q, tree)
    assert batch is not None and batch.num_seqs == 4 and len(batch.input_ids) == 4 * Q
    assert batch.logits_offsets == (0, 4, 5, 10, 13 if tree else 12)
    logits, features = graphs.run(batch)
    torch.testing.assert_close(logits, want_logits, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(features, want_features, rtol=1e-5, atol=1e-5)
    for t, want, old in zip((t for layer in cache.layers for t in layer), after_eager, before):
        torch.testing.assert_close(t, want, rtol=1e-5, atol=1e-5)  # the real tokens' keys and values
        assert torch.equal(t != old, want != old)  # no other slot written: padding wrote nothing
    assert graphs.replays == 0  # nothing captured on the CPU


def test_steps_a_verify_graph_does_not_take(network):
    blocks = list(range(8))
    decode = SchedulerOutput((_request("a", [5], 9, blocks),), ())
    assert verify_batch(decode, BS, network, {}, Q, False) is None  # no drafts: the decode graphs' step
    assert verify_batch(decode, BS, network, {}, Q, False, require_drafts=False) is not None  # EAGLE-3 features
    too_many = SchedulerOutput((_request("a", [5] * (Q + 1), 9, blocks),), ())
    assert verify_batch(too_many, BS, network, {}, Q, False) is None
    prefill = SchedulerOutput((_request("a", [5, 6, 7], 0, blocks, sampled=1),), ())
    assert verify_batch(prefill, BS, network, {}, Q, False) is None
    logprobs = SchedulerOutput((_request("a", [5, 6], 9, blocks),), ())
    assert verify_batch(logprobs, BS, network, {"a": object()}, Q, False) is None
    tree = SchedulerOutput((_request("a", [5, 6, 7], 9, blocks, parents=(-1, -1)),), ())
    assert verify_batch(tree, BS, network, {}, Q, False) is None  # chain graphs read no tree masks
    assert verify_batch(tree, BS, network, {}, Q, True) is not None


def test_sizes_and_mask_shift():
    assert verify_sizes(256, 8192, 5) == [1, 2, 4, 8, 16, 32, 48, 64, 80, 96, 102]
    assert max(verify_sizes(256, 8192, 5)) * 5 <= VERIFY_MAX_TOKENS
    assert verify_sizes(4, 64, 5) == [1, 2, 4]
    assert verify_sizes(8, 4, 5) == []  # not one sequence fits max_num_tokens
    assert _shift_mask(0b1011, 2) == 0b101100
    assert _shift_mask(-1 << 3 | 0b101, 1) == -1 << 4 | 0b1010  # the context bits stay set
    assert _shift_mask(-(1 << 63), 1) == 0  # a bit shifted out of the span is gone


def _plant_chains(proposer, sequences: list[list[int]]) -> None:
    """A random head's drafts are never accepted: the first two drafts of every chain become the tokens greedy
    decoding does produce next, so steps accept some drafts (trees: test_eagle3_tree's _plant_truth)."""
    propose = proposer.propose

    def planted(requests):
        proposals = propose(requests)
        for request in requests:
            proposal = proposals.get(request.request_id)
            tokens = list(request.token_ids)
            full = next((s for s in sequences if s[:len(tokens)] == tokens), None)
            if proposal is not None and full is not None:
                truth = full[len(tokens):]
                for j in range(min(2, len(truth), len(proposal.token_ids))):
                    proposal.token_ids[j] = truth[j]
        return proposals

    proposer.propose = planted


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("method", ["ngram", "eagle3", "eagle3-tree"])
def test_cuda_verify_graphs_give_the_tokens_of_decoding_without_speculation(tmp_path, method):
    """On CUDA with graphs: greedy tokens equal decoding without speculation under in-flight batching, and the
    verify steps replay graphs (with EAGLE-3, keeping the head's features)."""
    from test_eagle3 import LAYERS as TARGET_LAYERS
    from test_eagle3 import write_head
    from test_eagle3_tree import _plant_truth

    from kiln.builder.build import build_engine
    from kiln.builder.build_config import BuildConfig

    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", num_hidden_layers=TARGET_LAYERS, max_position_embeddings=512)
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(dtype="float32", device="cuda",
                                                                       max_batch_size=8, max_num_tokens=64),
                          progress=False)
    spec = {"method": "ngram", "num_speculative_tokens": 4, "ngram_min": 1, "ngram_max": 3}
    if method != "ngram":
        head, _ = write_head(tmp_path / "head")
        spec = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 4}
        if method == "eagle3-tree":
            spec.update(eagle_topk=2, num_draft_tokens=6)
    prompts = [[3, 4, 5, 6] * 4, [9, 8, 7] * 3, list(range(2, 30)), [11, 12] * 9, [40, 41, 42]]
    params = SamplingParams(max_tokens=40, temperature=0.0, ignore_eos=True)
    with LLM(engine, num_kv_blocks=200) as llm:
        want = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(engine, num_kv_blocks=200, speculative_config=spec) as llm:
        truth = [p + w for p, w in zip(prompts, want)]
        if method == "eagle3":
            _plant_chains(llm.engine.speculator.proposer, truth)
        elif method == "eagle3-tree":
            _plant_truth(llm.engine.speculator.proposer, truth)
        got = [o.token_ids for o in llm.generate(prompts, params)]
        graphs = llm.engine.executor.runner.verify_graphs
        assert graphs is not None and graphs.replays > 0
        assert bool(graphs.capture_layers) == (method != "ngram")
        stats = llm.engine.speculation_stats()
    assert got == want
    assert stats["mean_accepted_length"] > 1.5, stats
