"""Tree drafts: choosing a tree (EAGLE-2/3's search), walking the target's verdict, and its sampling rule.

A tree proposal is N nodes, node i a token with a parent (`parents[i]`, -1 for the request's last token, the
root), ancestors first, so that any prefix of the nodes is a tree too (the scheduler may cut the drafts
short). The target computes the root and the N nodes in one step at N + 1 consecutive keys (rope position:
the root's plus the depth; attention: a node sees the context, its ancestors and itself), and samples every
one of those rows.

Verifying: from the root, the target's token at a node's row picks the child carrying that token, if any;
the walk stops at the first row whose token no child carries, that token being the step's last (the bonus).
For greedy requests that is exact. For sampled ones the children of a node are deterministic (the head's
top-k), and the exact rule at a node with distribution p is: try its children in order, accept child x with
probability p(x), else set p(x) = 0 and renormalize; when none is accepted, draw from what is left
(`sequential_rule`). Its outcome is distributed as p itself (child x_i: prod_{j<i} (1 - p_j / r_j) *
p_i / r_i = p_i; another token y: p(y)), so the engine draws each node row's token from p as the sampler
always does (seeded per request) and walks with it; `sequential_rule` is that rule spelled out, for the tests.

Then the accepted path's keys (nodes at keys start + 1 + node) move to consecutive keys start + 1 + k
(`kv_moves`) before the next step, and the engine sees the step as a chain (`chain_view`).
"""

from __future__ import annotations

import heapq
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch


def children_of(parents: Sequence[int], node: int) -> list[int]:
    """The children of `node` (-1: the root), in order."""
    return [i for i, p in enumerate(parents) if p == node]


def accepted_path(parents: Sequence[int], drafts: Sequence[int], row_tokens: Sequence[int]) -> list[int]:
    """The nodes the target accepts, root first excluded: row_tokens[0] is the root row's token, row_tokens[1 + i]
    node i's. From the root, follow the child whose draft is the token of the current row."""
    path, node = [], -1
    while True:
        token = row_tokens[node + 1]
        child = next((c for c in children_of(parents, node) if drafts[c] == token), None)
        if child is None:
            return path
        path.append(child)
        node = child


def path_to(parents: Sequence[int], node: int) -> list[int]:
    """The nodes from the root's child down to `node` (included)."""
    out = []
    while node >= 0:
        out.append(node)
        node = parents[node]
    return out[::-1]


def chain_view(out, first_row: int, num_rows: int, drafts: Sequence[int], path: Sequence[int]) -> list[int]:
    """Rewrites a request's rows of a host sample (`SamplerOutput`: token_ids, logprobs, top_logprobs) in place so
    that they read as a chain: the root's row, the accepted nodes' rows, then the others; returns the drafts of
    that chain (the path's tokens, then -1 that no token equals, so that the walk stops where the tree's did)."""
    order = [0, *(1 + i for i in path)]
    taken = set(order)
    order += [r for r in range(num_rows) if r not in taken]
    for rows in (out.token_ids, out.logprobs, out.top_logprobs):
        if rows is not None:
            rows[first_row:first_row + num_rows] = [rows[first_row + r] for r in order]
    return [drafts[i] for i in path] + [-1] * (len(drafts) - len(path))


def kv_moves(start: int, path: Sequence[int]) -> list[tuple[int, int]]:
    """(from, to) positions of the accepted nodes' keys: node i was computed at start + 1 + i (start: the root's
    position), the k-th accepted node belongs at start + 1 + k. Sources never precede their destinations."""
    return [(start + 1 + node, start + 1 + k) for k, node in enumerate(path) if node != k]


def sequential_rule(p: torch.Tensor, children: Sequence[int], uniforms: torch.Tensor,
                    generator: torch.Generator | None = None) -> int:
    """The exact rule at one node for deterministic children: p [V] (the target's distribution there), the
    children's tokens in order, uniforms [len(children)] U[0, 1). Returns the token the node yields: an
    accepted child, or a draw from p with the children zeroed when none is."""
    p = p.double() / p.sum()
    for x, u in zip(children, uniforms.tolist()):
        if u < float(p[x]):
            return x
        p = p.clone()
        p[x] = 0.0
        total = float(p.sum())
        if total <= 0:  # every token was a rejected child: cannot happen unless p is one of them, exactly
            return x
        p = p / total
    return int(torch.multinomial(p, 1, generator=generator))


@dataclass
class TreeNode:
    """One node of a TreeSearch (also made by the device rounds, eagle3_tree_graphs.py, from their pool)."""

    token: int
    parent: int  # index into TreeSearch.nodes, -1: the root
    depth: int
    score: float  # the sum of the head's log-probs from the root


@dataclass
class TreeSearch:
    """EAGLE-2/3's draft tree for one request. Each round the `frontier` (at most topk nodes of one depth) is
    expanded: every frontier node's topk most likely children by cumulative log-prob join the pool, and the
    topk best of them are the next frontier. `result` keeps the best `max_nodes` of the pool (their ancestors
    score at least as well, so the set is a tree), ancestors first."""

    topk: int
    max_depth: int
    max_nodes: int
    nodes: list[TreeNode] = field(default_factory=list)
    frontier: list[int] = field(default_factory=list)  # node indices to feed to the head next

    def expand(self, parents: Sequence[int], logprobs: torch.Tensor) -> None:
        """parents: the nodes whose next-token log-probs these are (-1: the root), logprobs [P, V] float32.
        Adds their children and picks the next frontier (none past max_depth)."""
        values, tokens = logprobs.topk(self.topk, dim=-1)  # [P, topk]
        added = []
        for row, parent in enumerate(parents):
            base = 0.0 if parent < 0 else self.nodes[parent].score
            depth = 1 if parent < 0 else self.nodes[parent].depth + 1
            for v, t in zip(values[row].tolist(), tokens[row].tolist()):
                if v == float("-inf"):  # outside the draft vocabulary
                    continue
                self.nodes.append(TreeNode(t, parent, depth, base + v))
                added.append(len(self.nodes) - 1)
        best = heapq.nlargest(self.topk, added, key=lambda i: (self.nodes[i].score, -i))
        self.frontier = sorted(best) if added and self.nodes[added[0]].depth < self.max_depth else []

    def path(self, node: int) -> list[int]:
        """The nodes from depth 1 down to `node` (included)."""
        out = []
        while node >= 0:
            out.append(node)
            node = self.nodes[node].parent
        return out[::-1]

    def result(self) -> tuple[list[int], list[int]]:
        """(tokens, parents) of the chosen nodes, ancestors first."""
        nodes = self.nodes
        keep = heapq.nlargest(self.max_nodes, range(len(nodes)), key=lambda i: (nodes[i].score, -nodes[i].depth, -i))
        keep.sort(key=lambda i: (nodes[i].depth, i))
        index = {old: new for new, old in enumerate(keep)}
        missing = [i for i in keep if nodes[i].parent >= 0 and nodes[i].parent not in index]
        if missing:  # ties in score could only do this through -inf; keep the closed prefix
            keep = keep[:keep.index(missing[0])]
        return [nodes[i].token for i in keep], [index[nodes[i].parent] if nodes[i].parent >= 0 else -1 for i in keep]
