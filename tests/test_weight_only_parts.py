"""kiln::weight_only_linear_parts: a fused weight-only layer whose parts smooth x apart (kiln's AWQ qkv and
gate_up) in one product. The reference is the per-part loop the AWQ method ran before; the Triton path (one
GEMM whose tiles read their part's smoothed x) is checked in Triton's interpreter on the CPU and on CUDA."""

from __future__ import annotations

import inspect

import pytest
import torch
from cuda_graph_capture import capture
from test_kernels_weight_only import weight_only_case
from triton_interpret import needs_triton, run_interpreted

from kiln.plugins import weight_only_linear, weight_only_linear_parts
from kiln.plugins._triton import USE_TRITON


def _case(parts, k, bits, asymmetric, group_size, dtype, seed, device="cpu"):
    gen = torch.Generator().manual_seed(seed)
    qweight, scales, zeros, _ = weight_only_case(sum(parts), k, bits, asymmetric, group_size, False, gen)
    x = torch.randn(3, k, generator=gen).to(dtype)
    bias = torch.randn(sum(parts), generator=gen).to(dtype)
    pqs = torch.rand(len(parts), k, generator=gen) + 0.5
    move = lambda t: None if t is None else t.to(device)  # noqa: E731
    return [move(t) for t in (x, qweight, scales, zeros, bias, pqs)]


def _per_part(x, qweight, scales, zeros, bias, pqs, parts, bits, group_size):
    outs, start = [], 0
    for i, rows in enumerate(parts):
        rs = slice(start, start + rows)
        start += rows
        outs.append(weight_only_linear(x, qweight[rs], scales[rs], None if zeros is None else zeros[rs], bits=bits,
                                       group_size=group_size, bias=bias[rs], pre_quant_scale=pqs[i]))
    return torch.cat(outs, dim=-1)


@pytest.mark.parametrize("bits, asymmetric", [(4, False), (4, True), (8, False)])
def test_the_op_is_the_per_part_products_side_by_side(bits, asymmetric):
    parts = (64, 32, 32)
    x, qweight, scales, zeros, bias, pqs = _case(parts, 64, bits, asymmetric, 32, torch.float32, bits)
    y = weight_only_linear_parts(x, qweight, scales, zeros, bits=bits, group_size=32, bias=bias,
                                 pre_quant_scale=pqs, part_sizes=parts)
    assert torch.equal(y, _per_part(x, qweight, scales, zeros, bias, pqs, parts, bits, 32))


@pytest.mark.parametrize("change, message", [
    (dict(part_sizes=(64, 32)), r"part_sizes \[64, 32\] must be positive row counts adding up to the 128"),
    (dict(part_sizes=(128, 0)), r"part_sizes \[128, 0\] must be positive"),
    (dict(pre_quant_scale=torch.ones(2, 64)), r"pre_quant_scale.*3.*parts \(len\(part_sizes\)\)"),
    (dict(pre_quant_scale=torch.ones(3, 32)), r"pre_quant_scale.*64.*input features of qweight"),
    (dict(pre_quant_scale=torch.ones(3, 64, dtype=torch.float16)), r"pre_quant_scale.*float32"),
])
def test_bad_parts_are_named(change, message):
    x, qweight, scales, zeros, bias, pqs = _case((64, 32, 32), 64, 4, True, 32, torch.float32, 0)
    args = dict(bits=4, group_size=32, bias=bias, pre_quant_scale=pqs, part_sizes=(64, 32, 32)) | change
    with pytest.raises(ValueError, match=message):
        weight_only_linear_parts(x, qweight, scales, zeros, **args)


_INTERPRETED = """
import dataclasses
import torch
from kiln.plugins.triton_weight_only import _launch_config
from kiln.plugins.triton_weight_only_parts import parts_fit, weight_only_linear_parts_triton
from kiln.plugins.weight_only_parts import weight_only_linear_parts_reference
import kiln.plugins.triton_weight_only_parts as parts_module

per_part_calls = []  # the part-by-part fallback's calls
_single = parts_module.weight_only_linear_triton
parts_module.weight_only_linear_triton = lambda *a: (per_part_calls.append(1), _single(*a))[1]


def check(parts, k, bits, asymmetric, group_size, t=3):
    x, qweight, scales, zeros, bias, pqs = _case(parts, k, bits, asymmetric, group_size, torch.float16,
                                                 sum(parts) + bits)
    x = x[:1].expand(t, k).contiguous() if t else x[:0]
    args = (x, qweight, scales, zeros, bits, group_size, bias, pqs, list(parts))
    y = weight_only_linear_parts_triton(*args)
    ref = weight_only_linear_parts_reference(*args)
    assert y.shape == ref.shape == (t, sum(parts)) and y.dtype == torch.float16
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2, msg=f"{parts} {bits} {asymmetric}")


# Bounds on tile edges: one launch (the heuristic's 128-wide decode tiles), INT4 with and without zero points,
# INT8, three parts and two.
assert parts_fit([256, 128, 128], 128) and not parts_fit([96, 32], 64) and not parts_fit([64] * 4, 64)
for bits, asymmetric in ((4, False), (4, True), (8, False)):
    check((256, 128, 128), 64, bits, asymmetric, 32)
check((128, 128), 128, 4, True, 64, t=1)
assert not per_part_calls, "parts on tile edges ran part by part"
# Bounds off the tile edges, and four parts: part by part. No tokens: an empty result.
check((96, 32), 64, 4, True, 32)
check((128, 128, 128, 128), 64, 4, False, 32)
assert len(per_part_calls) == 6
check((256, 128, 128), 64, 4, False, 32, t=0)
print("ok")
"""


@needs_triton
def test_interpreted_kernel_reads_each_parts_x():
    script = ("import torch\n" + inspect.getsource(weight_only_case) + inspect.getsource(_case) + _INTERPRETED)
    assert run_interpreted(script).strip().endswith("ok")


needs_cuda_kernels = pytest.mark.skipif(not (torch.cuda.is_available() and USE_TRITON),
                                        reason="needs CUDA and triton (with KILN_DISABLE_TRITON unset)")


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("parts", [(4096, 1024, 1024), (14336, 14336)], ids=["qkv", "gate_up"])
@pytest.mark.parametrize("t", [1, 16, 128])
def test_llama_8b_qkv_and_gate_up_match_the_per_part_reference(t, parts):
    """The 8B model's AWQ qkv and gate_up in bfloat16, and a decode-sized call captured in a CUDA graph
    (tolerance as test_kernels_weight_only's CUDA checks)."""
    from kiln.plugins.weight_only_parts import weight_only_linear_parts_reference

    _, qweight, scales, zeros, bias, pqs = _case(parts, 4096, 4, True, 128, torch.bfloat16, t, "cuda")
    x = torch.randn(t, 4096, device="cuda").to(torch.bfloat16)
    kwargs = dict(bits=4, group_size=128, bias=bias, pre_quant_scale=pqs, part_sizes=parts)
    y = weight_only_linear_parts(x, qweight, scales, zeros, **kwargs)
    ref = weight_only_linear_parts_reference(x, qweight, scales, zeros, 4, 128, bias, pqs, list(parts))
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)
    if t == 1:
        graph, out = capture(lambda: weight_only_linear_parts(x, qweight, scales, zeros, **kwargs))
        out.zero_()
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(out, y)  # split-K partials are summed in a fixed order
