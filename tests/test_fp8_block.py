"""Block-scaled FP8 (quant_method "fp8", the layout of Qwen's and DeepSeek's FP8 releases): the operator
against the formula computed by hand in float64, the method's quantize round trip, and checkpoints of a tiny
random Llama quantized here, built by kiln and run against transformers on the weights this file dequantizes
itself, with activations quantized per token and group by this file's own code. Refusals, by their messages.

Every quantization below (weights and activations) is written out again in this file from the format's
definition, so kiln's code is checked against the definition, not against itself.
"""

from __future__ import annotations

import copy
import json
import math
import shutil

import pytest
import torch
from model_factory import make_checkpoint
from safetensors.torch import load_file, save_file

from kiln.builder.build import BuildError, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.checkpoints.prequant.detect import detect_checkpoint_quantization
from kiln.engine_format import load_engine_spec
from kiln.plugins import fp8_block_linear
from kiln.quant.base import LinearPart, QuantError
from kiln.quant.fp8_block import Fp8BlockConfig, Fp8BlockLinear
from kiln.runtime import LLM, SamplingParams

FP8 = torch.float8_e4m3fn
LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj")
SMALL = dict(dtype="float32", max_seq_len=128, max_batch_size=8, max_num_tokens=64)
PROMPTS = [[5, 17, 99, 3, 250, 31, 7], [8, 8, 250, 31, 7, 64, 2, 90, 11, 300, 12], [300, 1, 44, 45, 46],
           [120, 121, 122, 123, 124, 125, 126, 127]]


# --- the definition, written out independently --------------------------------------------------------------


def _fp8(values: torch.Tensor) -> torch.Tensor:
    """float32 values already within ±448 -> their float8_e4m3fn rounding, back as float32."""
    return values.to(FP8).float()


def _quantize_weight_by_blocks(w: torch.Tensor, b0: int, b1: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w: [N, K] float -> (w_q [N, K] fp8, scale [ceil(N/b0), ceil(K/b1)] float32), block by block."""
    n, k = w.shape
    rows, cols = math.ceil(n / b0), math.ceil(k / b1)
    w_q, scale = torch.empty(n, k, dtype=FP8), torch.empty(rows, cols)
    for i in range(rows):
        for j in range(cols):
            block = w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1].float()
            s = max(block.abs().max().item(), 1e-12) / 448.0
            scale[i, j] = s
            w_q[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] = (block / scale[i, j]).clamp(-448, 448).to(FP8)
    return w_q, scale


def _dequantize_by_blocks(w_q: torch.Tensor, scale: torch.Tensor, b0: int, b1: int) -> torch.Tensor:
    """[N, K] float32: each element times its block's scale (weight_scale_inv multiplies)."""
    w = w_q.float()
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            w[i * b0:(i + 1) * b0, j * b1:(j + 1) * b1] *= scale[i, j]
    return w


def _group_scales(x: torch.Tensor, group: int) -> list[tuple[slice, torch.Tensor]]:
    """Per group of `group` columns of x [..., K]: (its columns, its per-token scale [..., 1] float32)."""
    k = x.shape[-1]
    out = []
    for start in range(0, k, group):
        cols = slice(start, min(start + group, k))
        amax = x[..., cols].float().abs().amax(dim=-1, keepdim=True)
        out.append((cols, (amax / 448.0).clamp(min=1e-12)))
    return out


def _fake_quantize_activation(x: torch.Tensor, group: int) -> torch.Tensor:
    """x [..., K] -> x_q * s_x per token and group of columns, in float32 (what the GEMM multiplies)."""
    out = torch.empty(x.shape, dtype=torch.float32)
    for cols, s in _group_scales(x, group):
        out[..., cols] = _fp8((x[..., cols].float() / s).clamp(-448, 448)) * s
    return out


def _by_hand(x, w_q, scale, b0, b1, bias=None) -> torch.Tensor:
    """The operator's formula in float64: per token t and k-group g, (Σ_k x_q w_q) · s_x[t, g] · scale[n // b0, g]."""
    n = w_q.shape[0]
    row_scale = scale.double().repeat_interleave(b0, dim=0)[:n]  # [N, G]
    y = torch.zeros(x.shape[0], n, dtype=torch.float64)
    for g, (cols, s) in enumerate(_group_scales(x, b1)):
        x_q = _fp8((x[:, cols].float() / s).clamp(-448, 448)).double()  # [T, cols]
        y += (x_q @ w_q[:, cols].double().t()) * s.double() * row_scale[None, :, g]
    return y if bias is None else y + bias.double()


def _assert_close_to(result: torch.Tensor, expected: torch.Tensor) -> None:
    """result (any float dtype) against a float64 expectation, at the tolerance of result's dtype."""
    if result.dtype == torch.float32:
        torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-4)
    else:  # one rounding to 16 bits apart at most
        torch.testing.assert_close(result, expected.to(result.dtype), rtol=1.6e-2, atol=1e-2)


# --- the operator ------------------------------------------------------------------------------------------


def _case(t, n, k, b0, b1, seed=0, dtype=torch.float32):
    torch.manual_seed(seed)
    x = (torch.randn(t, k) * torch.rand(1, k) * 4).to(dtype)  # columns of different ranges: groups differ
    w_q, scale = _quantize_weight_by_blocks(torch.randn(n, k) * torch.rand(n, 1), b0, b1)
    return x, w_q, scale


@pytest.mark.parametrize("t, n, k, b0, b1", [(5, 256, 256, 128, 128), (3, 100, 130, 128, 128),
                                             (4, 70, 200, 32, 64), (2, 33, 17, 8, 5), (1, 8, 1, 1, 1)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_the_operator_is_the_formula_with_partial_blocks(t, n, k, b0, b1, dtype):
    x, w_q, scale = _case(t, n, k, b0, b1, dtype=dtype)
    bias = torch.randn(n).to(dtype)
    for b in (None, bias):
        y = fp8_block_linear(x, w_q, scale, (b0, b1), b)
        assert y.dtype == dtype and y.shape == (t, n)
        _assert_close_to(y, _by_hand(x, w_q, scale, b0, b1, b))


def test_activations_are_quantized_per_group_not_per_token():
    # One large column would crush a per-token scale; per group of 64, the other groups keep their precision.
    x, w_q, scale = _case(3, 64, 256, 64, 64, seed=1)
    x[:, 0] = 1000.0
    y = fp8_block_linear(x, w_q, scale, [64, 64])
    _assert_close_to(y, _by_hand(x, w_q, scale, 64, 64))
    per_token = _by_hand(x, w_q, scale, 64, 256)  # the same weights, one activation scale per token
    assert (y.double() - per_token).abs().max() > 1e-3


def test_zero_rows_zero_groups_and_no_tokens_give_no_nan():
    x, w_q, scale = _case(3, 40, 96, 16, 32, seed=2)
    x[0] = 0.0
    x[1, 32:64] = 0.0
    bias = torch.randn(40)
    y = fp8_block_linear(x, w_q, scale, (16, 32), bias)
    assert torch.isfinite(y).all()
    assert torch.equal(y[0], bias)  # a zero row gives exactly the bias
    _assert_close_to(y, _by_hand(x, w_q, scale, 16, 32, bias))
    empty = fp8_block_linear(torch.empty(0, 96, dtype=torch.bfloat16), w_q, scale, (16, 32))
    assert empty.shape == (0, 40) and empty.dtype == torch.bfloat16


def test_the_operator_through_torch_library():
    x, w_q, scale = _case(3, 24, 40, 16, 16, seed=3)
    bias = torch.randn(24)
    via_op = torch.ops.kiln.fp8_block_linear(x, w_q, scale, [16, 16], bias)
    assert torch.equal(via_op, fp8_block_linear(x, w_q, scale, (16, 16), bias))
    # opcheck's schema test compares inputs with ops the CPU lacks for float8 ("mul_cpu_reduced_float")
    torch.library.opcheck(torch.ops.kiln.fp8_block_linear.default, (x, w_q, scale, [16, 16], bias),
                          test_utils=("test_faketensor",))
    compiled = torch.compile(lambda a: fp8_block_linear(a, w_q, scale, (16, 16), bias), backend="eager", fullgraph=True)
    assert torch.equal(compiled(x), via_op)


def _call(**bad):
    args = dict(x=torch.randn(2, 40), weight=torch.zeros(24, 40, dtype=FP8), weight_scale_inv=torch.ones(2, 3),
                block_size=(16, 16), bias=None)
    args.update(bad)
    return fp8_block_linear(**args)


@pytest.mark.parametrize("bad, message", [
    ({"weight": torch.zeros(24, 40)}, "weight has dtype torch.float32"),
    ({"weight": torch.zeros(40, 24, dtype=FP8).t()}, "weight must be contiguous"),
    ({"weight": torch.zeros(24, 0, dtype=FP8)}, "K = 0"),
    ({"x": torch.randn(2, 41)}, r"x.shape\[1\] is 41, expected 40"),
    ({"x": torch.randn(2, 40, dtype=torch.float64)}, "x has dtype torch.float64"),
    ({"x": torch.randn(40)}, "x must have 2 dims"),
    ({"weight_scale_inv": torch.ones(3, 3)}, r"weight_scale_inv.shape\[0\] is 3, expected 2 \(row blocks"),
    ({"weight_scale_inv": torch.ones(2, 2)}, r"weight_scale_inv.shape\[1\] is 2, expected 3 \(column blocks"),
    ({"weight_scale_inv": torch.ones(2, 3, dtype=torch.float16)}, "weight_scale_inv has dtype torch.float16"),
    ({"block_size": (16,)}, "block_size must be two positive ints"),
    ({"block_size": (0, 16)}, "block_size must be two positive ints"),
    ({"block_size": (16.0, 16)}, "block_size must be two positive ints"),
    ({"bias": torch.ones(24, dtype=torch.float16)}, "bias has dtype torch.float16"),
    ({"bias": torch.ones(23)}, r"bias.shape\[0\] is 23"),
    ({"weight_scale_inv": torch.ones(2, 3, device="meta")}, "different devices"),
])
def test_bad_arguments_are_named(bad, message):
    with pytest.raises(ValueError, match=message):
        _call(**bad)


# --- the method --------------------------------------------------------------------------------------------


def test_quantize_makes_the_blocks_of_the_definition_and_round_trips():
    torch.manual_seed(4)
    parts = [LinearPart("q", torch.randn(48, 100)), LinearPart("k", torch.randn(20, 100))]  # blocks straddle parts
    method = Fp8BlockConfig((32, 48)).linear_method("model.layers.0.self_attn.qkv_proj", 100, 68, torch.float32)
    assert isinstance(method, Fp8BlockLinear) and method.block_size == (32, 48)
    decls = method.tensors(100, 68, bias=True)
    assert {n: (d.shape, d.dtype) for n, d in decls.items()} == {
        "weight": ((68, 100), FP8), "weight_scale_inv": ((3, 3), torch.float32), "bias": ((68,), torch.float32)}
    made = method.quantize(parts)
    weight = torch.cat([p.weight for p in parts])
    w_q, scale = _quantize_weight_by_blocks(weight, 32, 48)
    assert torch.equal(made["weight"].view(torch.uint8), w_q.view(torch.uint8))
    assert torch.equal(made["weight_scale_inv"], scale)
    back = _dequantize_by_blocks(made["weight"], made["weight_scale_inv"], 32, 48)
    assert ((back - weight).abs() <= weight.abs() / 16 + scale.max() * 2 ** -9).all()  # e4m3: 3 mantissa bits


def test_the_config_excludes_and_checks_its_block_size():
    config = Fp8BlockConfig((128, 128))
    assert config.linear_method("lm_head", 64, 100, torch.float32) is None
    with pytest.raises(QuantError, match=r"block_size=\(128,\) must be two positive integers"):
        Fp8BlockConfig((128,))


# --- checkpoints -------------------------------------------------------------------------------------------

BLOCK_128 = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2)
# 128 columns in groups of 48 and down_proj's 224 too: the last column blocks are partial.
BLOCK_32_48 = dict(hidden_size=128, intermediate_size=224, num_attention_heads=4, num_key_value_heads=2)


def _write_fp8_checkpoint(src, dst, quantization_config: dict, quantize_module) -> dict:
    """Copies checkpoint `src` to `dst` with every decoder linear replaced by `quantize_module(name, weight)`'s
    tensors, and `quantization_config` in config.json; returns the new tensors by name."""
    shutil.copytree(src, dst)
    tensors = load_file(dst / "model.safetensors")
    layers = json.loads((dst / "config.json").read_text())["num_hidden_layers"]
    for i in range(layers):
        for linear in LINEARS:
            module = f"model.layers.{i}.{linear}"
            tensors.update(quantize_module(module, tensors.pop(f"{module}.weight")))
    save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config))
    return tensors


def _block_quantizer(b0, b1):
    def quantize(module, weight):
        w_q, scale = _quantize_weight_by_blocks(weight, b0, b1)
        return {f"{module}.weight": w_q, f"{module}.weight_scale_inv": scale}
    return quantize


def _block_config(b0, b1, **extra):
    return {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic", "weight_block_size": [b0, b1],
            **extra}


@pytest.fixture(scope="module", params=[(128, 128, BLOCK_128), (32, 48, BLOCK_32_48)], ids=["128x128", "32x48"])
def block_checkpoint(request, tmp_path_factory):
    b0, b1, sizes = request.param
    root = tmp_path_factory.mktemp(f"fp8-block-{b0}x{b1}")
    src, model = make_checkpoint(root / "float", **sizes)
    tensors = _write_fp8_checkpoint(src, root / "fp8", _block_config(b0, b1), _block_quantizer(b0, b1))
    return root / "fp8", model, tensors, (b0, b1)


class _ActivationQuant:
    """Hooks on transformers' decoder linears that replace each input by its fake-quantized value (groups of
    `group` columns, None = the whole row; or a static per-tensor scale per module)."""

    def __init__(self, model, group: int | None = None, static: dict[str, float] | None = None):
        self.handles = []
        for name, module in model.named_modules():
            if any(name.endswith(linear) for linear in LINEARS):
                self.handles.append(module.register_forward_pre_hook(self._hook(name, group, static)))

    @staticmethod
    def _hook(name, group, static):
        def hook(module, args):
            (x,) = args
            if static is not None:
                s = static[name]
                return (_fp8((x.float() / s).clamp(-448, 448)) * s).to(x.dtype)
            return _fake_quantize_activation(x, group or x.shape[-1]).to(x.dtype)
        return hook

    def remove(self):
        for h in self.handles:
            h.remove()


def _dequantized_model(model, tensors, dequantize):
    """A copy of the float model running the checkpoint's weights as `dequantize(module)` gives them."""
    ref = copy.deepcopy(model)
    state = ref.state_dict()
    for i in range(model.config.num_hidden_layers):
        for linear in LINEARS:
            module = f"model.layers.{i}.{linear}"
            state[f"{module}.weight"] = dequantize(module)
    ref.load_state_dict(state)
    return ref


def _reference(ref, hooks, prompts, max_new_tokens):
    """(greedy tokens, prompt logprobs after the first token) of transformers with the hooks in place."""
    greedy, logprobs = [], []
    with torch.no_grad():
        for prompt in prompts:
            ids = list(prompt)
            for _ in range(max_new_tokens):
                ids.append(int(ref(torch.tensor([ids])).logits[0, -1].argmax()))
            greedy.append(ids[len(prompt):])
            lp = torch.log_softmax(ref(torch.tensor([prompt])).logits[0].double(), dim=-1)
            logprobs.append([lp[i - 1, prompt[i]].item() for i in range(1, len(prompt))])
    hooks.remove()
    return greedy, logprobs


def _kiln(engine, prompts, max_new_tokens):
    llm = LLM(engine)
    greedy = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_new_tokens, temperature=0,
                                                                        ignore_eos=True))]
    outs = llm.generate(prompts, SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=True))
    return greedy, [o.prompt_logprobs[1:] for o in outs]


def _max_diff(a, b) -> float:
    return max(abs(x - y) for xs, ys in zip(a, b) for x, y in zip(xs, ys))


def _assert_logprobs_match(got, want) -> None:
    """kiln and the reference differ by float32 rounding (sums in another order, about 1e-6 here), but an
    activation that lies a hair from an FP8 rounding boundary may round the other way in one of them: one
    FP8 step of one element, seen as up to a few 1e-3 in a logprob (measured: 2.9e-3 once in 27 positions).
    So nearly every position agrees within 1e-4, and none is off by 1e-2; a wrong quantization (per-token
    scales, no activation quantization, a misread scale) is off by 1e-1 or more almost everywhere."""
    diffs = [abs(x - y) for xs, ys in zip(got, want) for x, y in zip(xs, ys)]
    assert len(diffs) == sum(len(p) - 1 for p in PROMPTS)
    assert max(diffs) < 1e-2, diffs
    assert sum(d > 1e-4 for d in diffs) <= 2, diffs


def test_a_block_fp8_checkpoint_builds_exactly_and_runs_like_transformers(block_checkpoint, tmp_path):
    checkpoint, model, tensors, (b0, b1) = block_checkpoint
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(**SMALL), progress=False)

    recorded = load_engine_spec(engine).build_config["quantization"]
    assert recorded["qformat"] == "fp8_block" and recorded["block_size"] == [b0, b1]
    assert recorded["kv_cache_dtype"] == "auto" and recorded["exclude_modules"] == ["lm_head"]
    assert recorded["source"] == f"FP8 block (quant_method fp8, weight_block_size [{b0}, {b1}])"

    # The engine holds the checkpoint's FP8 codes and scales, fused by rows, bit for bit.
    written = load_file(engine / "rank0.safetensors")
    for fused, parts in (("self_attn.qkv_proj", ("q_proj", "k_proj", "v_proj")), ("mlp.gate_up_proj", ("gate_proj",
                                                                                                       "up_proj"))):
        prefix, parent = f"model.layers.1.{fused}", f"model.layers.1.{fused.split('.')[0]}"
        for attr, view in (("weight", torch.uint8), ("weight_scale_inv", torch.float32)):
            expected = torch.cat([tensors[f"{parent}.{p}.{attr}"] for p in parts])
            assert torch.equal(written[f"{prefix}.{attr}"].view(view), expected.view(view)), (prefix, attr)
    assert written["lm_head.weight"].dtype == torch.float32

    def dequantize(module):
        return _dequantized_model_weight(tensors, module, b0, b1)

    ref = _dequantized_model(model, tensors, dequantize)
    want_greedy, want_lp = _reference(ref, _ActivationQuant(ref, group=b1), PROMPTS, 8)
    _, per_token_lp = _reference(ref, _ActivationQuant(ref), PROMPTS, 0)
    got_greedy, got_lp = _kiln(engine, PROMPTS, 8)
    assert got_greedy == want_greedy
    _assert_logprobs_match(got_lp, want_lp)
    # Per-token activation scales instead of per-group ones (the nearest wrong reading) are far off.
    assert _max_diff(got_lp, per_token_lp) > 5e-2


def _dequantized_model_weight(tensors, module, b0, b1):
    return _dequantize_by_blocks(tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"], b0, b1)


def test_the_dequantization_here_is_transformers_own(block_checkpoint):
    checkpoint, _, tensors, (b0, b1) = block_checkpoint
    if b0 != 128:
        pytest.skip("transformers' dequantizer takes whole blocks only")
    fp8_module = pytest.importorskip("transformers.integrations.finegrained_fp8")
    dequantizer = getattr(fp8_module, "Fp8Dequantize", None)
    if dequantizer is None or not hasattr(dequantizer, "_dequantize_one"):
        pytest.skip("this transformers has no Fp8Dequantize._dequantize_one")
    module = "model.layers.0.mlp.down_proj"
    theirs = dequantizer(None)._dequantize_one(tensors[f"{module}.weight"], tensors[f"{module}.weight_scale_inv"],
                                               output_dtype=torch.float32)
    assert torch.equal(theirs, _dequantized_model_weight(tensors, module, b0, b1))


# Static activation scales, about amax / 448 of the tiny model's inputs to these layers (measured: 1.9 to 4.6):
# a few activations saturate, as they may with a static scale; the reference clamps the same way.
STATIC_INPUT_SCALES = {"q_proj": 0.008, "k_proj": 0.008, "v_proj": 0.008, "o_proj": 0.005, "gate_proj": 0.008,
                       "up_proj": 0.008, "down_proj": 0.008}


@pytest.mark.parametrize("dynamic", [True, False])
def test_a_per_tensor_fp8_checkpoint_builds_as_fp8_dynamic_or_fp8(dynamic, tmp_path):
    src, model = make_checkpoint(tmp_path / "float")
    input_scales = {}

    def quantize(module, weight):
        scale = weight.abs().max() / 448.0  # [] : one per tensor
        out = {f"{module}.weight": (weight / scale).clamp(-448, 448).to(FP8), f"{module}.weight_scale": scale}
        if not dynamic:  # q/k/v and gate/up see the same input, so a calibration gives them the same scale
            input_scales[module] = STATIC_INPUT_SCALES[module.rsplit(".", 1)[1]]
            out[f"{module}.input_scale"] = torch.tensor([input_scales[module]])
        return out

    config = {"quant_method": "fp8", "activation_scheme": "dynamic" if dynamic else "static"}
    tensors = _write_fp8_checkpoint(src, tmp_path / "fp8", config, quantize)
    engine = build_engine(tmp_path / "fp8", tmp_path / "engine", BuildConfig(**SMALL), progress=False)
    recorded = load_engine_spec(engine).build_config["quantization"]
    assert recorded["qformat"] == ("fp8_dynamic" if dynamic else "fp8") and recorded["block_size"] is None
    assert recorded["source"] == f"FP8 per tensor (quant_method fp8, activation_scheme {config['activation_scheme']})"

    ref = _dequantized_model(model, tensors, lambda m: tensors[f"{m}.weight"].float() * tensors[f"{m}.weight_scale"])
    hooks = _ActivationQuant(ref, static=None if dynamic else input_scales)
    want_greedy, want_lp = _reference(ref, hooks, PROMPTS, 8)
    got_greedy, got_lp = _kiln(engine, PROMPTS, 8)
    assert got_greedy == want_greedy
    _assert_logprobs_match(got_lp, want_lp)


# --- refusals ----------------------------------------------------------------------------------------------


def _variant(block_checkpoint, tmp_path, config_change=None, tensor_change=None):
    checkpoint, *_ = block_checkpoint
    dst = tmp_path / "variant"
    shutil.copytree(checkpoint, dst)
    if config_change is not None:
        config = json.loads((dst / "config.json").read_text())
        config_change(config["quantization_config"])
        (dst / "config.json").write_text(json.dumps(config))
    if tensor_change is not None:
        tensors = load_file(dst / "model.safetensors")
        tensor_change(tensors)
        save_file(tensors, dst / "model.safetensors", metadata={"format": "pt"})
    return dst


@pytest.mark.parametrize("change, message", [
    (lambda c: c.update(activation_scheme="static"),
     r"quantization_config.activation_scheme='static' is not read by kiln; it reads \"dynamic\" with weight_block"),
    (lambda c: c.update(fmt="e5m2"), r"quantization_config.fmt='e5m2' is not read by kiln; it reads .*\"e4m3\""),
    (lambda c: c.update(weight_block_size=[128]), r"weight_block_size=\[128\] must be two positive integers"),
    (lambda c: c.update(weight_block_size=[0, 128]), r"weight_block_size=\[0, 128\] must be two positive integers"),
    (lambda c: c.update(modules_to_not_convert="lm_head"), "modules_to_not_convert='lm_head' must be a list"),
    (lambda c: c.update(modules_to_not_convert=["model.layers.0.self_attn.k_proj"]),
     r"modules_to_not_convert leaves model.layers.0.self_attn.k_proj unquantized, but the checkpoint stores "
     r"model.layers.0.self_attn.k_proj quantized"),
    (lambda c: c.update(modules_to_convert=["model.embed_tokens"]), "modules_to_convert=.* is not read by kiln"),
    (lambda c: c.pop("weight_block_size"), "stores weight_scale_inv"),
])
def test_a_config_kiln_cannot_read_exactly_is_refused_before_any_work(block_checkpoint, tmp_path, change, message):
    variant = _variant(block_checkpoint, tmp_path, config_change=change)
    with pytest.raises(BuildError, match=message):
        build_engine(variant, tmp_path / "engine", BuildConfig(**SMALL), progress=False)
    assert not (tmp_path / "engine").exists()


def test_ignored_layers_exclude_like_modules_to_not_convert(block_checkpoint, tmp_path):
    checkpoint, model, tensors, (b0, b1) = block_checkpoint

    def unquantize_layer_1(t):  # layer 1's attention stored in float, as a release may keep sensitive layers
        for p in ("q_proj", "k_proj", "v_proj"):
            module = f"model.layers.1.self_attn.{p}"
            t[f"{module}.weight"] = _dequantized_model_weight(t, module, b0, b1)
            del t[f"{module}.weight_scale_inv"]

    variant = _variant(block_checkpoint, tmp_path, tensor_change=unquantize_layer_1, config_change=lambda c: c.update(
        ignored_layers=[f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")]))
    names = set(load_file(variant / "model.safetensors"))
    reader = detect_checkpoint_quantization(variant, json.loads((variant / "config.json").read_text()), names)
    assert "model.layers.1.self_attn.qkv_proj" in reader.quant_spec().exclude_modules
    engine = build_engine(variant, tmp_path / "engine", BuildConfig(**SMALL), progress=False)
    written = load_file(engine / "rank0.safetensors")
    assert written["model.layers.1.self_attn.qkv_proj.weight"].dtype == torch.float32
    assert "model.layers.1.self_attn.qkv_proj.weight_scale_inv" not in written
    assert written["model.layers.0.self_attn.qkv_proj.weight"].dtype == FP8


def test_an_unquantized_part_that_is_not_excluded_is_named(block_checkpoint, tmp_path):
    checkpoint, model, tensors, (b0, b1) = block_checkpoint

    def unquantize_v(t):
        module = "model.layers.0.self_attn.v_proj"
        t[f"{module}.weight"] = _dequantized_model_weight(t, module, b0, b1)
        del t[f"{module}.weight_scale_inv"]

    variant = _variant(block_checkpoint, tmp_path, tensor_change=unquantize_v)
    with pytest.raises(BuildError, match=r"model.layers.0.self_attn.qkv_proj is quantized in the engine .* stores "
                                         r"model.layers.0.self_attn.v_proj unquantized \(no .*weight_scale_inv\); a "
                                         r"fused layer's parts must all be quantized"):
        build_engine(variant, tmp_path / "engine", BuildConfig(**SMALL), progress=False)
    assert not (tmp_path / "engine").exists()


def test_a_scale_of_the_wrong_shape_is_named(block_checkpoint, tmp_path):
    def widen(t):
        name = "model.layers.0.mlp.down_proj.weight_scale_inv"
        t[name] = torch.cat([t[name], t[name]], dim=1)

    variant = _variant(block_checkpoint, tmp_path, tensor_change=widen)
    with pytest.raises(BuildError, match=r"model.layers.0.mlp.down_proj.weight_scale_inv has shape \[\d+, \d+\], "
                                         r"expected"):
        build_engine(variant, tmp_path / "engine", BuildConfig(**SMALL), progress=False)


def test_a_fused_part_that_ends_inside_a_block_is_refused_naming_layer_and_sizes(tmp_path):
    # k_proj has 32 rows (2 kv heads of 16): with blocks of 64 rows its last block would share rows with v's.
    src, _ = make_checkpoint(tmp_path / "float")
    _write_fp8_checkpoint(src, tmp_path / "fp8", _block_config(64, 64), _block_quantizer(64, 64))
    with pytest.raises(BuildError, match=r"model.layers.0.self_attn.qkv_proj: part model.layers.0.self_attn.k_proj "
                                         r"has 32 rows, not a multiple of the checkpoint's block of 64 rows"):
        build_engine(tmp_path / "fp8", tmp_path / "engine", BuildConfig(**SMALL), progress=False)
    assert not (tmp_path / "engine").exists()


def test_static_input_scales_that_differ_within_a_fused_layer_are_refused(tmp_path):
    src, _ = make_checkpoint(tmp_path / "float")

    def quantize(module, weight):
        scale = weight.abs().max() / 448.0
        return {f"{module}.weight": (weight / scale).to(FP8), f"{module}.weight_scale": scale.reshape(1),
                f"{module}.input_scale": torch.tensor([0.01 + 0.001 * ("k_proj" in module)])}

    _write_fp8_checkpoint(src, tmp_path / "fp8", {"quant_method": "fp8", "activation_scheme": "static"}, quantize)
    with pytest.raises(BuildError, match=r"model.layers.0.self_attn.qkv_proj: its parts have different static input "
                                         r"scales"):
        build_engine(tmp_path / "fp8", tmp_path / "engine", BuildConfig(**SMALL), progress=False)
