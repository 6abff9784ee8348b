"""`kiln build` of AutoAWQ (GEMM) and GPTQ checkpoints: checkpoints written here in each format's documented
layout from a round-to-nearest quantization of a tiny random Llama, built by kiln, and compared with transformers
running the weights this file dequantizes from the format's definition (not with kiln's reader): the engine's
weights exactly, greedy tokens and prompt logprobs; the bundled kiln-tiny-code's perplexity as an AWQ checkpoint;
refusals of what kiln does not read.

The layouts written here (see checkpoints/prequant/awq.py and gptq.py for the sources):
- AWQ GEMM: qweight int32 [in, out / 8], word [k, c] nibble i = output column 8c + AWQ_ORDER[i]; qzeros int32
  [in / G, out / 8] likewise; scales fp16 [in / G, out]; w = (q - z) * s.
- GPTQ: qweight int32 [in / p, out], bits b*j of word [r, o] = input row r*p + j; qzeros int32 [in / G, out / p]
  along the output; scales fp16 [in / G, out]; g_idx int32 [in]; w = (q - z[g_idx]) * s[g_idx]; format "gptq"
  (v1) stores z - 1 as int32 arithmetic (GPTQModel's convert_gptq_v2_to_v1_format), "gptq_v2" stores z.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import transformers
from model_factory import hf_greedy, hf_perplexity, hf_prompt_logprobs, make_checkpoint
from safetensors.torch import load_file, save_file

from kiln.bench.perplexity import perplexity
from kiln.builder.build import BuildError, build_engine
from kiln.builder.build_config import BuildConfig
from kiln.checkpoints.prequant.gptq import GptqCheckpoint
from kiln.engine_format import load_engine_spec
from kiln.plugins.quant_linear import dequantize_weight
from kiln.quant.base import QuantError
from kiln.runtime import LLM, SamplingParams

EXAMPLES = Path(__file__).resolve().parent.parent / "examples"
TINY_CODE = EXAMPLES / "kiln-tiny-code"
HELDOUT = EXAMPLES / "heldout-sample.txt"

AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
# The checkpoint modules a Llama layer quantizes, by the input they read (parts that read the same input share a
# g_idx: GPTQ orders columns by the Hessian of that input).
LINEARS = {"self_attn.q_proj": "attn", "self_attn.k_proj": "attn", "self_attn.v_proj": "attn",
           "self_attn.o_proj": "o", "mlp.gate_proj": "mlp", "mlp.up_proj": "mlp", "mlp.down_proj": "down"}
# kiln's engine layers and the checkpoint modules they are made of, in row order.
ENGINE_LAYERS = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
                 "self_attn.o_proj": ("self_attn.o_proj",), "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj"),
                 "mlp.down_proj": ("mlp.down_proj",)}
SMALL = dict(dtype="float32", max_seq_len=128, max_batch_size=8, max_num_tokens=64)
PROMPTS = [[5, 17, 99, 3], [8, 8, 250, 31, 7, 64, 2, 90, 11], [300], [(7 * i + 3) % 390 + 2 for i in range(40)]]
NEW_TOKENS = 10


# --- the formats, written from their definitions ------------------------------------------------------------


def rtn(w: torch.Tensor, bits: int, g_idx: torch.Tensor, sym: bool):
    """Round-to-nearest per group, GPTQ's quantizer: w [N, K] float32, g_idx [K] -> (u [N, K] int64 0..2^b-1,
    scales [N, groups] fp16, zeros [N, groups] int64). Symmetric: zero 2^(b-1), scale 2 amax / (2^b - 1)."""
    n, _ = w.shape
    groups, maxq = int(g_idx.max()) + 1, 2 ** bits - 1
    u = torch.empty(w.shape, dtype=torch.int64)
    scales, zeros = torch.empty(n, groups), torch.empty(n, groups, dtype=torch.int64)
    for g in range(groups):
        cols = g_idx == g
        block = w[:, cols]
        if sym:
            s = (2 * block.abs().amax(1) / maxq).clamp(min=1e-6)
            z = torch.full((n,), (maxq + 1) // 2)
        else:
            lo, hi = block.amin(1).clamp(max=0), block.amax(1).clamp(min=0)
            s = ((hi - lo) / maxq).clamp(min=1e-6).half().float()  # z from the stored scale
            z = torch.round(-lo / s).clamp(0, maxq).long()
        s = s.half().float()  # the checkpoint stores fp16 scales: quantize with the stored value
        u[:, cols] = (torch.round(block / s[:, None]) + z[:, None]).clamp(0, maxq).long()
        scales[:, g], zeros[:, g] = s, z
    return u, scales.half(), zeros


def dequantized(u, scales, zeros, g_idx) -> torch.Tensor:
    """The format's definition: w[o, k] = (q[o, k] - z[o, g_idx[k]]) * s[o, g_idx[k]], float32 [N, K]."""
    g = g_idx.long()
    return (u - zeros[:, g]).float() * scales.float()[:, g]


def int32_words(x: torch.Tensor) -> torch.Tensor:
    """Unsigned 32-bit words (int64) -> the int32 tensors checkpoints store (two's complement)."""
    return ((x % 2 ** 32 + 2 ** 31) % 2 ** 32 - 2 ** 31).to(torch.int32)


def pack_awq(u_kn: torch.Tensor) -> torch.Tensor:
    """[R, C] values 0..15 -> AWQ GEMM int32 [R, C / 8]: nibble i of word c = column 8c + AWQ_ORDER[i]."""
    x = u_kn.reshape(u_kn.shape[0], -1, 8)
    return int32_words(sum(x[..., AWQ_ORDER[i]] << (4 * i) for i in range(8)))


def pack_gptq_rows(u_kn: torch.Tensor, bits: int) -> torch.Tensor:
    """GPTQ qweight: [K, N] -> int32 [K / p, N], field j of word [r, n] = row r*p + j."""
    p = 32 // bits
    x = u_kn.reshape(-1, p, u_kn.shape[1])
    return int32_words(sum(x[:, j] << (bits * j) for j in range(p)))


def pack_gptq_cols(z_gn: torch.Tensor, bits: int, v1: bool) -> torch.Tensor:
    """GPTQ qzeros: [G, N] -> int32 [G, N / p], field j of word [g, c] = column c*p + j; v1 subtracts 1 from
    every field as one int32 subtraction (GPTQModel's convert_gptq_v2_to_v1_format)."""
    p = 32 // bits
    x = z_gn.reshape(z_gn.shape[0], -1, p)
    words = sum(x[..., j] << (bits * j) for j in range(p))
    return int32_words(words - (sum(1 << (bits * j) for j in range(p)) if v1 else 0))


def write_quantized(directory: Path, model: transformers.PreTrainedModel, fmt: str, *, bits: int = 4,
                    group: int | None = 32, sym: bool = False, act_order: bool = False, v1: bool = True,
                    config: dict | None = None, skip: tuple[str, ...] = (), lm_head: bool = False,
                    seed: int = 0) -> dict[str, torch.Tensor]:
    """Replaces model.safetensors in `directory` by `fmt` ("awq" / "gptq") tensors of every quantized linear
    (those of each layer but the `skip` ones; lm_head too when asked), adds quantization_config to config.json,
    and returns the dequantized weights by checkpoint module name."""
    state = {name: t.contiguous() for name, t in model.state_dict().items()}
    if model.config.tie_word_embeddings:  # the head is the embedding, stored once
        state.pop("lm_head.weight")
    gen = torch.Generator().manual_seed(seed)
    modules = {f"model.layers.{layer}.{linear}": (layer, site) for layer in range(model.config.num_hidden_layers)
               for linear, site in LINEARS.items() if linear not in skip}
    if lm_head:
        modules["lm_head"] = (None, "head")
    weights, perms = {}, {}  # perms: one column order per input, shared by the modules reading it
    for module, site in modules.items():
        w = state.pop(f"{module}.weight").float()
        n, k = w.shape
        g_idx = (torch.arange(k) // (group or k)).to(torch.int32)
        if act_order:
            g_idx = g_idx[perms.setdefault(site, torch.randperm(k, generator=gen))]
        u, scales, zeros = rtn(w, bits, g_idx, sym)
        weights[module] = dequantized(u, scales, zeros, g_idx)
        if fmt == "awq":
            state[f"{module}.qweight"], state[f"{module}.qzeros"] = pack_awq(u.t()), pack_awq(zeros.t())
        else:
            state[f"{module}.qweight"] = pack_gptq_rows(u.t().contiguous(), bits)
            state[f"{module}.qzeros"] = pack_gptq_cols(zeros.t().contiguous(), bits, v1)
            state[f"{module}.g_idx"] = g_idx
        state[f"{module}.scales"] = scales.t().contiguous()
    save_file({name: t.contiguous() for name, t in state.items()}, directory / "model.safetensors",
              metadata={"format": "pt"})
    if config is None:
        config = {"quant_method": "awq", "bits": 4, "group_size": group or -1, "zero_point": True,
                  "version": "gemm", "modules_to_not_convert": None} if fmt == "awq" else \
                 {"quant_method": "gptq", "bits": bits, "group_size": group or -1, "desc_act": act_order, "sym": sym,
                  "checkpoint_format": "gptq" if v1 else "gptq_v2", "true_sequential": True, "damp_percent": 0.1}
    set_quantization_config(directory, config)
    return weights


def set_quantization_config(directory: Path, config: dict) -> None:
    raw = json.loads((directory / "config.json").read_text())
    raw["quantization_config"] = config
    (directory / "config.json").write_text(json.dumps(raw, indent=2))


def use_weights(model: transformers.PreTrainedModel, weights: dict[str, torch.Tensor]) -> None:
    """transformers' model with the dequantized weights: the reference."""
    params = dict(model.named_parameters())
    with torch.no_grad():
        for module, w in weights.items():
            params[f"{module}.weight"].copy_(w)


# --- tiny random Llama: each format and setting -------------------------------------------------------------

CASES = {  # name: (format, write_quantized options, what engine.json records besides qformat weight_only)
    "awq-g32": ("awq", dict(group=32), dict(bits=4, group_size=32, zero_point=True, act_order=False)),
    "awq-per-channel": ("awq", dict(group=None), dict(bits=4, group_size=None, zero_point=True, act_order=False)),
    "gptq-4bit-sym-g32": ("gptq", dict(sym=True), dict(bits=4, group_size=32, zero_point=False, act_order=False)),
    "gptq-4bit-asym-g32": ("gptq", dict(), dict(bits=4, group_size=32, zero_point=True, act_order=False)),
    "gptq-4bit-sym-desc-act": ("gptq", dict(sym=True, act_order=True),
                               dict(bits=4, group_size=32, zero_point=False, act_order=True)),
    "gptq-4bit-asym-desc-act-g16-v2": ("gptq", dict(group=16, act_order=True, v1=False),
                                       dict(bits=4, group_size=16, zero_point=True, act_order=True)),
    "gptq-4bit-sym-per-channel": ("gptq", dict(group=None, sym=True),
                                  dict(bits=4, group_size=None, zero_point=False, act_order=False)),
    "gptq-8bit-sym-g32": ("gptq", dict(bits=8, sym=True), dict(bits=8, group_size=32, zero_point=False,
                                                               act_order=False)),
    "gptq-8bit-asym-g32": ("gptq", dict(bits=8), dict(bits=8, group_size=32, zero_point=True, act_order=False)),
    "gptq-8bit-asym-desc-act-v2": ("gptq", dict(bits=8, act_order=True, v1=False),
                                   dict(bits=8, group_size=32, zero_point=True, act_order=True)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_quantized_checkpoint_builds_exactly_and_runs_like_transformers(tmp_path, case):
    fmt, options, recorded = CASES[case]
    checkpoint, model = make_checkpoint(tmp_path / "ckpt")
    weights = write_quantized(checkpoint, model, fmt, **options)
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(**SMALL), progress=False)

    quantization = load_engine_spec(engine).build_config["quantization"]
    assert {key: quantization[key] for key in recorded} == recorded
    assert quantization["qformat"] == "weight_only" and quantization["exclude_modules"] == ["lm_head"]
    assert quantization["source"].startswith("AutoAWQ GEMM" if fmt == "awq" else "GPTQ")

    # The engine's weights are the format's, exactly: kiln's operator dequantizes them to the same numbers.
    tensors = load_file(engine / "rank0.safetensors")
    spec = dict(bits=recorded["bits"])
    for layer in range(model.config.num_hidden_layers):
        for engine_layer, modules in ENGINE_LAYERS.items():
            prefix = f"model.layers.{layer}.{engine_layer}"
            k = weights[f"model.layers.{layer}.{modules[0]}"].shape[1]
            w = dequantize_weight(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.scales"],
                                  tensors.get(f"{prefix}.zeros"), spec["bits"], recorded["group_size"] or k,
                                  torch.float32, tensors.get(f"{prefix}.g_idx"))
            expected = torch.cat([weights[f"model.layers.{layer}.{m}"] for m in modules])
            assert torch.equal(w, expected), prefix
            assert (f"{prefix}.zeros" in tensors) == recorded["zero_point"]
            assert (f"{prefix}.g_idx" in tensors) == recorded["act_order"]

    use_weights(model, weights)
    llm = LLM(engine)
    params = SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True, prompt_logprobs=True)
    for prompt, out in zip(PROMPTS, llm.generate(PROMPTS, params)):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"
        expected = hf_prompt_logprobs(model, prompt)
        assert out.prompt_logprobs[0] is None
        assert out.prompt_logprobs[1:] == pytest.approx(expected, abs=1e-5)


def _assert_runs_like(engine: Path, model: transformers.PreTrainedModel) -> None:
    outputs = LLM(engine).generate(PROMPTS, SamplingParams(max_tokens=NEW_TOKENS, temperature=0, ignore_eos=True))
    for prompt, out in zip(PROMPTS, outputs):
        assert out.token_ids == hf_greedy(model, prompt, NEW_TOKENS), f"prompt of {len(prompt)} tokens"


def test_awq_modules_to_not_convert_stay_unquantized(tmp_path):
    # AutoAWQ skips a layer when a listed name is a substring of its path: o_proj keeps its float weight.
    checkpoint, model = make_checkpoint(tmp_path / "ckpt")
    weights = write_quantized(checkpoint, model, "awq", skip=("self_attn.o_proj",), config={
        "quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemm",
        "modules_to_not_convert": ["o_proj"]})
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(**SMALL), progress=False)
    assert load_engine_spec(engine).build_config["quantization"]["exclude_modules"] == ["lm_head", "*o_proj*"]
    tensors = load_file(engine / "rank0.safetensors")
    assert tensors["model.layers.0.self_attn.o_proj.weight"].dtype == torch.float32
    assert "model.layers.0.self_attn.qkv_proj.qweight" in tensors
    use_weights(model, weights)
    _assert_runs_like(engine, model)


def test_gptq_with_a_quantized_lm_head(tmp_path):
    # GPTQModel's lm_head: true quantizes the (untied) head too: kiln then quantizes it as well.
    checkpoint, model = make_checkpoint(tmp_path / "ckpt")
    weights = write_quantized(checkpoint, model, "gptq", sym=True, lm_head=True)
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(**SMALL), progress=False)
    assert load_engine_spec(engine).build_config["quantization"]["exclude_modules"] == []
    assert "lm_head.qweight" in load_file(engine / "rank0.safetensors")
    use_weights(model, weights)
    _assert_runs_like(engine, model)


def test_desc_act_without_scattered_groups_needs_no_g_idx(tmp_path):
    # GPTQ with desc_act and static_groups keeps groups k // G: the engine needs no g_idx.
    checkpoint, model = make_checkpoint(tmp_path / "ckpt")
    write_quantized(checkpoint, model, "gptq", sym=True, config={
        "quant_method": "gptq", "bits": 4, "group_size": 32, "desc_act": True, "static_groups": True, "sym": True,
        "checkpoint_format": "gptq"})
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(**SMALL), progress=False)
    assert load_engine_spec(engine).build_config["quantization"]["act_order"] is False
    assert not any(name.endswith(".g_idx") for name in load_file(engine / "rank0.safetensors"))


# --- GPTQ v1 zero points, word by word -----------------------------------------------------------------------


@pytest.mark.parametrize("bits", [4, 8])
def test_gptq_v1_zero_points_of_every_value_including_zero(bits):
    # Each field of every zero-point word, 0 and 2^b - 1 included: v1 stores z - 1 with the borrow of one int32
    # subtraction, which kiln undoes with one addition; v2 stores z.
    torch.manual_seed(1)
    levels, n, k, group = 2 ** bits, 16, 64, 16
    zeros = torch.randint(0, levels, (n, k // group))
    zeros[0, 0], zeros[1, 0], zeros[2, 1] = 0, 0, levels - 1  # a borrow, a borrow in word 0, the top value
    u = torch.randint(0, levels, (n, k))
    scales = (torch.rand(n, k // group) + 0.5).half()
    g_idx = (torch.arange(k) // group).to(torch.int32)
    for v1 in (True, False):
        tensors = {"m.qweight": pack_gptq_rows(u.t().contiguous(), bits),
                   "m.qzeros": pack_gptq_cols(zeros.t().contiguous(), bits, v1),
                   "m.scales": scales.t().contiguous(), "m.g_idx": g_idx}
        reader = GptqCheckpoint(bits, group, False, False, "gptq" if v1 else "gptq_v2", ("lm_head",),
                                frozenset(tensors))
        layer = SimpleNamespace(in_features=k, out_features=n)
        out = reader.layer_tensors("m", layer, ["m"], tensors.__getitem__)
        assert torch.equal(out["zeros"], zeros.to(torch.uint8))
        w = dequantize_weight(out["qweight"], out["scales"], out["zeros"], bits, group, torch.float32)
        assert torch.equal(w, dequantized(u, scales, zeros, g_idx))


# --- the bundled model as an AWQ checkpoint ------------------------------------------------------------------


def test_kiln_tiny_code_as_awq_matches_transformers_perplexity(tmp_path):
    checkpoint = tmp_path / "awq"
    checkpoint.mkdir()
    for path in TINY_CODE.iterdir():
        if path.name != "model.safetensors":
            (checkpoint / path.name).write_bytes(path.read_bytes())
    model = transformers.AutoModelForCausalLM.from_pretrained(TINY_CODE, dtype=torch.float32).eval()
    weights = write_quantized(checkpoint, model, "awq", group=128)
    engine = build_engine(checkpoint, tmp_path / "engine", BuildConfig(dtype="float32"), progress=False)
    assert load_engine_spec(engine).build_config["quantization"]["group_size"] == 128

    result = perplexity(LLM(engine), HELDOUT.read_text())
    use_weights(model, weights)
    token_ids = transformers.AutoTokenizer.from_pretrained(TINY_CODE).encode(HELDOUT.read_text())
    expected, _ = hf_perplexity(model, token_ids, result.window_len)
    assert abs(result.perplexity / expected - 1) < 0.01
    assert abs(result.perplexity / expected - 1) < 1e-4  # float32 on both sides: really the same numbers
    # Still the model that learned Python (about 9 unquantized; random weights would give about 8192).
    assert result.perplexity < 15


# --- refusals ------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def awq_checkpoint(tmp_path_factory):
    checkpoint, model = make_checkpoint(tmp_path_factory.mktemp("awq") / "ckpt")
    write_quantized(checkpoint, model, "awq")
    return checkpoint


@pytest.mark.parametrize("fmt, config, message", [
    ("awq", {"quant_method": "awq", "bits": 3, "group_size": 32, "zero_point": True, "version": "gemm"},
     r"quantization_config.bits=3 is not a width kiln reads from AWQ; kiln reads 4-bit AutoAWQ GEMM"),
    ("awq", {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": True, "version": "gemv"},
     r"quantization_config.version='gemv' is an AWQ layout kiln does not read; kiln reads AutoAWQ's GEMM layout "
     r"\(version \"gemm\"\) only"),
    ("awq", {"quant_method": "awq", "bits": 4, "group_size": 32, "zero_point": False, "version": "gemm"},
     r"quantization_config.zero_point=False: kiln reads AWQ with zero points \(zero_point: true\) only"),
    ("gptq", {"quant_method": "gptq", "bits": 3, "group_size": 32, "sym": True},
     r"quantization_config.bits=3 is not a width kiln reads from GPTQ; kiln reads 4 and 8-bit GPTQ"),
    ("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True, "checkpoint_format": "marlin"},
     r"quantization_config.checkpoint_format='marlin' is a GPTQ packing kiln does not read; kiln reads 'gptq' "
     r"and 'gptq_v2'"),
])
def test_unreadable_settings_are_refused_naming_the_field(awq_checkpoint, tmp_path, fmt, config, message):
    checkpoint = tmp_path / "ckpt"
    checkpoint.mkdir()
    for path in awq_checkpoint.iterdir():
        (checkpoint / path.name).write_bytes(path.read_bytes())
    set_quantization_config(checkpoint, config)
    with pytest.raises(BuildError, match=message):
        build_engine(checkpoint, tmp_path / "engine", BuildConfig(**SMALL), progress=False)
    assert not (tmp_path / "engine").exists()


def test_symmetric_gptq_with_other_zero_points_is_refused(tmp_path):
    checkpoint, model = make_checkpoint(tmp_path / "ckpt")
    write_quantized(checkpoint, model, "gptq", sym=False)  # real zero points ...
    set_quantization_config(checkpoint, {"quant_method": "gptq", "bits": 4, "group_size": 32, "sym": True})
    with pytest.raises(BuildError, match=r"model.layers.0.self_attn.qkv_proj: quantization_config.sym is true but "
                                         r"the checkpoint's zero points of .* are not all 8"):
        build_engine(checkpoint, tmp_path / "engine", BuildConfig(**SMALL), progress=False)


def test_fused_parts_with_different_g_idx_are_refused():
    k, n, group = 32, 8, 16
    tensors = {}
    for i, module in enumerate(("q", "k")):
        g_idx = (torch.arange(k) // group).to(torch.int32)[torch.randperm(k, generator=torch.Generator().manual_seed(i))]
        tensors |= {f"{module}.qweight": torch.zeros(k // 8, n, dtype=torch.int32),
                    f"{module}.qzeros": torch.zeros(k // group, n // 8, dtype=torch.int32),
                    f"{module}.scales": torch.ones(k // group, n, dtype=torch.float16), f"{module}.g_idx": g_idx}
    reader = GptqCheckpoint(4, group, False, True, "gptq_v2", ("lm_head",), frozenset(tensors))
    with pytest.raises(QuantError, match="qkv: the checkpoint's q, k have different g_idx"):
        reader.layer_tensors("qkv", SimpleNamespace(in_features=k, out_features=2 * n), ["q", "k"],
                             tensors.__getitem__)
