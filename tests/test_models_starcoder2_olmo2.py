"""Starcoder2 and OLMo 2 against transformers: tiny random checkpoints with each family's quirks on (LayerNorm
biases, GELU MLP and a sliding window shorter than the prompts; post-norms and q/k norms over the whole
projection), every bias and norm weight randomized so a wrongly mapped one shows. kiln's greedy tokens equal
transformers' and its prompt logprobs match within float32 tolerance, also under in-flight batching with
chunked prefill, at TP=2 over gloo, and an FP8 engine builds and runs."""

from __future__ import annotations

import json

import pytest
from model_factory import BASE, build_case, hf_greedy, hf_prompt_logprobs, randomized_checkpoint

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.engine_format import load_engine_spec
from kiln.model_defs import ModelConfigError, get_model_def
from kiln.runtime import LLM, SamplingParams

PROMPTS = [[(7 * i + 3 * n) % 390 + 2 for i in range(n)] for n in (1, 5, 17, 40)]
NEW_TOKENS = 12
LIMITS = dict(max_batch_size=8, max_num_tokens=64, max_seq_len=128)

# name -> (architecture, config overrides)
CASES = {
    # window 8 < the 17- and 40-token prompts; tied embeddings and use_bias are Starcoder2's defaults
    "starcoder2-window-tied": ("Starcoder2ForCausalLM", {"sliding_window": 8}),
    "starcoder2-untied-exact-gelu": ("Starcoder2ForCausalLM", {"tie_word_embeddings": False, "hidden_act": "gelu",
                                                               "sliding_window": 6}),
    "olmo2": ("Olmo2ForCausalLM", {}),
    "olmo2-bias-tied": ("Olmo2ForCausalLM", {"attention_bias": True, "tie_word_embeddings": True}),
}


make_checkpoint = randomized_checkpoint  # the name the other families' files import


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    return build_case(request.param, CASES, tmp_path_factory, LIMITS)


def test_greedy_tokens_and_prompt_logprobs_match_transformers(case):
    _, _, engine, model = case
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=True)
    with LLM(engine) as llm:
        outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
        assert out.prompt_logprobs[1:] == pytest.approx(hf_prompt_logprobs(model, prompt), abs=1e-4)


def test_in_flight_batching_with_chunked_prefill_matches_transformers(case):
    """An 8-token step budget cuts the long prompts into chunks (the window spanning chunks), two sequences at a
    time, requests of different lengths joining as others finish."""
    _, _, engine, model = case
    params = [SamplingParams(max_tokens=4 + 3 * i, temperature=0, ignore_eos=True) for i in range(len(PROMPTS))]
    with LLM(engine, max_num_tokens=8, max_batch_size=2) as llm:
        outputs = llm.generate(PROMPTS[::-1], params)
        stats = llm.kv_cache_stats()
    for prompt, p, out in zip(PROMPTS[::-1], params, outputs):
        assert out.token_ids == hf_greedy(model, prompt, p.max_tokens), f"prompt of {len(prompt)} tokens"
    assert stats["free_blocks"] == stats["total_blocks"]


def test_config_is_read_as_transformers_reads_it(case):
    name, checkpoint, engine, _ = case
    config = load_engine_spec(engine).model_config
    raw = json.loads((checkpoint / "config.json").read_text())
    if name.startswith("starcoder2"):
        assert config["hidden_act"] == raw["hidden_act"] and config["mlp_bias"] and config["o_bias"]
        assert config["layer_sliding_windows"] == [raw["sliding_window"]] * raw["num_hidden_layers"]
        assert config["rms_norm_eps"] == raw["norm_epsilon"]
    else:
        assert config["qk_norm"] and config["qk_norm_scope"] == "projection"
    assert config["tie_word_embeddings"] == raw["tie_word_embeddings"]


# One TP=2 engine per family: OLMo 2 with a single KV head (replicated on both ranks: the k norm's mean over a
# replicated head), Starcoder2 with its window and row-parallel biases.
TP_CASES = {
    "starcoder2": ("Starcoder2ForCausalLM", {"sliding_window": 8}),
    "olmo2-kv1": ("Olmo2ForCausalLM", {"num_key_value_heads": 1, "attention_bias": True}),
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


@pytest.mark.parametrize("architecture", ["Starcoder2ForCausalLM", "Olmo2ForCausalLM"])
def test_fp8_engine_builds_calibrated_and_stays_near_transformers(tmp_path, architecture):
    """FP8 on the linears (c_fc / c_proj and the biased projections; the projection-wide q/k norms stay float),
    calibrated by ModelOpt on transformers' model of the family, on the CPU."""
    overrides = {"sliding_window": 8} if architecture == "Starcoder2ForCausalLM" else {}
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
    for prompt, out in zip(PROMPTS, outputs):  # measured: at most 0.11 (Starcoder2), 0.31 (OLMo 2) apart
        assert out.prompt_logprobs[1:] == pytest.approx(hf_prompt_logprobs(model, prompt), abs=0.6)


@pytest.mark.parametrize("architecture, act, message", [
    ("Starcoder2ForCausalLM", "gelu_new", r"hidden_act='gelu_new' is not supported for Starcoder2ForCausalLM; "
                                          r"supported: gelu_pytorch_tanh, gelu"),
    ("Olmo2ForCausalLM", "gelu", r"hidden_act='gelu' is not supported for Olmo2ForCausalLM; supported: silu"),
])
def test_unsupported_activation_is_refused_by_name(architecture, act, message):
    raw = {**BASE, "architectures": [architecture], "hidden_act": act}
    with pytest.raises(ModelConfigError, match=message):
        get_model_def(architecture).parse_config(raw)
