"""Granite and SmolLM3 against transformers: tiny random checkpoints with each family's quirks on (Granite's four
scalars set far from 1 and from 1/sqrt(head_dim), biases; SmolLM3's NoPE layers, a sliding window on them
shorter than the prompts, tied and untied embeddings), every bias and norm weight randomized. kiln's greedy
tokens equal transformers' and its prompt logprobs match within float32 tolerance, also under in-flight
batching with chunked prefill, at TP=2 over gloo, and an FP8 engine builds and runs."""

from __future__ import annotations

import json

import pytest
from model_factory import BASE, build_case, hf_greedy

# The parity tests themselves are the Starcoder2 / OLMo 2 file's, run here on this file's `case` fixture.
from test_models_starcoder2_olmo2 import (  # noqa: F401
    LIMITS,
    NEW_TOKENS,
    PROMPTS,
    hf_prompt_logprobs,
    make_checkpoint,
    test_greedy_tokens_and_prompt_logprobs_match_transformers,
    test_in_flight_batching_with_chunked_prefill_matches_transformers,
)

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.engine_format import load_engine_spec
from kiln.model_defs import ModelConfigError, get_model_def
from kiln.runtime import LLM, SamplingParams

# Multipliers that bite: each changes the logits well past the 1e-4 tolerance if dropped or misplaced.
GRANITE = dict(embedding_multiplier=3.5, residual_multiplier=0.4, attention_multiplier=0.3, logits_scaling=1.7)
# SmolLM3Config's default pad_token_id (128004) lies outside the tiny vocabulary.
SMOL = dict(pad_token_id=None)

# name -> (architecture, config overrides)
CASES = {
    "granite": ("GraniteForCausalLM", GRANITE),
    "granite-bias-tied": ("GraniteForCausalLM", {**GRANITE, "attention_bias": True, "mlp_bias": True,
                                                 "tie_word_embeddings": True}),
    # 4 layers, interval 2: layers 1 and 3 are NoPE; tied embeddings are SmolLM3's default
    "smollm3": ("SmolLM3ForCausalLM", {**SMOL, "num_hidden_layers": 4, "no_rope_layer_interval": 2}),
    # explicit no_rope_layers, window 6 < the 17- and 40-token prompts on the NoPE layer, biases, untied
    "smollm3-window-bias-untied": ("SmolLM3ForCausalLM", {
        **SMOL, "num_hidden_layers": 3, "no_rope_layers": [1, 0, 1], "use_sliding_window": True, "sliding_window": 6,
        "attention_bias": True, "mlp_bias": True, "tie_word_embeddings": False}),
}


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return build_case(request.param, CASES, tmp_path_factory, LIMITS, make_checkpoint)


def test_config_is_read_as_transformers_reads_it(case):
    name, checkpoint, engine, model = case
    config = load_engine_spec(engine).model_config
    raw = json.loads((checkpoint / "config.json").read_text())
    if name.startswith("granite"):
        assert {k: config[k] for k in GRANITE} == GRANITE
    else:
        assert config["layer_rope"] == [bool(f) for f in model.config.no_rope_layers]
        window = raw["sliding_window"] if raw.get("use_sliding_window") else 0
        assert config["layer_sliding_windows"] == [window if t == "sliding_attention" else 0
                                                   for t in model.config.layer_types]
    assert config["tie_word_embeddings"] == raw["tie_word_embeddings"]


# One TP=2 engine per family, a single KV head replicated on both ranks.
TP_CASES = {
    "granite": ("GraniteForCausalLM", {**GRANITE, "attention_bias": True}),
    "smollm3-kv1": ("SmolLM3ForCausalLM", {**SMOL, "num_hidden_layers": 3, "no_rope_layer_interval": 2,
                                           "num_key_value_heads": 1}),
}


@pytest.mark.parametrize("name", sorted(TP_CASES))
def test_tp2_matches_transformers(tmp_path, name):
    architecture, overrides = TP_CASES[name]
    checkpoint, model = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    engine = build_engine(checkpoint, tmp_path / "tp2", BuildConfig(tp_size=2, **LIMITS), progress=False)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=True)
    with LLM(engine, max_num_tokens=16) as llm:
        outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
        assert out.prompt_logprobs[1:] == pytest.approx(hf_prompt_logprobs(model, prompt), abs=1e-4)


@pytest.mark.parametrize("overrides, message", [
    ({"no_rope_layers": [1, 0, 1]}, r"no_rope_layers must be a list of 2 flags"),
    ({"no_rope_layer_interval": 0}, r"no_rope_layer_interval=0 must be an integer >= 1"),
])
def test_bad_smollm3_rope_layers_are_refused_by_name(overrides, message):
    raw = {**BASE, "architectures": ["SmolLM3ForCausalLM"], **overrides}
    with pytest.raises(ModelConfigError, match=message):
        get_model_def("SmolLM3ForCausalLM").parse_config(raw)


def test_bad_granite_multiplier_is_refused_by_name():
    raw = {**BASE, "architectures": ["GraniteForCausalLM"], "logits_scaling": 0}
    with pytest.raises(ModelConfigError, match=r"logits_scaling=0.0 must be a finite number > 0"):
        get_model_def("GraniteForCausalLM").parse_config(raw)


@pytest.mark.parametrize("name", ["granite", "smollm3"])
def test_fp8_engine_builds_calibrated_and_stays_near_transformers(tmp_path, name):
    """FP8 on the linears (Granite's multipliers and SmolLM3's NoPE layers stay float), calibrated by ModelOpt
    on transformers' model of the family, on the CPU."""
    architecture, overrides = CASES[name]
    checkpoint, model = make_checkpoint(tmp_path / "ckpt", architecture, **overrides)
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": " ".join(f"word{(i * 7 + j) % 50}" for j in range(40))}) + "\n"
                             for i in range(8)))
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(
        **LIMITS, dtype="float32", qformat="fp8", calib_dataset=str(calib), calib_size=4, calib_max_seq_len=64),
        progress=False)
    assert load_engine_spec(engine).build_config["quantization"]["qformat"] == "fp8"
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=True)
    with LLM(engine) as llm:
        outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):  # measured: at most 0.06 (Granite), 0.24 (SmolLM3) apart
        assert out.prompt_logprobs[1:] == pytest.approx(hf_prompt_logprobs(model, prompt), abs=0.6)
