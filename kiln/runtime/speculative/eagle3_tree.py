"""Tree drafts from an EAGLE-3 head (eagle_topk > 1): the head's steps that grow each request's tree.

The head's position N-2 (reading the request's last token) gives the root's distribution; its topk best
tokens are the depth-1 nodes (tree.TreeSearch). Each later round feeds the frontier (at most topk nodes of
one depth) to the head in one step: a node at depth d reads its token at head position N-2+d with the head's
prenorm state of the row that predicted it, and attends to the head's context, its fed ancestors and itself
(a tree mask, as the target's verify step). The fed nodes take the head's keys after N-2 in feeding order;
the next proposal computes those positions again from the request's own tokens.

This is the eager path, a head step and a host read-back a round. Trees whose root expansion gave topk
children (every one, in practice) grow on the device instead (`eagle3_tree_graphs.py`: the same rounds, keys
and masks, TreeSearch's choices exactly, captured in CUDA graphs, one read-back a proposal); the rest come here.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import torch

from kiln.plugins.tree_mask import tree_bits
from kiln.runtime.core.scheduler import ScheduledRequest, SchedulerOutput
from kiln.runtime.speculative.tree import TreeSearch
from kiln.runtime.worker.step_inputs import pack_step, rope_length


@dataclasses.dataclass
class HeadTree:
    """One request's tree under construction and where its fed nodes sit in the head's cache."""

    search: TreeSearch
    num_context: int  # head keys 0..N-2 hold the request's own positions: N - 1
    keys: dict[int, int] = dataclasses.field(default_factory=dict)  # node -> its key index in the head's cache
    inputs: dict[int, torch.Tensor] = dataclasses.field(default_factory=dict)  # node -> [1, H] state it reads

    def take(self, parents: Sequence[int], logprobs: torch.Tensor, hidden: torch.Tensor) -> None:
        """The head's log-probs [P, V] and prenorm states [P, H] at the rows of `parents` (-1: the root)."""
        first = len(self.search.nodes)
        self.search.expand(parents, logprobs)
        row = {p: i for i, p in enumerate(parents)}
        for node in range(first, len(self.search.nodes)):
            self.inputs[node] = hidden[row[self.search.nodes[node].parent]][None]


def grow(proposer, trees: dict[str, HeadTree], work) -> None:
    """One round: every request of `work` (eagle3._Drafting, with a frontier) feeds its frontier to the head."""
    runtime = proposer.runtime
    for first in range(0, len(work), runtime.max_batch_size):
        chunk = work[first:first + runtime.max_batch_size]
        items, feats, positions, ropes, masks = [], [], [], [], []
        for w in chunk:
            tree, request = trees[w.request.request_id], w.request
            frontier = tree.search.frontier
            start = tree.num_context + len(tree.keys)
            for i, node in enumerate(frontier):
                tree.keys[node] = start + i
            seq_len = start + len(frontier)
            prompt = len(request.row.prompt_token_ids)
            for node in frontier:
                pos = tree.num_context - 1 + tree.search.nodes[node].depth
                positions.append(pos)
                ropes.append(rope_length(pos, prompt))
                seen = [seq_len - 1 - tree.keys[a] for a in tree.search.path(node)]
                masks.append(tree_bits(seen, seq_len - tree.num_context))
                feats.append(tree.inputs[node])
            items.append(ScheduledRequest(request.request_id, tuple(tree.search.nodes[n].token for n in frontier),
                                          start, proposer.blocks.block_table(request.request_id), prompt,
                                          len(frontier)))
        packed = pack_step(SchedulerOutput(tuple(items), ()), runtime.block_size, proposer.cache.layers,
                           proposer.device)
        device = proposer.device
        ctx = dataclasses.replace(packed.context, positions=torch.tensor(positions, device=device),
                                  rope_lengths=torch.tensor(ropes, device=device), max_rope_length=max(ropes),
                                  tree_mask=torch.tensor(masks, dtype=torch.int64, device=device))
        normed, prenorm = proposer.head(packed.input_ids, torch.cat(feats), ctx)  # [T, H] each
        logprobs = proposer.head.target_logits(normed).log_softmax(-1)  # [T, V]: every fed node's children
        offset = 0
        for w, item in zip(chunk, items):
            tree = trees[w.request.request_id]
            frontier, n = list(tree.search.frontier), len(item.token_ids)
            tree.take(frontier, logprobs[offset:offset + n], prenorm[offset:offset + n])
            offset += n


def new_tree(proposer, w) -> HeadTree:
    """An empty tree for a request's proposal (eagle3._Drafting)."""
    request = w.request
    nodes = request.max_nodes or request.max_tokens
    return HeadTree(TreeSearch(proposer.topk, request.max_tokens, nodes), len(request.token_ids) - 1)
