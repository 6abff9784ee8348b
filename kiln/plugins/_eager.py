"""What an operator wrapper calls for plain eager tensors instead of going through torch.library.

The dispatcher's path to a custom op's implementation (argument parsing against the schema, the
in-place/view bookkeeping of mutating ops, the output aliasing check, the dynamo guard around a registered
kernel) costs tens of microseconds a call. On the CPU that is a fifth of a small model's decode step; on the
GPU it is more than a small kernel's runtime, so an eager step was bound by the host: a 128-token prefill of
an 8B model on an H100 ran 6.8 ms of kernels in 27 ms. A plain eager tensor therefore skips it: on the CPU
the wrapper calls the op's PyTorch reference (which is what the op runs there), on CUDA the kernel registered
for the op (the same function, called with the same arguments, launching the same kernels: CUDA-graph
capture sees no difference). Anything that traces (torch.compile, fake or functional tensors, a dispatch
mode such as make_fx's, a functorch transform) still sees the op, and so does a device without a registered
kernel (CUDA under KILN_DISABLE_TRITON=1, where the op runs the reference).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

import torch


def runs_reference_directly(t: torch.Tensor) -> bool:
    """Whether an op on `t` (its first tensor argument) may call its reference without dispatch."""
    return type(t) is torch.Tensor and t.is_cpu and not torch.compiler.is_compiling()


def _nothing_intercepts() -> bool:
    # A kernel launch is invisible to a dispatch mode (make_fx, FakeTensorMode over real inputs) or a functorch
    # transform, where the reference's aten ops are not: a kernel is called directly only outside them.
    return not torch._C._len_torch_dispatch_stack() and torch._C._functorch.peek_interpreter_stack() is None


class KernelOp:
    """A torch.library custom op plus what plain eager tensors call instead of dispatching to it: the reference
    on the CPU, the kernel registered with `register_kernel` on its device type (CUDA)."""

    def __init__(self, name: str, reference: Callable[..., Any], *, mutates_args: Iterable[str] = (),
                 schema: str | None = None) -> None:
        """Defines the op `name` ("kiln::...") with `reference` as its implementation on every device, its
        schema `schema` ("(Tensor x, float eps) -> Tensor"; kiln's ops get theirs from their `OpSpec`,
        _spec.py) or, when None, inferred from reference's annotations as torch.library.custom_op does."""
        self.name = name
        self.op = torch.library.custom_op(name, mutates_args=tuple(mutates_args), schema=schema)(reference)
        self.reference = reference
        self._kernels: dict[str, Callable[..., Any]] = {}  # device type -> the kernel registered on the op

    def register_kernel(self, device_type: str, kernel: Callable[..., Any]) -> None:
        """Registers `kernel` as the op's implementation on `device_type` and as what plain eager tensors of
        that device call directly. Not "cpu": the CPU runs the reference, directly or through the op."""
        if device_type == "cpu":
            raise ValueError("the CPU runs the op's reference; a kernel is registered for another device type")
        self.op.register_kernel(device_type)(kernel)
        self._kernels[device_type] = kernel

    def kernel(self, device_type: str) -> Callable[..., Any] | None:
        """The kernel registered for `device_type`, None where the op runs the reference."""
        return self._kernels.get(device_type)

    def for_tensor(self, t: torch.Tensor) -> Callable[..., Any]:
        """What to call for an op whose first tensor argument is `t`: the reference for a plain eager CPU tensor
        (`runs_reference_directly`), the registered kernel for a plain eager tensor of its device type, the op
        itself otherwise. Each takes the op's arguments as the op's schema passes them to its implementation
        (e.g. a Python float for a `float` argument): the wrappers convert scalars before the call."""
        if type(t) is not torch.Tensor or torch.compiler.is_compiling():
            return self.op
        if t.is_cpu:
            return self.reference
        kernel = self._kernels.get(t.device.type)
        if kernel is None or not _nothing_intercepts():
            return self.op
        return kernel
