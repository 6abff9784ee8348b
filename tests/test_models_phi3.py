"""Phi-3 / 3.5 / 4-mini (`Phi3ForCausalLM`) and LongRoPE against transformers.

Tiny random checkpoints with the family's quirks on: fused qkv_proj / gate_up_proj, LongRoPE over an original
context of 32 tokens (max_position_embeddings 128, random short and long factors, the inferred attention
factor or a given one), partial rotary 0.75 (Phi-4-mini's), a sliding window shorter than the long prompts,
tied and untied embeddings. Prompts of 45 and 70 tokens are past the original context (long factors
throughout, as transformers picks them for such a sequence), those of 3 and 20 stay within it with their
generations (short factors). kiln's greedy tokens equal transformers' generate, its prompt and generated
logprobs transformers' forward within float32 tolerance, under in-flight batching with chunked prefill, at
TP=2 over gloo (one KV head, replicated), with prefix caching across the switch length, and an FP8 engine
builds and stays near. The fused rotary + KV-write kernel is checked on partial longrope tables in Triton's
interpreter."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import transformers
from model_factory import BASE, hf_greedy
from test_models_starcoder2_olmo2 import make_checkpoint
from test_rope_yarn import check_fused_rotary_kv_on_yarn_tables
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from triton_interpret import needs_triton, run_interpreted

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.engine_format import load_engine_spec
from kiln.model_defs import ModelConfig, ModelConfigError, get_model_def
from kiln.model_defs.config import RopeConfig
from kiln.model_defs.layers.rotary import RotaryTables, attention_scaling
from kiln.plugins._triton import USE_TRITON
from kiln.runtime import LLM, SamplingParams

ORIGINAL = 32
PROMPTS = [[(7 * i + 3 * n) % 390 + 2 for i in range(n)] for n in (3, 20, 45, 70)]
NEW_TOKENS = 8  # 20 + 8 stays within the original context: transformers never switches mid-sequence
LIMITS = dict(max_batch_size=4, max_num_tokens=128, max_seq_len=4 * ORIGINAL)


def _factors(n: int, seed: int, high: float) -> list[float]:
    gen = torch.Generator().manual_seed(seed)
    return (1 + (high - 1) * torch.rand(n, generator=gen)).tolist()


def _longrope(rotated_pairs: int, **extra) -> dict:
    return {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": _factors(rotated_pairs, 1, 1.5),
            "long_factor": _factors(rotated_pairs, 2, 8.0), **extra}


# Phi3Config's pad_token_id (32000) lies outside the tiny vocabulary; head_dim is 64 / 4 = 16.
PHI3 = dict(pad_token_id=None, original_max_position_embeddings=ORIGINAL, max_position_embeddings=4 * ORIGINAL)
CASES = {
    # Phi-4-mini's shape: 12 of 16 dims rotate (6 factor pairs), tied embeddings; window 24 < the long prompts
    "longrope-partial-window-tied": {**PHI3, "rope_parameters": _longrope(6, partial_rotary_factor=0.75),
                                     "sliding_window": 24, "tie_word_embeddings": True},
    # Phi-3's older layout: rope_scaling with type "su", a given attention factor, untied
    "su-attention-factor": {**PHI3, "rope_scaling": {**_longrope(8), "type": "su", "attention_factor": 1.3}},
}


def _checkpoint(path: Path, overrides: dict) -> tuple[Path, transformers.PreTrainedModel]:
    """The tiny checkpoint; a `rope_scaling` override is written back into config.json as given (transformers
    saves its normalized rope_parameters), so the old layout is what kiln reads."""
    checkpoint, model = make_checkpoint(path, "Phi3ForCausalLM", **overrides)
    if "rope_scaling" in overrides:
        raw = json.loads((checkpoint / "config.json").read_text())
        raw["rope_theta"] = raw.pop("rope_parameters")["rope_theta"]
        raw["rope_scaling"] = overrides["rope_scaling"]
        (checkpoint / "config.json").write_text(json.dumps(raw))
    return checkpoint, model


def _hf_logprobs(model, token_ids: list[int]) -> list[float]:
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(-1, ids[0, 1:, None])[:, 0].tolist()


def _check(engine: Path, model, prompts=PROMPTS, **options) -> None:
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=True,
                            prompt_logprobs=True)
    with LLM(engine, **options) as llm:
        outputs = llm.generate(prompts, params)
        stats = llm.kv_cache_stats()
    for prompt, out in zip(prompts, outputs):
        what = f"prompt of {len(prompt)} tokens"
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS), what
        got = out.prompt_logprobs[1:] + out.logprobs
        assert got == pytest.approx(_hf_logprobs(model, prompt + out.token_ids), abs=1e-4), what
    assert stats["free_blocks"] == stats["total_blocks"]


@pytest.fixture(scope="module", params=sorted(CASES))
def case(request, tmp_path_factory):
    tmp = tmp_path_factory.mktemp(request.param)
    checkpoint, model = _checkpoint(tmp / "ckpt", CASES[request.param])
    engine = build_engine(checkpoint, tmp / "engine", BuildConfig(**LIMITS), progress=False)
    return request.param, checkpoint, engine, model


def test_config_and_tables_are_transformers(case):
    """The rope read from config.json, and kiln's short and long tables bit for bit transformers' cos/sin
    (attention factor included) over the rotated dims."""
    name, checkpoint, engine, model = case
    config = ModelConfig.from_dict(load_engine_spec(engine).model_config)
    rope = config.rope
    assert rope.rope_type == "longrope" and rope.original_max_position_embeddings == ORIGINAL
    assert config.tie_word_embeddings == ("tied" in name)
    assert config.layer_sliding_windows == (24 if "window" in name else 0,) * 2
    hf_config = transformers.AutoConfig.from_pretrained(checkpoint)
    assert attention_scaling(rope) == ROPE_INIT_FUNCTIONS["longrope"](hf_config, "cpu")[1] != 1.0
    tables = RotaryTables(rope, config.head_dim, config.max_position_embeddings, 4 * ORIGINAL, "cpu")
    half = tables.cos.shape[1]
    assert half == (6 if "partial" in name else 8)
    for length in (ORIGINAL, ORIGINAL + 1, 4 * ORIGINAL):  # transformers switches to long past ORIGINAL
        positions = torch.arange(length)
        cos, sin = model.model.rotary_emb(torch.zeros(1), positions[None])
        got_cos, got_sin = tables.lookup(positions, torch.full((length,), length), length)
        assert torch.equal(got_cos, cos[0, :, :half]) and torch.equal(got_sin, sin[0, :, :half]), length


def test_greedy_and_logprobs_match_transformers(case):
    _check(case[2], case[3])


def test_in_flight_batching_with_chunked_prefill_matches_transformers(case):
    """A 16-token step budget splits the long prompts over several steps (the window spanning chunks) beside
    other requests' decodes: each request keeps its own table, short or long, whatever its neighbours use."""
    _check(case[2], case[3], max_num_tokens=16)


def test_prefix_caching_is_off_across_the_switch_length(case, caplog):
    """A short prompt's blocks (short factors) are no long prompt's prefix (long factors), nor the other way
    round: the runtime turns prefix caching off, saying why, and prompts sharing their first 16 tokens on each
    side of the original context, one engine for all, keep transformers' tokens and logprobs."""
    _, _, engine, model = case
    shared = PROMPTS[3][:16]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=True)
    with caplog.at_level("WARNING", logger="kiln.runtime"), LLM(engine) as llm:
        for prompt in (shared + [5, 6, 7], shared + PROMPTS[2], shared + [5, 6, 7]):  # one at a time
            (out,) = llm.generate([prompt], params)
            assert out.num_cached_tokens == 0
            assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS)
            want = _hf_logprobs(model, prompt + out.token_ids)[len(prompt) - 1:]
            assert out.logprobs == pytest.approx(want, abs=1e-4), f"prompt of {len(prompt)} tokens"
    assert "prefix caching is off: Phi3ForCausalLM's longrope rope" in caplog.text


def _hf_cached_greedy(model, prompt: list[int], n: int) -> list[int]:
    """Greedy tokens from transformers' forward with a cache carried over, never recomputed: the cached keys
    keep the factors they were rotated with, each new token takes the factors of the sequence's length then."""
    tokens: list[int] = []
    with torch.no_grad():
        out = model(input_ids=torch.tensor([prompt]), use_cache=True)
        for i in range(n):
            tokens.append(int(out.logits[0, -1].argmax()))
            out = model(input_ids=torch.tensor([[tokens[-1]]]), cache=out.cache, use_cache=True,
                        position_ids=torch.tensor([[len(prompt) + i]]))
    return tokens


@pytest.mark.parametrize("max_num_tokens", [None, 8])
def test_a_sequence_growing_past_the_original_context_is_recomputed_on_long_factors(case, max_num_tokens):
    """A 28-token prompt generating 8 tokens crosses the switch length: as transformers' generate does, the
    sequence is recomputed on long factors there (kiln preempts it: SchedulerLimits.recompute_past), so the tokens
    are generate's, not those of a forward that kept its short-factor keys; in one batch with other requests and
    with the recompute chunked too."""
    _, _, engine, model = case
    prompt = PROMPTS[3][:28]
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True)
    with LLM(engine, max_num_tokens=max_num_tokens) as llm:
        out, *others = llm.generate([prompt, PROMPTS[0], PROMPTS[1]], params)
        assert llm.engine.num_preemptions >= 1
        assert llm.kv_cache_stats()["free_blocks"] == llm.kv_cache_stats()["total_blocks"]
    expected = hf_greedy(model, prompt, NEW_TOKENS)
    assert out.token_ids == expected and expected != _hf_cached_greedy(model, prompt, NEW_TOKENS)
    assert [o.token_ids for o in others] == [hf_greedy(model, p, NEW_TOKENS) for p in PROMPTS[:2]]


def test_tp2_with_a_replicated_kv_head_matches_transformers(tmp_path):
    overrides = {**CASES["longrope-partial-window-tied"], "num_key_value_heads": 1}
    checkpoint, model = _checkpoint(tmp_path / "ckpt", overrides)
    engine = build_engine(checkpoint, tmp_path / "tp2", BuildConfig(tp_size=2, **LIMITS), progress=False)
    _check(engine, model, max_num_tokens=16)


def test_fp8_engine_builds_calibrated_and_stays_near_transformers(tmp_path):
    """FP8 on the fused linears (one scale per fused checkpoint tensor) and an FP8 KV cache (partial rotary:
    the unrotated dims are cached quantized too), calibrated by ModelOpt on transformers' Phi3 model, on the
    CPU."""
    checkpoint, model = _checkpoint(tmp_path / "ckpt", CASES["longrope-partial-window-tied"])
    calib = tmp_path / "calib.jsonl"
    calib.write_text("".join(json.dumps({"text": " ".join(f"word{(i * 7 + j) % 50}" for j in range(40))}) + "\n"
                             for i in range(8)))
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(
        **LIMITS, dtype="float32", qformat="fp8", kv_cache_dtype="fp8", calib_dataset=str(calib), calib_size=4,
        calib_max_seq_len=64),
        progress=False)
    build = load_engine_spec(engine).build_config
    assert build["quantization"]["qformat"] == "fp8" and build["kv_cache_dtype"] == "fp8"
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=True)
    with LLM(engine) as llm:
        outputs = llm.generate(PROMPTS, params)
    for prompt, out in zip(PROMPTS, outputs):
        assert out.prompt_logprobs[1:] == pytest.approx(_hf_logprobs(model, prompt), abs=0.6)


def _raw(**overrides) -> dict:
    return {**BASE, **PHI3, "architectures": ["Phi3ForCausalLM"], "rope_scaling": _longrope(8), **overrides}


@pytest.mark.parametrize("overrides, message", [
    ({"rope_scaling": {**_longrope(8), "short_factor": [1.0] * 7}},
     r"short_factor has 7 entries; head_dim=16 with partial_rotary_factor=1.0 rotates 16 dimensions, which need 8"),
    ({"rope_scaling": _longrope(8), "partial_rotary_factor": 0.75}, r"short_factor has 8 entries.*need 6"),
    ({"rope_scaling": {**_longrope(8), "long_factor": [1.0] * 7 + [-2.0]}}, r"long_factor=.* finite numbers > 0"),
    ({"rope_scaling": {**_longrope(8), "long_factor": None}}, r"long_factor=None"),
    ({"rope_scaling": {**_longrope(8), "attention_factor": "big"}}, r"attention_factor='big' must be a number"),
    ({"partial_rotary_factor": 1.5}, r"partial_rotary_factor=1.5 must be a number in \(0, 1\]"),
    ({"rope_scaling": {"type": "dynamic", "factor": 2.0}}, r"'dynamic' is not supported for Phi3ForCausalLM"),
    ({"original_max_position_embeddings": 0}, r"original_max_position_embeddings=0"),
])
def test_bad_phi3_rope_fields_are_refused_by_name(overrides, message):
    with pytest.raises(ModelConfigError, match=message):
        get_model_def("Phi3ForCausalLM").parse_config(_raw(**overrides))


def test_phi3_4k_layout_without_rope_scaling():
    """Phi-3-mini-4k's config: no rope scaling, a 2047-token window, untied: plain tables, fused recipes by name."""
    config = get_model_def("Phi3ForCausalLM").parse_config(_raw(rope_scaling=None, sliding_window=2047))
    assert config.rope == RopeConfig() and config.layer_sliding_windows == (2047, 2047)
    recipes = get_model_def("Phi3ForCausalLM").recipes(config, ["model.layers.0.self_attn.qkv_proj.weight"])
    assert recipes["model.layers.0.self_attn.qkv_proj.weight"].parts == ("model.layers.0.self_attn.qkv_proj.weight",)


_RUN_INTERPRETED = """
import sys
sys.path.insert(0, {tests!r})
import torch
import test_rope_yarn as checks
from kiln.model_defs.config import RopeConfig

rope = RopeConfig(rope_type="longrope", theta=10000.0, factor=4.0, original_max_position_embeddings=32,
                  short_factor=(1.1,) * 24, long_factor=tuple(1.0 + i / 4 for i in range(24)),
                  partial_rotary_factor=0.75)
checks.check_fused_rotary_kv_on_yarn_tables(
    "cpu", rope, 128, [(torch.float16, torch.float16), (torch.float16, torch.int8)],  # float and quantized writes
    tokens=7, heads=4, kv_heads=2, dim=64)
print("ok")
"""


@needs_triton
def test_fused_rotary_kv_kernel_on_partial_longrope_tables_matches_reference_interpreted():
    out = run_interpreted(_RUN_INTERPRETED.format(tests=str(Path(__file__).parent)), timeout=300)
    assert out.strip().endswith("ok")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and USE_TRITON),
                    reason="needs CUDA and triton (with KILN_DISABLE_TRITON unset)")
def test_fused_rotary_kv_kernel_on_partial_longrope_tables_matches_reference_cuda():
    # Phi-4-mini's rope: head_dim 128, 96 rotated (48 factor pairs), original 4096 of 131072 positions.
    rope = RopeConfig(rope_type="longrope", theta=10000.0, factor=32.0, original_max_position_embeddings=4096,
                      short_factor=tuple(1.0 + i / 96 for i in range(48)),
                      long_factor=tuple(1.0 + i for i in range(48)), partial_rotary_factor=0.75)
    cases = [(dtype, cache) for dtype in (torch.bfloat16, torch.float16)
             for cache in (dtype, torch.float8_e4m3fn, torch.int8)]
    check_fused_rotary_kv_on_yarn_tables("cuda", rope, 131072, cases, tokens=257, heads=24, kv_heads=8, dim=128)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_graphs_give_eager_tokens_on_both_tables(tmp_path):
    """Decode steps replayed in CUDA graphs pick the short or long table per token on the device: the same
    tokens and logprobs as eager steps, for prompts on each side of the original context, and transformers'
    tokens (float32 engine)."""
    checkpoint, model = _checkpoint(tmp_path / "ckpt", CASES["longrope-partial-window-tied"])
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(device="cuda", dtype="float32", **LIMITS),
                          progress=False)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=True)
    runs = []
    for graphs in (True, False):
        with LLM(engine, cuda_graphs=graphs) as llm:
            runs.append(llm.generate(PROMPTS, params))
    for prompt, graphed, eager in zip(PROMPTS, *runs):
        assert graphed.token_ids == eager.token_ids == hf_greedy(model, prompt, NEW_TOKENS), len(prompt)
        assert graphed.logprobs == pytest.approx(eager.logprobs, abs=1e-4), len(prompt)
