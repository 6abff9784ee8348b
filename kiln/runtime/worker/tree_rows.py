"""The positions and attention masks of a request that verifies a tree of drafts (`pack_step` packs them).

A request verifying a tree (`ScheduledRequest.draft_parents`) computes its last token, the root, and its N
nodes at N + 1 consecutive keys, but a node's rope position is the root's plus its depth, and it attends to
the context, its ancestors and itself only (plugins/tree_mask.py). Requests without a tree in the same step
pack as always (positions = key indices, causal rows: tree mask 0).
"""

from __future__ import annotations

from kiln.plugins.tree_mask import tree_depths, verify_tree_mask
from kiln.runtime.core.scheduler import ScheduledRequest


def tree_rows(r: ScheduledRequest) -> tuple[list[int], list[int]]:
    """(positions, tree masks) of request r's packed tokens: its last token then its drafts' nodes."""
    n, root = len(r.token_ids), r.start_position  # the root: its only position not yet in the cache
    parents = r.draft_parents
    if len(parents) != n - 1:
        raise ValueError(f"request {r.request_id}: {len(parents)} draft parents for {n - 1} drafts")
    return [root, *(root + d for d in tree_depths(parents))], verify_tree_mask(parents)
