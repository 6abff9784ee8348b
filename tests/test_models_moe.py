"""Mixture-of-experts models (Mixtral, Qwen2-MoE with its shared expert, Qwen3-MoE with dense and sparse layers
mixed): greedy tokens equal transformers' generate, in batches under tight limits; the engine holds every
expert; dummy-weight builds for benchmark shapes; refusals."""

from __future__ import annotations

import json
import math

import pytest
from model_factory import hf_greedy, make_checkpoint
from safetensors import safe_open

from kiln.builder.build import BuildError, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, SamplingParams

PROMPT_LENGTHS = (1, 5, 17, 40, 63)
NEW_TOKENS = 12

CASES = {
    # top-2 of 4, renormalized; every layer sparse
    "mixtral": ("MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # top-2 of 6 without renormalization, a sigmoid-gated shared expert; layer 1 dense (mlp_only_layers)
    "qwen2-moe-shared": ("Qwen2MoeForCausalLM", {"num_experts": 6, "num_experts_per_tok": 2,
                                                  "moe_intermediate_size": 32, "shared_expert_intermediate_size": 48,
                                                  "mlp_only_layers": [1], "norm_topk_prob": False}),
    # top-3 of 8 renormalized; 4 layers: layer 0 dense by mlp_only_layers, 2 dense by decoder_sparse_step=2
    "qwen3-moe-mixed": ("Qwen3MoeForCausalLM", {"num_experts": 8, "num_experts_per_tok": 3,
                                                 "moe_intermediate_size": 32, "num_hidden_layers": 4,
                                                 "decoder_sparse_step": 2, "mlp_only_layers": [0],
                                                 "norm_topk_prob": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers_in_tight_batches(tmp_path, case):
    architecture, overrides = CASES[case]
    checkpoint, hf_model = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    engine = build_engine(checkpoint, tmp_path / "engine",
                          BuildConfig(max_batch_size=4, max_num_tokens=32, max_seq_len=128), progress=False)
    # Chunked prefill (32 tokens a step), preemption (few blocks), at most 4 requests a step.
    llm = LLM(engine, num_kv_blocks=8)
    prompts = [[(7 * i + 3 * n) % 390 + 2 for i in range(n)] for n in PROMPT_LENGTHS]
    outputs = llm.generate(prompts * 2, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts * 2, outputs):
        assert out.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    stats = llm.kv_cache_stats()
    assert stats["free_blocks"] == stats["total_blocks"] and stats["num_preemptions"] > 0
    assert stats["prefix_cache_hit_tokens"] > 0  # the second copy of each prompt found the first one's blocks


def test_the_engine_holds_every_expert_fused(tmp_path):
    architecture, overrides = CASES["qwen2-moe-shared"]
    checkpoint, hf_model = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(), progress=False)
    with safe_open(str(engine / "rank0.safetensors"), "pt") as f:
        shapes = {name: tuple(f.get_slice(name).get_shape()) for name in f.keys()}
    assert shapes["model.layers.0.mlp.experts.gate_up.weight"] == (6, 64, 64)  # [E, 2I, H]
    assert shapes["model.layers.0.mlp.experts.down.weight"] == (6, 64, 32)  # [E, H, I]
    assert shapes["model.layers.0.mlp.shared_expert.gate_up_proj.weight"] == (96, 64)
    assert "model.layers.1.mlp.gate_up_proj.weight" in shapes  # the dense layer
    hf_params = sum(p.numel() for p in hf_model.parameters())
    assert sum(math.prod(s) for s in shapes.values()) == hf_params
    llm = LLM(engine, num_kv_blocks=8)
    assert llm.engine.memory_report.weights_bytes == 4 * hf_params  # float32: every expert is resident


def test_dummy_weight_builds_of_the_benchmark_configs_have_their_shapes(tmp_path):
    from pathlib import Path

    from kiln.builder.build import load_model_config

    configs = Path(__file__).resolve().parent.parent / "benchmarks" / "configs"
    _, mixtral = load_model_config(configs / "mixtral-8x7b")
    _, qwen3 = load_model_config(configs / "qwen3-30b-a3b")
    assert (mixtral.moe.num_experts, mixtral.moe.top_k, mixtral.moe.intermediate_size) == (8, 2, 14336)
    assert (qwen3.moe.num_experts, qwen3.moe.top_k, qwen3.moe.intermediate_size, qwen3.moe.renormalize) == \
        (128, 8, 768, True)
    # A dummy build of a shrunken Qwen3-MoE config runs end to end.
    small = json.loads((configs / "qwen3-30b-a3b" / "config.json").read_text())
    small.update(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                 moe_intermediate_size=16, intermediate_size=64, vocab_size=512, num_experts=16,
                 eos_token_id=1, bos_token_id=0)  # the real ids lie outside the shrunken vocabulary
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "config.json").write_text(json.dumps(small))
    engine = build_engine(tmp_path / "ckpt", tmp_path / "engine", BuildConfig(dummy_weights=True, dtype="float32"),
                          progress=False)
    out = LLM(engine, num_kv_blocks=8).generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
    assert len(out.token_ids) == 4


def test_moe_engines_refuse_what_they_cannot_do_yet(tmp_path):
    architecture, overrides = CASES["mixtral"]
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    with pytest.raises(BuildError, match="intermediate|not divisible by tp_size=3"):
        build_engine(checkpoint, tmp_path / "tp", BuildConfig(tp_size=3), progress=False)
    with pytest.raises((BuildError, ValueError), match="quantized MoE engines are not supported yet"):
        build_engine(checkpoint, tmp_path / "q", BuildConfig(qformat="int8_wo"), progress=False)
    bad = json.loads((checkpoint / "config.json").read_text())
    bad["num_experts_per_tok"] = 9
    (checkpoint / "config.json").write_text(json.dumps(bad))
    with pytest.raises((BuildError, ValueError), match="num_experts_per_tok=9 exceeds the 4 experts"):
        build_engine(checkpoint, tmp_path / "bad", BuildConfig(), progress=False)


@pytest.mark.parametrize("renormalize", [True, False])
def test_fused_moe_reference_equals_a_per_token_loop(renormalize):
    import torch
    import torch.nn.functional as F

    from kiln.plugins import fused_moe

    torch.manual_seed(0)
    tokens, hidden, inter, experts, top_k = 9, 16, 8, 6, 2
    x = torch.randn(tokens, hidden, dtype=torch.float64).float()
    w_gate_up = torch.randn(experts, 2 * inter, hidden) / 4
    w_down = torch.randn(experts, hidden, inter) / 4
    logits = torch.randn(tokens, experts)
    logits[:, 5] = -30.0  # expert 5 receives no token
    logits[3] = 0.0  # a router tie over all experts: torch.topk's order decides, in both
    out = fused_moe(x, logits, w_gate_up, w_down, top_k=top_k, renormalize=renormalize)
    expected = torch.zeros_like(x)
    for t in range(tokens):
        probs = torch.softmax(logits[t], dim=-1)
        weights, ids = torch.topk(probs, top_k)
        if renormalize:
            weights = weights / weights.sum()
        for w, e in zip(weights, ids.tolist()):
            gate, up = (w_gate_up[e] @ x[t]).chunk(2)
            expected[t] += w * (w_down[e] @ (F.silu(gate) * up))
    torch.testing.assert_close(out, expected, rtol=1e-5, atol=1e-5)
    # What the reference runs inside a CUDA-graph capture (no host read of the routing): every expert on
    # every token, weight 0 where not chosen — the same sums.
    from kiln.plugins.moe import _fused_moe_every_expert, route

    weights, ids = route(logits, top_k, renormalize, x.dtype)
    torch.testing.assert_close(_fused_moe_every_expert(x, weights, ids, w_gate_up, w_down), out,
                               rtol=1e-6, atol=1e-6)
