"""Which linear layers a format quantizes: all but the excluded ones, as TensorRT-LLM and ModelOpt do.

Embeddings and norms are not linear layers and stay in the model dtype anyway; `lm_head` is excluded by
default (the logits are where low precision costs the most accuracy, and a tied head is the embedding).
"""

from __future__ import annotations

import fnmatch
from dataclasses import dataclass

DEFAULT_EXCLUDED = ("lm_head",)


@dataclass(frozen=True)
class LayerSelection:
    """`exclude` are fnmatch patterns on module paths ("lm_head", "model.layers.0.*")."""

    exclude: tuple[str, ...] = DEFAULT_EXCLUDED

    def quantizes(self, prefix: str) -> bool:
        return not any(fnmatch.fnmatchcase(prefix, pattern) for pattern in self.exclude)
