"""What one forward step needs besides the token ids: positions and the paged-KV metadata.

The model runner builds it from the scheduler's plain data; every tensor lives on the model's device.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch

from kiln.plugins.step_plan import StepPlan, step_plan

from .decode_prefix import DecodePrefix, decode_prefix
from .mla_split import MLASplit, mla_split


@dataclass(frozen=True)
class ForwardContext:
    positions: torch.Tensor  # [T] int64: position of each packed token in its sequence
    # [T] int64: the sequence length dynamic-NTK rope scales for, max(position + 1, prompt length),
    # which is what Hugging Face uses when it generates one sequence; longrope takes its long factors past
    # original_max_position_embeddings; other rope types ignore it.
    rope_lengths: torch.Tensor
    slot_mapping: torch.Tensor  # [T] int64: KV-cache slot (block * block_size + offset) of each token
    block_tables: torch.Tensor  # [S, max_blocks] int32: cache blocks of each sequence
    seq_lens: torch.Tensor  # [S] int32: tokens of each sequence in the cache after this step
    query_start_loc: torch.Tensor  # [S+1] int32: where each sequence's tokens start in the packed batch
    kv_caches: tuple[tuple[torch.Tensor, torch.Tensor], ...]  # per layer (k, v): [N, block_size, Hk, D]
    # The largest of rope_lengths, known on the host: dynamic-NTK rope needs its per-length tables only past
    # the trained context, and knowing that without reading the GPU keeps the step free of host syncs.
    max_rope_length: int = 0
    # Per layer (k_scale, v_scale): [1] float32 each, on the device, for a quantized (fp8 / int8) KV cache,
    # which stores k / k_scale and v / v_scale; None for a float cache.
    kv_scales: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None
    # EAGLE-3 (runtime/speculative/eagle3.py): the layers whose input residual stream the step keeps (index i: what
    # enters layer i, the output of layer i - 1; num_layers: the last layer's output, before the final norm),
    # and where the decoder keeps it: layer index -> [T, H]. Empty: nothing is kept.
    capture_layers: tuple[int, ...] = ()
    captured: dict[int, torch.Tensor] = field(default_factory=dict)
    # Tree drafts (speculative decoding): [T] int64, each query's tree mask (plugins/tree_mask.py; 0: causal);
    # None where no sequence of the step is a tree.
    tree_mask: torch.Tensor | None = None
    # Per sequence, known on the host where the eager step built this context (step_inputs.build_context): its
    # query tokens and its keys after the step. None (unknown, as in every CUDA-graph context) keeps the paths
    # that need them off (MLA's explicit prefill, mla_split.py).
    host_query_lens: tuple[int, ...] | None = None
    host_seq_lens: tuple[int, ...] | None = None

    @cached_property
    def plan(self) -> StepPlan | None:
        """What the reference ops (eager CPU) read from this step's tensors, worked out on first use and shared
        by every layer (the attention and KV-write wrappers' `plan=`); None where the GPU kernels run."""
        block_size = self.kv_caches[0][0].shape[1] if self.kv_caches else 1
        return step_plan(self.block_tables, self.seq_lens, self.query_start_loc, self.slot_mapping, block_size)

    @cached_property
    def decode_prefix(self) -> DecodePrefix | None:
        """A mixed step's leading decode rows, whose attention runs apart from the prompts' on the GPU
        (decode_prefix.py), worked out on first use and shared by every layer; None where nothing is split."""
        if self.plan is not None:  # the references run (eager CPU)
            return None
        return decode_prefix(self.host_query_lens, self.query_start_loc, self.tree_mask is not None)

    @cached_property
    def mla_split(self) -> MLASplit | None:
        """Which sequences MLA computes in the explicit form (mla_split.py), worked out on first use and shared
        by every layer; None where all stay absorbed."""
        block_size = self.kv_caches[0][0].shape[1] if self.kv_caches else 1
        return mla_split(self.host_query_lens, self.host_seq_lens, self.block_tables, self.seq_lens,
                         self.slot_mapping, block_size, self.tree_mask is not None)
