"""The newer model families with the rest of kiln (issue 37 item 6, GPT-OSS and DeepSeek: issue 38): speculative
decoding (a draft model that verifies in multi-token steps) keeps transformers' greedy tokens, and guided decoding
constrains the output, on each family's tiny random checkpoint (the families' own files check their parity with
transformers in depth)."""

from __future__ import annotations

import pytest
from model_factory import hf_greedy, make_checkpoint

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.runtime import LLM, GuidedDecoding, SamplingParams

FAMILIES = {
    "starcoder2": ("Starcoder2ForCausalLM", {"sliding_window": 8}),
    "olmo2": ("Olmo2ForCausalLM", {}),
    "granite": ("GraniteForCausalLM", {"embedding_multiplier": 2.0, "residual_multiplier": 0.5,
                                       "attention_multiplier": 0.2, "logits_scaling": 2.0}),
    "smollm3": ("SmolLM3ForCausalLM", {"no_rope_layer_interval": 2}),
    "gemma2": ("Gemma2ForCausalLM", {"head_dim": 16, "sliding_window": 8, "attn_logit_softcapping": 5.0,
                                     "final_logit_softcapping": 3.0, "query_pre_attn_scalar": 16}),
    "gemma3": ("Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 8, "query_pre_attn_scalar": 16}),
    "phi3": ("Phi3ForCausalLM", {"sliding_window": 8}),
    "deepseek-v2": ("DeepseekV2ForCausalLM", {"num_key_value_heads": 4, "kv_lora_rank": 16, "q_lora_rank": None,
                                              "qk_nope_head_dim": 8, "qk_rope_head_dim": 8, "v_head_dim": 12,
                                              "n_routed_experts": 4, "num_experts_per_tok": 2,
                                              "moe_intermediate_size": 16, "n_shared_experts": 1,
                                              "first_k_dense_replace": 1, "topk_method": "greedy"}),
}
PROMPTS = [[5, 17, 42, 9, 3, 5, 17, 42], list(range(20, 45)), [100, 200, 100, 200, 100]]
NEW_TOKENS = 10


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_speculation_and_guided_decoding(tmp_path, name):
    architecture, overrides = FAMILIES[name]
    # pad_token_id None: some families' defaults (Phi-3's 32000, SmolLM3's 128004) lie past the tiny vocabulary
    checkpoint, model = make_checkpoint(tmp_path / "ckpt", architecture, pad_token_id=None, **overrides)
    check_speculation_and_guidance(checkpoint, model, tmp_path)


def test_gpt_oss_speculation_and_guided_decoding(tmp_path):
    """GPT-OSS (issue 38 item 3): sinks, alternating windows and biased experts over multi-token verify steps."""
    from test_models_gpt_oss import make_checkpoint as make_gpt_oss

    checkpoint, model = make_gpt_oss(tmp_path / "ckpt")
    check_speculation_and_guidance(checkpoint, model, tmp_path)


def check_speculation_and_guidance(checkpoint, model, tmp_path) -> None:
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(dtype="float32", max_batch_size=4,
                                                                       max_num_tokens=64, max_seq_len=128),
                          progress=False)
    greedy = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    # The engine as its own draft: every draft is right, so steps verify several tokens at once.
    with LLM(engine, speculative_config={"method": "draft_model", "model": str(engine),
                                         "num_speculative_tokens": 3}) as llm:
        outputs = llm.generate(PROMPTS, greedy)
        stats = llm.speculation_stats()
        choice = llm.generate(PROMPTS[1], SamplingParams(max_tokens=32, temperature=0, guided_decoding=GuidedDecoding(
            choice=["alpha", "beta gamma"])))[0]
        kv = llm.kv_cache_stats()
    assert [o.token_ids for o in outputs] == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS]
    assert stats["num_accepted_tokens"] > 0
    assert choice.text in ("alpha", "beta gamma")
    assert kv["free_blocks"] == kv["total_blocks"]
