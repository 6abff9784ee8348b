"""GPT-OSS's MXFP4 experts kept in the engine (quant scheme `mxfp4`): a tiny random GPT-OSS checkpoint whose experts
are MXFP4 (made by the reference quantizer of test_models_gpt_oss.py) builds with the experts' blocks and scales
stored as uint8, and gives the greedy tokens and prompt logprobs of the `--dequantize` engine (the same weights
in float32) and of transformers, at TP=1 and TP=2 (gloo). The MXFP4 MoE operator's Triton kernel is checked
against its reference under Triton's interpreter (tiny shapes) and on CUDA at GPT-OSS-20B's shapes."""

from __future__ import annotations

import inspect
import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from model_factory import hf_greedy, hf_prompt_logprobs
from safetensors import safe_open
from test_models_gpt_oss import LIMITS, NEW_TOKENS, PROMPTS, make_checkpoint, quantize_mxfp4
from triton_interpret import needs_triton, run_interpreted

from kiln.builder.build import BuildError, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.engine_format import load_engine_spec
from kiln.plugins._triton import USE_TRITON
from kiln.plugins.mxfp4 import dequantize_mxfp4
from kiln.plugins.mxfp4_moe import fused_moe_mxfp4, fused_moe_mxfp4_reference

EXPERTS = ("experts.gate_up_proj", "experts.down_proj")


def make_mxfp4_checkpoint(path: Path, **overrides):
    """test_models_gpt_oss's tiny GPT-OSS with its experts stored as MXFP4 (transformers' layout: blocks
    [E, out, in / 32, 16], gate and up rows interleaved) and transformers' model holding the same weights
    dequantized. Hidden and intermediate sizes are multiples of 32."""
    from safetensors.torch import load_file, save_file

    checkpoint, model = make_checkpoint(path, **{"intermediate_size": 64, **overrides})
    tensors = load_file(checkpoint / "model.safetensors")
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith(EXPERTS):
                blocks, scales = quantize_mxfp4(param.transpose(1, 2))  # [E, out, in] quantized along in
                tensors.pop(name)
                tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = blocks, scales
                param.copy_(dequantize_mxfp4(blocks, scales).transpose(1, 2))
    save_file(tensors, checkpoint / "model.safetensors", metadata={"format": "pt"})
    raw = json.loads((checkpoint / "config.json").read_text())
    raw["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]}
    (checkpoint / "config.json").write_text(json.dumps(raw))
    return checkpoint, model


def generate(engine: Path, **runtime) -> tuple[list, int]:
    """The greedy outputs of PROMPTS (with prompt logprobs) and the weight bytes the memory plan counted."""
    from kiln.runtime import LLM, SamplingParams

    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=True)
    with LLM(engine, **runtime) as llm:
        return llm.generate(PROMPTS, params), llm.engine.memory_report.weights_bytes


@pytest.fixture(scope="module")
def engines(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("mxfp4")
    checkpoint, model = make_mxfp4_checkpoint(tmp / "ckpt")
    kept = build_engine(checkpoint, tmp / "mxfp4", BuildConfig(**LIMITS), progress=False)
    dequantized = build_engine(checkpoint, tmp / "float", BuildConfig(dequantize=True, **LIMITS), progress=False)
    return checkpoint, kept, dequantized, model


def test_experts_are_stored_mxfp4_and_recorded(engines):
    _, kept, dequantized, _ = engines
    spec = load_engine_spec(kept)
    assert spec.build_config["quantization"]["qformat"] == "mxfp4"
    assert load_engine_spec(dequantized).build_config["quantization"] is None
    with safe_open(kept / "rank0.safetensors", "pt") as f:
        names = set(f.keys())
        gate_up = f.get_tensor("model.layers.0.mlp.experts.gate_up.weight_blocks")
        scales = f.get_tensor("model.layers.0.mlp.experts.down.weight_scales")
        router = f.get_tensor("model.layers.0.mlp.gate.weight")
    assert gate_up.dtype == torch.uint8 and tuple(gate_up.shape) == (4, 128, 2, 16)  # [E, 2I, H / 32, 16]
    assert scales.dtype == torch.uint8 and tuple(scales.shape) == (4, 64, 2)  # [E, H, I / 32]
    assert router.dtype == torch.float32  # linears stay in the engine dtype
    assert not any(n.endswith("experts.gate_up.weight") or n.endswith("experts.down.weight") for n in names)
    # 4.25 bits instead of 32 a weight: the experts are most of this model's weights
    assert (kept / "rank0.safetensors").stat().st_size < 0.7 * (dequantized / "rank0.safetensors").stat().st_size


def test_kiln_build_dequantize_flag_builds_a_float_engine(engines, tmp_path, capsys):
    from kiln.cli import main

    checkpoint = engines[0]
    limits = ["--max-batch-size", "8", "--max-num-tokens", "64", "--max-seq-len", "128"]
    assert main(["build", "--checkpoint", str(checkpoint), "--output", str(tmp_path / "e"), "--dequantize",
                 *limits]) == 0
    assert load_engine_spec(tmp_path / "e").build_config["quantization"] is None
    assert "full_prec" in capsys.readouterr().err


def test_engine_summary_reports_the_smaller_weights(engines):
    from kiln.commands.build_summary import engine_summary

    _, kept, _, _ = engines
    first = engine_summary(kept).splitlines()[0]
    assert "mxfp4; float32 would be" in first, first


def test_mxfp4_engine_matches_the_dequantized_engine_and_transformers(engines):
    _, kept, dequantized, model = engines
    (kept_out, kept_bytes), (float_out, float_bytes) = generate(kept), generate(dequantized)
    assert kept_bytes < 0.7 * float_bytes  # the memory plan counts the MXFP4 experts' bytes
    for prompt, mx, fl in zip(PROMPTS, kept_out, float_out):
        assert mx.token_ids == fl.token_ids == hf_greedy(model, prompt, NEW_TOKENS), f"prompt of {len(prompt)}"
        assert mx.prompt_logprobs[1:] == pytest.approx(fl.prompt_logprobs[1:], abs=1e-5)
        assert mx.prompt_logprobs[1:] == pytest.approx(hf_prompt_logprobs(model, prompt), abs=1e-4)


def test_mxfp4_engine_under_chunked_prefill_and_preemption_matches_transformers(engines):
    """8-token steps (prompts in chunks), four sequences at a time in 80 tokens of KV cache (preemptions)."""
    from kiln.runtime import LLM, SamplingParams

    _, kept, _, model = engines
    with LLM(kept, max_num_tokens=8, max_batch_size=4, num_kv_blocks=5) as llm:
        outputs = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
        stats = llm.kv_cache_stats()
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
    assert stats["num_preemptions"] > 0


def test_tp2_mxfp4_matches_transformers(tmp_path):
    """Each rank holds half of every expert's intermediate features: 32 of 64, one whole MXFP4 block of down."""
    checkpoint, model = make_mxfp4_checkpoint(tmp_path / "ckpt")
    engine = build_engine(checkpoint, tmp_path / "tp2", BuildConfig(tp_size=2, **LIMITS), progress=False)
    with safe_open(engine / "rank1.safetensors", "pt") as f:
        assert tuple(f.get_tensor("model.layers.0.mlp.experts.down.weight_blocks").shape) == (4, 64, 1, 16)
    for prompt, out in zip(PROMPTS, generate(engine, max_num_tokens=16)[0]):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
        assert out.prompt_logprobs[1:] == pytest.approx(hf_prompt_logprobs(model, prompt), abs=1e-4)


def test_tp_split_through_an_mxfp4_block_is_refused_by_name(tmp_path):
    checkpoint, _ = make_mxfp4_checkpoint(tmp_path / "ckpt", intermediate_size=96)  # 48 a rank at TP=2
    with pytest.raises(BuildError, match=r"experts\.down\.weight_blocks \[4, 64, 96 / 32, 16\].*tp_size=2.*"
                                         r"--dequantize"):
        build_engine(checkpoint, tmp_path / "tp2", BuildConfig(tp_size=2, **LIMITS), progress=False)
    # dequantized, the same split is fine
    build_engine(checkpoint, tmp_path / "tp2", BuildConfig(tp_size=2, dequantize=True, **LIMITS), progress=False)


@pytest.mark.parametrize("weight_files", [True, False])
def test_dummy_weights_of_an_mxfp4_config_keep_the_experts_mxfp4(engines, tmp_path, weight_files):
    """Benchmarks build GPT-OSS from config.json alone: its experts MXFP4 as the checkpoint's would be, the scales
    2 ** -7 (weights of RMS ~0.02, as the float dummies), also when drawn at load (no weight files)."""
    from kiln.runtime import LLM, SamplingParams

    config = BuildConfig(dummy_weights=True, weights_at_load=not weight_files, **LIMITS)
    engine = build_engine(engines[0], tmp_path / "dummy", config, progress=False)
    assert load_engine_spec(engine).build_config["quantization"]["qformat"] == "mxfp4"
    if weight_files:
        with safe_open(engine / "rank0.safetensors", "pt") as f:
            assert bool((f.get_tensor("model.layers.1.mlp.experts.down.weight_scales") == 120).all())
    with LLM(engine) as llm:
        out = llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, ignore_eos=True))[0]
        assert llm.engine.executor.runner.model.model.layers[0].mlp.experts.mxfp4
    assert len(out.token_ids) == 4


def test_dequantize_without_a_quantized_checkpoint_is_refused(tmp_path):
    checkpoint, _ = make_checkpoint(tmp_path / "ckpt")
    with pytest.raises(BuildError, match="--dequantize: the checkpoint is not quantized"):
        build_engine(checkpoint, tmp_path / "engine", BuildConfig(dequantize=True, **LIMITS), progress=False)


def test_dequantize_of_a_format_kept_as_it_is_is_refused():
    from kiln.builder.quantize import plan_quantization
    from kiln.checkpoints.prequant.base import CheckpointQuantization
    from kiln.quant.base import QuantError

    class Other(CheckpointQuantization):
        name = "ModelOpt FP8 (hf_quant_config.json)"
        quant_spec = layer_tensors = module_tensors = None

    with pytest.raises(QuantError, match="--dequantize reads MXFP4 checkpoints.*ModelOpt FP8"):
        plan_quantization(BuildConfig(dequantize=True), None, SimpleNamespace(mla=None, moe=None), torch.float32,
                          Other())


def test_the_op_refuses_bad_blocks_by_name():
    x, logits = torch.randn(2, 64), torch.randn(2, 4)
    gu_b, gu_s = torch.zeros(4, 96, 2, 16, dtype=torch.uint8), torch.zeros(4, 96, 2, dtype=torch.uint8)
    d_b, d_s = torch.zeros(4, 64, 1, 16, dtype=torch.uint8), torch.zeros(4, 64, 1, dtype=torch.uint8)
    with pytest.raises(ValueError, match=r"down_blocks \[4, 64, 1, 16\].*\[4, 64, 48\]"):  # I = 48: not whole blocks
        fused_moe_mxfp4(x, logits, gu_b, gu_s, d_b, d_s, top_k=2, renormalize=True)
    with pytest.raises(ValueError, match="gate_up_scales has dtype"):
        fused_moe_mxfp4(x, logits, gu_b[:, :64].contiguous(), gu_s[:, :64].float(), d_b, d_s, top_k=2, renormalize=True)


def random_mxfp4(experts: int, rows: int, cols: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Random codes and scales near 2 ** 0 (a weight [E, rows, cols] of magnitude about 1 / sqrt(cols))."""
    blocks = torch.randint(0, 256, (experts, rows, cols // 32, 16), generator=gen, dtype=torch.uint8)
    low = 127 - 3 - int(torch.tensor(cols).log2()) // 2
    scales = torch.randint(low, low + 3, (experts, rows, cols // 32), generator=gen).to(torch.uint8)
    return blocks, scales


def test_reference_equals_the_float_reference_on_dequantized_weights():
    """The reference is moe.py's on the dequantized weights, bit for bit (what makes the engines agree)."""
    from kiln.plugins.moe import fused_moe_reference

    gen = torch.Generator().manual_seed(0)
    gate_up, down = random_mxfp4(4, 128, 64, gen), random_mxfp4(4, 64, 64, gen)
    x, logits = torch.randn(9, 64, generator=gen), torch.randn(9, 4, generator=gen)
    b_gate_up, b_down = torch.randn(4, 128, generator=gen), torch.randn(4, 64, generator=gen)
    got = fused_moe_mxfp4_reference(x, logits, *gate_up, *down, 2, True, b_gate_up, b_down, 1.0, 1.702)
    want = fused_moe_reference(x, logits, dequantize_mxfp4(*gate_up), dequantize_mxfp4(*down), 2, True, b_gate_up,
                               b_down, 1.0, 1.702)
    assert torch.equal(got, want)


# --- the Triton kernel: on the CPU under Triton's interpreter, on CUDA at GPT-OSS-20B's shapes ---

_INTERPRETED_CHECKS = """
import torch
from kiln.plugins.mxfp4_moe import fused_moe_mxfp4_reference
from kiln.plugins import triton_mxfp4_moe
from kiln.plugins.triton_mxfp4_moe import fused_moe_mxfp4_triton

gen = torch.Generator().manual_seed(0)
{random_mxfp4}

def check(tokens, experts, top_k, hidden, inter, dtype, bias, limit, tol):
    gate_up, down = random_mxfp4(experts, 2 * inter, hidden, gen), random_mxfp4(experts, hidden, inter, gen)
    x = torch.randn(tokens, hidden, generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, generator=gen)
    biases = (torch.randn(experts, 2 * inter, generator=gen).to(dtype),
              torch.randn(experts, hidden, generator=gen).to(dtype)) if bias else (None, None)
    args = (x, logits, *gate_up, *down, top_k, True, *biases, limit, 1.702 if limit else 0.0)
    want, got = fused_moe_mxfp4_reference(*args), fused_moe_mxfp4_triton(*args)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol,
                               msg=lambda m: f"{{KERNELS}} T={{tokens}} E={{experts}} {{dtype}} bias={{bias}}: {{m}}")


# GPT-OSS's block (biases, clamped SwiGLU) at decode and prefill sizes (BLOCK_M 16 and 64), float32 and float16;
# plain SwiGLU without biases; intermediate sizes that leave a partial BLOCK_N and BLOCK_K tile; both kernel sets
# (the pairs kernels at a small tile and at their default one, whose BLOCK_K runs past 160 inputs).
for KERNELS, launch in (("tiles", None), ("pairs", dict(BLOCK_N=32, BLOCK_K=64, num_warps=4, num_stages=3))):
    triton_mxfp4_moe.KERNELS = KERNELS
    triton_mxfp4_moe.PAIRS_LAUNCH = launch or triton_mxfp4_moe.PAIRS_LAUNCH
    check(1, 4, 2, 64, 64, torch.float32, True, 1.0, 1e-4)
    check(7, 4, 2, 96, 32, torch.float32, True, 1.0, 1e-4)
    check(40, 4, 2, 64, 96, torch.float32, True, 1.0, 1e-4)
    check(5, 8, 4, 64, 64, torch.float16, True, 1.0, 2e-2)
    check(6, 4, 2, 64, 32, torch.float32, False, 0.0, 1e-4)
triton_mxfp4_moe.PAIRS_LAUNCH = dict(BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)
check(3, 4, 2, 160, 96, torch.float32, True, 1.0, 1e-4)
print("ok")
"""


_DECODE_CHECK = """
import torch
import triton
import triton.language as tl
from kiln.plugins.mxfp4 import dequantize_mxfp4
from kiln.plugins.triton_mxfp4_pairs import _e2m1_times_scale


@triton.jit
def decode(codes_ptr, scales_ptr, out_ptr, N: tl.constexpr):
    i = tl.arange(0, N)
    code = tl.load(codes_ptr + i).to(tl.int32)
    s = tl.load(scales_ptr + i).to(tl.int32)
    tl.store(out_ptr + i, _e2m1_times_scale(code, (s - 1) << 23))


# Every code at every scale the bits trick is exact for (2 .. 252): 16 x 251 values, as the reference decodes them.
scales = torch.arange(2, 253, dtype=torch.uint8).repeat_interleave(16)  # [4016]
codes = torch.arange(16, dtype=torch.uint8).repeat(251)
out = torch.empty(4096, dtype=torch.float32)
decode[(1,)](torch.cat([codes, torch.zeros(80, dtype=torch.uint8)]),
             torch.cat([scales, torch.full((80,), 127, dtype=torch.uint8)]), out, N=4096)
pairs = torch.arange(0, 16, 2, dtype=torch.uint8) | (torch.arange(1, 16, 2, dtype=torch.uint8) << 4)  # [8]
blocks = pairs.repeat(2).repeat(251, 1)  # [251, 16]: a block a scale, codes 0..15 twice
want = dequantize_mxfp4(blocks, scales.view(-1, 16)[:, 0].contiguous())  # [251 * 32]
want = want.view(251, 2, 16)[:, 0].reshape(-1)  # the first 16 of each block: codes 0..15
assert torch.equal(out[:4016], want), (out[:4016] - want).abs().max()
print("ok")
"""


@needs_triton
def test_pairs_decode_is_exact_for_every_code_and_scale_interpreted():
    """triton_mxfp4_pairs decodes E2M1 x E8M0 in float32 bits: equal to the reference's product for every code
    and every scale in [2 ** -125, 2 ** 125]."""
    assert "ok" in run_interpreted(_DECODE_CHECK)


@needs_triton
def test_mxfp4_kernel_matches_reference_interpreted():
    out = run_interpreted(_INTERPRETED_CHECKS.format(random_mxfp4=inspect.getsource(random_mxfp4)))
    assert "ok" in out


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and USE_TRITON), reason="needs CUDA and triton")
@pytest.mark.parametrize("kernels", ["tiles", "pairs"])
@pytest.mark.parametrize("tokens", [1, 8, 256])
def test_mxfp4_kernel_matches_reference_at_gpt_oss_20b_shapes_cuda(tokens, kernels, monkeypatch):
    """GPT-OSS-20B's experts (32 of hidden 2880 and intermediate 2880, top 4, biases, limit 7) in bfloat16: the
    kernels against the dequantizing reference, and against the float MoE kernel on the dequantized weights
    (the same GEMM operands, so only the order of float32 sums may differ)."""
    from kiln.plugins import fused_moe, triton_mxfp4_moe

    monkeypatch.setattr(triton_mxfp4_moe, "KERNELS", kernels)

    gen = torch.Generator().manual_seed(0)
    experts, hidden, inter, top_k = 32, 2880, 2880, 4
    gate_up, down = random_mxfp4(experts, 2 * inter, hidden, gen), random_mxfp4(experts, hidden, inter, gen)
    gate_up, down = [t.cuda() for t in gate_up], [t.cuda() for t in down]
    x = torch.randn(tokens, hidden, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(tokens, experts, generator=gen).cuda()
    b_gate_up = (0.1 * torch.randn(experts, 2 * inter, generator=gen)).to("cuda", torch.bfloat16)
    b_down = (0.1 * torch.randn(experts, hidden, generator=gen)).to("cuda", torch.bfloat16)
    kw = dict(top_k=top_k, renormalize=True, b_gate_up=b_gate_up, b_down=b_down, swiglu_limit=7.0,
              swiglu_alpha=1.702)
    got = fused_moe_mxfp4(x, logits, *gate_up, *down, **kw)
    want = fused_moe_mxfp4_reference(x, logits, *gate_up, *down, top_k, True, b_gate_up, b_down, 7.0, 1.702)
    # Outputs of magnitude 1.5 (8 at most); the intermediate SwiGLU activation is rounded to bfloat16 between the
    # two GEMMs, so a one-step rounding flip there moves an output by a bfloat16 step of the activation times a
    # weight: an H200 measured 4 of 737,280 elements 0.0625 apart (near-zero outputs) at 256 tokens.
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=0.1)
    w_gate_up, w_down = (dequantize_mxfp4(*t).to(torch.bfloat16) for t in (gate_up, down))
    float_kernel = fused_moe(x, logits, w_gate_up, w_down, **kw)
    torch.testing.assert_close(got.float(), float_kernel.float(), rtol=1e-2, atol=0.1)  # the same flips


@pytest.mark.gpu
@pytest.mark.skipif(not (torch.cuda.is_available() and USE_TRITON), reason="needs CUDA and triton")
def test_mxfp4_kernel_replays_in_a_cuda_graph():
    """Sized by the token count alone (no host read of the routing): captured once, it routes new inputs afresh."""
    from cuda_graph_capture import capture

    gen = torch.Generator().manual_seed(1)
    gate_up, down = random_mxfp4(32, 2 * 256, 256, gen), random_mxfp4(32, 256, 256, gen)
    gate_up, down = [t.cuda() for t in gate_up], [t.cuda() for t in down]
    x = torch.randn(8, 256, generator=gen).to("cuda", torch.bfloat16)
    logits = torch.randn(8, 32, generator=gen).cuda()
    kw = dict(top_k=4, renormalize=True, swiglu_limit=7.0, swiglu_alpha=1.702)
    graph, out = capture(lambda: fused_moe_mxfp4(x, logits, *gate_up, *down, **kw))
    x.copy_(torch.randn(8, 256, generator=gen).to(torch.bfloat16))
    logits.copy_(torch.randn(8, 32, generator=gen))
    graph.replay()
    torch.cuda.synchronize()
    want = fused_moe_mxfp4_reference(x, logits, *gate_up, *down, 4, True, None, None, 7.0, 1.702)
    torch.testing.assert_close(out.float(), want.float(), rtol=2e-2, atol=2e-2)
