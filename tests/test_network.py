"""build_network: the same engine tensors as Hugging Face's parameters once fused, dtypes per tensor, the
CausalLM protocol, the lm_head of tied and untied models, and the MLP factory seam."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F
import transformers
from model_factory import BASE
from test_linear_methods import QuantizeMLPs
from torch import nn

from kiln.builder.build import param_specs
from kiln.engine_format.mapping import Mapping
from kiln.model_defs import CausalLM, ModelConfig, build_network, get_model_def
from kiln.model_defs.layers import DecoderForCausalLM, GatedMLP
from kiln.model_defs.layers.linear import Linear, TiedLinear
from kiln.model_defs.recipes import FUSED_MODULES

CASES = {
    "llama": ("LlamaForCausalLM", transformers.LlamaConfig, {}),
    "llama-tied-bias": ("LlamaForCausalLM", transformers.LlamaConfig,
                        {"tie_word_embeddings": True, "attention_bias": True, "mlp_bias": True}),
    "mistral": ("MistralForCausalLM", transformers.MistralConfig, {"sliding_window": 8}),
    "qwen2": ("Qwen2ForCausalLM", transformers.Qwen2Config, {}),
    "qwen3-tied": ("Qwen3ForCausalLM", transformers.Qwen3Config, {"tie_word_embeddings": True}),
}


def hf_and_kiln_config(case: str) -> tuple[transformers.PretrainedConfig, ModelConfig]:
    architecture, config_class, overrides = CASES[case]
    hf_config = config_class(**{**BASE, **overrides})
    hf_config.architectures = [architecture]
    return hf_config, get_model_def(architecture).parse_config(hf_config.to_dict())


def meta_network(config: ModelConfig, **kwargs) -> nn.Module:
    with torch.device("meta"):
        return build_network(get_model_def(config.architecture), config, **kwargs)


def fused_hf_shapes(hf_model: nn.Module) -> dict[str, tuple[int, ...]]:
    """HF's parameter names and shapes with q/k/v and gate/up fused by rows, as the engine stores them."""
    part_to_fused = {part: fused for fused, parts in FUSED_MODULES.items() for part in parts}
    shapes: dict[str, tuple[int, ...]] = {}
    for name, p in hf_model.named_parameters():  # tied weights appear once, as the embedding
        path = name.split(".")
        path = [part_to_fused.get(m, m) for m in path]
        fused = ".".join(path)
        rows = shapes.get(fused, (0,))[0]
        shapes[fused] = (rows + p.shape[0], *p.shape[1:])
    return shapes


@pytest.mark.parametrize("case", sorted(CASES))
def test_network_has_hf_parameters_fused_in_the_engine_order(case):
    hf_config, config = hf_and_kiln_config(case)
    with torch.device("meta"):
        hf_model = transformers.AutoModelForCausalLM.from_config(hf_config)
    model = meta_network(config)
    shapes = {n: tuple(t.shape) for n, t in model.state_dict().items()}
    assert shapes == fused_hf_shapes(hf_model)
    assert ("lm_head.weight" in shapes) == (not config.tie_word_embeddings)
    # The order the engine file is written in (unchanged, so engines built before still load).
    layer = [n.removeprefix("model.layers.0.") for n in shapes if n.startswith("model.layers.0.")]
    attn_bias = ["self_attn.qkv_proj.bias"] if config.qkv_bias else []
    qk_norm = ["self_attn.q_norm.weight", "self_attn.k_norm.weight"] if config.qk_norm else []
    mlp = [f"mlp.{m}.{k}" for m in ("gate_up_proj", "down_proj") for k in ("weight", "bias")[:1 + config.mlp_bias]]
    assert layer == ["input_layernorm.weight", "self_attn.qkv_proj.weight", *attn_bias, "self_attn.o_proj.weight",
                     *(["self_attn.o_proj.bias"] if config.o_bias else []), *qk_norm,
                     "post_attention_layernorm.weight", *mlp]
    assert next(iter(shapes)) == "model.embed_tokens.weight"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_every_tensor_is_made_in_the_requested_dtype(dtype):
    _, config = hf_and_kiln_config("qwen3-tied")
    model = meta_network(config, dtype=dtype)
    assert {t.dtype for t in model.state_dict().values()} == {dtype}
    assert {t.device.type for t in model.state_dict().values()} == {"meta"}
    specs = param_specs(get_model_def(config.architecture), config, dtype)
    assert [(s.name, s.dtype, s.shape) for s in specs] == [
        (n, t.dtype, tuple(t.shape)) for n, t in model.state_dict().items()]


def test_param_specs_take_each_tensors_dtype_from_its_linear_method():
    _, config = hf_and_kiln_config("llama")
    specs = {s.name: s for s in param_specs(get_model_def(config.architecture), config, torch.bfloat16,
                                            quant=QuantizeMLPs())}
    assert specs["model.layers.1.mlp.down_proj.qweight"].dtype == torch.int8
    assert specs["model.layers.1.mlp.down_proj.scale"].dtype == torch.float32
    assert "model.layers.1.mlp.down_proj.weight" not in specs
    assert specs["model.layers.1.self_attn.qkv_proj.weight"].dtype == torch.bfloat16
    assert specs["lm_head.weight"].dtype == torch.bfloat16


def test_network_implements_the_causal_lm_protocol():
    _, config = hf_and_kiln_config("llama")
    model = meta_network(config, mapping=Mapping())
    assert isinstance(model, CausalLM) and model.config is config
    whole = model.state_dict()
    rank1 = meta_network(config, mapping=Mapping(tp_size=2, tp_rank=1)).state_dict()
    assert list(rank1) == list(whole)  # same names on every rank; each holds its share
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert rank1[qkv].shape == (whole[qkv].shape[0] // 2, whole[qkv].shape[1])
    down = "model.layers.0.mlp.down_proj.weight"
    assert rank1[down].shape == (whole[down].shape[0], whole[down].shape[1] // 2)
    with pytest.raises(ValueError, match="num_attention_heads=.* is not divisible by tp_size=3"):
        meta_network(config, mapping=Mapping(tp_size=3))
    with pytest.raises(TypeError, match="does not implement CausalLM"):
        build_network(dataclasses.replace(get_model_def("LlamaForCausalLM"), model_class=lambda *a: nn.Linear(2, 2)),
                      config)


@pytest.mark.parametrize(("rope", "trained", "longest", "expected"), [
    ({}, 16, 100, False),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, 16, 16, False),
    ({"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}}, 16, 17, True),
])
def test_needs_per_length_rope_only_for_dynamic_ntk_past_the_trained_context(rope, trained, longest, expected):
    config = get_model_def("LlamaForCausalLM").parse_config(
        {**BASE, **rope, "max_position_embeddings": trained, "architectures": ["LlamaForCausalLM"]})
    model = build_network(get_model_def("LlamaForCausalLM"), config)
    assert model.needs_per_length_rope(longest) is False  # before setup_rotary
    model.setup_rotary(64, "cpu")
    assert model.needs_per_length_rope(longest) is expected


@pytest.mark.parametrize("case", ["llama", "qwen3-tied"])
def test_logits_go_through_the_lm_head_and_equal_f_linear(case):
    _, config = hf_and_kiln_config(case)
    model = build_network(get_model_def(config.architecture), config)
    state = {n: torch.randn(t.shape) for n, t in model.state_dict().items()}
    model.load_state_dict(state, strict=True, assign=True)
    tied = config.tie_word_embeddings
    assert isinstance(model.lm_head, TiedLinear if tied else Linear)
    weight = state["model.embed_tokens.weight" if tied else "lm_head.weight"]
    hidden = torch.randn(5, config.hidden_size)  # [N, H]
    logits = model.compute_logits(hidden)
    assert torch.equal(logits, F.linear(hidden, weight).float())
    assert logits.dtype == torch.float32 and logits.shape == (5, config.vocab_size)
    if tied:  # the head reads the embedding loaded with assign=True, not the one it was built with
        assert model.lm_head.weight is model.model.embed_tokens.weight
    model = model.bfloat16()
    assert torch.equal(model.compute_logits(hidden.bfloat16()), F.linear(hidden.bfloat16(), weight.bfloat16()).float())


def test_the_mlp_block_comes_from_the_model_defs_factory():
    made = []

    class RecordingMLP(GatedMLP):
        def __init__(self, config, layer_index, linears, prefix):
            super().__init__(config, layer_index, linears, prefix)
            made.append((layer_index, prefix, linears.dtype))

    _, config = hf_and_kiln_config("llama")
    model_def = dataclasses.replace(get_model_def("LlamaForCausalLM"), mlp=RecordingMLP)
    model = build_network(model_def, config, dtype=torch.float16)
    assert made == [(0, "model.layers.0.mlp", torch.float16), (1, "model.layers.1.mlp", torch.float16)]
    assert all(isinstance(layer.mlp, RecordingMLP) for layer in model.model.layers)
    assert model.model.layers[1].mlp.down_proj.prefix == "model.layers.1.mlp.down_proj"


def test_model_class_alone_still_builds_a_float32_network():
    _, config = hf_and_kiln_config("llama")
    with torch.device("meta"):
        model = DecoderForCausalLM(config)
    assert {t.dtype for t in model.state_dict().values()} == {torch.float32}
