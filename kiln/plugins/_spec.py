"""One declaration per operator (`OpSpec`), from which its torch.library definition, its implementation on
every device (the reference: what the CPU runs) and its CUDA kernel are all made by `define`.

An operator's signature is stated once, as its schema, argument by argument with each tensor's shape and
dtype beside it. The Python functions that implement it restate the parameter list (torch.library calls
them positionally, a wrapper's direct call too): `define` checks, once when the op is registered, that the
reference, the fake (shape) implementation and the kernel take exactly the schema's parameters in its
order, and refuses the spec naming the first difference, so none of them can drift from the others. The
calls themselves go through `KernelOp` unchanged: no check runs per call.

The kernel is named, not imported: "triton_norm.rms_norm_triton" (a module of this package and its
function), looked up only where the Triton kernels are registered (`USE_TRITON`), so a reference module
never imports a kernel module and a machine without triton never imports one.
"""

from __future__ import annotations

import functools
import importlib
import inspect
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from ._eager import KernelOp
from ._triton import USE_TRITON


@dataclass(frozen=True)
class Arg:
    """One row of a spec's table: an argument or a result. `decl`: as torch.library's schema language writes it
    ("Tensor x", "Tensor? k_scale=None", "Tensor(a!) k_cache" for one the op writes to, "SymInt top_k" for a
    Python int, "SymInt[] block_size" for a list of them; a result: "Tensor"). `doc`: its shape, dtype, meaning."""

    decl: str
    doc: str = ""


@dataclass(frozen=True)
class OpSpec:
    """Everything torch.library and the CUDA registration need to know about one operator.

    name: "kiln::<op>". table: the schema, a row per argument then a row per result ("-> Tensor"; "-> ()" for
    none), each row the declaration, two or more spaces, and its shape and dtype:

        Tensor x        [T, H] float32 / float16 / bfloat16, last dim contiguous
        float eps       added to the mean square
        -> Tensor       [T, H] x's dtype

    reference: the plain PyTorch implementation, run on the CPU (and on CUDA where no kernel is registered).
    fake: the shape implementation (meta and fake tensors, tracing). kernel: "<module>.<function>" of this
    package, the CUDA implementation, or None for an op that runs its reference everywhere.
    """

    name: str
    table: str
    reference: Callable[..., Any]
    fake: Callable[..., Any]
    kernel: str | None = None

    @functools.cached_property
    def _rows(self) -> tuple[tuple[Arg, ...], tuple[Arg, ...]]:
        args: list[Arg] = []
        returns: list[Arg] = []
        results_seen = False
        for line in filter(None, (line.strip() for line in self.table.splitlines())):
            decl, doc = (re.split(r"\s{2,}", line, maxsplit=1) + [""])[:2]
            if decl.startswith("->"):
                results_seen = True
                if decl[2:].strip() != "()":
                    returns.append(Arg(decl[2:].strip(), doc))
            elif results_seen:
                raise ValueError(f"{self.name}: table row {line!r} is an argument after the results")
            else:
                args.append(Arg(decl, doc))
        if not results_seen:
            raise ValueError(f"{self.name}: its table has no result row ('-> Tensor', or '-> ()' for none)")
        return tuple(args), tuple(returns)

    @property
    def args(self) -> tuple[Arg, ...]:
        return self._rows[0]

    @property
    def returns(self) -> tuple[Arg, ...]:
        return self._rows[1]

    @property
    def schema(self) -> str:
        """The schema string torch.library takes, e.g. "(Tensor x, float eps) -> Tensor"."""
        results = [r.decl for r in self.returns]
        returned = results[0] if len(results) == 1 else f"({', '.join(results)})"
        return f"({', '.join(a.decl for a in self.args)}) -> {returned}"


_SPECS: dict[str, OpSpec] = {}


def specs() -> dict[str, OpSpec]:
    """Every operator defined so far, by name ("kiln::rms_norm")."""
    return dict(_SPECS)


def _parse(spec: OpSpec) -> torch._C.FunctionSchema:
    try:
        return torch._C.parse_schema(spec.name + spec.schema)
    except RuntimeError as e:
        raise ValueError(f"{spec.name}: its args and returns make no valid schema {spec.schema!r}: {e}") from None


def parameter_names(fn: Callable[..., Any]) -> tuple[str, ...]:
    """The names of fn's parameters in order; TypeError for *args, **kwargs or keyword-only ones, which a
    positional call from torch.library could not fill by name."""
    params = inspect.signature(fn).parameters.values()
    odd = [p.name for p in params if p.kind not in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if odd:
        raise TypeError(f"{fn.__module__}.{fn.__qualname__}: parameters {odd} are not positional; an operator's "
                        f"implementations take the schema's arguments positionally")
    return tuple(p.name for p in params)


def check_signature(spec: OpSpec, fn: Callable[..., Any], role: str) -> None:
    """Raises TypeError unless fn (the spec's `role`: reference, fake or kernel) takes exactly the schema's
    parameters, by name and in order."""
    expected = tuple(a.name for a in _parse(spec).arguments)
    got = parameter_names(fn)
    if got == expected:
        return
    where = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
    found = got[where] if where < len(got) else "nothing"
    wanted = expected[where] if where < len(expected) else "nothing"
    raise TypeError(f"{spec.name}: its {role} {fn.__module__}.{fn.__qualname__} takes ({', '.join(got)}) but the "
                    f"spec's schema is {spec.schema}: parameter {where} is {found!r}, the schema's is {wanted!r}")


def kernel_function(spec: OpSpec) -> Callable[..., Any]:
    """Imports the spec's kernel ("<module>.<function>" of this package); needs triton."""
    module, _, function = (spec.kernel or "").rpartition(".")
    if not module:
        raise ValueError(f"{spec.name}: kernel {spec.kernel!r} must be '<module>.<function>' of kiln.plugins")
    kernel = getattr(importlib.import_module(f".{module}", __package__), function, None)
    if not callable(kernel):
        raise ValueError(f"{spec.name}: kernel {spec.kernel!r} names no function of kiln.plugins.{module}")
    return kernel


def define(spec: OpSpec) -> KernelOp:
    """Defines the spec's operator: its schema, the reference as its implementation on every device, the fake
    for meta and fake tensors, and the kernel on CUDA where `USE_TRITON`. The signatures are checked first,
    so a spec that disagrees with one of its functions registers nothing."""
    if spec.name in _SPECS:
        raise ValueError(f"{spec.name} is defined twice: an operator has one spec")
    schema = _parse(spec)
    check_signature(spec, spec.reference, "reference")
    check_signature(spec, spec.fake, "fake")
    kernel = kernel_function(spec) if USE_TRITON and spec.kernel else None
    if kernel is not None:
        check_signature(spec, kernel, "kernel")
    mutated = [a.name for a in schema.arguments if a.alias_info is not None and a.alias_info.is_write]
    op = KernelOp(spec.name, spec.reference, mutates_args=mutated, schema=spec.schema)
    op.op.register_fake(spec.fake)
    if kernel is not None:
        op.register_kernel("cuda", kernel)
    _SPECS[spec.name] = spec
    return op
