"""The mixture-of-experts MLP block (Mixtral, Qwen2-MoE, Qwen3-MoE) and the MLP factory that places it.

Engine tensors of a sparse layer (whatever the checkpoint calls them; the model def's recipes map them):
    {prefix}.gate.weight                   [E, H]      the router
    {prefix}.experts.gate_up.weight        [E, 2I, H]  each expert's [gate; up] rows
    {prefix}.experts.down.weight           [E, H, I]
    {prefix}.shared_expert.*, {prefix}.shared_expert_gate.weight   (Qwen2-MoE's shared expert)
    {prefix}.gate.bias [E], {prefix}.experts.gate_up.bias [E, 2I], {prefix}.experts.down.bias [E, H]   (GPT-OSS)

With a QuantConfig whose `moe_experts` is "mxfp4" (kiln.quant.mxfp4: GPT-OSS's checkpoints kept as shipped) the
experts' weights are `experts.{gate_up,down}.weight_blocks` / `weight_scales` instead (mxfp4_experts.py), run by
the MXFP4 MoE operator; any other quantized MoE engine is refused.

Tensor parallelism splits every expert's intermediate dimension: each rank holds rows [r*I/tp, (r+1)*I/tp) of
each expert's gate and up and the same columns of its down projection (recorded as FeatureShards, which the
builder's cutter reads as for linear layers), computes its partial sum of every token's expert outputs, and
the ranks' partial sums are added (all-reduce). The router and the routing are replicated.
"""

from __future__ import annotations

import torch
from torch import nn

from kiln.plugins import fused_moe, fused_moe_mxfp4

from ..config import ModelConfig, MoEConfig
from .linear import LinearFactory
from .mlp import GatedMLP, SwiGLU
from .mxfp4_experts import Mxfp4ExpertWeight
from .parallel import FeatureShard, even_shard, require_comm


class ExpertWeight(nn.Module):
    """One stacked expert tensor, `weight` [E, out, in] (this rank's share), with the FeatureShard the builder
    cuts the whole tensor by, and where the experts have biases (GPT-OSS) `bias` [E, out]. A down projection's
    bias is marked `parallel = "row"`: the ranks' partial outputs are summed, so the builder stores it on
    rank 0 and zeros elsewhere, as for a row-parallel linear."""

    def __init__(self, shape: tuple[int, int, int], dtype: torch.dtype, shard: FeatureShard | None,
                 bias: bool = False, row: bool = False) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(shape, dtype=dtype), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(shape[:2], dtype=dtype), requires_grad=False) if bias else None
        self.shard = shard
        self.parallel = "row" if row else None


class FusedExperts(nn.Module):
    """Every expert's weights, stacked: the tensors the fused MoE operator reads (this rank's share of each
    expert's intermediate features)."""

    def __init__(self, moe: MoEConfig, hidden: int, linears: LinearFactory, prefix: str, mxfp4: bool = False) -> None:
        super().__init__()
        experts, inter = moe.num_experts, moe.intermediate_size
        gate_up_shard = down_shard = None
        local = inter
        if linears.tp_size > 1:
            gate_up_shard = even_shard("output", (inter, inter), linears.mapping, f"{prefix}.gate_up")
            down_shard = even_shard("input", (inter,), linears.mapping, f"{prefix}.down")
            local = down_shard.local_sizes[0]
        self.mxfp4 = mxfp4  # weights as MXFP4 blocks and scales (mxfp4_experts.py)
        if mxfp4:
            tp = linears.tp_size
            self.gate_up = Mxfp4ExpertWeight(f"{prefix}.gate_up", (experts, 2 * local, hidden), linears.dtype,
                                             gate_up_shard, moe.bias, tp_size=tp)
            self.down = Mxfp4ExpertWeight(f"{prefix}.down", (experts, hidden, local), linears.dtype, down_shard,
                                          moe.bias, row=True, tp_size=tp)
            return
        self.gate_up = ExpertWeight((experts, 2 * local, hidden), linears.dtype, gate_up_shard, moe.bias)
        self.down = ExpertWeight((experts, hidden, local), linears.dtype, down_shard, moe.bias, row=True)


class SparseMoE(nn.Module):
    """Router, top-k experts through the fused MoE operator, and the gated shared expert where there is one."""

    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, prefix: str) -> None:
        super().__init__()
        moe, hidden = config.moe, config.hidden_size
        experts_format = getattr(linears.quant, "moe_experts", None)  # "mxfp4": kiln.quant.mxfp4
        if linears.quant is not None and experts_format != "mxfp4":
            raise ValueError(f"{config.architecture}: quantized MoE engines are not supported yet; build without "
                             f"--qformat (and from an unquantized checkpoint)")
        self.top_k, self.renormalize = moe.top_k, moe.renormalize
        self.swiglu = dict(swiglu_limit=moe.swiglu_limit, swiglu_alpha=moe.swiglu_alpha)  # GPT-OSS; 0: plain
        self.gate = linears.replicated(f"{prefix}.gate", hidden, moe.num_experts, moe.bias)
        self.experts = FusedExperts(moe, hidden, linears, f"{prefix}.experts", mxfp4=experts_format == "mxfp4")
        comm = linears.comm
        # The ranks' partial sums over their intermediate features add up to the block's output.
        self.reduce = (lambda y: require_comm(comm, prefix).all_reduce(y)) if linears.tp_size > 1 else None
        self.shared_expert = self.shared_expert_gate = None
        if moe.shared_expert_intermediate_size:
            # Qwen2-MoE's shared expert: a dense SwiGLU MLP of its own intermediate size
            self.shared_expert = SwiGLU(hidden, moe.shared_expert_intermediate_size, False, linears,
                                        f"{prefix}.shared_expert")
            self.shared_expert_gate = linears.replicated(f"{prefix}.shared_expert_gate", hidden, 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; router logits [T, E] in x's dtype, as transformers computes them
        gate_up, down = self.experts.gate_up, self.experts.down
        if self.experts.mxfp4:
            out = fused_moe_mxfp4(x, self.gate(x), gate_up.weight_blocks, gate_up.weight_scales, down.weight_blocks,
                                  down.weight_scales, top_k=self.top_k, renormalize=self.renormalize,
                                  b_gate_up=gate_up.bias, b_down=down.bias, **self.swiglu)  # [T, H]
        else:
            out = fused_moe(x, self.gate(x), gate_up.weight, down.weight, top_k=self.top_k,
                            renormalize=self.renormalize, b_gate_up=gate_up.bias, b_down=down.bias,
                            **self.swiglu)  # [T, H]
        if self.reduce is not None:
            out = self.reduce(out)
        if self.shared_expert is not None:
            out = out + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return out


def moe_mlp(config: ModelConfig, layer_index: int, linears: LinearFactory, prefix: str) -> nn.Module:
    """The MLP factory of MoE architectures: the sparse block on the config's sparse layers, the dense
    SwiGLU MLP (the model's intermediate_size) elsewhere."""
    if config.moe is not None and config.moe.sparse_layers[layer_index]:
        return SparseMoE(config, layer_index, linears, prefix)
    return GatedMLP(config, layer_index, linears, prefix)
