"""Moving KV entries between cache slots (tree drafts: an accepted path's keys to consecutive positions).

After a verify step of a tree of drafts, the nodes the target accepted sit at the slots where the tree put
them; the next step expects them at the positions that follow the request's last token. The move reads every
source before writing any destination (index_select, then index_copy_), so overlapping moves are safe. One
torch op pair per cache tensor, the same on the CPU and on CUDA (no kernel of its own: a handful of slots a
step); `move_kv_reference` is the slot-by-slot definition the tests compare it with.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _rows(cache: torch.Tensor) -> torch.Tensor:
    # cache: [N, block_size, ...] -> [N * block_size, entry] viewed as bytes-compatible rows; a 1-byte
    # cache (float8, int8) as uint8, which index_copy_ takes on every device
    rows = cache.view(cache.shape[0] * cache.shape[1], -1)
    return rows.view(torch.uint8) if cache.element_size() == 1 else rows


def move_kv_slots(layers: Sequence[tuple[torch.Tensor, ...]], src: Sequence[int], dst: Sequence[int]) -> None:
    """For every layer's cache tensors ([N, block_size, Hk, D] each, contiguous): slot dst[i] <- slot src[i]."""
    if len(src) != len(dst):
        raise ValueError(f"{len(src)} source slots for {len(dst)} destinations")
    if not src or not layers:
        return
    device = layers[0][0].device
    src_t = torch.tensor(list(src), dtype=torch.int64, device=device)  # [M]
    dst_t = torch.tensor(list(dst), dtype=torch.int64, device=device)  # [M]
    seen = set()
    for tensors in layers:
        for cache in tensors:
            if cache.data_ptr() in seen:  # a layer whose k and v are one tensor (MLA's latent)
                continue
            seen.add(cache.data_ptr())
            rows = _rows(cache)
            rows.index_copy_(0, dst_t, rows.index_select(0, src_t))


def move_kv_reference(layers: Sequence[tuple[torch.Tensor, ...]], src: Sequence[int], dst: Sequence[int]) -> None:
    """move_kv_slots one slot at a time, all sources read first."""
    for tensors in layers:
        for cache in {t.data_ptr(): t for t in tensors}.values():
            flat = cache.view(cache.shape[0] * cache.shape[1], *cache.shape[2:])
            saved = [flat[s].clone() for s in src]
            for d, value in zip(dst, saved):
                flat[d] = value
