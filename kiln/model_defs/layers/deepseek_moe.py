"""DeepSeek-MoE: fine-grained routed experts chosen by a grouped router, plus always-on shared experts.

Engine tensors of a sparse layer (names as the checkpoint's, the experts stacked by the model def's recipes):
    {prefix}.gate.weight                      [E, H] float32   the router (float32, as transformers keeps it)
    {prefix}.gate.e_score_correction_bias     [E] float32      V3 (noaux_tc) only
    {prefix}.experts.gate_up.weight           [E, 2I, H]
    {prefix}.experts.down.weight              [E, H, I]
    {prefix}.shared_experts.gate_up_proj / down_proj           a SwiGLU MLP of n_shared_experts * I

From a block-scaled FP8 checkpoint the shared experts stay FP8 (FP8 block linears); the routed experts are
dequantized at build (the fused MoE operator takes float experts only; deepseek.py's recipes).

The routing (`grouped_route`, transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter) runs in torch on
every device; the chosen experts run through the fused MoE operator, which routes by softmax over its
logits: given log(weight) for the chosen experts and -inf elsewhere, its softmax gives weight / sum, and the
output is multiplied back by each token's sum (exact in real arithmetic; the kernel is reused unchanged).
Tensor parallelism splits the experts' and the shared experts' intermediate features, as layers/moe.py.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kiln.plugins import fused_moe

from ..config import ModelConfig
from ..mla_config import GroupedRouting
from .linear import LinearFactory
from .mlp import GatedMLP, SwiGLU
from .moe import FusedExperts
from .parallel import require_comm


def grouped_route(router_logits: torch.Tensor, routing: GroupedRouting, top_k: int,
                  correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """router_logits: [T, E] float32 -> (weights [T, k] float32, expert ids [T, k] int64), in transformers'
    operations and order (torch.topk(sorted=False) as it calls it, so ties fall alike)."""
    num_tokens, experts = router_logits.shape
    groups = routing.n_group
    if routing.scoring == "sigmoid":
        scores = router_logits.sigmoid()
    else:
        scores = router_logits.softmax(dim=-1, dtype=torch.float32)
    if routing.topk_method == "greedy":
        weights, ids = torch.topk(scores, k=top_k, dim=-1, sorted=False)
    else:
        choice = scores if correction_bias is None else scores + correction_bias  # [T, E]
        grouped = choice.view(num_tokens, groups, experts // groups)
        if routing.topk_method == "noaux_tc":  # a group ranks by the sum of its two best experts
            group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
        else:
            group_scores = grouped.max(dim=-1).values  # [T, G]
        group_idx = torch.topk(group_scores, k=routing.topk_group, dim=-1, sorted=False)[1]
        group_mask = torch.zeros_like(group_scores).scatter_(1, group_idx, 1)
        score_mask = group_mask.unsqueeze(-1).expand(-1, groups, experts // groups).reshape(-1, experts).bool()
        if routing.topk_method == "noaux_tc":
            ids = torch.topk(choice.masked_fill(~score_mask, float("-inf")), k=top_k, dim=-1, sorted=False)[1]
            weights = scores.gather(1, ids)
        else:
            weights, ids = torch.topk(scores.masked_fill(~score_mask, 0.0), k=top_k, dim=-1, sorted=False)
    if routing.topk_method == "noaux_tc":  # V3: normalized, then scaled
        if routing.norm_topk_prob:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
        weights = weights * routing.routed_scaling_factor
    elif top_k > 1 and routing.norm_topk_prob:  # V2 (DeepSeek's code): normalized or scaled
        weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    else:
        weights = weights * routing.routed_scaling_factor
    return weights, ids


def routed_experts(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, experts: FusedExperts) -> torch.Tensor:
    """sum over each token's chosen experts of weight * expert(x), through the fused MoE operator.
    x: [T, H]; weights, ids: [T, k] -> [T, H] in x's dtype."""
    total = weights.sum(dim=-1, keepdim=True)  # [T, 1]
    logits = torch.full((x.shape[0], experts.gate_up.weight.shape[0]), float("-inf"), dtype=torch.float32,
                        device=x.device)
    # softmax over these logits is weights / total on the chosen experts and 0 elsewhere
    logits.scatter_(1, ids, (weights / total).clamp_min(1e-30).log())
    out = fused_moe(x, logits, experts.gate_up.weight, experts.down.weight, top_k=ids.shape[1], renormalize=False)
    return out * total.to(out.dtype)


class DeepseekMoE(nn.Module):
    """Grouped router, routed experts through the fused operator, shared experts (a dense SwiGLU) added."""

    def __init__(self, config: ModelConfig, layer_index: int, linears: LinearFactory, prefix: str) -> None:
        super().__init__()
        moe, hidden = config.moe, config.hidden_size
        if moe is None or moe.routing is None:
            raise ValueError(f"{config.architecture}: DeepseekMoE needs config.moe.routing")
        if linears.quant is not None and (config.mla is None or config.mla.fp8_block_size is None):
            raise ValueError(f"{config.architecture}: quantized MoE engines are supported from block-scaled FP8 "
                             f"checkpoints only (DeepSeek-V3's release); build without --qformat")
        self.routing, self.top_k = moe.routing, moe.top_k
        self.gate = nn.Module()
        self.gate.weight = nn.Parameter(torch.empty(moe.num_experts, hidden, dtype=torch.float32),
                                        requires_grad=False)
        if self.routing.correction_bias:
            self.gate.e_score_correction_bias = nn.Parameter(torch.zeros(moe.num_experts, dtype=torch.float32),
                                                             requires_grad=False)
        self.experts = FusedExperts(moe, hidden, linears, f"{prefix}.experts")
        comm = linears.comm
        self.reduce = (lambda y: require_comm(comm, prefix).all_reduce(y)) if linears.tp_size > 1 else None
        self.shared_experts = None
        if moe.shared_expert_intermediate_size:
            self.shared_experts = SwiGLU(hidden, moe.shared_expert_intermediate_size, False, linears,
                                         f"{prefix}.shared_experts")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # x: [T, H]; the router in float32, as transformers computes it
        logits = F.linear(x.float(), self.gate.weight)  # [T, E]
        bias = getattr(self.gate, "e_score_correction_bias", None)
        weights, ids = grouped_route(logits, self.routing, self.top_k, bias)
        out = routed_experts(x, weights, ids, self.experts)  # [T, H]
        if self.reduce is not None:
            out = self.reduce(out)
        if self.shared_experts is not None:
            out = out + self.shared_experts(x)
        return out


def deepseek_mlp(config: ModelConfig, layer_index: int, linears: LinearFactory, prefix: str) -> nn.Module:
    """The MLP factory of DeepSeek-V2/V3: DeepseekMoE past the first_k_dense_replace dense layers."""
    if config.moe is not None and config.moe.sparse_layers[layer_index]:
        return DeepseekMoE(config, layer_index, linears, prefix)
    return GatedMLP(config, layer_index, linears, prefix)
