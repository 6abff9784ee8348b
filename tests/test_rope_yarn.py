"""YaRN rope scaling (`rope_scaling.type=yarn`) against transformers.

Tiny random checkpoints with an original context of 32 tokens scaled by 4: prompts and generations run past
position 32, where the interpolated band and the attention factor matter. kiln's tables must equal
transformers' (same float32 operations), its greedy tokens transformers' generate, and its prompt and
generated logprobs transformers' forward within float32 tolerance, under chunked prefill with requests of
different lengths in flight, and at TP=2 over gloo. The fused rotary + KV-write kernel reads the tables, so
it is checked on yarn tables (scaled by the attention factor, |cos| > 1) in Triton's interpreter.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch
import transformers
from model_factory import hf_greedy, make_checkpoint
from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
from triton_interpret import needs_triton, run_interpreted

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.model_defs.config import ModelConfig, ModelConfigError, RopeConfig, parse_rope
from kiln.model_defs.layers.rotary import RotaryTables, attention_scaling, inverse_frequencies
from kiln.plugins._triton import USE_TRITON
from kiln.runtime import LLM, SamplingParams

ORIGINAL = 32
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": ORIGINAL}
# name -> (architecture, checkpoint overrides); max_position_embeddings = factor x the original context.
CASES = {
    "llama": ("LlamaForCausalLM", {"rope_parameters": YARN}),
    # DeepSeek-style attention factor from mscale / mscale_all_dim, other betas, an untruncated ramp
    "qwen2-mscale": ("Qwen2ForCausalLM", {"rope_parameters": {
        **YARN, "rope_theta": 1000000.0, "beta_fast": 16, "beta_slow": 2, "mscale": 1.0, "mscale_all_dim": 0.5,
        "truncate": False}}),
    # the old `rope_scaling` layout with `type`, an explicit attention factor
    "qwen3-attention-factor": ("Qwen3ForCausalLM", {"rope_scaling": {
        "type": "yarn", "factor": 4.0, "original_max_position_embeddings": ORIGINAL, "attention_factor": 1.25}}),
}
PROMPT_LENGTHS = (3, 20, 45, 70)
NEW_TOKENS = 12


def _checkpoint(path, case):
    architecture, overrides = CASES[case]
    return make_checkpoint(path, architecture, max_position_embeddings=4 * ORIGINAL, **overrides)


def _prompts():
    return [[(7 * i + 3 * n) % 390 + 2 for i in range(n)] for n in PROMPT_LENGTHS]


def _hf_logprobs(model, token_ids: list[int]) -> torch.Tensor:
    """Row i: transformers' logprob of token i + 1 given tokens 0..i."""
    ids = torch.tensor([token_ids])
    with torch.no_grad():
        logprobs = model(input_ids=ids).logits[0, :-1].float().log_softmax(-1)
    return logprobs.gather(-1, ids[0, 1:, None])[:, 0]


def _check_against_transformers(engine, hf_model, **options):
    prompts = _prompts()
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, logprobs=True,
                            prompt_logprobs=True)
    with LLM(engine, **options) as llm:
        outputs = llm.generate(prompts, params)
        stats = llm.kv_cache_stats()
    for prompt, out in zip(prompts, outputs):
        what = f"prompt of {len(prompt)} tokens"
        assert out.token_ids == hf_greedy(hf_model, prompt, NEW_TOKENS), what
        want = _hf_logprobs(hf_model, prompt + out.token_ids)
        got = torch.tensor(out.prompt_logprobs[1:] + out.logprobs)
        torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4, msg=what)
    assert stats["free_blocks"] == stats["total_blocks"]


@pytest.mark.parametrize("case", sorted(CASES))
def test_tables_equal_transformers(tmp_path, case):
    """Inverse frequencies bit for bit, and the attention factor, from the saved config.json."""
    checkpoint, hf_model = _checkpoint(tmp_path, case)
    config = transformers.AutoConfig.from_pretrained(checkpoint)
    inv_freq, scaling = ROPE_INIT_FUNCTIONS["yarn"](config, "cpu")
    rope = parse_rope(config.to_dict())
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    assert rope.rope_type == "yarn" and rope.original_max_position_embeddings == ORIGINAL
    assert torch.equal(inverse_frequencies(rope, head_dim, config.max_position_embeddings), inv_freq)
    assert attention_scaling(rope) == scaling != 1.0
    tables = RotaryTables(rope, head_dim, config.max_position_embeddings, 100, "cpu")
    positions = torch.arange(100)[None]
    cos, sin = hf_model.model.rotary_emb(torch.zeros(1, dtype=torch.float32), positions)
    half = head_dim // 2
    assert torch.equal(tables.cos, cos[0, :, :half]) and torch.equal(tables.sin, sin[0, :, :half])


@pytest.mark.parametrize("case", sorted(CASES))
def test_greedy_and_logprobs_match_transformers_under_chunked_prefill(tmp_path, case):
    checkpoint, hf_model = _checkpoint(tmp_path / "ckpt", case)
    engine = build_engine(checkpoint, tmp_path / "engine",
                          BuildConfig(max_batch_size=4, max_num_tokens=64, max_seq_len=4 * ORIGINAL), progress=False)
    model_config = ModelConfig.from_dict(json.loads((engine / "engine.json").read_text())["model_config"])
    assert model_config.rope.rope_type == "yarn"
    # A 16-token step budget splits every long prompt over several steps, next to other requests' decodes.
    _check_against_transformers(engine, hf_model, max_num_tokens=16)


def test_tp2_matches_transformers(tmp_path):
    checkpoint, hf_model = _checkpoint(tmp_path / "ckpt", "llama")
    engine = build_engine(checkpoint, tmp_path / "tp2", BuildConfig(tp_size=2, max_seq_len=4 * ORIGINAL),
                          progress=False)
    _check_against_transformers(engine, hf_model, max_num_tokens=16)


def _raw(**rope) -> dict:
    return {"max_position_embeddings": 4 * ORIGINAL, "rope_parameters": {**YARN, **rope}}


def test_original_length_and_null_factor_as_transformers_reads_them():
    # A null factor is the context extension; a top-level original_max_position_embeddings (Phi-3's layout)
    # wins over the rope dict's; a zero or null beta is its default.
    assert parse_rope(_raw(factor=None)).factor == 4.0
    assert parse_rope({**_raw(), "original_max_position_embeddings": 16}).original_max_position_embeddings == 16
    assert parse_rope(_raw(beta_fast=0, beta_slow=None)) == parse_rope(_raw())
    rope = parse_rope(_raw(mscale=1.0, mscale_all_dim=1.0))
    assert attention_scaling(rope) == 1.0  # equal mscales cancel
    assert ModelConfig.from_dict({**_model_dict(), "rope": asdict(rope)}).rope == rope


def _model_dict() -> dict:
    return dict(architecture="LlamaForCausalLM", vocab_size=100, hidden_size=64, intermediate_size=128,
                num_layers=1, num_heads=4, num_kv_heads=2, head_dim=16, rms_norm_eps=1e-6,
                max_position_embeddings=128)


@pytest.mark.parametrize("rope, field", [
    ({"beta_fast": "fast"}, "beta_fast"),
    ({"beta_fast": float("nan")}, "beta_fast"),
    ({"beta_slow": -1}, "beta_slow"),
    ({"beta_fast": 2, "beta_slow": 8}, "beta_fast=2.0 must be >= beta_slow=8.0"),
    ({"mscale": -1.0}, "mscale=-1.0"),
    ({"mscale_all_dim": float("inf")}, "mscale_all_dim"),
    ({"attention_factor": 0.0}, "attention_factor"),
    ({"attention_factor": [1.0]}, "attention_factor"),
    ({"factor": -4.0}, "factor"),
    ({"factor": "4"}, "factor"),
    ({"original_max_position_embeddings": 0}, "original_max_position_embeddings"),
    ({"original_max_position_embeddings": 32.5}, "original_max_position_embeddings"),
    ({"truncate": "yes"}, "truncate"),
])
def test_bad_yarn_fields_are_refused_by_name(rope, field):
    with pytest.raises(ModelConfigError, match=field.replace(".", r"\.").replace("(", r"\(")):
        parse_rope(_raw(**rope))


def test_bad_yarn_fields_in_an_engine_json_are_refused_by_name():
    with pytest.raises(ModelConfigError, match="beta_slow"):
        RopeConfig(rope_type="yarn", factor=4.0, original_max_position_embeddings=32, beta_slow=0.0)
    with pytest.raises(ModelConfigError, match="original_max_position_embeddings"):
        RopeConfig(rope_type="yarn", factor=4.0)


def check_fused_rotary_kv_on_yarn_tables(device: str, rope: RopeConfig, max_positions: int, cases, *,
                                         tokens: int, heads: int, kv_heads: int, dim: int) -> None:
    """The rotary and fused rotary + KV-write kernels against their references on yarn tables (bit for bit:
    the kernels round as the references do); `cases`: (activation dtype, cache dtype) pairs, a one-byte cache
    with scales. Run in Triton's interpreter on the CPU, and on CUDA."""
    from kiln.plugins.rotary import rotary_embedding_reference
    from kiln.plugins.rotary_kv import rotary_embedding_and_write_kv_reference
    from kiln.plugins.triton_rotary_kv import rotary_embedding_and_write_kv_triton, rotary_embedding_triton

    gen = torch.Generator().manual_seed(0)
    block_size = 16
    num_blocks = tokens // block_size + 2
    tables = RotaryTables(rope, dim, max_positions, max_positions, device)
    assert tables.cos.abs().max() > 1  # the attention factor is in the tables
    positions = torch.randint(0, max_positions, (tokens,), generator=gen)
    positions[:3] = torch.tensor([0, rope.original_max_position_embeddings - 1, max_positions - 1])
    cos, sin = tables.cos[positions.to(device)], tables.sin[positions.to(device)]
    for dtype, cache_dtype in cases:
        q, k, v = ((torch.randn(tokens, h, dim, generator=gen) * 2).to(device, dtype)
                   for h in (heads, kv_heads, kv_heads))
        one_byte = cache_dtype.itemsize == 1
        scales = tuple(torch.tensor([s], device=device) for s in (0.02, 0.01)) if one_byte else ()
        if not one_byte:
            out, ref = rotary_embedding_triton(q, k, cos, sin), rotary_embedding_reference(q, k, cos, sin)
            assert all(torch.equal(a, b) for a, b in zip(out, ref)), (dtype, "rotary")
        slots = torch.randperm(num_blocks * block_size, generator=gen)[:tokens]
        slots[4] = -1  # a padding token writes nothing
        caches = [torch.zeros(num_blocks, block_size, kv_heads, dim).to(device, cache_dtype) for _ in range(2)]
        ref_caches = [c.clone() for c in caches]
        q_out = rotary_embedding_and_write_kv_triton(q, k, v, cos, sin, *caches, slots.to(device), *scales)
        q_ref = rotary_embedding_and_write_kv_reference(q, k, v, cos, sin, *ref_caches, slots.to(device), *scales)
        assert torch.equal(q_out, q_ref), (dtype, cache_dtype, "q")
        for got, want in zip(caches, ref_caches):
            assert torch.equal(got.view(torch.uint8), want.view(torch.uint8)), (dtype, cache_dtype, "cache")


_RUN_INTERPRETED = """
import sys
sys.path.insert(0, {tests!r})
import torch
import test_rope_yarn as checks
from kiln.model_defs.config import RopeConfig

rope = RopeConfig(rope_type="yarn", theta=10000.0, factor=4.0, original_max_position_embeddings=32)
checks.check_fused_rotary_kv_on_yarn_tables(
    "cpu", rope, 128, [(torch.float32, torch.float32), (torch.float16, torch.float16),
                       (torch.float16, torch.float8_e4m3fn), (torch.float16, torch.int8)],
    tokens=11, heads=4, kv_heads=2, dim=64)
print("ok")
"""


@needs_triton
def test_fused_rotary_kv_kernel_on_yarn_tables_matches_reference_interpreted():
    out = run_interpreted(_RUN_INTERPRETED.format(tests=str(Path(__file__).parent)), timeout=300)
    assert out.strip().endswith("ok")


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and USE_TRITON),
                    reason="needs CUDA and triton (with KILN_DISABLE_TRITON unset)")
def test_fused_rotary_kv_kernel_on_yarn_tables_matches_reference_cuda():
    # Qwen2.5-7B-Instruct's YaRN (factor 4 over 32768 positions) and heads.
    rope = RopeConfig(rope_type="yarn", theta=1000000.0, factor=4.0, original_max_position_embeddings=32768)
    cases = [(dtype, cache) for dtype in (torch.bfloat16, torch.float16)
             for cache in (dtype, torch.float8_e4m3fn, torch.int8)]
    check_fused_rotary_kv_on_yarn_tables("cuda", rope, 131072, cases, tokens=257, heads=28, kv_heads=4, dim=128)
