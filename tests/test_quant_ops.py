"""The quantized linear operators (plugins/quant_linear.py) and INT4 packing (plugins/int4_pack.py): each
reference against the formula computed by hand in float64 from the same quantized values, their
torch.library registration, and the wrappers' argument checks."""

from __future__ import annotations

import pytest
import torch

from kiln.plugins import scaled_linear, weight_only_linear
from kiln.plugins.int4_pack import pack_int4, unpack_int4
from kiln.plugins.quant_linear import dequantize_weight

FP8 = torch.float8_e4m3fn
QMAX = {FP8: 448.0, torch.int8: 127.0}


def _assert_close_to(result: torch.Tensor, expected: torch.Tensor) -> None:
    """result (any float dtype) against a float64 expectation, at the tolerance of result's dtype."""
    if result.dtype == torch.float32:
        torch.testing.assert_close(result.double(), expected, rtol=1e-5, atol=1e-4)
    else:  # one rounding to 16 bits apart at most
        torch.testing.assert_close(result, expected.to(result.dtype), rtol=1.6e-2, atol=1e-2)


# --- INT4 packing ---------------------------------------------------------------------------------------


def test_pack_int4_puts_even_columns_in_the_low_nibble():
    u = torch.tensor([[1, 2, 15, 0], [0, 15, 7, 8]], dtype=torch.uint8)
    assert pack_int4(u).tolist() == [[0x21, 0x0F], [0xF0, 0x87]]


@pytest.mark.parametrize("shape", [(3, 6), (1, 2), (7, 130), (0, 4), (5, 0), (2, 3, 8)])
def test_pack_unpack_round_trip(shape):
    torch.manual_seed(0)
    u = torch.randint(0, 16, shape, dtype=torch.uint8)
    packed = pack_int4(u)
    assert packed.dtype == torch.uint8 and packed.shape == (*shape[:-1], shape[-1] // 2)
    by_hand = (u[..., 0::2].int() + 16 * u[..., 1::2].int()).to(torch.uint8)
    assert torch.equal(packed, by_hand)
    assert torch.equal(unpack_int4(packed), u)


def test_unpack_int4_of_every_byte():
    packed = torch.arange(256, dtype=torch.int32).to(torch.uint8)[None]  # [1, 256]
    u = unpack_int4(packed)  # [1, 512]
    assert u[0, 0::2].tolist() == [b % 16 for b in range(256)]
    assert u[0, 1::2].tolist() == [b // 16 for b in range(256)]


@pytest.mark.parametrize("call, message", [
    (lambda: pack_int4(torch.zeros(2, 5, dtype=torch.uint8)), r"K\) must be even"),
    (lambda: pack_int4(torch.full((2, 4), 16, dtype=torch.uint8)), "values up to 16"),
    (lambda: pack_int4(torch.zeros(2, 4, dtype=torch.int8)), "u has dtype"),
    (lambda: pack_int4(torch.tensor(3, dtype=torch.uint8)), "u must have at least 1 dim"),
    (lambda: unpack_int4(torch.zeros(2, 4, dtype=torch.int32)), "packed has dtype"),
])
def test_int4_packing_rejects_bad_arguments(call, message):
    with pytest.raises(ValueError, match=message):
        call()


# --- scaled_linear (W8A8) -------------------------------------------------------------------------------


def _quantized_weight(n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    if dtype == FP8:
        return (torch.randn(n, k) * 100).clamp(-448, 448).to(FP8)
    return torch.randint(-128, 128, (n, k), dtype=torch.int8)


def _expected_scaled(x, weight, weight_scale, input_scale=None, bias=None, pre_quant_scale=None):
    """The W8A8 formula by hand: quantize x in float32 as the kernel does, then the exact product in float64."""
    qmax = QMAX[weight.dtype]
    xs = x.float() if pre_quant_scale is None else x.float() * pre_quant_scale
    if input_scale is None:
        s = (xs.abs().amax(dim=1, keepdim=True) / qmax).clamp(min=1e-12)  # [T, 1]
    else:
        s = input_scale
    if weight.dtype == FP8:
        x_q = (xs / s).clamp(-448, 448).to(FP8).double()
    else:
        x_q = torch.round(xs / s).clamp(-128, 127).double()
    y = (x_q @ weight.double().T) * s.double() * weight_scale.double()
    return y if bias is None else y + bias.double()


@pytest.mark.parametrize("wdtype", [FP8, torch.int8])
@pytest.mark.parametrize("static", [False, True])
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias, with_smoothing", [(False, False), (True, False), (False, True), (True, True)])
def test_scaled_linear_matches_the_formula(wdtype, static, xdtype, with_bias, with_smoothing):
    torch.manual_seed(0)
    t, k, n = 5, 48, 24
    x = torch.randn(t, k).to(xdtype)
    x[1] *= 20  # rows of different ranges: per-token scales differ
    weight = _quantized_weight(n, k, wdtype)
    weight_scale = torch.rand(n) * 0.01 + 1e-3
    pre_quant_scale = torch.rand(k) + 0.5 if with_smoothing else None
    bias = torch.randn(n).to(xdtype) if with_bias else None
    input_scale = None
    if static:  # a calibrated scale smaller than the largest value: some activations saturate
        xs = x.float() * (1 if pre_quant_scale is None else pre_quant_scale)
        input_scale = (xs.abs().amax() / QMAX[wdtype] * 0.5).reshape(1)
    y = scaled_linear(x, weight, weight_scale, input_scale, bias, pre_quant_scale)
    assert y.dtype == xdtype and y.shape == (t, n)
    _assert_close_to(y, _expected_scaled(x, weight, weight_scale, input_scale, bias, pre_quant_scale))


@pytest.mark.parametrize("wdtype", [FP8, torch.int8])
def test_dynamic_scale_is_each_rows_amax_over_qmax(wdtype):
    torch.manual_seed(1)
    x = torch.randn(4, 32) * torch.tensor([[0.1], [1.0], [30.0], [500.0]])
    weight = _quantized_weight(16, 32, wdtype)
    weight_scale = torch.rand(16) + 0.5
    dynamic = scaled_linear(x, weight, weight_scale)
    for row in range(4):
        static = scaled_linear(x[row:row + 1], weight, weight_scale,
                               input_scale=(x[row].abs().amax() / QMAX[wdtype]).reshape(1))
        torch.testing.assert_close(dynamic[row:row + 1], static, rtol=1e-6, atol=0)


@pytest.mark.parametrize("wdtype", [FP8, torch.int8])
def test_dynamic_scale_of_a_zero_row_gives_the_bias(wdtype):
    x = torch.zeros(2, 16)
    x[1] = torch.randn(16)
    bias = torch.randn(8)
    y = scaled_linear(x, _quantized_weight(8, 16, wdtype), torch.ones(8), bias=bias)
    assert not y.isnan().any()
    assert torch.equal(y[0], bias)


@pytest.mark.parametrize("wdtype", [FP8, torch.int8])
@pytest.mark.parametrize("static", [False, True])
def test_scaled_linear_of_no_tokens(wdtype, static):
    x = torch.zeros(0, 16, dtype=torch.bfloat16)
    input_scale = torch.ones(1) if static else None
    y = scaled_linear(x, _quantized_weight(8, 16, wdtype), torch.ones(8), input_scale,
                      torch.zeros(8, dtype=torch.bfloat16), torch.ones(16))
    assert y.shape == (0, 8) and y.dtype == torch.bfloat16


def test_int8_sum_is_exact_past_float32_precision():
    # 127 * 127 * 8192 = 132128768: a float32 running sum stops being exact after 2^24 / 16129 ~ 1040 terms
    # (a blocked float32 BLAS happens to get this one right; the test below is one it gets wrong).
    k = 8192
    x = torch.full((2, k), 127.0)
    weight = torch.full((3, k), 127, dtype=torch.int8)
    y = scaled_linear(x, weight, torch.ones(3), input_scale=torch.ones(1))
    assert y.tolist() == [[127 * 127 * k] * 3] * 2


@pytest.mark.parametrize("int_mm", ["torch", "missing"])
def test_int8_sums_round_once_to_float32(monkeypatch, int_mm):
    # Large positive sums (~1e8, past 2^24): the output is the exact integer sum rounded once to float32,
    # both through torch._int_mm and through the float64 fallback (what CUDA takes for small T).
    if int_mm == "missing":
        monkeypatch.setattr(torch, "_int_mm", None)
    torch.manual_seed(2)
    k = 8192
    x_q = torch.randint(100, 128, (4, k), dtype=torch.int64)
    w_q = torch.randint(100, 128, (6, k), dtype=torch.int64)
    exact = x_q @ w_q.T  # [4, 6] int64
    y = scaled_linear(x_q.float(), w_q.to(torch.int8), torch.ones(6), input_scale=torch.ones(1))
    assert torch.equal(y, exact.double().float())


def test_scaled_linear_through_the_torch_library_op():
    torch.manual_seed(3)
    x, bias, smoothing = torch.randn(3, 32), torch.randn(16), torch.rand(32) + 0.5
    for wdtype in (FP8, torch.int8):
        weight, weight_scale = _quantized_weight(16, 32, wdtype), torch.rand(16)
        for input_scale in (None, torch.tensor([0.02])):
            via_op = torch.ops.kiln.scaled_linear(x, weight, weight_scale, input_scale, bias, smoothing)
            assert torch.equal(via_op, scaled_linear(x, weight, weight_scale, input_scale, bias, smoothing))
            # opcheck's schema test compares inputs with ops the CPU lacks for float8 ("mul_cpu_reduced_float")
            tests = ("test_schema", "test_faketensor") if wdtype == torch.int8 else ("test_faketensor",)
            torch.library.opcheck(torch.ops.kiln.scaled_linear.default,
                                  (x, weight, weight_scale, input_scale, bias, smoothing), test_utils=tests)


def _scaled_call(**bad):
    args = dict(x=torch.randn(2, 8), weight=torch.zeros(4, 8, dtype=torch.int8), weight_scale=torch.ones(4),
                input_scale=None, bias=None, pre_quant_scale=None)
    args.update(bad)
    return scaled_linear(**args)


@pytest.mark.parametrize("bad, message", [
    (dict(x=torch.randn(2, 8, 1)), "x must have 2 dims"),
    (dict(x=torch.randn(2, 8, dtype=torch.float64)), "x has dtype"),
    (dict(x=torch.randn(2, 7)), r"x.shape\[1\] is 7, expected 8"),
    (dict(x=torch.randn(8, 2).T), "x must be contiguous in its last dim"),
    (dict(weight=torch.zeros(4, 8)), "weight has dtype"),
    (dict(weight=torch.zeros(4, 8, 1, dtype=torch.int8)), "weight must have 2 dims"),
    (dict(weight=torch.zeros(8, 4, dtype=torch.int8).T), "weight must be contiguous"),
    (dict(weight=torch.zeros(4, 0, dtype=torch.int8), x=torch.randn(2, 0)), "K = 0"),
    (dict(weight_scale=torch.ones(3)), r"weight_scale.shape\[0\] is 3, expected 4"),
    (dict(weight_scale=torch.ones(4, 1)), "weight_scale must have 1 dims"),
    (dict(weight_scale=torch.ones(4, dtype=torch.float16)), "weight_scale has dtype"),
    (dict(input_scale=torch.ones(2)), r"input_scale.shape\[0\] is 2, expected 1"),
    (dict(input_scale=torch.tensor(1.0)), "input_scale must have 1 dims"),
    (dict(input_scale=torch.ones(1, dtype=torch.float64)), "input_scale has dtype"),
    (dict(bias=torch.ones(5)), r"bias.shape\[0\] is 5, expected 4"),
    (dict(bias=torch.ones(4, dtype=torch.float16)), "bias has dtype"),
    (dict(pre_quant_scale=torch.ones(7)), r"pre_quant_scale.shape\[0\] is 7, expected 8"),
    (dict(pre_quant_scale=torch.ones(8, dtype=torch.bfloat16)), "pre_quant_scale has dtype"),
    (dict(weight_scale=torch.ones(4, device="meta")), "different devices"),
    (dict(bias=torch.ones(4, device="meta")), "different devices"),
])
def test_scaled_linear_rejects_bad_arguments(bad, message):
    with pytest.raises(ValueError, match=message):
        _scaled_call(**bad)


# --- weight_only_linear (W8A16, W4A16) ------------------------------------------------------------------


def _weight_only_case(n: int, k: int, bits: int, group_size: int, asymmetric: bool, act_order: bool = False):
    """Random quantized values q: [N, K] int64, and what weight_only_linear takes for them: (q, qweight, scales,
    zeros, g_idx). With act_order each column gets a random group (GPTQ's g_idx), every group used."""
    groups = k // group_size
    scales = torch.rand(n, groups) * 0.05 + 0.01
    # The group of each column: k // group_size, or a random permutation of that (GPTQ's desc_act).
    group_of = torch.arange(k) // group_size  # [K]
    g_idx = None
    if act_order:
        group_of = group_of[torch.randperm(k)]
        g_idx = group_of.to(torch.int32)
    if bits == 8 and not asymmetric:
        q = torch.randint(-128, 128, (n, k))
        return q, q.to(torch.int8), scales, None, g_idx
    levels = 2 ** bits
    u = torch.randint(0, levels, (n, k))
    zeros = torch.randint(0, levels, (n, groups)) if asymmetric else None
    q = u - (levels // 2 if zeros is None else zeros[:, group_of])
    packed = u.to(torch.uint8) if bits == 8 else (u[:, 0::2] + 16 * u[:, 1::2]).to(torch.uint8)  # [N, K // 2]
    return q, packed, scales, None if zeros is None else zeros.to(torch.uint8), g_idx


def _expected_weight_only(x, q, scales, group_size, bias=None, pre_quant_scale=None, g_idx=None):
    """The W4A16 formula by hand: the weight dequantized to x's dtype, the product in float64."""
    group_of = torch.arange(q.shape[1]) // group_size if g_idx is None else g_idx.long()
    w = (q.float() * scales[:, group_of]).to(x.dtype)  # [N, K]
    xs = x if pre_quant_scale is None else (x.float() * pre_quant_scale).to(x.dtype)
    y = xs.double() @ w.double().T
    return y if bias is None else y + bias.double()


WEIGHT_ONLY_FORMATS = [  # (bits, group_size, asymmetric); K = 64
    (4, 16, False), (4, 32, True), (4, 64, False), (8, 64, False), (8, 16, False), (8, 16, True), (8, 64, True)]


@pytest.mark.parametrize("bits, group_size, asymmetric", WEIGHT_ONLY_FORMATS)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_bias, with_smoothing", [(False, False), (True, True)])
def test_weight_only_linear_matches_the_formula(bits, group_size, asymmetric, xdtype, with_bias, with_smoothing):
    torch.manual_seed(4)
    t, k, n = 6, 64, 24
    q, qweight, scales, zeros, _ = _weight_only_case(n, k, bits, group_size, asymmetric)
    x = torch.randn(t, k).to(xdtype)
    bias = torch.randn(n).to(xdtype) if with_bias else None
    pre_quant_scale = torch.rand(k) + 0.5 if with_smoothing else None
    y = weight_only_linear(x, qweight, scales, zeros, bits=bits, group_size=group_size, bias=bias,
                           pre_quant_scale=pre_quant_scale)
    assert y.dtype == xdtype and y.shape == (t, n)
    _assert_close_to(y, _expected_weight_only(x, q, scales, group_size, bias, pre_quant_scale))


@pytest.mark.parametrize("bits, group_size, asymmetric", WEIGHT_ONLY_FORMATS)
def test_dequantize_weight_is_q_times_its_groups_scale(bits, group_size, asymmetric):
    torch.manual_seed(5)
    q, qweight, scales, zeros, _ = _weight_only_case(8, 64, bits, group_size, asymmetric)
    group_of = torch.arange(64) // group_size
    for dtype in (torch.float32, torch.bfloat16):
        w = dequantize_weight(qweight, scales, zeros, bits, group_size, dtype)
        assert torch.equal(w, (q.float() * scales[:, group_of]).to(dtype))


def test_int4_packed_by_pack_int4_is_what_weight_only_linear_reads():
    torch.manual_seed(6)
    q = torch.randint(-8, 8, (8, 32))  # ModelOpt's symmetric INT4 AWQ: q in -8..7, stored as q + 8
    scales = torch.rand(8, 2)
    x = torch.randn(3, 32)
    y = weight_only_linear(x, pack_int4((q + 8).to(torch.uint8)), scales, bits=4, group_size=16)
    _assert_close_to(y, _expected_weight_only(x, q, scales, 16))


@pytest.mark.parametrize("bits, group_size, asymmetric", WEIGHT_ONLY_FORMATS)
@pytest.mark.parametrize("xdtype", [torch.float32, torch.bfloat16])
def test_weight_only_linear_with_g_idx_matches_the_formula(bits, group_size, asymmetric, xdtype):
    # GPTQ act-order: column k takes the scale and zero point of group g_idx[k], not k // group_size.
    torch.manual_seed(9)
    t, k, n = 5, 64, 16
    q, qweight, scales, zeros, g_idx = _weight_only_case(n, k, bits, group_size, asymmetric, act_order=True)
    x, bias = torch.randn(t, k).to(xdtype), torch.randn(n).to(xdtype)
    y = weight_only_linear(x, qweight, scales, zeros, bits=bits, group_size=group_size, bias=bias, g_idx=g_idx)
    assert y.dtype == xdtype and y.shape == (t, n)
    _assert_close_to(y, _expected_weight_only(x, q, scales, group_size, bias, g_idx=g_idx))
    group_of = g_idx.long()
    assert torch.equal(dequantize_weight(qweight, scales, zeros, bits, group_size, torch.float32, g_idx),
                       q.float() * scales[:, group_of])


def test_g_idx_of_k_over_group_size_is_the_plain_grouping():
    torch.manual_seed(10)
    _, qweight, scales, zeros, _ = _weight_only_case(8, 64, 4, 16, asymmetric=True)
    plain = torch.arange(64, dtype=torch.int32) // 16
    assert torch.equal(dequantize_weight(qweight, scales, zeros, 4, 16, torch.float32, plain),
                       dequantize_weight(qweight, scales, zeros, 4, 16, torch.float32))


def test_dequantize_weight_by_hand():
    # 4 bits, asymmetric, groups of 2 scattered by g_idx = [1, 0, 0, 1]: u = [3, 15, 0, 9], zeros [2, 7],
    # scales [0.5, 2]: (3 - 7) * 2, (15 - 2) * 0.5, (0 - 2) * 0.5, (9 - 7) * 2.
    packed = torch.tensor([[3 + 16 * 15, 0 + 16 * 9]], dtype=torch.uint8)
    zeros, scales = torch.tensor([[2, 7]], dtype=torch.uint8), torch.tensor([[0.5, 2.0]])
    g_idx = torch.tensor([1, 0, 0, 1], dtype=torch.int32)
    assert dequantize_weight(packed, scales, zeros, 4, 2, torch.float32, g_idx).tolist() == [[-8.0, 6.5, -1.0, 4.0]]
    # 8 bits, asymmetric (uint8 values, uint8 zero points), groups of 2 in order: u = [0, 255, 128, 7],
    # zeros [128, 3], scales [0.25, 1]: (0 - 128) * 0.25, (255 - 128) * 0.25, (128 - 3) * 1, (7 - 3) * 1.
    u = torch.tensor([[0, 255, 128, 7]], dtype=torch.uint8)
    zeros, scales = torch.tensor([[128, 3]], dtype=torch.uint8), torch.tensor([[0.25, 1.0]])
    assert dequantize_weight(u, scales, zeros, 8, 2, torch.float32).tolist() == [[-32.0, 31.75, 125.0, 4.0]]
    x = torch.tensor([[1.0, 2.0, 0.0, -1.0]])
    assert weight_only_linear(x, u, scales, zeros, bits=8, group_size=2).tolist() == [[-32.0 + 63.5 - 4.0]]


@pytest.mark.parametrize("bits", [4, 8])
def test_weight_only_linear_of_no_tokens(bits):
    _, qweight, scales, zeros, _ = _weight_only_case(8, 32, bits, 16, asymmetric=bits == 4)
    y = weight_only_linear(torch.zeros(0, 32, dtype=torch.float16), qweight, scales, zeros, bits=bits,
                           group_size=16, bias=torch.zeros(8, dtype=torch.float16), pre_quant_scale=torch.ones(32))
    assert y.shape == (0, 8) and y.dtype == torch.float16


def test_weight_only_linear_through_the_torch_library_op():
    torch.manual_seed(7)
    x, bias, smoothing = torch.randn(3, 64, dtype=torch.bfloat16), torch.randn(8, dtype=torch.bfloat16), torch.rand(64)
    for bits, group_size, asymmetric in WEIGHT_ONLY_FORMATS:
        _, qweight, scales, zeros, _ = _weight_only_case(8, 64, bits, group_size, asymmetric)
        args = (x, qweight, scales, zeros, bits, group_size, bias, smoothing)
        via_op = torch.ops.kiln.weight_only_linear(*args)
        assert torch.equal(via_op, weight_only_linear(x, qweight, scales, zeros, bits=bits, group_size=group_size,
                                                      bias=bias, pre_quant_scale=smoothing))
        torch.library.opcheck(torch.ops.kiln.weight_only_linear.default, args,
                              test_utils=("test_schema", "test_faketensor"))


def test_weight_only_linear_with_g_idx_through_the_torch_library_op():
    torch.manual_seed(8)
    x = torch.randn(3, 64, dtype=torch.bfloat16)
    for bits, group_size, asymmetric in WEIGHT_ONLY_FORMATS:
        _, qweight, scales, zeros, g_idx = _weight_only_case(8, 64, bits, group_size, asymmetric, act_order=True)
        args = (x, qweight, scales, zeros, bits, group_size, None, None, g_idx)
        via_op = torch.ops.kiln.weight_only_linear(*args)
        assert torch.equal(via_op, weight_only_linear(x, qweight, scales, zeros, bits=bits, group_size=group_size,
                                                      g_idx=g_idx))
        torch.library.opcheck(torch.ops.kiln.weight_only_linear.default, args,
                              test_utils=("test_schema", "test_faketensor"))


def _weight_only_call(**bad):
    args = dict(x=torch.randn(2, 8), qweight=torch.zeros(4, 4, dtype=torch.uint8), scales=torch.ones(4, 2),
                zeros=None, bits=4, group_size=4, bias=None, pre_quant_scale=None, g_idx=None)
    args.update(bad)
    return weight_only_linear(**args)


@pytest.mark.parametrize("bad, message", [
    (dict(bits=3), "bits must be 4 or 8, got 3"),
    (dict(bits=4.0), "bits must be 4 or 8, got 4.0"),
    (dict(group_size=3), "group_size 3 must be a positive divisor of K = 8"),
    (dict(group_size=0), "group_size 0 must be a positive divisor of K = 8"),
    (dict(x=torch.randn(2, 8, 1)), "x must have 2 dims"),
    (dict(x=torch.randn(2, 8, dtype=torch.float64)), "x has dtype"),
    (dict(x=torch.randn(2, 6)), r"x.shape\[1\] is 6, expected 8"),
    (dict(x=torch.randn(8, 2).T), "x must be contiguous in its last dim"),
    (dict(qweight=torch.zeros(4, 8, dtype=torch.int8)), "qweight has dtype"),
    (dict(qweight=torch.zeros(4, 8, dtype=torch.uint8), bits=8, group_size=8, scales=torch.ones(4, 1)),
     "qweight has dtype"),
    (dict(qweight=torch.zeros(4, 4, 1, dtype=torch.uint8)), "qweight must have 2 dims"),
    (dict(qweight=torch.zeros(4, 8, dtype=torch.uint8)[:, ::2]), "qweight must be contiguous"),
    (dict(scales=torch.ones(4, 3)), r"scales.shape\[1\] is 3, expected 2 \(groups: K = 8 / group_size = 4\)"),
    (dict(scales=torch.ones(3, 2)), r"scales.shape\[0\] is 3, expected 4"),
    (dict(scales=torch.ones(4, 2, dtype=torch.float16)), "scales has dtype"),
    (dict(zeros=torch.zeros(4, 2, dtype=torch.int32)), "zeros has dtype"),
    (dict(zeros=torch.zeros(4, 1, dtype=torch.uint8)), r"zeros.shape\[1\] is 1, expected 2"),
    # 8 bits: signed int8 when symmetric, uint8 with zero points when asymmetric
    (dict(zeros=torch.zeros(4, 1, dtype=torch.uint8), bits=8, group_size=8, scales=torch.ones(4, 1),
          qweight=torch.zeros(4, 8, dtype=torch.int8)), "qweight has dtype torch.int8"),
    (dict(g_idx=torch.zeros(8, dtype=torch.int64)), "g_idx has dtype"),
    (dict(g_idx=torch.zeros(7, dtype=torch.int32)), r"g_idx.shape\[0\] is 7, expected 8"),
    (dict(g_idx=torch.zeros(8, 1, dtype=torch.int32)), "g_idx must have 1 dims"),
    (dict(g_idx=torch.tensor([0, 1, 2, 0, 1, 0, 1, 0], dtype=torch.int32)),
     r"g_idx holds groups 0..2; they must be in 0..1 \(K = 8 / group_size = 4\)"),
    (dict(g_idx=torch.tensor([0, 1, -1, 0, 1, 0, 1, 0], dtype=torch.int32)), "g_idx holds groups -1..1"),
    (dict(g_idx=torch.zeros(8, dtype=torch.int32, device="meta")), "different devices"),
    (dict(bias=torch.ones(5)), r"bias.shape\[0\] is 5, expected 4"),
    (dict(bias=torch.ones(4, dtype=torch.bfloat16)), "bias has dtype"),
    (dict(pre_quant_scale=torch.ones(4)), r"pre_quant_scale.shape\[0\] is 4, expected 8"),
    (dict(pre_quant_scale=torch.ones(8, 1)), "pre_quant_scale must have 1 dims"),
    (dict(scales=torch.ones(4, 2, device="meta")), "different devices"),
    (dict(pre_quant_scale=torch.ones(8, device="meta")), "different devices"),
])
def test_weight_only_linear_rejects_bad_arguments(bad, message):
    with pytest.raises(ValueError, match=message):
        _weight_only_call(**bad)


def test_dequantize_weight_rejects_bad_arguments():
    with pytest.raises(ValueError, match="group_size 5 must be a positive divisor of K = 8"):
        dequantize_weight(torch.zeros(4, 4, dtype=torch.uint8), torch.ones(4, 2), None, 4, 5, torch.float16)
