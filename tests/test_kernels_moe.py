"""The Triton fused-MoE kernels against the PyTorch reference: on the CPU through Triton's interpreter (tiny
shapes, float16), and on CUDA at Mixtral- and Qwen3-MoE-like shapes (bfloat16), including CUDA-graph capture.

Kernel and reference round at the same steps (moe.py); the order of float32 sums differs (the GEMMs' K loop,
and the k-way sum the kernel adds in float32 where the reference adds in x's dtype), so outputs are compared
within a few units in the last place of x's dtype.
"""

from __future__ import annotations

import pytest
import torch
from cuda_graph_capture import capture
from triton_interpret import needs_triton, run_interpreted

from kiln.plugins import fused_moe
from kiln.plugins._triton import USE_TRITON
from kiln.plugins.moe import fused_moe_reference

# --- CPU: the kernels under Triton's interpreter ---

_INTERPRETED_CHECKS = """
import torch
from kiln.plugins.moe import fused_moe_reference
from kiln.plugins.triton_moe import align_by_expert, fused_moe_triton

gen = torch.Generator().manual_seed(0)


def check_alignment(tokens, experts, top_k, block_m):
    # Every slot exactly once, in blocks of its expert; padding holds tokens * top_k.
    ids = torch.stack([torch.randperm(experts, generator=gen)[:top_k] for _ in range(tokens)])
    ids[:, 0] = 0  # one crowded expert; others get none
    sorted_slots, block_experts = align_by_expert(ids, experts, block_m)
    assert bool(((sorted_slots >= 0) & (sorted_slots <= tokens * top_k)).all()), "a place left unwritten"
    slots = sorted_slots.view(-1, block_m)
    seen = []
    for block, expert in enumerate(block_experts.tolist()):
        real = [s for s in slots[block].tolist() if s < tokens * top_k]
        if expert < 0:
            assert not real, f"block {block} past the end holds slots {real}"
            continue
        assert real, f"block {block} of expert {expert} holds no slot"
        assert all(ids.flatten()[s] == expert for s in real), f"block {block} mixes experts"
        seen += real
    assert sorted(seen) == list(range(tokens * top_k)), "a slot is missing or repeated"


def check(tokens, experts, top_k, hidden, inter, renormalize, force=None):
    x = torch.randn(tokens, hidden, generator=gen).half()
    logits = torch.randn(tokens, experts, generator=gen)
    if force == "tie":  # equal logits: torch.topk's order picks, the same call in both
        logits[:, :] = 0.5
    if force == "starve":  # experts 1..3 never chosen
        logits[:, 1:4] = -30.0
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, generator=gen) / hidden ** 0.5).half()
    w_down = (torch.randn(experts, hidden, inter, generator=gen) / inter ** 0.5).half()
    want = fused_moe_reference(x, logits, w_gate_up, w_down, top_k, renormalize)
    got = fused_moe_triton(x, logits, w_gate_up, w_down, top_k, renormalize)
    assert got.dtype == want.dtype and got.shape == want.shape
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-3,
                               msg=lambda m: f"T={tokens} E={experts} k={top_k} {force}: {m}")


# Decode and prefill sizes, one and several chunks of the alignment kernel, Qwen3-MoE's 128 experts.
for tokens, experts, top_k, block_m in ((1, 8, 2, 16), (7, 8, 2, 16), (40, 16, 4, 64), (3, 64, 8, 16),
                                        (128, 128, 8, 16), (300, 128, 8, 64)):
    check_alignment(tokens, experts, top_k, block_m)
# Mixtral-like (softmax, top 2, renormalized), T = 1 (decode), 5, and 40 (BLOCK_M 64: prefill blocks)
for tokens in (1, 5, 40):
    check(tokens, experts=8, top_k=2, hidden=96, inter=40, renormalize=True)
check(6, experts=8, top_k=2, hidden=96, inter=40, renormalize=True, force="starve")
check(4, experts=8, top_k=2, hidden=96, inter=40, renormalize=True, force="tie")
# Qwen-like: more experts, top 4, not renormalized
check(9, experts=16, top_k=4, hidden=64, inter=24, renormalize=False)
print("ok")
"""


@needs_triton
def test_fused_moe_kernel_matches_reference_interpreted():
    assert "ok" in run_interpreted(_INTERPRETED_CHECKS)


# --- CUDA ---

gpu = pytest.mark.skipif(not (torch.cuda.is_available() and USE_TRITON), reason="needs CUDA and triton")

# (experts, top_k, hidden, intermediate, renormalize): Mixtral-8x7B and Qwen3-30B-A3B per rank
SHAPES = {"mixtral": (8, 2, 4096, 14336, True), "qwen3-moe": (128, 8, 2048, 768, True)}


def _inputs(name, tokens, dtype=torch.bfloat16, seed=0):
    experts, top_k, hidden, inter, renormalize = SHAPES[name]
    gen = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(tokens, hidden, device="cuda", generator=gen).to(dtype)
    logits = torch.randn(tokens, experts, device="cuda", generator=gen)
    w_gate_up = (torch.randn(experts, 2 * inter, hidden, device="cuda", generator=gen) / hidden ** 0.5).to(dtype)
    w_down = (torch.randn(experts, hidden, inter, device="cuda", generator=gen) / inter ** 0.5).to(dtype)
    return x, logits, w_gate_up, w_down, top_k, renormalize


def _close(got, want):
    # bfloat16 keeps 8 bits: a sum order differing by one rounding moves an element by 2^-8 relative.
    torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@gpu
@pytest.mark.parametrize("name", sorted(SHAPES))
@pytest.mark.parametrize("tokens", [1, 16, 256])
def test_fused_moe_kernel_matches_reference_cuda(name, tokens):
    x, logits, w_gate_up, w_down, top_k, renormalize = _inputs(name, tokens)
    got = fused_moe(x, logits, w_gate_up, w_down, top_k=top_k, renormalize=renormalize)
    _close(got, fused_moe_reference(x, logits, w_gate_up, w_down, top_k, renormalize))


@pytest.mark.gpu
@gpu
def test_fused_moe_kernel_replays_in_a_cuda_graph():
    x, logits, w_gate_up, w_down, top_k, renormalize = _inputs("qwen3-moe", 8)
    run = lambda: fused_moe(x, logits, w_gate_up, w_down, top_k=top_k, renormalize=renormalize)  # noqa: E731
    graph, out = capture(run)
    # New routing in the same buffers: the graph must route afresh, not replay the captured assignment.
    x2, logits2, *_ = _inputs("qwen3-moe", 8, seed=1)
    x.copy_(x2)
    logits.copy_(logits2)
    graph.replay()
    torch.cuda.synchronize()
    _close(out, fused_moe_reference(x, logits, w_gate_up, w_down, top_k, renormalize))
