"""Refusing checkpoint tensors that hold NaN or Inf, as each is read for conversion.

One NaN weight makes every logit NaN, and an engine built from it generates empty text without a word; a
build is where that can still be said, naming the tensor. Each float tensor is checked once, in chunks, so
the check costs one pass over the weights and a bounded temporary, not a copy of the tensor.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from pathlib import Path

import torch

from kiln.checkpoints.reader import CheckpointError

logger = logging.getLogger("kiln.builder")

# Integer and FP8 tensors (quantized weights) are left alone: FP8 E4M3 has no Inf, and its NaN is a bit
# pattern a scale may reuse; their float scales are checked.
CHECKED_DTYPES = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})
_CHUNK = 1 << 24  # elements per isfinite pass: the temporary bool tensor stays at 16 MiB


def count_non_finite(tensor: torch.Tensor) -> int:
    """How many elements of `tensor` are NaN or +-Inf."""
    bad = 0
    for chunk in tensor.reshape(-1).split(_CHUNK):
        finite = torch.isfinite(chunk)
        if not bool(finite.all()):
            bad += int(finite.numel() - finite.sum())
    return bad


def finite_reader(read: Callable[[str], torch.Tensor], checkpoint_dir: Path, *,
                  allow: bool) -> Callable[[str], torch.Tensor]:
    """`read` (checkpoint tensor name -> tensor) that raises CheckpointError naming a float tensor with NaN or
    Inf values, or with `allow` (--allow-non-finite) logs a warning instead. Each name is checked once."""
    checked: set[str] = set()

    def get(name: str) -> torch.Tensor:
        tensor = read(name)
        if name in checked or tensor.dtype not in CHECKED_DTYPES:
            return tensor
        checked.add(name)
        bad = count_non_finite(tensor)
        if bad:
            what = (f"checkpoint {checkpoint_dir}: tensor {name!r} holds {bad} non-finite value(s) (NaN or Inf) "
                    f"of {tensor.numel()}")
            if not allow:
                raise CheckpointError(f"{what}: an engine built from it would compute NaN logits and generate "
                                      f"nothing; fix the checkpoint, or build anyway with --allow-non-finite")
            logger.warning("%s; building anyway (--allow-non-finite): its outputs may be NaN", what)
        return tensor

    return get
