"""LongRoPE and partial-rotary settings: how config.json states them, read as transformers reads them, and
their checks (config.py's RopeConfig holds the values; layers/rotary.py makes the tables).

LongRoPE (Phi-3 / 3.5 / 4-mini, `rope_type` "longrope", Phi-3's older "su"): each rotary dimension's
frequency is divided by a per-dimension factor, `short_factor` for sequences up to
`original_max_position_embeddings` tokens and `long_factor` past it; cos and sin are multiplied by
`attention_factor` (given, else sqrt(1 + log(factor) / log(original)) with factor = max_position_embeddings /
original when the config gives none). Partial rotary (`partial_rotary_factor`, Phi-4-mini 0.75): only the
first `rotary_dim` dimensions of each head are rotated, the rest pass through.
"""

from __future__ import annotations

import math
from typing import Any

from .config_limits import ModelConfigError, check_count


def rotary_dim(partial_rotary_factor: float, head_dim: int) -> int:
    """The rotated dimensions of a head: transformers' int(head_dim * factor), rounded up to even as its
    inverse frequencies (one per arange(0, dim, 2)) and rotate_half make it."""
    dim = int(head_dim * partial_rotary_factor)
    return 2 * len(range(0, dim, 2))


def check_partial_rotary_factor(value: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ModelConfigError(f"partial_rotary_factor={value!r:.80} must be a number in (0, 1]")
    return float(value)


def check_factor_list(name: str, value: Any) -> tuple[float, ...]:
    """A longrope factor list (short_factor, long_factor): a non-empty list of finite numbers > 0, as a tuple."""
    if (not isinstance(value, (list, tuple)) or not value
            or any(isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
                   for v in value)):
        raise ModelConfigError(f"rope_scaling {name}={value!r:.80} must be a non-empty list of finite numbers > 0")
    return tuple(float(v) for v in value)


def check_rope_dims(rope: Any, head_dim: int) -> None:
    """The per-dimension factors of a longrope config against the head: one per rotated pair of dimensions
    (transformers' Phi3Config checks the same)."""
    if rope.rope_type != "longrope":
        return
    half = rotary_dim(rope.partial_rotary_factor, head_dim) // 2
    for name in ("short_factor", "long_factor"):
        factors = getattr(rope, name)
        if len(factors) != half:
            raise ModelConfigError(f"rope_scaling {name} has {len(factors)} entries; head_dim={head_dim} with "
                                   f"partial_rotary_factor={rope.partial_rotary_factor} rotates {2 * half} "
                                   f"dimensions, which need {half}")


def longrope_fields(params: dict[str, Any], raw: dict[str, Any], theta: float) -> dict[str, Any]:
    """RopeConfig's fields of a longrope `rope_scaling` / `rope_parameters` dict, as transformers'
    `_compute_longrope_parameters` reads them: a top-level original_max_position_embeddings (Phi-3's layout)
    wins over the dict's, which falls back to max_position_embeddings; a null factor is
    max_position_embeddings / original."""
    original = raw.get("original_max_position_embeddings")
    if original is None:
        original = params.get("original_max_position_embeddings", raw.get("max_position_embeddings"))
    original = check_count("rope_scaling original_max_position_embeddings", original, "max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = check_count("max_position_embeddings", raw.get("max_position_embeddings")) / original
    attention_factor = params.get("attention_factor")
    for name, value in (("factor", factor), ("attention_factor", attention_factor)):
        if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))):
            raise ModelConfigError(f"rope_scaling {name}={value!r:.80} must be a number")
    return dict(rope_type="longrope", theta=theta, factor=float(factor), original_max_position_embeddings=original,
                attention_factor=None if attention_factor is None else float(attention_factor),
                short_factor=check_factor_list("short_factor", params.get("short_factor")),
                long_factor=check_factor_list("long_factor", params.get("long_factor")))


def longrope_attention_factor(factor: float, original_max_position_embeddings: int) -> float:
    """transformers' default longrope attention factor: sqrt(1 + log(factor) / log(original)), 1 for factor <= 1."""
    if factor <= 1.0:
        return 1.0
    return math.sqrt(1 + math.log(factor) / math.log(original_max_position_embeddings))


def rope_switch_length(rope: Any, max_seq_len: int) -> int | None:
    """The length past which a LongRoPE sequence is rotated by its long factors (when the engine lets sequences
    grow past it): a sequence that started shorter is recomputed there, as transformers' Phi-3 does. None for
    any other rope."""
    if rope.rope_type == "longrope" and max_seq_len > rope.original_max_position_embeddings:
        return rope.original_max_position_embeddings
    return None


def kv_depends_on_sequence_length(rope: Any, max_position_embeddings: int, max_seq_len: int) -> bool:
    """Whether a token's cached keys can depend on how long its sequence is, not only on the tokens up to it:
    longrope (short or long factors by the sequence's length) and dynamic NTK (a base grown with it) where
    sequences may outgrow the original context. Such a model's KV blocks are no prefix another sequence may
    reuse: the runtime turns prefix caching off for it (worker/engine_loader.py)."""
    if rope.rope_type == "longrope":
        return max_seq_len > rope.original_max_position_embeddings
    if rope.rope_type == "dynamic":
        return max_seq_len > max_position_embeddings
    return False
