"""Tree attention masks as paged attention takes them (`tree_mask=`): one int64 a query token, not a dense mask.

A tree of draft tokens (speculative decoding with tree drafts) is computed in one step at the end of its
sequence's keys: a node sees the context, its ancestors and itself, not its siblings or cousins. The mask of a
query is an int64 whose bit j says whether it sees its sequence's key seq_len - 1 - j (counted back from the
sequence's last key, j < TREE_SPAN); keys further back are always seen (the context before the tree). A row
of 0 is plain causal attention: a tree query always sees itself, so it is never 0. A tree region therefore
spans at most TREE_SPAN keys (the verify step's root and nodes, a draft head's fed-back nodes).
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

import torch

TREE_SPAN = 64  # the bits of an int64: the keys a tree region may span


def tree_bits(seen_back: Iterable[int], region: int) -> int:
    """The mask of a query that sees, of the last `region` keys of its sequence, those `seen_back` (each
    counted back from the last key: 0 is the last), and every key before the region; as a signed int64."""
    if not 0 < region <= TREE_SPAN:
        raise ValueError(f"a tree region spans 1..{TREE_SPAN} keys, got {region}")
    bits = -1 << region  # the context before the region: seen
    for j in seen_back:
        if not 0 <= j < region:
            raise ValueError(f"key {j} back is outside the tree region of {region} keys")
        bits |= 1 << j
    bits &= (1 << TREE_SPAN) - 1
    return bits - (1 << TREE_SPAN) if bits >= 1 << (TREE_SPAN - 1) else bits


def tree_depths(parents: Sequence[int]) -> list[int]:
    """The depth of each node (1 for a child of the root, parent -1); parents precede their children."""
    depths: list[int] = []
    for i, p in enumerate(parents):
        if not -1 <= p < i:
            raise ValueError(f"node {i}'s parent {p} must be -1 (the root) or an earlier node")
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def verify_tree_mask(parents: Sequence[int]) -> list[int]:
    """The masks of a verify step's n + 1 queries: the root (the request's last token) then the n nodes of
    `parents` (node i's parent index, -1 the root), at the sequence's last n + 1 keys in that order."""
    n = len(parents)
    region = n + 1
    tree_depths(parents)  # checks the order
    masks = [tree_bits([n], region)]  # the root sees itself (and the context)
    for i in range(n):
        seen, node = [n], i
        while node >= 0:  # the node, its ancestors; the root is key n back
            seen.append(n - 1 - node)
            node = parents[node]
        masks.append(tree_bits(seen, region))
    return masks


def tree_visibility(tree_mask: torch.Tensor, seq_len: int) -> torch.Tensor:
    """The dense mask of one sequence's last n queries: tree_mask [n] int64 -> [n, seq_len] bool, True where a
    query sees a key (rows of 0: causal). What the attention reference and the tests read."""
    n = tree_mask.shape[0]
    keys = torch.arange(seq_len, device=tree_mask.device)  # [L]
    query_keys = torch.arange(seq_len - n, seq_len, device=tree_mask.device)  # [n]: each query's own key
    causal = keys[None, :] <= query_keys[:, None]  # [n, L]
    back = seq_len - 1 - keys  # [L]
    bit = (tree_mask[:, None] >> back.clamp(0, TREE_SPAN - 1)[None, :]) & 1  # [n, L]
    tree = (back >= TREE_SPAN)[None, :] | (bit != 0)
    return torch.where(tree_mask[:, None] == 0, causal, tree & causal)
