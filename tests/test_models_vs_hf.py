"""Greedy tokens from kiln equal transformers' generate, for every architecture and its variants."""

from __future__ import annotations

import pytest
from model_factory import hf_greedy, make_checkpoint

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, SamplingParams

PROMPT_LENGTHS = (1, 5, 17, 40)
NEW_TOKENS = 12

CASES = {
    "llama-gqa": ("LlamaForCausalLM", {}),
    "llama-tied": ("LlamaForCausalLM", {"tie_word_embeddings": True}),
    "llama-mha-head-dim": ("LlamaForCausalLM", {"num_key_value_heads": 4, "head_dim": 32}),
    "llama-bias": ("LlamaForCausalLM", {"attention_bias": True, "mlp_bias": True}),
    "llama3-rope": ("LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 16}}),
    "llama-linear-rope": ("LlamaForCausalLM", {"rope_parameters": {
        "rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    # max_position_embeddings 24 < longest prompt: dynamic NTK really rescales.
    "llama-dynamic-rope": ("LlamaForCausalLM", {"max_position_embeddings": 24, "rope_parameters": {
        "rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}),
    "mistral-sliding-window": ("MistralForCausalLM", {"sliding_window": 8}),
    "qwen2-bias": ("Qwen2ForCausalLM", {}),
    "qwen2-sliding-upper-layers": ("Qwen2ForCausalLM", {"use_sliding_window": True, "sliding_window": 6,
                                                        "max_window_layers": 1}),
    "qwen3-qk-norm": ("Qwen3ForCausalLM", {}),
    "qwen3-tied-bias": ("Qwen3ForCausalLM", {"tie_word_embeddings": True, "attention_bias": True}),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_matches_transformers(tmp_path, case):
    architecture, overrides = CASES[case]
    checkpoint, hf_model = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    engine = build_engine(checkpoint, tmp_path / "engine",
                          BuildConfig(max_batch_size=8, max_num_tokens=64, max_seq_len=128), progress=False)
    llm = LLM(engine)
    prompts = [[(7 * i + 3 * n) % 390 + 2 for i in range(n)] for n in PROMPT_LENGTHS]
    outputs = llm.generate(prompts, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(prompts, outputs):
        # Fresh model state per prompt: dynamic rope caches its frequencies across calls in transformers.
        if case == "llama-dynamic-rope":
            _, hf_model = make_checkpoint(tmp_path / "ckpt", architecture, tokenizer=False, **overrides)
        assert out.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    assert llm.kv_cache_stats()["free_blocks"] == llm.kv_cache_stats()["total_blocks"]
