"""EAGLE-3 tree proposals in one CUDA graph: the head's catch-up over the positions the last verify step added,
the root's expansion (its topk best tokens), then the tree's rounds (eagle3_tree_graphs), one host sync a proposal.

eagle3_tree_graphs.py runs a tree's rounds on the device, but before them the catch-up ran eagerly: one head
layer's kernels launched from Python, then a read-back for the root's children, ~2 ms of a ~4 ms tree step on
a GPU. After a verify step that kept a nodes, a request has a + 1 new tokens (at most K + 1 = Q), so the
catch-up is laid out as for a chain's whole proposal (eagle3_catch_up.py: Q rows a sequence, padded). At the
last real row the head's log-probs give the root's topk children, exactly as TreeSearch.expand takes them
(`topk` of the float32 log-softmax, scores the float64 sum from a root of 0), and its prenorm state is what they
read; they go into the tree drafter's buffers and its rounds follow in the same function. The result is the
root's children then the rounds' pool, [G, 3, k + steps k^2] float64 (token, parent, score), read back once.

Elsewhere (the CPU, --no-cuda-graphs) the same function runs eagerly over the same buffers. Requests whose
catch-up is longer (the first proposal after a prefill), trees of depth 1, and rows whose rope needs per-length
tables keep eagle3.py's path (the eager catch-up, then eagle3_tree_graphs' rounds or eagle3_tree.grow).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from kiln.runtime.speculative.eagle3_catch_up import CatchUpInputs, CatchUpRow, catch_up_row
from kiln.runtime.speculative.eagle3_tree_graphs import _CONTEXT, _PROMPT, _WANTED, TreeDraftGraphs
from kiln.runtime.speculative.tree import TreeNode
from kiln.runtime.worker.graph_inputs import capture_sizes_into, release_graphs

logger = logging.getLogger("kiln.runtime")


class TreeProposalGraphs:
    """Whole tree proposals (catch-up of up to `rows_per_seq` positions, the root's expansion, then `trees`'
    rounds) for batches of up to trees.max_rows requests; `capture()` (CUDA only) captures them per batch size,
    else they run eagerly. `feature_width`: the target features' width (3 H'). `replays` counts graph replays."""

    def __init__(self, trees: TreeDraftGraphs, *, rows_per_seq: int, feature_width: int) -> None:
        self.trees = trees
        self.q = rows_per_seq
        # Padding sequences read their table's first q keys (the CPU reference takes no sequence of q queries and
        # no keys, as the tree rounds' dead rows); they write none.
        self.catch_up = CatchUpInputs(trees.head, trees.kv_caches, max_rows=trees.max_rows, rows_per_seq=rows_per_seq,
                                      feature_width=feature_width, block_size=trees.block_size, device=trees.device,
                                      padding_len=rows_per_seq)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _propose(self, size: int) -> torch.Tensor:
        """[size, 3, k + steps k^2] float64: each sequence's depth-1 nodes (parent -1), then its rounds' pool."""
        trees, k = self.trees, self.trees.topk
        tree_buffers = trees._inputs.buffers
        normed, prenorm = self.catch_up.run(size, tree_buffers["tables"])  # [size, H] each
        logprobs = trees.head.target_logits(normed).log_softmax(-1)  # [size, V] float32
        values, children = logprobs.topk(k, dim=-1)  # [size, k] each: TreeSearch.expand's root children
        scores = values.double()  # a root's score is 0.0: the children's are their log-probs
        tree_buffers["tokens"][:size].copy_(children)
        tree_buffers["scores"][:size].copy_(scores)
        trees._hidden[:size].copy_(prenorm)
        pool = trees._steps(size, trees.steps)  # [size, 3, steps k^2]
        root = torch.stack([children.double(), torch.full_like(scores, -1.0), scores], dim=1)  # [size, 3, k]
        return torch.cat([root, pool], dim=2)

    @torch.inference_mode()
    def capture(self, pool=None) -> float:
        """Captures every size of the tree drafter's into `pool`, padding rows only (nothing written); returns
        seconds."""
        started = time.perf_counter()
        self.catch_up.zero_for_capture()
        for buffer in self.trees._inputs.buffers.values():
            buffer.zero_()
        self.trees._inputs.buffers["ints"][_PROMPT].fill_(1)
        capture_sizes_into(self.trees.sizes, self._propose, pool, self._graphs, self._outputs)
        return time.perf_counter() - started

    def release(self) -> None:
        """Destroys the captured graphs (later proposals run eagerly)."""
        release_graphs(self._graphs, self.trees.device)
        self._outputs.clear()

    @torch.inference_mode()
    def propose(self, rows: Sequence[tuple[CatchUpRow, int, Sequence[int]]]) -> list[list[tuple[int, int, float]]]:
        """rows: per request (its catch-up (eagle3_catch_up.CatchUpRow), the rounds it wants (<= trees.steps), its
        head block table); returns each request's nodes, (token, parent, score) in TreeSearch's order: its topk
        depth-1 nodes, then its rounds' nodes. At most trees.max_rows rows."""
        trees, n, k = self.trees, len(rows), self.trees.topk
        size = next(s for s in trees.sizes if s >= n) if self._graphs else n
        tree_stage = trees._inputs.stage()
        tints = tree_stage["ints"].numpy()
        tints[:, :size] = [[0], [1], [0]]  # padding rows: no round wanted
        for i, ((tokens, _, _, prompt), rounds, _) in enumerate(rows):
            tints[_CONTEXT, i], tints[_PROMPT, i], tints[_WANTED, i] = len(tokens) - 1, prompt, rounds
        tables = [table for *_, table in rows]
        self.catch_up.stage([row for row, _, _ in rows], tables, size)
        trees._mirror.gather(tables, out=tree_stage["tables"].numpy()[:n])
        trees._inputs.upload({"tables": size})
        if self._graphs:
            self._graphs[size].replay()
            self.replays += 1
            out = self._outputs[size][:n]
        else:
            out = self._propose(n)
        most = max(rounds for _, rounds, _ in rows)
        nodes = out[:, :, :k + most * k * k].tolist()  # the one host sync: [n][3][k + rounds k^2]
        return [list(zip(map(int, tok[:k + r * k * k]), map(int, par[:k + r * k * k]), score[:k + r * k * k]))
                for (tok, par, score), (_, r, _) in zip(nodes, rows)]


def propose_trees(graphs: TreeProposalGraphs, block_table: Callable[[str], Sequence[int]], trees: dict,
                  work: list) -> list:
    """Whole tree proposals for the requests of `work` (eagle3._Drafting, nothing computed this proposal yet,
    each with a fresh eagle3_tree.HeadTree in `trees` by request id) that these graphs can take: a catch-up of at
    most Q positions, 1..steps rounds, fixed rope tables. Their trees are grown (nodes added, frontier empty) and
    their catch-up marked done; returns the others, for eagle3.py's path."""
    trees_graphs, mine, rest = graphs.trees, [], []
    k = trees_graphs.topk
    for w in work:
        request = w.request
        n, rounds = len(request.token_ids), request.max_tokens - 1
        row = catch_up_row(w, graphs.q)
        ok = (row is not None and 0 < rounds <= trees_graphs.steps and len(mine) < trees_graphs.max_rows
              and trees_graphs.fits_rope(n - 2 + rounds, len(request.row.prompt_token_ids)))
        if not ok:
            rest.append(w)
            continue
        mine.append((w, (row, rounds, block_table(request.request_id))))
    if mine:
        for (w, _), nodes in zip(mine, graphs.propose([row for _, row in mine])):
            search = trees[w.request.request_id].search
            search.nodes.extend(TreeNode(token, parent, 1 if i < k else 2 + (i - k) // (k * k), score)
                                for i, (token, parent, score) in enumerate(nodes))
            search.frontier = []
            w.computed = len(w.request.token_ids) - 1
    return rest


def tree_proposals_for(trees: TreeDraftGraphs | None, runtime, num_speculative_tokens: int,
                       feature_width: int) -> TreeProposalGraphs | None:
    """The whole-proposal graphs over `trees` (None without them), captured on CUDA when the runtime's
    cuda_graphs is on; a failed capture leaves None (the eager catch-up and the rounds' graphs still work).
    `runtime`: the target's RuntimeConfig."""
    if trees is None:
        return None
    graphs = TreeProposalGraphs(trees, rows_per_seq=num_speculative_tokens + 1, feature_width=feature_width)
    if runtime.device.type == "cuda" and runtime.cuda_graphs:
        try:
            seconds = graphs.capture()
        except RuntimeError as e:
            graphs.release()
            logger.warning("EAGLE-3 tree proposals: capturing the catch-up with the rounds failed (%s); the catch-up "
                           "runs eagerly", e)
            return None
        logger.info("EAGLE-3 tree proposals (catch-up of up to %d positions + the root's %d children + %d rounds) "
                    "captured for %d batch sizes in %.2f s", graphs.q, trees.topk, trees.steps, len(trees.sizes),
                    seconds)
    return graphs
