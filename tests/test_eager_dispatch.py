"""What the operator wrappers call for plain eager tensors instead of dispatching through torch.library
(plugins/_eager.py): the reference on the CPU, the registered kernel on a device that has one, and the op
itself for everything that traces (torch.compile, fake tensors, dispatch modes, functorch transforms),
tensor subclasses and devices without a kernel. CPU only: the "device with a kernel" is the meta device of
an op made here."""

from __future__ import annotations

import functools
import importlib

import pytest
import torch
from torch._subclasses import FakeTensor, FakeTensorMode
from torch.utils._python_dispatch import TorchDispatchMode

from kiln.plugins import (
    fp8_block_linear,
    fused_add_rms_norm,
    fused_add_rms_norm_quant,
    fused_moe,
    paged_attention,
    rms_norm,
    rms_norm_quant,
    rotary_embedding,
    rotary_embedding_and_write_kv,
    scaled_linear,
    scaled_linear_quantized,
    silu_and_mul,
    silu_and_mul_quant,
    weight_only_linear,
    write_kv_cache,
)
from kiln.plugins._eager import KernelOp
from kiln.plugins._triton import USE_TRITON

# The modules by name: kiln.plugins' fp8_block_linear and fused_moe are the wrappers, not their modules.
_PLUGIN_MODULES = tuple(importlib.import_module(f"kiln.plugins.{name}") for name in (
    "activation", "attention", "fp8_block_linear", "kv_cache", "moe", "norm", "norm_quant", "quant_linear", "rotary",
    "rotary_kv"))
attention, kv_cache, norm, rotary_kv = (importlib.import_module(f"kiln.plugins.{name}")
                                        for name in ("attention", "kv_cache", "norm", "rotary_kv"))


def _double_reference(x: torch.Tensor) -> torch.Tensor:
    return x * 2


_double = KernelOp("kiln_test::double", _double_reference)
_meta_kernel_calls: list[torch.Tensor] = []


def _double_meta_kernel(x: torch.Tensor) -> torch.Tensor:
    _meta_kernel_calls.append(x)
    return torch.empty_like(x)


try:
    _double.register_kernel("meta", _double_meta_kernel)  # the op's fake implementation too
except RuntimeError:  # torch 2.11 comes with a Meta kernel of its own: record the kernel for direct calls only
    _double._kernels["meta"] = _double_meta_kernel

# The same op without a kernel for any device: a meta tensor stands for CUDA under KILN_DISABLE_TRITON=1.
_no_kernel = KernelOp("kiln_test::no_kernel", _double_reference)


@_no_kernel.op.register_fake
def _(x):
    return torch.empty_like(x)


class _Subclass(torch.Tensor):
    pass


class _PassThrough(TorchDispatchMode):
    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        return func(*args, **(kwargs or {}))


def _kernel_ops() -> list[KernelOp]:
    return [value for module in _PLUGIN_MODULES for value in vars(module).values() if isinstance(value, KernelOp)]


# --- the direct table ------------------------------------------------------------------------------------


def test_a_plain_cpu_tensor_gets_the_reference():
    assert _double.for_tensor(torch.ones(3)) is _double_reference
    assert norm._rms_norm.for_tensor(torch.ones(3)) is norm.rms_norm_reference


def test_a_plain_tensor_of_a_device_with_a_kernel_gets_the_kernel():
    x = torch.empty(2, 3, device="meta")
    assert _double.for_tensor(x) is _double_meta_kernel
    _meta_kernel_calls.clear()
    assert _double.for_tensor(x)(x).shape == (2, 3)
    assert _meta_kernel_calls == [x]  # called directly, with the very tensor


def test_a_device_without_a_kernel_goes_through_the_op():
    x = torch.empty(2, 3, device="meta")
    assert _no_kernel.kernel("meta") is None
    assert _no_kernel.for_tensor(x) is _no_kernel.op
    assert _no_kernel.for_tensor(x)(x).device.type == "meta"  # the op's fake implementation
    # kiln's ops have kernels only for CUDA: a meta tensor (the builder's) sees the op and its fake implementation
    assert norm._rms_norm.for_tensor(x) is norm._rms_norm.op
    assert rms_norm(torch.empty(2, 8, device="meta"), torch.empty(8, device="meta"), 1e-6).device.type == "meta"


def test_a_tensor_subclass_goes_through_the_op():
    for device in ("cpu", "meta"):
        x = torch.ones(3, device=device).as_subclass(_Subclass)
        assert _double.for_tensor(x) is _double.op
    x = torch.ones(2, 8).as_subclass(_Subclass)
    assert norm._rms_norm.for_tensor(x) is norm._rms_norm.op
    torch.testing.assert_close(torch.Tensor(rms_norm(x, torch.ones(8), 1e-6)),
                               norm.rms_norm_reference(torch.ones(2, 8), torch.ones(8), 1e-6))


def test_fake_tensors_go_through_the_op():
    with FakeTensorMode():
        for device in ("cpu", "meta"):
            x = torch.empty(2, 8, device=device)
            assert isinstance(x, FakeTensor)
            assert _double.for_tensor(x) is _double.op
        x = torch.empty(2, 8)
        assert norm._rms_norm.for_tensor(x) is norm._rms_norm.op
        out = rms_norm(x, torch.ones(8), 1e-6)
    assert isinstance(out, FakeTensor) and out.shape == (2, 8)


def test_a_dispatch_mode_or_a_functorch_transform_sees_the_op_instead_of_a_kernel():
    x = torch.empty(2, 3, device="meta")
    with _PassThrough():
        assert _double.for_tensor(x) is _double.op
    chosen = []

    def choose(t):
        chosen.append(_double.for_tensor(t))
        return _double.for_tensor(t)(t)

    torch.func.vmap(choose)(x)  # the op runs through vmap's fallback (it has no batching rule)
    assert chosen[0] is _double.op


def test_compiled_code_calls_the_op():
    graphs = []

    def capture(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    weight = torch.randn(8)

    def step(x, residual):
        normed, summed = fused_add_rms_norm(x, residual, weight, 1e-6)
        return rms_norm(normed, weight, 1e-6), summed

    x, residual = torch.randn(3, 8), torch.randn(3, 8)
    compiled = torch.compile(step, backend=capture, fullgraph=True)
    for got, expected in zip(compiled(x, residual), step(x, residual)):
        assert torch.equal(got, expected)
    targets = {node.target for gm in graphs for node in gm.graph.nodes}
    assert torch.ops.kiln.rms_norm.default in targets
    assert torch.ops.kiln.fused_add_rms_norm.default in targets


def test_a_cpu_kernel_is_refused():
    with pytest.raises(ValueError, match="CPU runs the op's reference"):
        _no_kernel.register_kernel("cpu", _double_reference)


# --- kiln's operators --------------------------------------------------------------------------------------


def test_every_op_records_the_kernel_it_registers_for_cuda():
    ops = _kernel_ops()
    assert sorted(op.name for op in ops) == sorted(
        f"kiln::{name}" for name in ("silu_and_mul", "paged_attention", "fp8_block_linear", "write_kv_cache",
                                     "fused_moe", "rms_norm", "fused_add_rms_norm", "scaled_linear",
                                     "weight_only_linear", "rotary_embedding", "rotary_embedding_and_write_kv",
                                     "rms_norm_quant", "fused_add_rms_norm_quant", "silu_and_mul_quant",
                                     "scaled_linear_quantized"))
    for op in ops:
        assert (op.kernel("cuda") is not None) == USE_TRITON, op.name
        assert torch._C._dispatch_has_kernel_for_dispatch_key(op.name, "CUDA") == USE_TRITON, op.name
        if USE_TRITON:
            assert op.kernel("cuda").__module__.startswith("kiln.plugins.triton_"), op.name


def _schema_accepts(kind: str, value: object) -> bool:
    """Whether `value` is what the dispatcher hands an implementation for a schema argument of type `kind`."""
    if kind == "Tensor":
        return type(value) is torch.Tensor
    if kind == "Optional[Tensor]":
        return value is None or type(value) is torch.Tensor
    if kind == "List[int]":
        return type(value) is list and all(type(v) is int for v in value)
    return type(value) is {"float": float, "int": int, "bool": bool, "ScalarType": torch.dtype}[kind]


def _every_wrapper_call():
    """Each wrapper once on small CPU tensors, scalars given as the Python types a caller may pass (an int eps
    or scale, a tuple block size, an int renormalize flag)."""
    q, k, v = torch.randn(3, 4, 8), torch.randn(3, 2, 8), torch.randn(3, 2, 8)
    cos, sin = torch.randn(3, 4), torch.randn(3, 4)
    caches = torch.zeros(4, 2, 2, 8), torch.zeros(4, 2, 2, 8)
    x = torch.randn(3, 8)
    int32 = functools.partial(torch.tensor, dtype=torch.int32)
    silu_and_mul(torch.randn(3, 8))
    rms_norm(x, torch.ones(8), 1)
    fused_add_rms_norm(x, x.clone(), torch.ones(8), 1)
    rotary_embedding(q, k, cos, sin)
    write_kv_cache(k, v, *caches, torch.tensor([0, 1, 2]))
    rotary_embedding_and_write_kv(q, k, v, cos, sin, *caches, torch.tensor([0, -1, 2]))
    paged_attention(q, *caches, int32([[0, 1]]), int32([3]), int32([0, 3]), 1, 0)
    fp8_block_linear(torch.randn(2, 40), torch.zeros(24, 40, dtype=torch.float8_e4m3fn),
                     torch.ones(2, 3), (16, 16))
    fused_moe(x, torch.randn(3, 4), torch.randn(4, 12, 8), torch.randn(4, 8, 6), top_k=2, renormalize=1)
    scaled_linear(torch.randn(2, 16), torch.ones(4, 16, dtype=torch.int8), torch.ones(4))
    weight_only_linear(torch.randn(2, 16), torch.ones(4, 16, dtype=torch.int8), torch.ones(4, 1), bits=8,
                       group_size=16)
    x_q, x_scale = rms_norm_quant(x, torch.ones(8), 1)
    fused_add_rms_norm_quant(x, x.clone(), torch.ones(8), 1, torch.tensor([0.5]))
    silu_and_mul_quant(x)
    scaled_linear_quantized(x_q, x_scale, torch.ones(4, 8, dtype=torch.float8_e4m3fn), torch.ones(4),
                            out_dtype=torch.float32)


def test_a_direct_call_gets_the_arguments_the_op_would_pass(monkeypatch):
    """What a wrapper hands `for_tensor(...)` is what a CUDA kernel gets directly; through the op it would get
    the schema's conversion of it (a float for `float`, a list for `int[]`): they must already agree."""
    calls = []

    def spy(kernel_op, *args):
        calls.append((kernel_op, args))
        return kernel_op.op(*args)  # the op on the CPU: the reference, after the schema's own argument check

    monkeypatch.setattr(KernelOp, "for_tensor", lambda self, t: functools.partial(spy, self))
    for module in (attention, kv_cache, rotary_kv):  # their CPU path (plan=) does not ask for_tensor
        monkeypatch.setattr(module, "runs_reference_directly", lambda t: False)
    _every_wrapper_call()
    assert sorted(op.name for op, _ in calls) == sorted(op.name for op in _kernel_ops())
    for kernel_op, args in calls:
        namespace, name = kernel_op.name.split("::")
        schema = getattr(getattr(torch.ops, namespace), name).default._schema
        assert len(args) <= len(schema.arguments), kernel_op.name
        for argument, value in zip(schema.arguments, args):
            # real_type: a ScalarType argument's .type reads int
            assert _schema_accepts(str(argument.real_type), value), (kernel_op.name, argument.name, value)
