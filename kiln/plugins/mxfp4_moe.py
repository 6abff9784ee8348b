"""Fused mixture-of-experts over MXFP4 expert weights (GPT-OSS's experts kept as shipped: mxfp4.py).

The operator of moe.py (routing, per-expert biases, the clamped SwiGLU, routing weights) with each expert's
weights stored as MXFP4 blocks and scales instead of floats:

    gate_up_blocks [E, 2I, H / 32, 16] uint8, gate_up_scales [E, 2I, H / 32] uint8   ([gate; up] rows)
    down_blocks    [E, H, I / 32, 16] uint8,  down_scales    [E, H, I / 32] uint8

The reference dequantizes the weights of each expert that received a token (float32, exact) to x's dtype and
computes what moe.py's reference computes on them, op for op: an engine that keeps the experts MXFP4 gives the
outputs of one built with `--dequantize` (bit for bit on the CPU). MXFP4 values are exact in bfloat16 and
float32 (float16 only within its range), so that cast rounds nothing there.

On CUDA the op runs triton_mxfp4_moe.py's kernels: moe.py's grouped GEMMs with each weight tile decoded in
registers (E2M1 code -> value, times 2 ** (scale - 127)), never the whole float weight.
"""

from __future__ import annotations

import torch

from ._checks import (
    FLOAT_DTYPES,
    check_dims,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
)
from ._spec import OpSpec, define
from .moe import check_routing_and_epilogue, expert_activation, fused_moe_reference, moe_by_expert
from .mxfp4 import BLOCK, dequantize_mxfp4


def _expert_weights(blocks: torch.Tensor, scales: torch.Tensor, expert: int, dtype: torch.dtype) -> torch.Tensor:
    # blocks [E, N, K / 32, 16], scales [E, N, K / 32] -> expert's [N, K] in dtype
    return dequantize_mxfp4(blocks[expert], scales[expert]).to(dtype)


def fused_moe_mxfp4_reference(x: torch.Tensor, router_logits: torch.Tensor, gate_up_blocks: torch.Tensor,
                              gate_up_scales: torch.Tensor, down_blocks: torch.Tensor, down_scales: torch.Tensor,
                              top_k: int, renormalize: bool, b_gate_up: torch.Tensor | None = None,
                              b_down: torch.Tensor | None = None, swiglu_limit: float = 0.0,
                              swiglu_alpha: float = 0.0) -> torch.Tensor:
    num_experts = gate_up_blocks.shape[0]
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        # No host read of the routing while capturing a CUDA graph (KILN_DISABLE_TRITON=1 on a GPU): every
        # expert's weights, dequantized whole, through the float reference's every-expert path.
        w_gate_up = dequantize_mxfp4(gate_up_blocks, gate_up_scales).to(x.dtype)  # [E, 2I, H]
        w_down = dequantize_mxfp4(down_blocks, down_scales).to(x.dtype)  # [E, H, I]
        return fused_moe_reference(x, router_logits, w_gate_up, w_down, top_k, renormalize, b_gate_up, b_down,
                                   swiglu_limit, swiglu_alpha)

    def expert_mlp(expert: int, tokens_x: torch.Tensor) -> torch.Tensor:
        # moe.py's _expert_mlp on this expert's dequantized weights, op for op: [n, H] -> [n, H]
        gate_up = tokens_x @ _expert_weights(gate_up_blocks, gate_up_scales, expert, x.dtype).t()  # [n, 2I]
        if b_gate_up is not None:
            gate_up = gate_up + b_gate_up[expert]
        w_down = _expert_weights(down_blocks, down_scales, expert, x.dtype)  # [H, I]
        y = expert_activation(gate_up, swiglu_limit, swiglu_alpha) @ w_down.t()  # [n, H]
        return y if b_down is None else y + b_down[expert]

    return moe_by_expert(x, router_logits, top_k, renormalize, num_experts, expert_mlp)


def _fused_moe_mxfp4_fake(x, router_logits, gate_up_blocks, gate_up_scales, down_blocks, down_scales, top_k,
                          renormalize, b_gate_up=None, b_down=None, swiglu_limit=0.0, swiglu_alpha=0.0):
    return torch.empty_like(x)


FUSED_MOE_MXFP4 = OpSpec("kiln::fused_moe_mxfp4", """
    Tensor x                 [T, H] float32 / float16 / bfloat16, last dim contiguous
    Tensor router_logits     [T, E] any float dtype
    Tensor gate_up_blocks    [E, 2I, H / 32, 16] uint8, each expert's [gate; up] rows, two E2M1 codes a byte
    Tensor gate_up_scales    [E, 2I, H / 32] uint8, E8M0: each block of 32 is times 2 ** (scale - 127)
    Tensor down_blocks       [E, H, I / 32, 16] uint8
    Tensor down_scales       [E, H, I / 32] uint8
    SymInt top_k             experts per token, in [1, E]
    bool renormalize         the top-k weights are divided by their sum
    Tensor? b_gate_up=None   [E, 2I] x's dtype, added to each expert's [gate; up] outputs
    Tensor? b_down=None      [E, H] x's dtype, added to each expert's output before its routing weight
    float swiglu_limit=0.0   > 0: GPT-OSS's clamped SwiGLU (moe.expert_activation); 0: silu(gate) * up
    float swiglu_alpha=0.0   the clamped SwiGLU's sigmoid slope (GPT-OSS: 1.702)
    -> Tensor                [T, H] x's dtype
    """, reference=fused_moe_mxfp4_reference, fake=_fused_moe_mxfp4_fake,
    kernel="triton_mxfp4_moe.fused_moe_mxfp4_triton")
_fused_moe_mxfp4 = define(FUSED_MOE_MXFP4)


def _check_mxfp4(name: str, blocks: torch.Tensor, scales: torch.Tensor, shape: tuple[int, int, int]) -> None:
    """blocks [E, N, K / 32, 16] and scales [E, N, K / 32], uint8 and contiguous, for a weight of `shape` [E, N, K]."""
    experts, n, k = shape
    want = (experts, n, k // BLOCK, BLOCK // 2)
    if k % BLOCK or tuple(blocks.shape) != want or tuple(scales.shape) != want[:3]:
        raise ValueError(f"{name}_blocks {list(blocks.shape)} and {name}_scales {list(scales.shape)} must be "
                         f"{list(want)} and {list(want[:3])} (MXFP4 blocks of {BLOCK} of a weight {list(shape)}; "
                         f"its {k} input features a multiple of {BLOCK})")
    for suffix, t in (("_blocks", blocks), ("_scales", scales)):
        check_dtype(name + suffix, t, (torch.uint8,))
        if not t.is_contiguous():
            raise ValueError(f"{name}{suffix} must be contiguous, got strides {t.stride()}")


def fused_moe_mxfp4(x: torch.Tensor, router_logits: torch.Tensor, gate_up_blocks: torch.Tensor,
                    gate_up_scales: torch.Tensor, down_blocks: torch.Tensor, down_scales: torch.Tensor, *,
                    top_k: int, renormalize: bool, b_gate_up: torch.Tensor | None = None,
                    b_down: torch.Tensor | None = None, swiglu_limit: float = 0.0,
                    swiglu_alpha: float = 0.0) -> torch.Tensor:
    """The sparse MoE block over MXFP4 experts. x: [T, H] float (last dim contiguous); router_logits: [T, E];
    gate_up_blocks [E, 2I, H / 32, 16] / gate_up_scales [E, 2I, H / 32] and down_blocks [E, H, I / 32, 16] /
    down_scales [E, H, I / 32], uint8 and contiguous; the rest as moe.fused_moe's. Returns [T, H] in x's dtype."""
    check_dims("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    check_dims("gate_up_blocks", gate_up_blocks, 4)
    check_dims("down_blocks", down_blocks, 4)
    experts, two_inter, hidden = gate_up_blocks.shape[0], gate_up_blocks.shape[1], x.shape[1]
    if two_inter % 2:
        raise ValueError(f"gate_up_blocks.shape[1] must be even ([gate; up] rows), got {two_inter}")
    _check_mxfp4("gate_up", gate_up_blocks, gate_up_scales, (experts, two_inter, hidden))
    _check_mxfp4("down", down_blocks, down_scales, (experts, hidden, two_inter // 2))
    check_routing_and_epilogue(x, router_logits, top_k, experts, two_inter, b_gate_up, b_down, swiglu_limit,
                               swiglu_alpha, weights="gate_up_blocks")
    check_same_device(x=x, router_logits=router_logits, gate_up_blocks=gate_up_blocks, gate_up_scales=gate_up_scales,
                      down_blocks=down_blocks, down_scales=down_scales)
    return _fused_moe_mxfp4.for_tensor(x)(x, router_logits, gate_up_blocks, gate_up_scales, down_blocks, down_scales,
                                          top_k, bool(renormalize), b_gate_up, b_down, float(swiglu_limit),
                                          float(swiglu_alpha))
