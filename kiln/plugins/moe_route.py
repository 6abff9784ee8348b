"""The MoE routing rule, on its own so that the reference (moe.py) and the Triton kernels (triton_moe.py) both
import it and neither imports the other's module for it."""

from __future__ import annotations

import torch


def route(router_logits: torch.Tensor, top_k: int, renormalize: bool,
          dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """The routing rule shared by the reference and the kernels. router_logits: [T, E] -> (weights [T, k] in
    `dtype`, expert ids [T, k] int64), most probable first."""
    probs = torch.softmax(router_logits, dim=-1, dtype=torch.float32)  # [T, E]
    weights, ids = torch.topk(probs, top_k, dim=-1)  # [T, k] each
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(dtype), ids
