"""The Triton kernel of kiln::weight_only_linear (W4A16 / W8A16) against weight_only_linear_reference: on the
CPU through Triton's interpreter (tiny float16 shapes, every format, groups, act-order g_idx, bias and
smoothing, edge tiles, split-K), and on CUDA at Llama-8B shapes (bfloat16), including CUDA graph capture.

Tolerance: the kernel dequantizes the weight and smooths x exactly as the reference does (same float32
operations, same one rounding to x's dtype), so both sides multiply the same values and every product is
exact in float32. Only the float32 summation order differs (tile by tile, split-K partials), which moves the
float32 sum by ~K * 2**-24 relative and so flips at most the last bit of the rounded output now and then:
one float16 ulp is 2**-11 relative, one bfloat16 ulp 2**-8. The cases keep |y| around 1, so rtol = atol =
1e-2 allows such flips with margin while a wrong nibble, group, zero point or scale (errors of ~0.1 and up)
fails. INT4 steps inside one group skip the dequantization (scale and zero point applied to each group's
partial sum), so on CUDA, in bfloat16, the reference's own rounding of every weight to bfloat16 (2**-9
relative each, ~3e-3 over K = 4096) adds to the output's flip of one ulp (2**-7 for 1 <= |y| < 2): the CUDA
checks allow 2e-2, still far below a wrong nibble's error.
"""

from __future__ import annotations

import inspect

import pytest
import torch
from cuda_graph_capture import capture
from triton_interpret import needs_triton, run_interpreted

from kiln.plugins._triton import USE_TRITON
from kiln.plugins.quant_linear import weight_only_linear_reference

# (bits, asymmetric): INT4 symmetric (q + 8), INT4 with zero points, INT8 symmetric (int8), INT8 with zero
# points (uint8).
FORMATS = [(4, False), (4, True), (8, False), (8, True)]
FORMAT_IDS = ["int4-sym", "int4-zeros", "int8-sym", "int8-zeros"]


def weight_only_case(n: int, k: int, bits: int, asymmetric: bool, group_size: int, act_order: bool,
                     gen: torch.Generator):
    """Random CPU weights of one format as weight_only_linear takes them: (qweight, scales, zeros, g_idx),
    scaled so that y = x @ W^T is ~1 for x ~ N(0, 1). With act_order, columns get shuffled groups (every
    group used). The interpreted script gets this function's source."""
    groups = k // group_size
    levels = 2 ** bits
    # |q| ~ levels / 4 on average: w ~ 1 / sqrt(k).
    scales = (torch.rand(n, groups, generator=gen) + 0.5) * 4 / (levels * k ** 0.5)
    g_idx = None
    if act_order:
        g_idx = (torch.arange(k) // group_size)[torch.randperm(k, generator=gen)].to(torch.int32)
    if bits == 8 and not asymmetric:
        return torch.randint(-128, 128, (n, k), generator=gen).to(torch.int8), scales, None, g_idx
    u = torch.randint(0, levels, (n, k), generator=gen)
    zeros = torch.randint(0, levels, (n, groups), generator=gen).to(torch.uint8) if asymmetric else None
    qweight = u.to(torch.uint8) if bits == 8 else (u[:, 0::2] | (u[:, 1::2] << 4)).to(torch.uint8)  # [N, K // 2]
    return qweight, scales, zeros, g_idx


# --- CPU: the kernel under Triton's interpreter ---

_INTERPRETED_CHECKS = """
import dataclasses
from kiln.plugins.quant_linear import weight_only_linear_reference
from kiln.plugins.triton_weight_only import _launch, _launch_config, weight_only_linear_triton

gen = torch.Generator().manual_seed(BITS * 2 + ASYMMETRIC)


def check(t, n, k, group_size, act_order=False, extras=False, dtype=torch.float16, cfg=None, x_pad=0,
          transposed_scales=False):
    qweight, scales, zeros, g_idx = weight_only_case(n, k, BITS, ASYMMETRIC, group_size, act_order, gen)
    if transposed_scales:  # [N, G] views of [G, N] tensors: the kernel reads through their strides
        scales = scales.t().contiguous().t()
        zeros = None if zeros is None else zeros.t().contiguous().t()
    x = torch.randn(t, k + x_pad, generator=gen).to(dtype)[:, :k]  # x_pad: rows strided past K
    bias = torch.randn(n, generator=gen).to(dtype) if extras else None
    smoothing = torch.rand(k, generator=gen) + 0.5 if extras else None
    args = (x, qweight, scales, zeros, BITS, group_size, bias, smoothing, g_idx)
    y = weight_only_linear_triton(*args) if cfg is None else _launch(*args, cfg)
    ref = weight_only_linear_reference(*args)
    what = f"bits={BITS} asym={ASYMMETRIC} t={t} n={n} k={k} group={group_size} g_idx={act_order} "
    what += f"extras={extras} {dtype} cfg={cfg}"
    assert y.dtype == dtype and y.shape == (t, n), what
    torch.testing.assert_close(y.float(), ref.float(), rtol=1e-2, atol=1e-2, msg=lambda m: what + "\\n" + m)


# Groups of 32 and per-channel (group_size = K), act-order, bias + smoothing, decode and prefill token counts
# (edge tiles in M), N = 40 (an edge tile in N).
for k in (64, 128):
    for group_size in (32, k):
        for act_order in (False, True):
            for t in (1, 5, 33):
                check(t, 40, k, group_size, act_order, extras=(t + act_order) % 2 == 1)
check(5, 40, 128, 32, act_order=True, extras=True)
check(33, 40, 128, 128, act_order=False, extras=True)

# Groups that no power-of-two step of >= 16 columns fits (a scale per column), K not a multiple of BLOCK_K.
check(3, 24, 96, 24, extras=True)
check(17, 40, 64, 8)
# Strided x rows and transposed scales / zero points; float32 activations (IEEE dots). No bfloat16 here: the
# interpreter keeps it as uint16 and its tl.dot multiplies the bit patterns (triton-lang/triton#11584); the
# CUDA tests run bfloat16.
check(5, 40, 64, 32, extras=True, x_pad=16, transposed_scales=True)
check(5, 40, 64, 32, extras=True, dtype=torch.float32)

# Split-K: K = 128 in steps of 16 over 3 ranges (the last one shorter), summed by the second kernel; with a
# per-column gather too.
cfg = _launch_config(5, 40, 128, BITS, 16, False, 132)
split = dataclasses.replace(cfg, block_k=16, split_k=3, k_per_split=48)
check(5, 40, 128, 16, extras=True, cfg=split)
check(1, 40, 128, 16, act_order=True, extras=True, cfg=dataclasses.replace(split, group_aligned=False))

# From DEQUANT_MIN_TOKENS tokens: the weight dequantized by its own kernel (bit for bit the reference's), then
# one GEMM.
from kiln.plugins.quant_linear import dequantize_weight
from kiln.plugins.triton_dequantize import dequantize_weight_triton
from kiln.plugins.triton_weight_only import DEQUANT_MIN_TOKENS

for group_size, act_order in ((32, False), (128, False), (32, True)):
    qweight, scales, zeros, g_idx = weight_only_case(40, 128, BITS, ASYMMETRIC, group_size, act_order, gen)
    for dtype in (torch.float16, torch.float32):
        want = dequantize_weight(qweight, scales, zeros, BITS, group_size, dtype, g_idx)
        got = dequantize_weight_triton(qweight, scales, zeros, BITS, group_size, dtype, g_idx)
        assert got.dtype == dtype and torch.equal(got, want), f"dequantized {BITS} {group_size} {act_order}"
check(DEQUANT_MIN_TOKENS, 40, 128, 32, act_order=True, extras=True)
check(DEQUANT_MIN_TOKENS + 6, 40, 64, 64, extras=True, dtype=torch.float32)

# No tokens: an empty [0, N] result, no launch.
qweight, scales, zeros, _ = weight_only_case(8, 64, BITS, ASYMMETRIC, 32, False, gen)
empty = weight_only_linear_triton(torch.zeros(0, 64, dtype=torch.float16), qweight, scales, zeros, BITS, 32,
                                  None, None)
assert empty.shape == (0, 8) and empty.dtype == torch.float16
print("ok")
"""


@needs_triton
@pytest.mark.parametrize("bits, asymmetric", FORMATS, ids=FORMAT_IDS)
def test_interpreted_kernel_matches_the_reference(bits, asymmetric):
    script = (f"import torch\nBITS, ASYMMETRIC = {bits}, {asymmetric}\n" + inspect.getsource(weight_only_case)
              + _INTERPRETED_CHECKS)
    assert run_interpreted(script).strip().endswith("ok")


@needs_triton
def test_launch_config_keeps_steps_in_one_group_and_splits_small_outputs():
    from kiln.plugins.triton_weight_only import _launch_config

    def covers_k(cfg, k):
        return cfg.k_per_split % cfg.block_k == 0 and (cfg.split_k - 1) * cfg.k_per_split < k <= (
            cfg.split_k * cfg.k_per_split)

    decode = _launch_config(1, 4096, 4096, 4, 128, False, 132)
    assert decode.block_m == 16 and decode.group_aligned and 128 % decode.block_k == 0
    assert decode.split_k > 1 and covers_k(decode, 4096)  # 64 tiles of 4096 outputs on 132 SMs
    prefill = _launch_config(4096, 14336, 4096, 4, 128, False, 132)
    assert prefill.block_m == 128 and prefill.split_k == 1 and prefill.group_aligned
    # 32 tiles: split, but the float32 partials stay within the weight's bytes.
    mid = _launch_config(128, 4096, 4096, 4, 128, False, 132)
    assert 1 < mid.split_k and mid.split_k * 128 * 4096 * 4 <= 4096 * 4096 // 2 and covers_k(mid, 4096)
    per_channel = _launch_config(16, 14336, 4096, 8, 4096, False, 132)
    assert per_channel.group_aligned and per_channel.block_k == 128 and covers_k(per_channel, 4096)
    assert not _launch_config(16, 4096, 4096, 4, 128, True, 132).group_aligned  # act-order gathers
    assert not _launch_config(16, 4096, 4104, 8, 4104, False, 132).group_aligned  # 4104 = 8 * 513


@needs_triton
def test_int4_group_step_is_taken_at_one_token_only():
    """The one-token INT4 path was 25% slower at 16 tokens and 2.5-7x slower from 32 on an H100 (docs/performance.md): every
    other token count, INT8 and act-order launches dequantize each step."""
    from kiln.plugins.triton_weight_only import _int4_fast, _launch_config

    one = _launch_config(1, 4096, 4096, 4, 128, False, 132)
    assert _int4_fast(one, 4, 1)
    assert not _int4_fast(one, 4, 2) and not _int4_fast(one, 4, 16)  # same tile height, more tokens
    assert not _int4_fast(_launch_config(128, 4096, 4096, 4, 128, False, 132), 4, 128)
    assert not _int4_fast(_launch_config(1, 4096, 4096, 8, 128, False, 132), 8, 1)
    assert not _int4_fast(_launch_config(1, 4096, 4096, 4, 128, True, 132), 4, 1)


# --- CUDA ---

needs_cuda_kernels = pytest.mark.skipif(not (torch.cuda.is_available() and USE_TRITON),
                                        reason="needs CUDA and triton (with KILN_DISABLE_TRITON unset)")


def _cuda_case(t, n, k, bits, asymmetric, group_size=128, act_order=False, extras=True, seed=0):
    gen = torch.Generator().manual_seed(seed)
    weight = weight_only_case(n, k, bits, asymmetric, group_size, act_order, gen)
    qweight, scales, zeros, g_idx = (None if w is None else w.cuda() for w in weight)
    x = torch.randn(t, k, generator=gen).to("cuda", torch.bfloat16)
    bias = torch.randn(n, generator=gen).to("cuda", torch.bfloat16) if extras else None
    smoothing = (torch.rand(k, generator=gen) + 0.5).cuda() if extras else None
    return x, qweight, scales, zeros, bits, group_size, bias, smoothing, g_idx


def _check_cuda(args):
    from kiln.plugins.triton_weight_only import weight_only_linear_triton

    y = weight_only_linear_triton(*args)
    ref = weight_only_linear_reference(*args)
    assert y.dtype == torch.bfloat16 and y.shape == ref.shape and torch.isfinite(y).all()
    torch.testing.assert_close(y.float(), ref.float(), rtol=2e-2, atol=2e-2)


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("bits, asymmetric", FORMATS, ids=FORMAT_IDS)
@pytest.mark.parametrize("n", [14336, 4096])
@pytest.mark.parametrize("t", [1, 16, 128, 1024])  # 1024: dequantize + cuBLAS
def test_llama_8b_shapes_match_reference(t, n, bits, asymmetric):
    _check_cuda(_cuda_case(t, n, 4096, bits, asymmetric, extras=bits == 4, seed=t + n))


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("t", [1, 128])
@pytest.mark.parametrize("group_size", [128, 4096], ids=["g128-act-order", "per-channel"])
def test_act_order_and_per_channel_match_reference(t, group_size):
    _check_cuda(_cuda_case(t, 4096, 4096, 4, True, group_size, act_order=group_size < 4096, seed=t))


@pytest.mark.gpu
@needs_cuda_kernels
@pytest.mark.parametrize("t", [1, 16])
def test_op_runs_the_kernel_inside_a_cuda_graph(t):
    """The op dispatches to the kernel on CUDA; a decode-sized call (split-K: two kernels and a workspace)
    captures in a CUDA graph, and its replay reads the static input: new x values give the eager result."""
    from kiln.plugins import weight_only_linear
    from kiln.plugins.triton_weight_only import weight_only_linear_triton

    assert torch._C._dispatch_has_kernel_for_dispatch_key("kiln::weight_only_linear", "CUDA")
    x, qweight, scales, zeros, bits, group_size, bias, smoothing, _ = _cuda_case(t, 4096, 4096, 4, False)

    def step():
        return weight_only_linear(x, qweight, scales, zeros, bits=bits, group_size=group_size, bias=bias,
                                  pre_quant_scale=smoothing)

    graph, out = capture(step)
    for seed in (1, 2):
        x.copy_(torch.randn(x.shape, generator=torch.Generator().manual_seed(seed)).to(x))
        graph.replay()
        torch.cuda.synchronize()
        want = weight_only_linear_triton(x, qweight, scales, zeros, bits, group_size, bias, smoothing)
        assert torch.equal(out, want)  # split-K sums in a fixed order: replays are deterministic
