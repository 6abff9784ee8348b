"""Which target engine a speculative head engine was built for: the target's identity, recorded in the head
engine's build_config by the builder and compared at load by the runtime (an EAGLE-3 head reads the target's own
hidden states, so it belongs to one model)."""

from __future__ import annotations

import hashlib
import json
import re
from typing import Any

from .spec import EngineSpec

# The head engine's build_config key holding `target_record`.
SPECULATIVE_TARGET = "speculative_target"
_WEIGHT_FILE = re.compile(r"rank\d+\.safetensors")


def target_identity(spec: EngineSpec) -> str:
    """sha256 hex of what makes the target's hidden states what they are: its architecture, model_config and
    the manifest sha256 of every weight file (the target device type for an engine whose weights are drawn at
    load). Limits, tokenizer and kernels do not count: a rebuild with other limits keeps the identity."""
    weights = {path: entry.sha256 for path, entry in spec.files.items() if _WEIGHT_FILE.fullmatch(path)}
    document = {"architecture": spec.architecture, "model_config": spec.model_config, "weights": weights,
                "weights_device": None if weights else spec.target.get("device_type")}
    text = json.dumps(document, sort_keys=True, separators=(",", ":"), allow_nan=False)
    return hashlib.sha256(text.encode("utf-8")).hexdigest()


def target_record(spec: EngineSpec) -> dict[str, Any]:
    """What a head engine records of its target: the directory it was built against (for messages), its
    identity, architecture and dtype."""
    return {"engine": str(spec.engine_dir.resolve()), "identity": target_identity(spec), "architecture": spec.architecture,
            "dtype": spec.build_config.get("dtype")}
