"""Tensor-parallel engines on the CPU: two processes over gloo give the tokens of one (float32).

Each TP engine here starts a second process (rank 1), so the engines are shared per module.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from model_factory import make_checkpoint

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.engine_format import EngineError
from kiln.runtime import LLM, SamplingParams

PROMPTS = [[5, 17, 42, 9, 3], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [100, 200], list(range(20, 60))]
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)

# name -> (architecture, checkpoint overrides, build options)
VARIANTS = {
    "llama-gqa": ("LlamaForCausalLM", {}, {}),
    "llama-kv1-replicated": ("LlamaForCausalLM", {"num_key_value_heads": 1}, {}),
    "llama-tied-biases": ("LlamaForCausalLM", {"tie_word_embeddings": True, "attention_bias": True,
                                               "mlp_bias": True}, {}),
    "qwen2-biases": ("Qwen2ForCausalLM", {"tie_word_embeddings": False}, {}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {"head_dim": 16}, {}),
    "llama-int4-wo": ("LlamaForCausalLM", {}, {"qformat": "int4_wo", "awq_block_size": 32}),
    # FP8 linears fed by the fused norm / SiLU quantization; AWQ's per-part smoothing as one product of parts
    "llama-fp8-dummy": ("LlamaForCausalLM", {}, {"qformat": "fp8", "dummy_weights": True}),
    "llama-int4-awq-dummy": ("LlamaForCausalLM", {}, {"qformat": "int4_awq", "awq_block_size": 32,
                                                      "dummy_weights": True}),
    # experts split by intermediate features, the shared expert column/row, a dense layer among sparse ones
    "qwen2-moe-shared-expert": ("Qwen2MoeForCausalLM", {"num_experts": 4, "num_experts_per_tok": 2,
                                                         "moe_intermediate_size": 32,
                                                         "shared_expert_intermediate_size": 48,
                                                         "mlp_only_layers": [1]}, {}),
}


def build_pair(tmp: Path, architecture: str, overrides: dict, options: dict) -> tuple[Path, Path]:
    """(tp1 engine, tp2 engine) of one tiny checkpoint."""
    checkpoint, _ = make_checkpoint(tmp / "ckpt", architecture, **overrides)
    engines = []
    for tp in (1, 2):
        engines.append(build_engine(checkpoint, tmp / f"tp{tp}", BuildConfig(tp_size=tp, **options), progress=False))
    return engines[0], engines[1]


def generate(engine: Path, prompts, params, **options):
    with LLM(engine, **options) as llm:
        outs = llm.generate(prompts, params)
        stats = llm.kv_cache_stats()
    return outs, stats


@pytest.fixture(scope="module")
def llama_pair(tmp_path_factory):
    return build_pair(tmp_path_factory.mktemp("tp-llama"), *VARIANTS["llama-gqa"])


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_tp2_greedy_tokens_equal_tp1(tmp_path, variant):
    tp1, tp2 = build_pair(tmp_path, *VARIANTS[variant])
    expected, _ = generate(tp1, PROMPTS, GREEDY)
    got, stats = generate(tp2, PROMPTS, GREEDY)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert stats["free_blocks"] == stats["total_blocks"]


def test_tp2_scheduling_features_equal_tp1(llama_pair):
    """Chunked prefill (8-token budget), preemption (few KV blocks), the prefix cache (shared prefixes) and
    in-flight batching (requests of different lengths join and leave) give TP=1's tokens."""
    tp1, tp2 = llama_pair
    shared = list(range(30, 62))
    prompts = [shared + [1 + i, 2 + i] for i in range(4)] + PROMPTS
    params = [SamplingParams(max_tokens=20 + 6 * i, temperature=0.0, ignore_eos=True) for i in range(len(prompts))]
    options = dict(max_num_tokens=8, num_kv_blocks=10, max_batch_size=4)
    expected, _ = generate(tp1, prompts, params, **options)
    with LLM(tp2, **options) as llm:
        got = llm.generate(prompts, params)
        stats = llm.kv_cache_stats()
        preemptions = llm.engine.num_preemptions
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert preemptions > 0
    assert stats["free_blocks"] == stats["total_blocks"] == 10


def test_tp2_host_tier_gives_tp1_tokens(llama_pair, tmp_path):
    """Each rank copies its own shard of an evicted prefix to its host tier and back (kv_offloading_size is the
    total over ranks); the disk tier is refused at tp_size 2, naming both options."""
    tp1, tp2 = llama_pair
    prompts = [[k] + list(range(30 + k, 62 + k)) for k in range(6)] * 2  # 2 blocks each, evicted and repeated
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    expected, _ = generate(tp1, prompts, params)
    with LLM(tp2, num_kv_blocks=10, max_batch_size=2, kv_offloading_size=0.01) as llm:
        got = [llm.generate(p, params)[0] for p in prompts]  # one at a time: each evicts the ones before
        stats = llm.kv_cache_stats()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert stats["host_tier_hits"] > 0 and any(o.metrics.num_cached_tokens_host for o in got[6:])
    assert stats["free_blocks"] == stats["total_blocks"] == 10
    with pytest.raises(ValueError, match="kv-offloading-dir.*tensor-parallel.*kv-offloading-size"):
        LLM(tp2, kv_offloading_size=0.01, kv_offloading_dir=str(tmp_path / "kv"))


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
def test_tp2_target_with_speculative_decoding_gives_tp1_tokens(llama_pair, method):
    """Speculation over a TP=2 target: the verify steps (1 + K rows a request) reach rank 1 like any step, and
    rejected slots are given back on both ranks. The draft is the TP=1 engine of the same checkpoint."""
    tp1, tp2 = llama_pair
    prompts = PROMPTS + [[3, 4, 5, 3, 4, 5, 3, 4, 5, 3, 4]]  # repeats for n-gram lookup
    spec = {"method": method, "num_speculative_tokens": 3}
    if method == "draft_model":
        spec["model"] = str(tp1)
    expected, _ = generate(tp1, prompts, GREEDY)
    with LLM(tp2, speculative_config=spec) as llm:
        got = llm.generate(prompts, GREEDY)
        stats = llm.kv_cache_stats()
        speculation = llm.speculation_stats()
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    assert speculation["num_draft_tokens"] > 0 and speculation["num_accepted_tokens"] > 0
    assert stats["free_blocks"] == stats["total_blocks"]


def test_tp2_seeded_sampling_and_logprobs_equal_tp1(llama_pair):
    tp1, tp2 = llama_pair
    params = [SamplingParams(max_tokens=10, temperature=0.8, top_p=0.9, seed=7 + i, logprobs=True, ignore_eos=True)
              for i in range(len(PROMPTS))]
    expected, _ = generate(tp1, PROMPTS, params)
    got, _ = generate(tp2, PROMPTS, params)
    assert [o.token_ids for o in got] == [o.token_ids for o in expected]
    for g, e in zip(got, expected):
        assert torch.allclose(torch.tensor(g.logprobs), torch.tensor(e.logprobs), atol=1e-4)


def test_tp2_context_and_generation_logits_equal_tp1(llama_pair):
    """Context logits come from every rank's gather of the prompt rows (their targets travel with the step), in
    chunks of 8 tokens, beside requests that ask for nothing."""
    tp1, tp2 = llama_pair
    asks = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, return_context_logits=True,
                          return_generation_logits=True)
    params = [asks if i % 2 == 0 else GREEDY for i in range(len(PROMPTS))]
    expected, _ = generate(tp1, PROMPTS, params, max_num_tokens=8)
    got, _ = generate(tp2, PROMPTS, params, max_num_tokens=8)
    for g, e, p in zip(got, expected, params):
        assert g.token_ids == e.token_ids
        if p is asks:
            assert g.context_logits.shape[0] == len(g.prompt_token_ids)
            torch.testing.assert_close(g.context_logits, e.context_logits, atol=1e-4, rtol=0)
            torch.testing.assert_close(g.generation_logits, e.generation_logits, atol=1e-4, rtol=0)
        else:
            assert g.context_logits is None and g.generation_logits is None


def test_tp2_memory_report_is_per_rank(llama_pair):
    tp1, tp2 = llama_pair
    with LLM(tp1) as one, LLM(tp2) as two:
        r1, r2 = one.engine.memory_report, two.engine.memory_report
    assert r2.tp_size == 2 and "per rank of 2" in r2.summary()
    assert r2.kv_bytes_per_token * 2 == r1.kv_bytes_per_token
    assert r2.weights_bytes < r1.weights_bytes


def test_rank_that_fails_to_start_is_named(tmp_path, llama_pair):
    """A rank whose weights cannot be read: the engine fails at startup naming rank 1 and the cause."""
    import shutil

    _, tp2 = llama_pair
    broken = tmp_path / "broken"
    shutil.copytree(tp2, broken)
    data = bytearray((broken / "rank1.safetensors").read_bytes())
    data[8:16] = b"{{{{{{{{"  # the JSON header, same size: only reading the file finds it
    (broken / "rank1.safetensors").write_bytes(bytes(data))
    with pytest.raises(EngineError, match=r"rank 1 failed: EngineError: cannot read .*rank1\.safetensors"):
        LLM(broken, verify_checksums=False)


def test_torchrun_launch_serves_from_rank0(tmp_path, llama_pair):
    """Under torchrun each process runs the same program; rank 0 generates, rank 1 only runs steps and exits."""
    tp1, tp2 = llama_pair
    script = tmp_path / "run.py"
    script.write_text(
        "import json, os, sys\n"
        "from kiln.runtime import LLM, SamplingParams\n"
        f"llm = LLM({str(tp2)!r})\n"
        f"outs = llm.generate({PROMPTS!r}, SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True))\n"
        "print('TOKENS', json.dumps([o.token_ids for o in outs]), flush=True)\n"
        "llm.shutdown()\n")
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    from kiln.runtime.distributed.launch import local_launch

    port = local_launch(2).master_port  # a free port
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port",
                           str(port), str(script)], capture_output=True, text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    lines = [line for line in proc.stdout.splitlines() if line.startswith("TOKENS")]
    assert len(lines) == 1  # rank 1 printed nothing: it never returned from LLM()
    expected, _ = generate(tp1, PROMPTS, GREEDY)
    assert json.loads(lines[0].removeprefix("TOKENS ")) == [o.token_ids for o in expected]


def test_launcher_with_the_wrong_world_size_is_refused(llama_pair, monkeypatch):
    _, tp2 = llama_pair
    for name, value in dict(RANK="0", WORLD_SIZE="3", MASTER_ADDR="127.0.0.1", MASTER_PORT="29999",
                            LOCAL_RANK="0").items():
        monkeypatch.setenv(name, value)
    with pytest.raises(EngineError, match=r"tp_size=2 ranks but the launcher started WORLD_SIZE=3"):
        LLM(tp2)


def test_tp_engine_on_cuda_without_enough_gpus_says_how_many(llama_pair):
    from kiln.runtime.distributed.launch import RankLaunch, rank_device

    launch = RankLaunch(0, 2, "127.0.0.1", 1, 1, 2, external=False)
    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        pytest.skip("two GPUs are visible")
    with pytest.raises(EngineError, match=r"needs 2 GPUs on this machine, but \d+ (is|are) visible"):
        rank_device(torch.device("cuda"), launch, "engine")


@pytest.mark.parametrize("tp_size", [1, 2])
def test_dummy_engine_without_weight_files_draws_them_at_load(tmp_path, tp_size):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", "LlamaForCausalLM", tokenizer=False)
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(dummy_weights=True, weights_at_load=True,
                                                                        tp_size=tp_size), progress=False)
    assert not list(engine.glob("*.safetensors"))
    with LLM(engine) as llm:
        (out,) = llm.generate([[3, 4, 5]], GREEDY)
        report = llm.engine.memory_report
    assert len(out.token_ids) == GREEDY.max_tokens
    assert report.dummy_weights_at_load and "(dummy, drawn at load)" in report.summary()
    with pytest.raises(ValueError, match=r"--no-weight-files\) needs dummy_weights \(--dummy-weights\)"):
        BuildConfig(weights_at_load=True)
