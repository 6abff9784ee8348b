"""DeepSeek-V2 / V3 (multi-head latent attention, DeepSeek-MoE) against transformers: tiny random checkpoints
with several expert groups, a dense first layer, q_lora_rank null (V2-Lite) and set, YaRN with mscale, V3's
correction bias and both rope layouts. kiln's greedy tokens equal transformers' and its prompt logprobs match
within float32 tolerance, under in-flight batching with chunked prefill and preemption, at TP=2 over gloo
(long chunks through the explicit prefill on both ranks); the absorbed attention equals the explicit form; the
KV cache holds one latent per token and layer."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
import transformers
from mla_probe import record_explicit_prefill
from model_factory import (
    BASE,
    build_case,
    hf_greedy,
    hf_prompt_logprobs,
    randomized_checkpoint,
)

from kiln.builder.build import BuildError, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.model_defs import ModelConfigError, get_model_def
from kiln.runtime import LLM, SamplingParams

PROMPTS = [[(7 * i + 3 * n) % 390 + 2 for i in range(n)] for n in (1, 5, 17, 70)]
NEW_TOKENS = 10
LIMITS = dict(max_batch_size=8, max_num_tokens=128, max_seq_len=128)

MLA = dict(num_key_value_heads=4, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=12,
           moe_intermediate_size=16, n_routed_experts=8, first_k_dense_replace=1, num_hidden_layers=3)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 0.8}

CASES = {
    # V2-Lite's shape: q_proj (no q low rank), greedy softmax top-2, two shared experts
    "v2-lite": ("DeepseekV2ForCausalLM", dict(MLA, q_lora_rank=None, topk_method="greedy", num_experts_per_tok=2,
                                              n_shared_experts=2)),
    # V2: q low rank, group-limited greedy (2 of 4 groups), scaled weights, YaRN past its 32-token context
    "v2-grouped-yarn": ("DeepseekV2ForCausalLM", dict(MLA, q_lora_rank=24, topk_method="group_limited_greedy",
                                                      n_group=4, topk_group=2, num_experts_per_tok=3,
                                                      n_shared_experts=1, routed_scaling_factor=2.0,
                                                      rope_parameters=YARN)),
    # V3: sigmoid scores + correction bias, groups by their two best, normalized and scaled; interleaved rope
    # (reordered at build, the biases' rope rows too)
    "v3": ("DeepseekV3ForCausalLM", dict(MLA, q_lora_rank=24, n_group=4, topk_group=2, num_experts_per_tok=3,
                                         n_shared_experts=1, norm_topk_prob=True, routed_scaling_factor=2.5,
                                         num_nextn_predict_layers=1, attention_bias=True)),
    "v3-yarn-no-interleave": ("DeepseekV3ForCausalLM", dict(MLA, q_lora_rank=24, n_group=2, topk_group=1,
                                                            num_experts_per_tok=2, n_shared_experts=1,
                                                            rope_interleave=False, rope_parameters=YARN)),
}


def make_checkpoint(path: Path, architecture: str, **overrides) -> tuple[Path, transformers.PreTrainedModel]:
    """A tiny checkpoint with every 1-d tensor randomized (norm weights near 1, V3's e_score_correction_bias
    large enough to change the choice): transformers starts them at 1 and 0, which would hide a misread."""
    path, model = randomized_checkpoint(path, architecture, **overrides)
    with torch.no_grad():
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn_like(buffer))
    model.save_pretrained(path)
    return path, model


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return build_case(request.param, CASES, tmp_path_factory, LIMITS, make_checkpoint)


def test_greedy_tokens_and_prompt_logprobs_match_transformers(case):
    _, _, engine, model = case
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=True)
    with LLM(engine) as llm:
        outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
        assert out.prompt_logprobs[1:] == pytest.approx(hf_prompt_logprobs(model, prompt), abs=1e-4)


def test_in_flight_batching_chunked_prefill_and_preemption_match_transformers(case):
    """A 16-token step budget cuts the long prompts into chunks, four sequences at a time; few blocks force
    preemption; the second copy of each prompt reads the first one's cached latents."""
    _, _, engine, model = case
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    with LLM(engine, max_num_tokens=16, max_batch_size=4, num_kv_blocks=6) as llm:
        outputs = llm.generate(PROMPTS[::-1] * 2, params * 2)
        stats = llm.kv_cache_stats()
    for prompt, p, out in zip(PROMPTS[::-1] * 2, params * 2, outputs):
        assert out.token_ids == hf_greedy(model, prompt, p.max_tokens), f"prompt of {len(prompt)} tokens"
    assert stats["free_blocks"] == stats["total_blocks"]
    assert stats["num_preemptions"] > 0 and stats["prefix_cache_hit_tokens"] > 0


@pytest.mark.parametrize("name", ["v2-lite", "v3"])
def test_tp2_matches_transformers(tmp_path, monkeypatch, name):
    """Heads split over two ranks (q, kv_b_proj by whole heads, o_proj by rows), the latent and its cache
    replicated; the routed and shared experts split by intermediate features. Short chunks (absorbed), then
    long ones (the explicit prefill) on both ranks."""
    architecture, overrides = CASES[name]
    checkpoint, model = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    engine = build_engine(checkpoint, tmp_path / "tp2", BuildConfig(tp_size=2, **LIMITS), progress=False)
    from kiln.commands.build_summary import engine_summary

    assert "KV cache 288 bytes/token per rank (the MLA latent, whole on every rank" in engine_summary(engine)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=True)
    with LLM(engine, max_num_tokens=16) as llm:
        outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
        assert out.prompt_logprobs[1:] == pytest.approx(hf_prompt_logprobs(model, prompt), abs=1e-4)
    check_explicit_prefill(engine, model, 2, monkeypatch, tmp_path)


def _assert_logprobs_within_1e4(got: list[list[float]], want: list[list[float]]) -> None:
    for g, w in zip(got, want, strict=True):
        assert g == pytest.approx(w, abs=1e-4)


def check_explicit_prefill(engine: Path, model, tp_size: int, monkeypatch, tmp_path: Path,
                           assert_logprobs_close=_assert_logprobs_within_1e4) -> None:
    """MLA's explicit prefill (mla_split.py: a sequence of >= 32 queries in an eager step) on every rank: a
    48-token prompt in one step; then, beside a short prompt's prefill and then its decode row, a prompt whose
    first 32 tokens are prefix-cached, in chunks of 43 and 37 queries (a 48-token step budget). Greedy tokens
    equal transformers' (`model`), the generated tokens' logprobs are close to its; each of the `tp_size` ranks
    took the explicit path in exactly those steps, in every layer."""
    calls = record_explicit_prefill(monkeypatch, tmp_path)  # before the LLM starts its worker ranks
    first = [(13 * i + 5) % 390 + 2 for i in range(48)]
    cached = first[:32] + [(5 * i + 1) % 390 + 2 for i in range(80)]
    prompts, new_tokens = [first, PROMPTS[1], cached], 4
    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True, logprobs=True)
    with LLM(engine, max_num_tokens=48) as llm:
        outputs = llm.generate(prompts[:1], params) + llm.generate(prompts[1:], params)
    assert [o.num_cached_tokens for o in outputs] == [0, 0, 32]
    for prompt, out in zip(prompts, outputs):
        assert out.token_ids == hf_greedy(model, prompt, new_tokens), f"prompt of {len(prompt)} tokens"
    assert_logprobs_close([o.logprobs for o in outputs],
                          [hf_prompt_logprobs(model, p + o.token_ids)[len(p) - 1:] for p, o in zip(prompts, outputs)])
    layers = model.config.num_hidden_layers  # (queries, keys, absorbed rows beside) per explicit sequence
    steps = [((48,), (48,), False), ((43,), (75,), True), ((37,), (112,), True)]
    assert calls() == [[step for step in steps for _ in range(layers)]] * tp_size


def _tiny_mla_model(q_lora_rank: int, tp_heads: int = 4):
    """A V3-shaped network (random float32 weights) and its MLAttention of layer 0."""
    from kiln.model_defs import build_network

    architecture, overrides = CASES["v3"]
    raw = {**BASE, **overrides, "q_lora_rank": q_lora_rank or None, "architectures": [architecture]}
    model_def = get_model_def(architecture)
    config = model_def.parse_config(raw)
    torch.manual_seed(1)
    net = build_network(model_def, config, dtype=torch.float32)
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(torch.randn_like(p) * 0.3)
    return config, net


@pytest.mark.parametrize("q_lora_rank", [0, 24])
@torch.no_grad()
def test_absorbed_attention_equals_the_explicit_form(q_lora_rank):
    """Three sequences in one step: a decode token over 21 cached tokens, a 6-token chunk after 9 cached, a
    fresh 4-token prompt. The engine's absorbed path (queries taken into latent space, attention over the
    latent cache, W_UV after) equals k and v up-projected per head from the same cache."""
    from kiln.model_defs.layers import ForwardContext
    from kiln.runtime.worker.kv_cache import KVCache

    config, net = _tiny_mla_model(q_lora_rank)
    attn = net.model.layers[0].self_attn
    net.setup_rotary(64, "cpu")
    block_size, cached, new = 4, (21, 9, 0), (1, 6, 4)
    cache = KVCache(config, 32, block_size, torch.float32, torch.device("cpu"))
    tables = torch.tensor([[0, 1, 2, 3, 4, 5], [8, 9, 10, 11, 12, 13], [20, 21, 22, 23, 24, 25]], dtype=torch.int32)
    seq_lens = [c + n for c, n in zip(cached, new)]
    # fill the cached prefixes as earlier steps would have: run the layer over them first
    positions, slots = [], []
    for s, (c, n) in enumerate(zip(cached, new)):
        for p in range(c, c + n):
            positions.append(p)
            slots.append(int(tables[s, p // block_size]) * block_size + p % block_size)
    for s, c in enumerate(cached):
        if c:
            prefix_slots = [int(tables[s, p // block_size]) * block_size + p % block_size for p in range(c)]
            ctx = ForwardContext(torch.arange(c), torch.arange(c) + 1, torch.tensor(prefix_slots),
                                 tables[s:s + 1], torch.tensor([c], dtype=torch.int32),
                                 torch.tensor([0, c], dtype=torch.int32), cache.layers)
            cos, sin = net.rotary.lookup(ctx.positions, ctx.rope_lengths, c)
            attn(torch.randn(c, config.hidden_size), ctx, cos, sin)
    x = torch.randn(sum(new), config.hidden_size)
    pos = torch.tensor(positions)
    starts = torch.tensor([0, 1, 7, 11], dtype=torch.int32)
    ctx = ForwardContext(pos, pos + 1, torch.tensor(slots), tables, torch.tensor(seq_lens, dtype=torch.int32),
                         starts, cache.layers)
    cos, sin = net.rotary.lookup(pos, pos + 1, max(seq_lens))
    absorbed = attn(x, ctx, cos, sin)  # [T, H] after o_proj
    q_nope, q_pe, _ = attn.project(x, cos, sin)
    explicit = torch.cat([attn.explicit_attention(q_nope[a:b], q_pe[a:b], cache.layers[0][0], tables[s], seq_lens[s])
                          for s, (a, b) in enumerate(zip(starts[:-1].tolist(), starts[1:].tolist()))])
    explicit = attn.o_proj(explicit.reshape(x.shape[0], -1))
    torch.testing.assert_close(absorbed, explicit, rtol=1e-4, atol=1e-4)


def test_the_kv_cache_holds_one_latent_per_token_and_layer():
    from kiln.engine_format import Mapping
    from kiln.runtime.worker.kv_cache import KVCache, rank_cache_config

    config, _ = _tiny_mla_model(24)
    latent = config.mla.kv_lora_rank + config.mla.qk_rope_head_dim  # 16 + 8
    assert KVCache.bytes_per_token(config, torch.bfloat16) == config.num_layers * latent * 2
    assert KVCache.bytes_per_block(config, 16, torch.float32) == 16 * config.num_layers * latent * 4
    cache = KVCache(config, 5, 16, torch.bfloat16, torch.device("cpu"))
    assert cache.storage.shape == (config.num_layers, 1, 5, 16, 1, latent)
    assert cache.nbytes == 5 * KVCache.bytes_per_block(config, 16, torch.bfloat16)
    k, v = cache.layers[1]
    assert k.data_ptr() == v.data_ptr() and k.shape == (5, 16, 1, latent)
    # every tensor-parallel rank holds the whole latent (replicated), not a share of heads
    rank = rank_cache_config(config, Mapping(tp_size=2, tp_rank=1))
    assert KVCache.bytes_per_token(rank, torch.bfloat16) == KVCache.bytes_per_token(config, torch.bfloat16)
    # a dense model of the same width caches 2 * heads * head_dim per layer
    dense = dataclasses.replace(config, mla=None, head_dim=16)
    assert KVCache.bytes_per_token(dense, torch.bfloat16) == config.num_layers * 2 * 4 * 16 * 2
    with pytest.raises(ValueError, match="not supported with multi-head latent attention"):
        KVCache(config, 5, 16, torch.float8_e4m3fn, torch.device("cpu"), [(1.0, 1.0)] * config.num_layers)


def test_mtp_layers_are_left_unread_and_the_config_is_read(tmp_path):
    """V3's multi-token-prediction layer (checkpoint layer num_hidden_layers) is not part of the engine."""
    from safetensors import safe_open
    from safetensors.torch import load_file, save_file

    from kiln.engine_format import load_engine_spec

    architecture, overrides = CASES["v3"]
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    tensors = load_file(checkpoint / "model.safetensors")
    mtp = overrides["num_hidden_layers"]
    tensors[f"model.layers.{mtp}.eh_proj.weight"] = torch.zeros(64, 128)
    tensors[f"model.layers.{mtp}.self_attn.kv_b_proj.weight"] = torch.zeros(80, 16)
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(**LIMITS), progress=False)
    with safe_open(str(engine / "rank0.safetensors"), "pt") as f:
        names = set(f.keys())
    assert not any(n.startswith(f"model.layers.{mtp}.") for n in names)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in names
    config = load_engine_spec(engine).model_config
    assert config["mla"] == {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_head_dim": 8, "qk_rope_head_dim": 8,
                             "v_head_dim": 12, "rope_interleave": True, "fp8_block_size": None}
    assert config["moe"]["sparse_layers"] == [False, True, True]
    assert config["moe"]["routing"] == {"scoring": "sigmoid", "topk_method": "noaux_tc", "n_group": 4,
                                        "topk_group": 2, "routed_scaling_factor": 2.5, "norm_topk_prob": True}
    assert config["moe"]["shared_expert_intermediate_size"] == 16
    from kiln.commands.build_summary import engine_summary

    assert "KV cache 288 bytes/token" in engine_summary(engine)  # 3 layers x (16 + 8) values x 4 bytes


def test_what_is_not_done_is_refused_by_name(tmp_path):
    architecture, overrides = CASES["v2-lite"]
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    with pytest.raises((ValueError, RuntimeError), match="quantized"):
        build_engine(checkpoint, tmp_path / "q", BuildConfig(qformat="int8_wo"), progress=False)
    with pytest.raises(BuildError, match="--kv-cache-dtype fp8 is not supported with multi-head latent attention"):
        build_engine(checkpoint, tmp_path / "fp8kv", BuildConfig(kv_cache_dtype="fp8"), progress=False)
    raw = {**BASE, **overrides, "architectures": [architecture]}
    with pytest.raises(ModelConfigError, match="topk_method='noaux_tc' is V3's"):
        get_model_def(architecture).parse_config({**raw, "topk_method": "noaux_tc"})
    with pytest.raises(ModelConfigError, match="n_routed_experts=8 is not a multiple of n_group=3"):
        get_model_def(architecture).parse_config({**raw, "topk_method": "group_limited_greedy", "n_group": 3})
    with pytest.raises(ModelConfigError, match="pre-quantized checkpoints \\(fp8, no weight_block_size\\) are not "
                                               "supported with MLA"):
        get_model_def(architecture).parse_config({**raw, "quantization_config": {"quant_method": "fp8"}})


def test_dummy_weight_build_of_the_benchmark_config(tmp_path):
    """benchmarks/configs/deepseek-v2-lite has V2-Lite's shapes; shrunken, its dummy build runs end to end."""
    import json

    from kiln.builder.build import load_model_config
    from kiln.runtime.worker.kv_cache import KVCache

    configs = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"
    _, lite = load_model_config(configs / "deepseek-v2-lite")
    assert (lite.mla.kv_lora_rank, lite.mla.qk_rope_head_dim, lite.mla.q_lora_rank) == (512, 64, 0)
    assert (lite.moe.num_experts, lite.moe.top_k, lite.moe.shared_expert_intermediate_size) == (64, 6, 2 * 1408)
    assert KVCache.bytes_per_token(lite, torch.bfloat16) == 27 * 576 * 2  # 31,104 bytes
    small = json.loads((configs / "deepseek-v2-lite" / "config.json").read_text())
    small.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=16, v_head_dim=16, moe_intermediate_size=16,
                 intermediate_size=64, vocab_size=512, n_routed_experts=8, num_experts_per_tok=2,
                 eos_token_id=1, bos_token_id=0)
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(small))
    engine = build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildConfig(dummy_weights=True, dtype="float32"),
                          progress=False)
    out = LLM(engine, num_kv_blocks=8).generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_ngram_speculation_gives_the_tokens_of_plain_decoding(tmp_path):
    """Verified drafts run several query tokens per sequence through the latent cache (rejected ones rolled
    back); repetitive prompts make the n-gram proposer draft."""
    from kiln.runtime.speculative import SpeculativeConfig

    architecture, overrides = CASES["v3"]
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(**LIMITS), progress=False)
    prompts = [[5, 6, 7, 8] * 6, [9, 10, 11] * 9 + [12], PROMPTS[2]]
    params = SamplingParams(max_tokens=16, temperature=0, ignore_eos=True)
    with LLM(engine) as llm:
        plain = [o.token_ids for o in llm.generate(prompts, params)]
    with LLM(engine, speculative_config=SpeculativeConfig("ngram", 3, ngram_min=1, ngram_max=3)) as llm:
        assert [o.token_ids for o in llm.generate(prompts, params)] == plain
        assert llm.speculation_stats()["num_drafts"] > 0


def test_evicted_latents_come_back_from_the_host_tier(case):
    """The host KV tier copies MLA's one-plane latent blocks out and back: prompts run one at a time through 6
    device blocks, then again, read from the host."""
    _, _, engine, model = case
    params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    prompts = [[(11 * i + 5 * n) % 390 + 2 for i in range(n)] for n in (40, 45, 50)]
    with LLM(engine, num_kv_blocks=6, kv_offloading_size=1 / 1024) as llm:
        first = [llm.generate(p, params)[0] for p in prompts]
        again = [llm.generate(p, params)[0] for p in prompts]
        stats = llm.kv_cache_stats()
    for prompt, a, b in zip(prompts, first, again):
        assert a.token_ids == b.token_ids == hf_greedy(model, prompt, 6)
    assert stats["host_tier_hits"] > 0 and sum(o.metrics.num_cached_tokens_host for o in again) > 0
