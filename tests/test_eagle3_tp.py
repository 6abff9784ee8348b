"""EAGLE-3 over a tensor-parallel target on the CPU (two processes over gloo, float32): a tiny random Llama built
with tp_size 2 and a random head in the published layout sharing its embedding. Greedy output identical to
decoding without speculation on a small mixed batch under tight limits, every KV block (target and head) back;
rank 0's features are Hugging Face's hidden states (the whole residual stream, not a shard); the head's embedding
is the whole table, assembled from the rank files (a vocabulary padded over the ranks trimmed); tree drafts
refused by name; capturing other layers than the ranks started with refused."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from model_factory import make_checkpoint
from safetensors.torch import load_file
from test_eagle3 import LAYERS, TIGHT, _params, _prompts, _spec, write_head

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.engine_format import EngineError
from kiln.runtime import LLM
from kiln.runtime.distributed import TPExecutor
from kiln.runtime.speculative.target_embedding import EMBEDDING, full_target_embedding
from kiln.runtime.worker.engine_loader import load_engine_info

N = 6  # requests: mixed lengths, penalties, per-request K (2, 0), min_tokens; the fifth repeats the fourth


@pytest.fixture(scope="module")
def target(tmp_path_factory):
    """(tp_size 2 engine dir, the HF model) of a tiny random Llama of LAYERS layers."""
    root = tmp_path_factory.mktemp("eagle3-tp-target")
    checkpoint, model = make_checkpoint(root / "ckpt", num_hidden_layers=LAYERS, max_position_embeddings=512)
    engine = build_engine(checkpoint, root / "engine", BuildConfig(dtype="float32", max_batch_size=8,
                                                                   max_num_tokens=64, tp_size=2), progress=False)
    return engine, model


def test_greedy_output_over_a_tp2_target_is_identical_to_decoding_without_speculation(target, tmp_path):
    engine, hf = target
    prompts, params = _prompts()[:N], [_params(i) for i in range(N)]
    with LLM(engine, **TIGHT) as llm:
        reference = [o.token_ids for o in llm.generate(prompts, params)]
    head, _ = write_head(tmp_path / "head")  # no embedding of its own: the target's, assembled on rank 0
    observed = []
    with LLM(engine, speculative_config=_spec(head), **TIGHT) as llm:
        executor, proposer = llm.engine.executor, llm.engine.speculator.proposer
        assert isinstance(executor, TPExecutor)
        sink = executor._hidden_sink
        executor._hidden_sink = lambda schedule, aux: (observed.append((schedule, aux.clone())), sink(schedule, aux))
        outputs = llm.generate(prompts, params)
        assert [o.token_ids for o in outputs] == reference
        kv, stats = llm.kv_cache_stats(), llm.speculation_stats()
        assert kv["free_blocks"] == kv["total_blocks"] and kv["num_preemptions"] > 0
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks  # the head's cache is back too
        assert stats["num_drafts"] > 0
        torch.testing.assert_close(proposer.head.embed_tokens.weight, hf.model.embed_tokens.weight.detach(),
                                   atol=0, rtol=0)
    # Rank 0's features: HF's hidden states entering the head's layers (2, 3, 3), at every position computed from
    # the request's own tokens.
    full = {o.request_id: [*p, *o.token_ids] for p, o in zip(prompts, outputs)}
    layers = (2, LAYERS // 2, LAYERS - 3)
    with torch.no_grad():
        states = {rid: hf(torch.tensor([ids]), output_hidden_states=True).hidden_states for rid, ids in full.items()}
    features = {rid: torch.cat([s[i][0] for i in layers], -1) for rid, s in states.items()}  # [N, 3H]
    checked = 0
    for schedule, aux in observed:
        offset = 0
        for r in schedule.requests:
            ids, start = full[r.request_id], r.start_position
            good = next((j for j, tok in enumerate(r.token_ids) if start + j >= len(ids) or tok != ids[start + j]),
                        len(r.token_ids))
            torch.testing.assert_close(aux[offset:offset + good], features[r.request_id][start:start + good],
                                       atol=1e-4, rtol=1e-4)
            checked += good
            offset += len(r.token_ids)
    assert checked >= sum(len(ids) - 1 for ids in full.values())


def test_tree_drafts_over_a_tp2_target_are_refused_by_name(target, tmp_path):
    head, _ = write_head(tmp_path / "head")
    with pytest.raises(EngineError, match=r"eagle_topk 2 \(tree drafts\) runs with one rank.*split over 2 ranks"):
        LLM(target[0], speculative_config={**_spec(head, 6), "eagle_topk": 2})


def test_the_embedding_is_assembled_from_the_rank_files_and_its_padding_trimmed(tmp_path):
    """401 tokens over 2 ranks: 201 rows each, the last a padding row of zeros."""
    checkpoint, hf = make_checkpoint(tmp_path / "ckpt", vocab_size=401, tokenizer=False)
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(dtype="float32", tp_size=2), progress=False)
    info = load_engine_info(engine, tokenizer=False)
    local = load_file(str(info.spec.rank_file(0)))[EMBEDDING]
    assert local.shape == (201, 64)
    whole = full_target_embedding(info, local)
    torch.testing.assert_close(whole, hf.model.embed_tokens.weight.detach(), atol=0, rtol=0)
    # Weights drawn at load: every rank drew rank 0's rows (same seed, name and shape).
    drawn = SimpleNamespace(config=SimpleNamespace(mapping=SimpleNamespace(tp_size=3),
                                                   build=SimpleNamespace(weights_at_load=True)),
                            model_config=SimpleNamespace(vocab_size=7))
    rows = torch.arange(6.0).view(3, 2)
    assert full_target_embedding(drawn, rows).tolist() == torch.cat([rows] * 3)[:7].tolist()
    missing = SimpleNamespace(config=SimpleNamespace(mapping=SimpleNamespace(tp_size=2),
                                                     build=SimpleNamespace(weights_at_load=False)),
                              model_config=SimpleNamespace(vocab_size=6),
                              spec=SimpleNamespace(rank_file=lambda rank: tmp_path / f"gone{rank}.safetensors"))
    with pytest.raises(EngineError, match="gone1.safetensors"):
        full_target_embedding(missing, rows)


def test_capturing_other_layers_than_the_ranks_started_with_is_refused(target):
    """Every rank captures RuntimeConfig.feature_layers from its start (so that all take the same path through a
    step); asking rank 0 for other layers later would break that: a ValueError naming both."""
    engine, _ = target
    with LLM(engine, **TIGHT) as llm:  # no speculation: the ranks capture nothing
        executor = llm.engine.executor
        assert isinstance(executor, TPExecutor)
        with pytest.raises(ValueError, match=r"feature layers \[1, 2\]: the ranks started capturing \[\]"):
            executor.capture_hidden((1, 2), lambda schedule, aux: None)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available() or torch.cuda.device_count() < 2, reason="needs two CUDA GPUs")
def test_cuda_tp2_greedy_output_is_identical_to_decoding_without_speculation(tmp_path):
    """Two GPUs over NCCL, float32: the plain engine decodes in CUDA graphs; with the head every rank captures the
    head's layers from its start (RuntimeConfig.feature_layers) and takes the path rank 0 takes (verify graphs or
    eager), so the ranks' collectives match."""
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", num_hidden_layers=LAYERS, max_position_embeddings=512)
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(device="cuda", dtype="float32", tp_size=2,
                                                                       max_batch_size=8, max_num_tokens=64),
                          progress=False)
    head, _ = write_head(tmp_path / "head")
    prompts, params = _prompts(), [_params(i) for i in range(14)]
    with LLM(engine, **TIGHT) as llm:
        reference = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(engine, speculative_config=_spec(head), **TIGHT) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == reference
        kv, proposer = llm.kv_cache_stats(), llm.engine.speculator.proposer
        assert kv["free_blocks"] == kv["total_blocks"]
        assert proposer.blocks.num_free_blocks == proposer.blocks.num_blocks
        assert llm.speculation_stats()["num_drafts"] > 0
