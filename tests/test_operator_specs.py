"""One spec per operator (plugins/_spec.py): every kiln op is defined from an `OpSpec`, its reference, fake and
CUDA kernel take exactly the spec's parameters, and a spec that disagrees with one of its functions is refused
when it is registered, naming the difference. CPU only: the kernels' signatures are read from their source
where triton is not installed."""

from __future__ import annotations

import ast
import importlib
import importlib.util
import sys
import types

import pytest
import torch

import kiln.plugins  # noqa: F401  (defines every operator)
from kiln.plugins import _spec
from kiln.plugins._eager import KernelOp
from kiln.plugins._spec import Arg, OpSpec, check_signature, define, specs
from kiln.plugins._triton import USE_TRITON

_OPS = ("silu_and_mul", "paged_attention", "fp8_block_linear", "write_kv_cache", "fused_moe", "rms_norm",
        "fused_add_rms_norm", "scaled_linear", "weight_only_linear", "rotary_embedding",
        "rotary_embedding_and_write_kv", "rms_norm_quant", "fused_add_rms_norm_quant", "silu_and_mul_quant",
        "scaled_linear_quantized", "weight_only_linear_parts", "lora_add", "mla_attention", "fused_moe_mxfp4")
_PLUGIN_MODULES = ("activation", "attention", "fp8_block_linear", "kv_cache", "moe", "norm", "norm_quant",
                   "quant_linear", "rotary", "rotary_kv", "weight_only_parts", "lora", "mla_attention", "mxfp4_moe")


def _kiln_specs() -> dict[str, OpSpec]:
    return {name: spec for name, spec in specs().items() if name.startswith("kiln::")}


def _kernel_parameters(kernel: str) -> tuple[str, ...]:
    """The parameter names of a kernel ("<module>.<function>" of kiln.plugins) read from its source, so that the
    check needs no triton."""
    module, _, function = kernel.rpartition(".")
    origin = importlib.util.find_spec(f"kiln.plugins.{module}").origin
    with open(origin, encoding="utf-8") as f:
        tree = ast.parse(f.read())
    found = [node for node in tree.body if isinstance(node, ast.FunctionDef) and node.name == function]
    assert len(found) == 1, f"{kernel}: no function {function} at the top of {origin}"
    arguments = found[0].args
    assert not (arguments.vararg or arguments.kwonlyargs or arguments.kwarg), kernel
    return tuple(a.arg for a in (*arguments.posonlyargs, *arguments.args))


# --- kiln's operators --------------------------------------------------------------------------------------


def test_every_registered_op_has_one_spec():
    registered = {name for name in torch._C._dispatch_get_all_op_names() if name.startswith("kiln::")}
    assert registered == set(_kiln_specs()) == {f"kiln::{name}" for name in _OPS}
    kernel_ops = [value for name in _PLUGIN_MODULES
                  for value in vars(importlib.import_module(f"kiln.plugins.{name}")).values()
                  if isinstance(value, KernelOp)]
    assert sorted(op.name for op in kernel_ops) == sorted(registered)  # one KernelOp per spec, none twice
    for name, spec in _kiln_specs().items():
        namespace, op = name.split("::")
        assert getattr(getattr(torch.ops, namespace), op).default._schema == torch._C.parse_schema(name + spec.schema)


def test_reference_fake_and_kernel_take_the_specs_parameters():
    for name, spec in _kiln_specs().items():
        expected = tuple(a.name for a in torch._C.parse_schema(name + spec.schema).arguments)
        check_signature(spec, spec.reference, "reference")
        check_signature(spec, spec.fake, "fake")
        assert spec.kernel is not None and spec.kernel.startswith("triton_"), name
        assert _kernel_parameters(spec.kernel) == expected, name


@pytest.mark.skipif(not USE_TRITON, reason="the CUDA kernels are registered only with triton")
def test_the_registered_kernel_is_the_specs():
    for name, spec in _kiln_specs().items():
        module, _, function = spec.kernel.rpartition(".")
        kernel = getattr(importlib.import_module(f"kiln.plugins.{module}"), function)
        check_signature(spec, kernel, "kernel")
        assert torch._C._dispatch_has_kernel_for_dispatch_key(name, "CUDA"), name


def test_every_tensor_of_a_spec_has_its_shape_documented():
    for name, spec in _kiln_specs().items():
        for arg in (*spec.args, *spec.returns):
            if arg.decl.startswith("Tensor"):
                assert "[" in arg.doc, (name, arg.decl)  # a shape: "[T, H] ..."


def test_a_plain_cpu_tensor_still_gets_the_reference_itself():
    norm = importlib.import_module("kiln.plugins.norm")
    assert norm._rms_norm.for_tensor(torch.ones(2, 8)) is norm.RMS_NORM.reference  # no wrapper per call


# --- a toy spec: refused at registration where it disagrees -----------------------------------------------


def _toy_reference(x: torch.Tensor, eps: float) -> torch.Tensor:
    return x + eps


def _toy_fake(x, eps):
    return torch.empty_like(x)


_TABLE = """
    Tensor x    [T] float32
    float eps   added to every element
    -> Tensor   [T] float32
"""


def _toy(name: str, **changes) -> OpSpec:
    fields = dict(name=f"kiln_test::{name}", table=_TABLE, reference=_toy_reference, fake=_toy_fake)
    return OpSpec(**{**fields, **changes})


def test_a_table_reads_as_the_schema_with_its_docs():
    spec = _toy("spec_unused")
    assert spec.schema == "(Tensor x, float eps) -> Tensor"
    assert spec.args == (Arg("Tensor x", "[T] float32"), Arg("float eps", "added to every element"))
    assert spec.returns == (Arg("Tensor", "[T] float32"),)
    assert _toy("spec_unused", table="Tensor(a!) x  [T]\n-> ()").schema == "(Tensor(a!) x) -> ()"


_TOY = define(_toy("spec_toy"))


def _defined(name: str) -> bool:
    return name in torch._C._dispatch_get_all_op_names() or name in specs()


def test_a_consistent_toy_spec_defines_a_working_op():
    assert _TOY.name in specs()
    assert torch.equal(torch.ops.kiln_test.spec_toy(torch.ones(3), 1.0), torch.full((3,), 2.0))
    assert torch.ops.kiln_test.spec_toy(torch.ones(3, device="meta"), 1.0).device.type == "meta"  # the fake
    with pytest.raises(ValueError, match="kiln_test::spec_toy is defined twice"):
        define(_toy("spec_toy"))


def test_a_reference_with_other_parameters_is_refused():
    def reference(x, epsilon):
        return x

    with pytest.raises(TypeError, match=r"kiln_test::spec_bad_ref: its reference .*reference takes \(x, "
                                        r"epsilon\) .*parameter 1 is 'epsilon', the schema's is 'eps'"):
        define(_toy("spec_bad_ref", reference=reference))
    assert not _defined("kiln_test::spec_bad_ref")  # nothing registered


def test_parameters_in_another_order_are_refused():
    def reference(eps, x):
        return x

    with pytest.raises(TypeError, match="parameter 0 is 'eps', the schema's is 'x'"):
        define(_toy("spec_swapped", reference=reference))
    assert not _defined("kiln_test::spec_swapped")


def test_a_fake_missing_a_parameter_is_refused():
    with pytest.raises(TypeError, match=r"its fake .* takes \(x\) .*parameter 1 is 'nothing', the schema's is 'eps'"):
        define(_toy("spec_bad_fake", fake=lambda x: x))
    assert not _defined("kiln_test::spec_bad_fake")


def test_a_keyword_only_parameter_is_refused():
    def reference(x, *, eps):
        return x

    with pytest.raises(TypeError, match=r"parameters \['eps'\] are not positional"):
        define(_toy("spec_kwonly", reference=reference))


def test_a_kernel_with_other_parameters_is_refused(monkeypatch):
    kernels = types.ModuleType("kiln.plugins.triton_spec_toy")
    kernels.toy_kernel = lambda x, eps, extra: x
    monkeypatch.setitem(sys.modules, kernels.__name__, kernels)
    monkeypatch.setattr(_spec, "USE_TRITON", True)
    with pytest.raises(TypeError, match=r"its kernel .* takes \(x, eps, extra\) .*parameter 2 is 'extra'"):
        define(_toy("spec_bad_kernel", kernel="triton_spec_toy.toy_kernel"))
    assert not _defined("kiln_test::spec_bad_kernel")
    with pytest.raises(ValueError, match="names no function of kiln.plugins.triton_spec_toy"):
        define(_toy("spec_no_kernel", kernel="triton_spec_toy.missing"))
    with pytest.raises(ValueError, match="must be '<module>.<function>'"):
        define(_toy("spec_bare_kernel", kernel="toy_kernel"))


def test_a_table_that_makes_no_schema_is_refused():
    with pytest.raises(ValueError, match=r"kiln_test::spec_bad_schema: its args and returns make no valid schema"):
        define(_toy("spec_bad_schema", table="Tensr x  [T]\nfloat eps\n-> Tensor  [T]"))
    with pytest.raises(ValueError, match=r"kiln_test::spec_no_result: its table has no result row"):
        define(_toy("spec_no_result", table="Tensor x  [T]\nfloat eps"))
    with pytest.raises(ValueError, match=r"row 'float eps' is an argument after the results"):
        define(_toy("spec_late_arg", table="Tensor x  [T]\n-> Tensor  [T]\nfloat eps"))
    for name in ("spec_bad_schema", "spec_no_result", "spec_late_arg"):
        assert not _defined(f"kiln_test::{name}")
