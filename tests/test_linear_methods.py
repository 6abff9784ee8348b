"""Linear methods and the linear factory: the tensors a method declares, the layers the factory makes, and
the seams a quantization format and tensor parallelism plug into."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from kiln.engine_format.mapping import Mapping
from kiln.model_defs.layers.linear import (
    Linear,
    LinearFactory,
    LinearMethod,
    TensorDecl,
    TiedLinear,
    UnquantizedLinear,
)
from kiln.quant.base import QuantConfig


@dataclass(frozen=True)
class Int8WeightOnly(LinearMethod):
    """A toy quantized method: int8 weight [out, in] and a float32 scale per output row."""

    dtype: torch.dtype

    def tensors(self, in_features, out_features, bias):
        return {"qweight": TensorDecl((out_features, in_features), torch.int8),
                "scale": TensorDecl((out_features,), torch.float32)}

    def apply(self, layer, x):
        return F.linear(x, (layer.qweight.float() * layer.scale[:, None]).to(x.dtype))


@dataclass(frozen=True)
class QuantizeMLPs:
    """A toy QuantConfig: quantizes the MLP linears only."""

    def linear_method(self, prefix, in_features, out_features, dtype):
        return Int8WeightOnly(dtype) if ".mlp." in prefix else None


def test_unquantized_method_declares_weight_and_optional_bias():
    method = UnquantizedLinear(torch.bfloat16)
    assert method.tensors(3, 5, bias=True) == {"weight": TensorDecl((5, 3), torch.bfloat16),
                                               "bias": TensorDecl((5,), torch.bfloat16)}
    assert method.tensors(3, 5, bias=False) == {"weight": TensorDecl((5, 3), torch.bfloat16)}


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_factory_linear_creates_the_declared_tensors_and_equals_f_linear(bias, dtype):
    layer = LinearFactory(dtype=dtype).row("model.layers.0.mlp.down_proj", 8, 6, bias)
    assert [(n, p.shape, p.dtype) for n, p in layer.named_parameters()] == [
        ("weight", (6, 8), dtype), *([("bias", (6,), dtype)] if bias else [])]
    assert not hasattr(layer, "bias") or bias
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in layer.parameters():
            p.copy_(torch.randn(p.shape, generator=gen))
    x = torch.randn(4, 8, generator=gen).to(dtype)  # x: [T, in]
    expected = F.linear(x, layer.weight, layer.bias if bias else None)
    assert torch.equal(layer(x), expected)


def test_factory_layers_record_kind_prefix_and_fused_parts():
    linears = LinearFactory()
    qkv = linears.column("model.layers.0.self_attn.qkv_proj", 16, (16, 8, 8), bias=True)
    assert (qkv.out_features, qkv.output_sizes, qkv.parallel, qkv.prefix) == (
        32, (16, 8, 8), "column", "model.layers.0.self_attn.qkv_proj")
    assert linears.row("o", 16, 16).parallel == "row"
    assert linears.replicated("router", 16, 4).parallel == "replicated"
    assert linears.column("lm", 16, 50).output_sizes == (50,)
    with pytest.raises(ValueError, match="do not add up"):
        Linear(4, 10, False, UnquantizedLinear(), prefix="x", output_sizes=(4, 4))


def test_quant_config_picks_a_method_per_layer_by_prefix():
    quant = QuantizeMLPs()
    assert isinstance(quant, QuantConfig)
    linears = LinearFactory(quant=quant, dtype=torch.float16)
    down = linears.row("model.layers.1.mlp.down_proj", 8, 4)
    o_proj = linears.row("model.layers.1.self_attn.o_proj", 8, 4)
    assert {n: p.dtype for n, p in down.named_parameters()} == {"qweight": torch.int8, "scale": torch.float32}
    assert {n: p.dtype for n, p in o_proj.named_parameters()} == {"weight": torch.float16}
    assert not down.qweight.requires_grad
    with torch.no_grad():
        down.qweight.copy_(torch.arange(32).reshape(4, 8) - 16)
        down.scale.fill_(0.5)
    x = torch.ones(2, 8, dtype=torch.float16)
    assert torch.equal(down(x), F.linear(x, ((torch.arange(32).reshape(4, 8) - 16) * 0.5).half()))


def test_rank_layers_hold_their_share_and_record_which():
    linears = LinearFactory(mapping=Mapping(tp_size=2, tp_rank=1))
    qkv = linears.column("model.layers.0.self_attn.qkv_proj", 8, (8, 4, 4))
    assert qkv.weight.shape == (8, 8) and qkv.output_sizes == (4, 2, 2)
    assert qkv.shard.ranges() == [(4, 8), (10, 12), (14, 16)]
    o = linears.row("model.layers.0.self_attn.o_proj", 8, 8)
    assert o.weight.shape == (8, 4) and o.shard.ranges() == [(4, 8)] and o.collective is not None
    head = linears.lm_head("lm_head", 8, 51)  # padded to 52 rows: 26 per rank
    assert head.weight.shape == (26, 8) and head.shard.ranges() == [(26, 52)]
    with pytest.raises(ValueError, match=r"output features 5 \(parts \[5\]\) are not divisible by tp_size=2"):
        linears.column("x", 8, 5)
    with pytest.raises(RuntimeError, match="built without a TPComm"):
        o(torch.zeros(1, 4))
    assert linears.replicated("router", 8, 2).weight.shape == (2, 8)
    assert LinearFactory(mapping=Mapping()).column("x", 8, 4).weight.shape == (4, 8)


def test_qkv_of_fewer_kv_heads_than_ranks_replicates_them():
    # 4 query heads, 1 KV head, head_dim 2, 4 ranks: every rank reads the one KV head
    for rank in range(4):
        qkv = LinearFactory(mapping=Mapping(tp_size=4, tp_rank=rank)).attention_qkv("qkv", 8, 4, 1, 2)
        assert qkv.output_sizes == (2, 2, 2)
        assert qkv.shard.ranges() == [(2 * rank, 2 * rank + 2), (8, 10), (10, 12)]


def test_untied_lm_head_is_a_linear_without_bias():
    head = LinearFactory(dtype=torch.bfloat16).lm_head("lm_head", 8, 50)
    assert isinstance(head, Linear)
    assert {n: (p.shape, p.dtype) for n, p in head.named_parameters()} == {"weight": ((50, 8), torch.bfloat16)}


def test_tied_lm_head_owns_no_tensors_and_reads_the_embedding_weight_at_call_time():
    embed = nn.Embedding(50, 8)
    head = LinearFactory(quant=QuantizeMLPs()).lm_head("lm_head", 8, 50, tied_to=embed)
    assert isinstance(head, TiedLinear) and isinstance(head.method, UnquantizedLinear)
    assert dict(head.named_parameters()) == {} and head.state_dict() == {}
    hidden = torch.randn(3, 8)  # [N, H]
    assert torch.equal(head(hidden), F.linear(hidden, embed.weight))
    # Loading with assign=True replaces the embedding's parameter; the head follows it.
    new_weight = torch.randn(50, 8)
    embed.load_state_dict({"weight": new_weight}, assign=True)
    assert torch.equal(head(hidden), F.linear(hidden, new_weight))
