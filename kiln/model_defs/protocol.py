"""What the runtime may call on a model: the `CausalLM` protocol every model class implements.

Implementations are torch.nn.Modules (the loader also uses load_state_dict(..., assign=True) and eval()),
made by `build_network`. Anything else on the module is private to model_defs.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import torch

from .config import ModelConfig
from .layers.context import ForwardContext


@runtime_checkable
class CausalLM(Protocol):
    """A causal language model over a packed batch: the tokens of many sequences in one row."""

    config: ModelConfig

    def setup_rotary(self, max_positions: int, device: torch.device | str) -> None:
        """Builds the rotary tables for positions [0, max_positions) on `device`; call once after loading
        weights and before the first forward."""
        ...

    def needs_per_length_rope(self, max_rope_length: int) -> bool:
        """Whether a step whose largest `ForwardContext.rope_lengths` is this needs rope tables computed per
        sequence length (dynamic NTK past the trained context): such a step cannot replay a CUDA graph.
        False before setup_rotary."""
        ...

    def forward(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """input_ids: [T] int64 (packed tokens) -> hidden states [T, H] in the model's dtype. Writes each
        token's keys and values into ctx.kv_caches at ctx.slot_mapping."""
        ...

    def __call__(self, input_ids: torch.Tensor, ctx: ForwardContext) -> torch.Tensor:
        """Same as forward (nn.Module's call)."""
        ...

    def compute_logits(self, hidden: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """hidden: [N, H] (the rows to sample from) -> logits: [N, V] float32, written into `out` ([N, V]
        float32: a CUDA graph's output buffer) when given."""
        ...
