"""The paged KV cache on the device: one allocation, per-layer views, its own dtype, room for scales.

The block manager (plain Python) decides which blocks a request owns; this object only holds the memory
those block ids index. Its dtype is the cache's own (engine.json `kv_cache_dtype`), which an FP8 or INT8
cache will make differ from the activation dtype; such caches add per-layer scales here.
"""

from __future__ import annotations

import torch

from kiln.model_defs import ModelConfig

LayerCache = tuple[torch.Tensor, torch.Tensor]  # (k, v): [num_blocks, block_size, Hk, D] each


class KVCache:
    """`num_blocks` blocks of `block_size` tokens for every layer, allocated once for the engine's lifetime
    (captured CUDA graphs read these addresses: never reallocate)."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        # storage: [layers, 2 (k, v), num_blocks, block_size, Hk, D]
        self.storage = torch.zeros(config.num_layers, 2, num_blocks, block_size, config.num_kv_heads,
                                   config.head_dim, dtype=dtype, device=device)
        self.layers: tuple[LayerCache, ...] = tuple(
            (self.storage[i, 0], self.storage[i, 1]) for i in range(config.num_layers))
        # Per layer (k_scale, v_scale) for a quantized cache; None while the cache holds `dtype` values as is.
        self.scales: tuple[tuple[torch.Tensor, torch.Tensor], ...] | None = None

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Device bytes one block takes over all layers (keys and values)."""
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()
