"""The whole runtime on a CUDA device through the reference operators: same greedy tokens as the CPU."""

from __future__ import annotations

import gc

import pytest
import torch
from model_factory import make_checkpoint

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


def _cuda_engine(tmp_path, **limits):
    """A tiny random Llama built for CUDA with these build limits."""
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM")
    return build_engine(checkpoint, tmp_path / "gpu", BuildConfig(device="cuda", **limits), progress=False)


@pytest.mark.parametrize("architecture", ["LlamaForCausalLM", "Qwen3ForCausalLM"])
def test_cuda_engine_matches_cpu_greedy(tmp_path, architecture):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", architecture)
    limits = dict(max_batch_size=4, max_num_tokens=32, max_seq_len=128, kv_block_size=4)
    cpu = LLM(build_engine(checkpoint, tmp_path / "cpu", BuildConfig(**limits), progress=False))
    gpu = LLM(build_engine(checkpoint, tmp_path / "gpu", BuildConfig(device="cuda", **limits), progress=False),
              num_kv_blocks=48)
    prompts = [[(5 * i + n) % 390 + 2 for i in range(n)] for n in (1, 9, 40, 23, 60, 3)]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    assert [o.token_ids for o in gpu.generate(prompts, params)] == [o.token_ids for o in cpu.generate(prompts, params)]
    seeded = SamplingParams(max_tokens=8, temperature=1.0, seed=11, logprobs=True, ignore_eos=True)
    alone = gpu.generate(prompts[1], seeded)[0]
    batched = gpu.generate(prompts[:3], [params, seeded, params])[1]
    assert batched.token_ids == alone.token_ids
    stats = gpu.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"]


def test_cuda_engine_refuses_cpu_and_reports_target(tmp_path):
    engine = _cuda_engine(tmp_path, dtype="bfloat16", max_seq_len=64)
    from kiln.engine_format import EngineError, load_engine_spec

    spec = load_engine_spec(engine)
    assert spec.target["compute_capability"] == list(torch.cuda.get_device_capability())
    with pytest.raises(EngineError, match="rebuild it with `kiln build --device cpu`"):
        LLM(engine, device="cpu")
    out = LLM(engine).generate("the cat", SamplingParams(max_tokens=8, temperature=0))[0]
    assert len(out.token_ids) >= 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_cuda_graphs_give_the_eager_tokens_under_in_flight_batching(tmp_path, dtype):
    engine = _cuda_engine(tmp_path, dtype=dtype, max_batch_size=24, max_num_tokens=64, max_seq_len=256,
                          kv_block_size=16)
    graphs = LLM(engine, num_kv_blocks=200)
    eager = LLM(engine, num_kv_blocks=200, cuda_graphs=False)
    assert graphs.engine.executor.runner.graphs.sizes == [1, 2, 4, 8, 16, 24]
    assert eager.engine.executor.runner.graphs is None
    # 19 requests of different lengths: decode batches of many sizes, padded to the captured ones.
    prompts = [[(7 * i + n) % 390 + 2 for i in range(n)] for n in range(3, 60, 3)]
    params = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
    batched = [o.token_ids for o in graphs.generate(prompts, params)]
    assert batched == [o.token_ids for o in eager.generate(prompts, params)]
    assert [graphs.generate(p, params)[0].token_ids for p in prompts[::6]] == batched[::6]  # alone = batched
    for llm in (graphs, eager):
        stats = llm.kv_cache_stats()
        assert stats["free_blocks"] == stats["total_blocks"]


def test_async_scheduling_gives_the_tokens_of_reading_each_step_back_first(tmp_path):
    """On CUDA each step is launched before the one in flight is read back, its input tokens fed on the device
    (into the captured graphs' buffers, or the eager packed step): same tokens as reading back first, through
    graphs and eager steps, EOS endings, seeded sampling and a tight KV cache that preempts."""
    engine = _cuda_engine(tmp_path, dtype="bfloat16", max_batch_size=24, max_num_tokens=64, max_seq_len=256,
                          kv_block_size=16)
    prompts = [[(7 * i + n) % 390 + 2 for i in range(n)] for n in range(3, 60, 3)]
    params = [SamplingParams(max_tokens=8 + i % 20, temperature=0, ignore_eos=i % 3 != 0) for i in range(len(prompts))]
    params[4] = SamplingParams(max_tokens=20, temperature=1.0, seed=5, logprobs=True)
    for graphs in (True, False):
        on = LLM(engine, num_kv_blocks=40, cuda_graphs=graphs)
        off = LLM(engine, num_kv_blocks=40, cuda_graphs=graphs, async_scheduling=False)
        assert on.engine.async_scheduling and not off.engine.async_scheduling
        fed = []
        execute = on.engine.executor.execute
        on.engine.executor.execute = lambda step, fed=fed, execute=execute: \
            fed.append(step.token_feed is not None) or execute(step)
        got = [(o.token_ids, o.finish_reason) for o in on.generate(prompts, params)]
        assert got == [(o.token_ids, o.finish_reason) for o in off.generate(prompts, params)]
        assert sum(fed) > 10 and on.kv_cache_stats()["num_preemptions"] > 0
        for llm in (on, off):
            stats = llm.kv_cache_stats()
            assert stats["free_blocks"] == stats["total_blocks"]
        del on, off
        gc.collect()


def test_prefill_graphs_give_the_eager_tokens(tmp_path):
    """A lone request's prefill steps replay a captured graph (its tokens padded to 16, 32 or 64, later chunks
    and prefix-cache hits at any start): the tokens of eager steps."""
    engine = _cuda_engine(tmp_path, dtype="bfloat16", max_batch_size=8, max_num_tokens=64, max_seq_len=256,
                          kv_block_size=16)
    graphs, eager = LLM(engine, num_kv_blocks=100), LLM(engine, num_kv_blocks=100, cuda_graphs=False)
    runner = graphs.engine.executor.runner
    assert runner.prefill_graphs.sizes == [16, 32, 64] and eager.engine.executor.runner.prefill_graphs is None
    replays = []
    run = runner.prefill_graphs.run
    runner.prefill_graphs.run = lambda batch, *rest: replays.append(len(batch)) or run(batch, *rest)
    params = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    prompts = [[(11 * i + n) % 390 + 2 for i in range(n)] for n in (2, 5, 17, 40, 64, 100, 130)]
    prompts.append(prompts[-1][:120] + [7, 8, 9])  # a prefix-cache hit: the graph starts at position 112
    for prompt in prompts:
        assert graphs.generate(prompt, params)[0].token_ids == eager.generate(prompt, params)[0].token_ids
    assert len(replays) >= len(prompts) + 3 and max(replays) == 64  # 100 and 130 tokens come in chunks
    assert graphs.kv_cache_stats()["prefix_cache_hit_tokens"] > 0


def test_memory_report_and_kv_cache_fraction(tmp_path):
    engine = _cuda_engine(tmp_path, dtype="bfloat16", max_seq_len=128)
    big = LLM(engine, kv_cache_memory_fraction=0.2)
    report = big.engine.memory_report
    assert report.weights_bytes > 0 and report.activation_bytes > 0 and report.graph_bytes >= 0
    assert report.kv_cache_bytes > 0 and report.sequences_at_max_len == report.num_kv_blocks // 8
    assert big.engine.graph_capture_seconds > 0
    blocks = report.num_kv_blocks
    del big
    gc.collect()
    torch.cuda.empty_cache()
    small = LLM(engine, kv_cache_memory_fraction=0.1)
    assert 0.4 < small.engine.runtime.num_kv_blocks / blocks < 0.6
    del small
    gc.collect()
    torch.cuda.empty_cache()
    from kiln.engine_format import EngineError

    with pytest.raises(EngineError, match="raise --kv-cache-memory-fraction"):
        LLM(engine, kv_cache_memory_fraction=1e-9)


def test_logits_outputs_on_cuda_graphs_and_async_scheduling(tmp_path):
    """Generation logits of decode steps come from the CUDA graphs' rows (copied for the asking requests only),
    context logits from eager prefills; with async scheduling on (CUDA's default) they equal the eager engine's,
    and the requests that ask for nothing get their usual tokens."""
    engine = _cuda_engine(tmp_path, dtype="float32", max_batch_size=8, max_num_tokens=64, max_seq_len=256,
                          kv_block_size=16)
    prompts = [[(7 * i + n) % 390 + 2 for i in range(n)] for n in (5, 30, 12)]
    asks = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True, return_context_logits=True,
                          return_generation_logits=True, return_perf_metrics=True)
    plain = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    params = [asks, plain, asks]
    graphs = LLM(engine, num_kv_blocks=64)
    eager = LLM(engine, num_kv_blocks=64, cuda_graphs=False, async_scheduling=False)
    assert graphs.engine.async_scheduling and graphs.engine.executor.runner.graphs is not None
    got, want = graphs.generate(prompts, params), eager.generate(prompts, params)
    for g, w, p in zip(got, want, params):
        assert g.token_ids == w.token_ids
        if p is asks:
            assert g.generation_logits.device.type == "cpu" and g.generation_logits.shape == (12, w.generation_logits.shape[1])
            torch.testing.assert_close(g.context_logits, w.context_logits, atol=1e-3, rtol=1e-3)
            torch.testing.assert_close(g.generation_logits, w.generation_logits, atol=1e-3, rtol=1e-3)
            m = g.perf_metrics
            assert m.arrival_time_ns <= m.first_scheduled_time_ns <= m.first_token_time_ns <= m.last_token_time_ns
        else:
            assert g.generation_logits is None and g.context_logits is None
    del graphs, eager
    gc.collect()
