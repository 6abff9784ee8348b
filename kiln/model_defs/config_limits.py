"""Bounds on a model config, checked before anything is sized from it: one piece of code for a checkpoint's
config.json (the builder) and engine.json's model_config (the loader).

A config is data from a file, and a hostile or damaged one must fail in one line naming the key, the value
and the limit, before a network, a rope table or a Python loop is sized by it (a million layers took minutes
and gigabytes before anything said no). The limits are far above every released model, so they refuse only
nonsense; raise one here, with its reason, when a real model needs more.
"""

from __future__ import annotations

import logging
import math
from typing import Any

logger = logging.getLogger("kiln.model_defs")


class ModelConfigError(ValueError):
    """A checkpoint config that kiln cannot build; the message names the field and value."""

# ModelConfig field -> (largest value kiln takes, why). Each is 4-20x the largest released model's value.
LIMITS: dict[str, tuple[int, str]] = {
    "num_layers": (1024, "the deepest released decoders have ~126 layers"),
    "hidden_size": (1 << 17, "the widest released models are 16384-25600 wide"),
    "intermediate_size": (1 << 20, "released MLPs are at most ~53248 wide"),
    "num_heads": (1024, "released models have at most 128 attention heads"),
    "num_kv_heads": (1024, "released models have at most 128 attention heads"),
    "head_dim": (1024, "released heads are at most 256 wide"),
    "vocab_size": (1 << 22, "the largest released vocabularies have ~262144 tokens"),
    # Rope positions are float32 (rotary.py), exact integers only up to 2**24; the longest released context
    # is 10485760 tokens (Llama 4 Scout).
    "max_position_embeddings": (1 << 24, "rope positions are float32, exact only up to 2**24"),
    "num_experts": (4096, "released MoE models have at most a few hundred experts"),
    "shared_expert_intermediate_size": (1 << 20, "released MLPs are at most ~53248 wide"),
}
# The names config.json gives the fields whose Hugging Face key differs from kiln's.
HF_KEYS = {"num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
           "num_kv_heads": "num_key_value_heads"}
# Other config.json keys that parsers size things by, checked against the limit of the field they become.
_HF_ALIASES = {"num_local_experts": "num_experts", "moe_intermediate_size": "intermediate_size"}


def is_count(value: Any) -> bool:
    """A JSON integer (not true/false, not 2.0)."""
    return isinstance(value, int) and not isinstance(value, bool)


def check_count(key: str, value: Any, field: str | None = None, *, minimum: int = 1) -> int:
    """`value` if it is an integer from `minimum` to the limit of ModelConfig field `field` (default: `key`);
    else a ModelConfigError naming `key`, the value and the limit."""
    field = field or key
    if not is_count(value) or value < minimum:
        kind = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        raise ModelConfigError(f"{key}={value!r:.80} must be {kind}")
    if field in LIMITS and value > LIMITS[field][0]:
        limit, why = LIMITS[field]
        raise ModelConfigError(f"{key}={value} exceeds kiln's limit {limit} ({why})")
    return value


def check_positive_finite(key: str, value: Any) -> float:
    """`value` if it is a finite number > 0 (rope theta, rms_norm_eps); else a ModelConfigError naming it."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise ModelConfigError(f"{key}={value!r:.80} must be a finite number > 0")
    return value


def check_token_id(key: str, value: Any, vocab_size: int) -> int:
    """A token id inside the vocabulary [0, vocab_size); else a ModelConfigError naming it and the vocabulary."""
    if not is_count(value) or not 0 <= value < vocab_size:
        raise ModelConfigError(f"{key}={value!r:.80} is not a token of the vocabulary (ids 0..{vocab_size - 1}, "
                               f"vocab_size={vocab_size})")
    return value


def check_hf_counts(raw: dict[str, Any]) -> None:
    """The counts a config.json parser loops over or divides by, checked before any parser runs (the parsers
    make per-layer tuples from num_hidden_layers and divide hidden_size by num_attention_heads). Absent keys
    are left to the parser, which names the ones it requires."""
    for field in LIMITS:
        key = HF_KEYS.get(field, field)
        if raw.get(key) is not None:
            check_count(key, raw[key], field, minimum=0 if field == "shared_expert_intermediate_size" else 1)
    for key, field in _HF_ALIASES.items():
        if raw.get(key) is not None:
            check_count(key, raw[key], field)
    # kiln never reads pad_token_id (requests are packed, not padded), so one outside the vocabulary only warns;
    # a negative one is the old "no pad token" convention.
    pad, vocab = raw.get("pad_token_id"), raw.get("vocab_size")
    if is_count(pad) and is_count(vocab) and pad >= vocab:
        logger.warning("config.json: pad_token_id=%d is outside the vocabulary (vocab_size=%d); kiln does not use "
                       "it", pad, vocab)
