"""Fused mixture-of-experts: route each token to its top-k experts, run their SwiGLU MLPs, sum the outputs.

One operator for the whole sparse block of Mixtral, Qwen2-MoE and Qwen3-MoE (a shared expert, where a model
has one, is an ordinary MLP outside it):

    weights = softmax(router_logits) in float32; top_k of them per token (ties: torch.topk's order);
    renormalized to sum 1 when `renormalize`; rounded to x's dtype
    out[t] = sum over the token's experts e of weight[t, e] * down_e(silu(gate_e(x[t])) * up_e(x[t]))

Expert weights are fused at build time: w_gate_up [E, 2I, H] ([gate; up] rows, as the dense MLP's
gate_up_proj), w_down [E, H, I]; GPT-OSS adds per-expert biases (b_gate_up [E, 2I] after the gate/up GEMM,
b_down [E, H] after the down GEMM, before the routing weight) and its clamped SwiGLU (`swiglu_limit` > 0: see
`expert_activation`). The reference groups the tokens by expert (one GEMM pair per expert that
received any; no per-token loop), as transformers' MoE blocks compute it: each expert's output in x's dtype,
multiplied by the token's weight in x's dtype, summed into the token's row.

On CUDA the op runs the Triton kernels of triton_moe.py (grouped GEMMs over expert-sorted tokens).
"""

from __future__ import annotations

import math
from collections.abc import Callable

import torch

from ._checks import (
    FLOAT_DTYPES,
    check_dims,
    check_dtype,
    check_last_dim_contiguous,
    check_same_device,
    check_size,
)
from ._spec import OpSpec, define
from .activation import silu_and_mul_reference
from .moe_route import route


def expert_activation(gate_up: torch.Tensor, swiglu_limit: float, swiglu_alpha: float) -> torch.Tensor:
    """gate_up: [n, 2I] ([gate | up] columns) -> [n, I] in its dtype. swiglu_limit 0: silu(gate) * up (Mixtral,
    Qwen); > 0: GPT-OSS's clamped SwiGLU as transformers' GptOssExperts computes it: gate clamped to at most the
    limit, up to [-limit, limit], out = (up + 1) * gate * sigmoid(swiglu_alpha * gate)."""
    if swiglu_limit <= 0:
        return silu_and_mul_reference(gate_up)
    gate, up = gate_up.chunk(2, dim=-1)  # [n, I] each
    gate = gate.clamp(max=swiglu_limit)
    up = up.clamp(min=-swiglu_limit, max=swiglu_limit)
    return (up + 1) * (gate * torch.sigmoid(gate * swiglu_alpha))


def _expert_mlp(x: torch.Tensor, expert: int, w_gate_up: torch.Tensor, w_down: torch.Tensor,
                b_gate_up: torch.Tensor | None = None, b_down: torch.Tensor | None = None,
                swiglu_limit: float = 0.0, swiglu_alpha: float = 0.0) -> torch.Tensor:
    # x: [n, H] -> [n, H]: one expert's MLP on its tokens, in x's dtype
    gate_up = x @ w_gate_up[expert].t()  # [n, 2I]
    if b_gate_up is not None:
        gate_up = gate_up + b_gate_up[expert]
    y = expert_activation(gate_up, swiglu_limit, swiglu_alpha) @ w_down[expert].t()  # [n, H]
    return y if b_down is None else y + b_down[expert]


def fused_moe_reference(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor,
                        w_down: torch.Tensor, top_k: int, renormalize: bool, b_gate_up: torch.Tensor | None = None,
                        b_down: torch.Tensor | None = None, swiglu_limit: float = 0.0,
                        swiglu_alpha: float = 0.0) -> torch.Tensor:
    mlp = (w_gate_up, w_down, b_gate_up, b_down, swiglu_limit, swiglu_alpha)
    if x.is_cuda and torch.cuda.is_current_stream_capturing():
        weights, ids = route(router_logits, top_k, renormalize, x.dtype)  # [T, k], [T, k]
        return _fused_moe_every_expert(x, weights, ids, *mlp)
    return moe_by_expert(x, router_logits, top_k, renormalize, w_gate_up.shape[0],
                         lambda expert, tokens_x: _expert_mlp(tokens_x, expert, *mlp))


def moe_by_expert(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, renormalize: bool, num_experts: int,
                  expert_mlp: Callable[[int, torch.Tensor], torch.Tensor]) -> torch.Tensor:
    """The references' dispatch (float and MXFP4 experts alike): routes x [T, H], runs `expert_mlp(expert,
    x_e)` -> [n, H] on each chosen expert's tokens x_e [n, H], in expert order, and adds each output times its
    routing weight into [T, H] (x's dtype). One host read: the per-expert token counts."""
    num_tokens, hidden = x.shape
    weights, ids = route(router_logits, top_k, renormalize, x.dtype)  # [T, k], [T, k]
    flat = ids.flatten()  # [T*k]: slot s belongs to token s // k
    order = torch.argsort(flat, stable=True)  # slots grouped by expert, tokens in order within each
    counts = torch.bincount(flat, minlength=num_experts).tolist()  # [E] (one host read)
    out = torch.zeros(num_tokens, hidden, dtype=x.dtype, device=x.device)
    start = 0
    for expert, count in enumerate(counts):
        if not count:
            continue
        slots = order[start:start + count]  # [n]
        start += count
        tokens = slots // top_k  # [n]
        y = expert_mlp(expert, x[tokens]) * weights.flatten()[slots, None]  # [n, H]
        out.index_add_(0, tokens, y)
    return out


def _fused_moe_every_expert(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, w_gate_up: torch.Tensor,
                            w_down: torch.Tensor, *mlp) -> torch.Tensor:
    """The reference inside a CUDA-graph capture (KILN_DISABLE_TRITON=1 on a GPU), where the per-expert token
    counts cannot be read on the host: every expert runs on every token, a token's weight for an expert it did
    not choose being 0. The sums are the reference's (in expert order; the zeros add nothing), at E / k times
    the work."""
    # x: [T, H]; weights, ids: [T, k] -> [T, H]
    out = torch.zeros_like(x)
    for expert in range(w_gate_up.shape[0]):
        token_weight = (weights * (ids == expert)).sum(dim=-1, keepdim=True)  # [T, 1]: top-k ids are distinct
        out += _expert_mlp(x, expert, w_gate_up, w_down, *mlp) * token_weight  # mlp: biases, activation
    return out


def _fused_moe_fake(x, router_logits, w_gate_up, w_down, top_k, renormalize, b_gate_up=None, b_down=None,
                    swiglu_limit=0.0, swiglu_alpha=0.0):
    return torch.empty_like(x)


FUSED_MOE = OpSpec("kiln::fused_moe", """
    Tensor x               [T, H] float32 / float16 / bfloat16, last dim contiguous
    Tensor router_logits   [T, E] any float dtype
    Tensor w_gate_up       [E, 2I, H] x's dtype, each expert's [gate; up] rows
    Tensor w_down          [E, H, I] x's dtype
    SymInt top_k           experts per token, in [1, E]
    bool renormalize       the top-k weights are divided by their sum
    Tensor? b_gate_up=None   [E, 2I] x's dtype, added to each expert's [gate; up] outputs (GPT-OSS)
    Tensor? b_down=None      [E, H] x's dtype, added to each expert's output before its routing weight
    float swiglu_limit=0.0   > 0: GPT-OSS's clamped SwiGLU (expert_activation); 0: silu(gate) * up
    float swiglu_alpha=0.0   the clamped SwiGLU's sigmoid slope (GPT-OSS: 1.702)
    -> Tensor              [T, H] x's dtype
    """, reference=fused_moe_reference, fake=_fused_moe_fake, kernel="triton_moe.fused_moe_triton")
_fused_moe = define(FUSED_MOE)


def fused_moe(x: torch.Tensor, router_logits: torch.Tensor, w_gate_up: torch.Tensor, w_down: torch.Tensor, *,
              top_k: int, renormalize: bool, b_gate_up: torch.Tensor | None = None,
              b_down: torch.Tensor | None = None, swiglu_limit: float = 0.0,
              swiglu_alpha: float = 0.0) -> torch.Tensor:
    """The sparse MoE block. x: [T, H] float (last dim contiguous); router_logits: [T, E] (any float dtype);
    w_gate_up: [E, 2I, H] and w_down: [E, H, I] in x's dtype; top_k in [1, E]. Returns [T, H] in x's dtype.
    `renormalize`: the top-k weights are divided by their sum (Mixtral; Qwen's norm_topk_prob).
    GPT-OSS: b_gate_up [E, 2I], b_down [E, H] (x's dtype) and swiglu_limit > 0 with swiglu_alpha (the clamped
    SwiGLU, `expert_activation`)."""
    check_dims("x", x, 2)
    check_dtype("x", x, FLOAT_DTYPES)
    check_last_dim_contiguous("x", x)
    check_dims("w_gate_up", w_gate_up, 3)
    check_dims("w_down", w_down, 3)
    experts, two_inter, hidden = w_gate_up.shape
    if two_inter % 2:
        raise ValueError(f"w_gate_up.shape[1] must be even ([gate; up] rows), got {two_inter}")
    check_size("x", x, 1, hidden, "hidden size of w_gate_up")
    check_size("w_down", w_down, 0, experts, "experts of w_gate_up")
    check_size("w_down", w_down, 1, hidden, "hidden size of w_gate_up")
    check_size("w_down", w_down, 2, two_inter // 2, "intermediate size of w_gate_up")
    for name, w in (("w_gate_up", w_gate_up), ("w_down", w_down)):
        check_dtype(name, w, (x.dtype,))
    check_routing_and_epilogue(x, router_logits, top_k, experts, two_inter, b_gate_up, b_down, swiglu_limit,
                               swiglu_alpha, weights="w_gate_up")
    check_same_device(x=x, router_logits=router_logits, w_gate_up=w_gate_up, w_down=w_down)
    return _fused_moe.for_tensor(x)(x, router_logits, w_gate_up, w_down, top_k, bool(renormalize), b_gate_up,
                                    b_down, float(swiglu_limit), float(swiglu_alpha))


def check_routing_and_epilogue(x: torch.Tensor, router_logits: torch.Tensor, top_k: int, experts: int, two_inter: int,
                               b_gate_up: torch.Tensor | None, b_down: torch.Tensor | None, swiglu_limit: float,
                               swiglu_alpha: float, weights: str) -> None:
    """The checks every MoE op shares, whatever its experts' format: router_logits [T, E], top_k, the biases
    ([E, 2I] and [E, H] in x's dtype) and the clamped SwiGLU's parameters. `weights`: the gate_up tensor's name."""
    hidden = x.shape[1]
    check_dims("router_logits", router_logits, 2)
    check_dtype("router_logits", router_logits, FLOAT_DTYPES)
    check_size("router_logits", router_logits, 0, x.shape[0], "tokens of x")
    check_size("router_logits", router_logits, 1, experts, f"experts of {weights}")
    if not isinstance(top_k, int) or isinstance(top_k, bool) or not 1 <= top_k <= experts:
        raise ValueError(f"top_k={top_k!r} must be an integer in [1, {experts}] (the number of experts)")
    for name, b, shape in (("b_gate_up", b_gate_up, (experts, two_inter)), ("b_down", b_down, (experts, hidden))):
        if b is not None:
            if tuple(b.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)} (experts, outputs of its weights), got "
                                 f"{list(b.shape)}")
            check_dtype(name, b, (x.dtype,))
            check_last_dim_contiguous(name, b)
            check_same_device(x=x, **{name: b})
    for name, value in (("swiglu_limit", swiglu_limit), ("swiglu_alpha", swiglu_alpha)):
        if not math.isfinite(value) or value < 0:
            raise ValueError(f"{name}={value!r} must be a finite number >= 0 (swiglu_limit 0: plain SwiGLU)")
