"""FP8 linears take their input quantized by the norm and SiLU-and-mul before them (model_defs/layers/fp8_input.py):
the same numbers as quantizing in the linear, one pass over the activations fewer."""

from __future__ import annotations

import pytest
from model_factory import make_checkpoint

from kiln.builder.build import build_engine
from kiln.builder.build_config import BuildConfig
from kiln.quant import fp8
from kiln.runtime import LLM, SamplingParams

PROMPTS = [[5, 17, 99, 3, 41, 7, 2], [8, 8, 250, 31, 7, 64, 2, 90, 11]]


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    path, _ = make_checkpoint(tmp_path_factory.mktemp("fp8in") / "ckpt")
    return path


def _run(engine):
    llm = LLM(engine)
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    return [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in llm.generate(PROMPTS, params)]


def _counting(monkeypatch, name, counts):
    original = getattr(fp8, name)

    def counted(*args, **kwargs):
        counts[name] = counts.get(name, 0) + 1
        return original(*args, **kwargs)

    monkeypatch.setattr(fp8, name, counted)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_fused_producers_give_the_fp8_linears_exactly_what_they_computed_themselves(checkpoint, tmp_path,
                                                                                   monkeypatch, dtype):
    config = BuildConfig(dtype=dtype, max_batch_size=4, max_num_tokens=16, max_seq_len=64, kv_block_size=8,
                         qformat="fp8", dummy_weights=True)
    engine = build_engine(checkpoint, tmp_path / "engine", config, progress=False)
    counts: dict[str, int] = {}
    _counting(monkeypatch, "scaled_linear", counts)
    _counting(monkeypatch, "scaled_linear_quantized", counts)
    fused = _run(engine)
    # Per layer: qkv_proj, gate_up_proj and down_proj get FP8 input; o_proj (after attention) quantizes its own.
    assert counts["scaled_linear_quantized"] == 3 * counts["scaled_linear"] > 0
    counts.clear()
    monkeypatch.setattr(fp8.Fp8Linear, "accepts_fp8_input", False)
    unfused = _run(engine)
    assert "scaled_linear_quantized" not in counts
    assert fused == unfused  # token ids and every logprob, bit for bit


@pytest.mark.gpu
def test_on_cuda_the_fused_kernels_agree_with_quantizing_in_the_linear(checkpoint, tmp_path, monkeypatch):
    """Through the Triton kernels and CUDA graphs: prompt logprobs within FP8 rounding (a fused kernel may round a
    value differently from the float norm kernel, and then its FP8 code by one step). Greedy tokens are not
    compared: the dummy weights' logits come close to ties."""
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    config = BuildConfig(dtype="bfloat16", max_batch_size=4, max_num_tokens=16, max_seq_len=64, kv_block_size=16,
                         qformat="fp8", kv_cache_dtype="fp8", dummy_weights=True, device="cuda")
    engine = build_engine(checkpoint, tmp_path / "engine", config, progress=False)
    fused = _run(engine)
    monkeypatch.setattr(fp8.Fp8Linear, "accepts_fp8_input", False)
    unfused = _run(engine)
    for (_, _, prompt), (_, _, prompt_u) in zip(fused, unfused):
        assert prompt[1:] == pytest.approx(prompt_u[1:], abs=0.05)


def test_with_lora_the_fp8_linears_quantize_their_own_input_for_the_adapters(checkpoint, tmp_path):
    """LoRA adapters multiply the float input, so with enable_lora the producers hand floats and each FP8 linear
    quantizes them itself: without an adapter the same numbers bit for bit, with one the adapter applies."""
    from lora_util import make_adapter
    from transformers import AutoModelForCausalLM

    from kiln.runtime import LoRARequest

    config = BuildConfig(dtype="float32", max_batch_size=4, max_num_tokens=16, max_seq_len=64, kv_block_size=8,
                         qformat="fp8", dummy_weights=True)
    engine = build_engine(checkpoint, tmp_path / "engine", config, progress=False)
    base = _run(engine)
    adapter, _ = make_adapter(AutoModelForCausalLM.from_pretrained(checkpoint), tmp_path / "adapter", r=8,
                              target_modules="all-linear")
    params = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True, logprobs=True, prompt_logprobs=True)
    with LLM(engine, enable_lora=True, max_lora_rank=8) as llm:
        plain = [(o.token_ids, o.logprobs, o.prompt_logprobs) for o in llm.generate(PROMPTS, params)]
        adapted = llm.generate(PROMPTS, params, LoRARequest("a", 1, str(adapter)))
    assert plain == base
    assert [o.prompt_logprobs for o in adapted] != [p for _, _, p in base]
