"""The quantization schemes, one entry each, registered by the scheme's own module.

A scheme's name, its config factory, the parameters it takes, whether it is calibrated or grouped, the
GPU it needs and whether `kiln build --qformat` makes it are said once, here, by its module (fp8.py,
int8_sq.py, ...); `formats.py`'s tuples, `spec.py`'s checks and `runtime/worker/device_support.py` read them.
`kiln.quant`'s `__init__` imports every scheme module, so the registry is full whenever any `kiln.quant`
module can be imported. Imports nothing of kiln: the scheme modules import it, not the other way round.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

DEFAULT_GROUP_SIZE = 128  # --awq-block-size's default, for the grouped --qformat schemes


class UnknownSchemeError(ValueError):
    """A name no scheme is registered under; the message lists the valid ones. kiln.quant.base.QuantError
    is raised instead where the caller expects one (formats.py, spec.py)."""


@dataclass(frozen=True)
class SchemeParams:
    """A QuantSpec's scheme parameters, as a config factory takes them; each scheme reads only its own
    (QuantScheme.parameters). `selection` is a kiln.quant.selection.LayerSelection (Any: no import here)."""

    selection: Any
    group_size: int | None = None  # grouped schemes: None = DEFAULT_GROUP_SIZE; weight_only: None = per channel
    bits: int | None = None  # weight_only: 4 or 8
    zero_point: bool = False  # weight_only
    act_order: bool = False  # weight_only
    smoothed: bool = False  # weight_only
    block_size: tuple[int, ...] | None = None  # fp8_block

    @property
    def group(self) -> int:
        """The group size of a grouped scheme, its default filled in."""
        return self.group_size or DEFAULT_GROUP_SIZE


@dataclass(frozen=True)
class QuantScheme:
    """One quantization scheme (engine.json's `quantization.qformat`)."""

    name: str  # TensorRT-LLM's --qformat name, or kiln's for a checkpoint-only scheme
    config: Callable[[SchemeParams], Any]  # the scheme's QuantConfig, or None (full precision)
    order: int  # where it is listed (--qformat choices, error messages): TensorRT-LLM's order, then the rest
    parameters: frozenset[str] = field(default_factory=frozenset)  # the SchemeParams fields it takes
    calibrated: bool = False  # needs calibration data (ModelOpt) when built by kiln
    grouped: bool = False  # has a group size that --awq-block-size sets (required in its QuantSpec)
    min_compute_capability: tuple[int, int] | None = None  # the oldest CUDA GPU that computes it; None: any
    buildable: bool = True  # made by `kiln build --qformat`; False: only pre-quantized checkpoints bring it

    def __reduce__(self) -> tuple[Callable[[str], QuantScheme], tuple[str]]:
        # Pickled (and deep-copied) by name, as an Enum member is: `config` is a lambda, and the entry in
        # another process is that process's own registered one.
        return scheme, (self.name,)


_SCHEMES: dict[str, QuantScheme] = {}


def register(entry: QuantScheme) -> QuantScheme:
    """Adds `entry`; a second entry under the same name is a programming error (ValueError)."""
    if entry.name in _SCHEMES:
        raise ValueError(f"quantization scheme {entry.name!r} is registered twice")
    _SCHEMES[entry.name] = entry
    return entry


def schemes() -> tuple[QuantScheme, ...]:
    """Every registered scheme, in listing order. Full once `kiln.quant` is imported, which Python does
    before this module (its package's `__init__` imports every scheme module); no import here, which
    would make a circle with the scheme modules that import `register`."""
    return tuple(sorted(_SCHEMES.values(), key=lambda s: s.order))


def scheme(name: str) -> QuantScheme:
    """The scheme registered as `name`; UnknownSchemeError naming the valid ones for any other."""
    found = {s.name: s for s in schemes()}.get(name)
    if found is None:
        raise UnknownSchemeError(f"unknown quantization scheme {name!r}; valid: {', '.join(names())}")
    return found


def names(*, buildable: bool | None = None, calibrated: bool | None = None,
          grouped: bool | None = None) -> tuple[str, ...]:
    """The registered schemes' names in listing order, only those whose flags match the ones given."""
    wanted = {"buildable": buildable, "calibrated": calibrated, "grouped": grouped}
    return tuple(s.name for s in schemes()
                 if all(v is None or getattr(s, k) == v for k, v in wanted.items()))
