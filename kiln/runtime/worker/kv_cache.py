"""The paged KV cache on the device: one allocation, per-layer views, its own dtype, per-layer scales.

The block manager (plain Python) decides which blocks a request owns; this object only holds the memory
those block ids index. Its dtype is the cache's own (engine.json `kv_cache_dtype`): a float dtype, or FP8
(float8_e4m3fn) / INT8, which store k / k_scale and v / v_scale with one calibrated (k_scale, v_scale) pair
per layer (engine.json `kv_cache_scales`), held here as device tensors the attention ops read.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence

import torch

from kiln.engine_format import Mapping
from kiln.model_defs import ModelConfig
from kiln.model_defs.mla_config import kv_cache_layout, kv_values_per_token
from kiln.plugins.kv_cache import QUANTIZED_KV_DTYPES

# (k, v): [num_blocks, block_size, Hk, D] each; for MLA both are the one latent cache [num_blocks, block_size, 1,
# kv_lora_rank + rope dim] (mla_config.kv_cache_layout)
LayerCache = tuple[torch.Tensor, torch.Tensor]
LayerScales = tuple[torch.Tensor, torch.Tensor]  # (k_scale, v_scale): [1] float32 each


def rank_cache_config(config: ModelConfig, mapping: Mapping | None) -> ModelConfig:
    """The model config as one tensor-parallel rank's cache sees it: that rank's query and KV heads (a KV
    head replicated when there are fewer than ranks); `config` itself without tensor parallelism."""
    if mapping is None or mapping.tp_size == 1:
        return config
    return dataclasses.replace(config, num_heads=config.num_heads // mapping.tp_size,
                               num_kv_heads=mapping.kv_heads_per_rank(config.num_kv_heads))


def is_quantized(dtype: torch.dtype) -> bool:
    """Whether a cache of `dtype` stores scaled values (FP8, INT8) that need per-layer scales."""
    return dtype in QUANTIZED_KV_DTYPES


class KVCache:
    """`num_blocks` blocks of `block_size` tokens for every layer, allocated once for the engine's lifetime
    (captured CUDA graphs read these addresses: never reallocate). `scales`: per layer (k_scale, v_scale)
    positive floats, given exactly when `dtype` is quantized (FP8, INT8); a ValueError says which is wrong."""

    def __init__(self, config: ModelConfig, num_blocks: int, block_size: int, dtype: torch.dtype,
                 device: torch.device, scales: Sequence[tuple[float, float]] | None = None) -> None:
        planes, heads, dim = kv_cache_layout(config)
        if planes == 1 and is_quantized(dtype):
            raise ValueError(f"a {dtype} KV cache is not supported with multi-head latent attention (MLA, "
                             f"{config.architecture}); use a float KV cache (no --kv-cache-dtype fp8/int8)")
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.dtype = dtype
        # Per layer (k_scale, v_scale) for a quantized cache; None while the cache holds `dtype` values as is.
        self.scales: tuple[LayerScales, ...] | None = _scale_tensors(config, dtype, scales, device)
        # storage: [layers, 2 (k, v), num_blocks, block_size, Hk, D]; MLA: [layers, 1 (the latent), ..., 1, r + dr]
        self.storage = torch.zeros(config.num_layers, planes, num_blocks, block_size, heads, dim, dtype=dtype,
                                   device=device)
        self.layers: tuple[LayerCache, ...] = tuple(
            (self.storage[i, 0], self.storage[i, planes - 1]) for i in range(config.num_layers))

    @staticmethod
    def bytes_per_token(config: ModelConfig, dtype: torch.dtype) -> int:
        """Device bytes one token's keys and values take over all layers (1 byte an element for FP8, INT8); for
        MLA its compressed latent: layers * (kv_lora_rank + rope dim) * element size."""
        element = torch.empty((), dtype=dtype).element_size()
        return kv_values_per_token(config) * element

    @staticmethod
    def bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
        """Device bytes one block takes over all layers (keys and values); the scales are not counted."""
        return block_size * KVCache.bytes_per_token(config, dtype)

    def copy_blocks(self, copies: Sequence[tuple[int, int]]) -> None:
        """Copies block src to block dst, every layer's keys and values, for each (src, dst) (beam search's
        copy-on-write). In place: the storage CUDA graphs read stays where it is."""
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.storage.device)  # [C]
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.storage.device)  # [C]
        self.storage.index_copy_(2, dst, self.storage.index_select(2, src))

    @property
    def nbytes(self) -> int:
        return self.storage.numel() * self.storage.element_size()


def _scale_tensors(config: ModelConfig, dtype: torch.dtype, scales: Sequence[tuple[float, float]] | None,
                   device: torch.device) -> tuple[LayerScales, ...] | None:
    """The per-layer scales as [1] float32 device tensors; ValueError unless given for a quantized cache
    only, one positive pair per layer."""
    if scales is None:
        if is_quantized(dtype):
            raise ValueError(f"a {dtype} KV cache needs scales: one (k_scale, v_scale) pair per layer")
        return None
    if not is_quantized(dtype):
        raise ValueError(f"KV-cache scales are given but the cache is {dtype}: scales are only for "
                         f"{' and '.join(str(d) for d in QUANTIZED_KV_DTYPES)} caches")
    if len(scales) != config.num_layers:
        raise ValueError(f"{len(scales)} KV-cache scale pairs for a model of {config.num_layers} layers: "
                         f"need one (k_scale, v_scale) pair per layer")
    out = []
    for i, pair in enumerate(scales):
        if len(pair) != 2 or not all(math.isfinite(float(x)) and float(x) > 0 for x in pair):
            raise ValueError(f"KV-cache scales of layer {i}: {pair!r} must be two positive finite numbers")
        out.append(tuple(torch.tensor([float(x)], dtype=torch.float32, device=device) for x in pair))
    return tuple(out)
