"""EAGLE-3 tree drafts grown on the device: the head's rounds after the root's expansion, with no host sync
between them, captured in CUDA graphs per batch size (as eagle3_graphs.py does for chains).

Eagerly (eagle3_tree.grow) every round of a tree is a head step and a host read-back: TreeSearch picks the
next frontier on the host. But for a tree whose root has topk children (the catch-up's expansion, every
value finite) the search has a fixed shape: each round feeds exactly topk nodes a request, each gets topk
children, and the next frontier is the topk best of the topk * topk new nodes. So the rounds run as one
function of static buffers (`_tree_steps`), reproducing TreeSearch exactly:

- round r (1..D-1) feeds the frontier (depth r, in node order) at positions N-2+r, at the head keys
  num_context + (r-1) topk + i (the order `grow` assigns), each node reading its parent's row's prenorm
  state (the root's for depth 1), under the tree mask `grow` builds with `tree_bits` (the context, the fed
  ancestors, itself): a node's path bits are its parent's shifted by topk (the region grows by topk keys a
  round) plus its own bit;
- its children: the topk best of log_softmax(head.target_logits) per node, scored in float64 as the host's
  Python floats sum them, numbered as TreeSearch numbers them (round r's start at topk + (r-1) topk^2,
  parent-major);
- the next frontier: the topk best by (score, then lowest index), in node order.

The pool of new nodes (token, parent, score, [G, 3, rounds * topk^2] float64) is read back once a proposal
and TreeSearch.result chooses the nodes on the host. Padding rows and rows past their depth write no key
(slot -1) and read only the first topk keys of their table (length topk: the CPU reference takes no sequence
of topk queries and no keys); their outputs go unused, and rows never mix (the head works per row, the
frontier per request). A node of value -inf (outside the draft vocabulary) TreeSearch skips; here none can
come while topk <= the draft vocabulary (a head with fewer draft tokens gets no device path), but a tree whose
root had fewer than topk children anyway keeps `grow`, as do trees deeper than the graphs' rounds and those
whose rope needs per-length tables.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from kiln.model_defs.eagle3_head import Eagle3Head
from kiln.model_defs.layers import ForwardContext
from kiln.plugins.tree_mask import tree_bits
from kiln.runtime.speculative.config import MAX_SPECULATIVE_TOKENS
from kiln.runtime.speculative.eagle3_graphs import MAX_GRAPH_BATCH, HeadDraftGraphs
from kiln.runtime.speculative.tree import TreeNode
from kiln.runtime.worker.block_table_mirror import BlockTableMirror
from kiln.runtime.worker.cuda_graphs import capture_sizes
from kiln.runtime.worker.graph_inputs import GraphInputs
from kiln.runtime.worker.kv_cache import LayerCache

logger = logging.getLogger("kiln.runtime")

# The int rows of the input buffer, [3, G] int64: the head keys the request's own positions hold (N - 1), its
# prompt length (rope lengths), the rounds it wants (its depth - 1; 0: a padding row).
_CONTEXT, _PROMPT, _WANTED = range(3)


def best_k(scores: torch.Tensor, k: int) -> torch.Tensor:
    """scores: [B, M] -> [B, k] int64, each row's k best columns by (score, then lowest column), in column order:
    TreeSearch's `sorted(heapq.nlargest(k, added, key=(score, -index)))`. A column is taken when fewer than k
    beat it (a higher score, or the same at a lower column): spelled out, not left to a sort's stability."""
    m = scores.shape[1]
    columns = torch.arange(m, device=scores.device)  # [M]
    a, c = scores[:, :, None], scores[:, None, :]  # [B, M, 1] column i, [B, 1, M] column j
    beats = (c > a) | ((c == a) & (columns[None, None, :] < columns[None, :, None]))  # [B, M, M]: j beats i
    taken = beats.sum(-1) < k  # [B, M]
    return torch.where(taken, columns, m).sort(dim=-1).values[:, :k]


def _tree_steps(head: Eagle3Head, kv_caches: tuple[LayerCache, ...], ints: torch.Tensor, tables: torch.Tensor,
                tokens: torch.Tensor, scores: torch.Tensor, hidden: torch.Tensor, pool: torch.Tensor,
                query_start_loc: torch.Tensor, *, size: int, steps: int, topk: int,
                block_size: int) -> torch.Tensor:
    """`steps` tree rounds over the first `size` rows of the static buffers, all on the device.

    ints: [3, G] int64 rows (num_context, prompt length, rounds wanted); tables: [G, MB] int32 head block tables;
    tokens: [G, k] int64 and scores: [G, k] float64, the depth-1 nodes (TreeSearch nodes 0..k-1); hidden: [G, H]
    the root's prenorm state; pool: [G, 3, >= steps k^2] float64, where round r writes its new nodes' tokens,
    parents and scores at columns (r-1) k^2 ..; query_start_loc: [G + 1] int32, arange(0, .., k). Returns
    pool[:size] (a row's columns past its rounds are junk)."""
    k, b = topk, size
    device = ints.device
    context, prompt, wanted = (ints[i, :b] for i in (_CONTEXT, _PROMPT, _WANTED))  # [B] each
    tables = tables[:b]  # [B, MB]
    last_block = tables.shape[1] - 1
    slot = torch.arange(k, device=device)  # [k]
    own = torch.ones(k, dtype=torch.int64, device=device) << (k - 1 - slot)  # [k]: slot i's own key, i back
    frontier = slot.expand(b, k)  # [B, k] node indices
    toks, score = tokens[:b], scores[:b]  # [B, k] each
    state = hidden[:b, None].expand(b, k, hidden.shape[1])  # [B, k, H]: the state each frontier node reads
    path = own.expand(b, k)  # [B, k] int64: each node's path (itself included) as bits back from its last key
    for r in range(1, steps + 1):
        live = wanted >= r  # [B] bool
        live_k = live[:, None].expand(b, k)  # [B, k]
        keys = context[:, None] + (r - 1) * k + slot  # [B, k] int64
        blocks = tables.gather(1, (keys // block_size).clamp(max=last_block)).long()  # [B, k]
        pos = torch.where(live, context - 1 + r, 0)  # [B]: depth r sits at N-2+r
        context_bits = tree_bits((), r * k)  # the keys before the region: seen
        ctx = ForwardContext(
            positions=pos[:, None].expand(b, k).reshape(-1),
            rope_lengths=torch.where(live, torch.maximum(pos + 1, prompt), 1)[:, None].expand(b, k).reshape(-1),
            slot_mapping=torch.where(live_k, blocks * block_size + keys % block_size, -1).reshape(-1),
            block_tables=tables,
            seq_lens=torch.where(live, context + r * k, k).to(torch.int32),  # dead: the table's first k keys
            query_start_loc=query_start_loc[:b + 1],
            kv_caches=kv_caches,
            tree_mask=torch.where(live_k, path | context_bits, 0).reshape(-1))  # 0 (causal) for dead rows
        normed, prenorm = head(toks.reshape(-1), state.reshape(b * k, -1), ctx)  # [B k, H] each
        values, children = head.target_logits(normed).log_softmax(-1).topk(k, dim=-1)  # [B k, k] each
        new_scores = (score[:, :, None] + values.view(b, k, k).double()).view(b, k * k)  # [B, k^2] float64
        new_tokens = children.view(b, k * k)  # [B, k^2] int64
        lo = (r - 1) * k * k
        pool[:b, 0, lo:lo + k * k].copy_(new_tokens)
        pool[:b, 1, lo:lo + k * k].copy_(frontier[:, :, None].expand(b, k, k).reshape(b, k * k))
        pool[:b, 2, lo:lo + k * k].copy_(new_scores)
        if r == steps:
            break
        best = best_k(new_scores, k)  # [B, k]
        parent_slot = best // k  # [B, k]
        frontier = k + lo + best
        toks, score = new_tokens.gather(1, best), new_scores.gather(1, best)
        state = prenorm.view(b, k, -1).gather(1, parent_slot[:, :, None].expand(b, k, prenorm.shape[1]))
        path = (path.gather(1, parent_slot) << k) | own
    return pool[:b]


class TreeDraftGraphs(HeadDraftGraphs):
    """Tree rounds (up to `steps`: the engine's K - 1) of `topk` nodes a request for batches of up to
    `max_batch_size` requests (at most MAX_GRAPH_BATCH // topk: a round's logits are [G topk, V] float32);
    `capture()` (CUDA only) captures them per batch size, else `grow` runs them eagerly. `replays` counts the
    graphs replayed."""

    _PROMPT_ROW = _PROMPT

    def __init__(self, head: Eagle3Head, kv_caches: tuple[LayerCache, ...], *, topk: int, steps: int,
                 max_batch_size: int, max_seq_len: int, block_size: int, device: torch.device) -> None:
        self.head = head
        self.kv_caches = kv_caches
        self.topk = topk
        self.steps = steps
        self.block_size = block_size
        self.device = device
        g = max(1, min(max_batch_size, MAX_GRAPH_BATCH // topk))
        self.sizes = capture_sizes(g)
        self.max_rows = g
        # A head table holds a request's positions and its fed nodes (eagle3.Eagle3Proposer.load's count).
        mb = -(-(max_seq_len + MAX_SPECULATIVE_TOKENS * topk) // block_size)
        self._inputs = GraphInputs({"ints": ((3, g), torch.int64), "tables": ((g, mb), torch.int32),
                                    "tokens": ((g, topk), torch.int64), "scores": ((g, topk), torch.float64)},
                                   device)
        self._hidden = torch.zeros(g, head.config.layer.hidden_size, dtype=head.fc.weight.dtype, device=device)
        self._pool = torch.zeros(g, 3, max(steps, 1) * topk * topk, dtype=torch.float64, device=device)
        self._query_start_loc = torch.arange(0, (g + 1) * topk, topk, dtype=torch.int32, device=device)  # [G+1]
        self._mirror = BlockTableMirror(2 * g, mb)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _steps(self, size: int, steps: int) -> torch.Tensor:
        b = self._inputs.buffers
        return _tree_steps(self.head, self.kv_caches, b["ints"], b["tables"], b["tokens"], b["scores"], self._hidden,
                           self._pool, self._query_start_loc, size=size, steps=steps, topk=self.topk,
                           block_size=self.block_size)

    @torch.inference_mode()
    def grow(self, tokens: Sequence[Sequence[int]], scores: Sequence[Sequence[float]], hidden: torch.Tensor,
             contexts: Sequence[int], prompt_lens: Sequence[int], rounds: Sequence[int],
             tables: Sequence[Sequence[int]]) -> list[list[tuple[int, int, float]]]:
        """Each row's new nodes, (token, parent, score) in TreeSearch's order: row r's depth-1 nodes are
        tokens[r] / scores[r] (topk each), the root's prenorm state hidden[r] ([B, H] on the device); it has
        contexts[r] head keys of its own positions, in the head blocks tables[r], and wants rounds[r] (<= steps)
        rounds. One host sync per chunk of max_rows rows."""
        out: list[list[tuple[int, int, float]]] = []
        for lo in range(0, len(tokens), self.max_rows):
            hi = min(lo + self.max_rows, len(tokens))
            out.extend(self._chunk(tokens[lo:hi], scores[lo:hi], hidden[lo:hi], contexts[lo:hi],
                                   prompt_lens[lo:hi], rounds[lo:hi], tables[lo:hi]))
        return out

    def _chunk(self, tokens, scores, hidden, contexts, prompt_lens, rounds, tables) -> list[list[tuple]]:
        n, k = len(tokens), self.topk
        size = next(s for s in self.sizes if s >= n) if self._graphs else n
        stage = self._inputs.stage()
        ints = stage["ints"].numpy()
        for row, values in ((_CONTEXT, contexts), (_PROMPT, prompt_lens), (_WANTED, rounds)):
            ints[row, :n] = values
        ints[:, n:size] = [[0], [1], [0]]  # padding rows: no round wanted
        stage["tokens"].numpy()[:n] = tokens
        stage["scores"].numpy()[:n] = scores
        self._mirror.gather(tables, out=stage["tables"].numpy()[:n])
        self._inputs.upload({"tables": size})
        self._hidden[:n].copy_(hidden)
        most = max(rounds)
        if self._graphs:
            self._graphs[size].replay()
            self.replays += 1
            pool = self._outputs[size][:n]
        else:  # as many rounds as the batch wants
            pool = self._steps(n, most)
        rows = pool[:, :, :most * k * k].tolist()  # the one host sync: [n][3][rounds k^2]
        return [list(zip(map(int, t[:r * k * k]), map(int, p[:r * k * k]), s[:r * k * k]))
                for (t, p, s), r in zip(rows, rounds)]


def grow_trees(graphs: TreeDraftGraphs, block_table, trees: dict, work: list) -> None:
    """Grows on the device the trees (eagle3_tree.HeadTree, by request id) of `work` (eagle3._Drafting, after
    the catch-up's root expansion) that `graphs` can take: the root's topk children, all there, as the
    frontier; at most `steps` rounds; fixed rope tables. Their nodes are added and their frontier emptied; the
    others keep theirs, for eagle3_tree.grow. `block_table(request_id)`: the request's head blocks."""
    k, mine = graphs.topk, []
    for w in work:
        tree, request = trees[w.request.request_id], w.request
        search, rounds = tree.search, tree.search.max_depth - 1
        if (search.frontier == list(range(k)) and len(search.nodes) == k and 0 < rounds <= graphs.steps
                and graphs.fits_rope(tree.num_context - 1 + rounds, len(request.row.prompt_token_ids))):
            mine.append((tree, request, rounds))
    if not mine:
        return
    new = graphs.grow([[tree.search.nodes[i].token for i in range(k)] for tree, _, _ in mine],
                      [[tree.search.nodes[i].score for i in range(k)] for tree, _, _ in mine],
                      torch.cat([tree.inputs[0] for tree, _, _ in mine]),
                      [tree.num_context for tree, _, _ in mine],
                      [len(request.row.prompt_token_ids) for _, request, _ in mine], [r for _, _, r in mine],
                      [block_table(request.request_id) for _, request, _ in mine])
    for (tree, _, _), nodes in zip(mine, new):
        search = tree.search
        for i, (token, parent, score) in enumerate(nodes):
            search.nodes.append(TreeNode(token, parent, 2 + i // (k * k), score))
        search.frontier = []


def trees_for(head: Eagle3Head, kv_caches: tuple[LayerCache, ...], runtime, topk: int,
              steps: int) -> TreeDraftGraphs | None:
    """The tree grower of an engine drafting trees of depth steps + 1 (None for depth 1, or a draft vocabulary
    smaller than topk, whose -inf children TreeSearch skips), captured on CUDA when the runtime's cuda_graphs is
    on. `runtime`: the target's RuntimeConfig."""
    if steps < 1 or head.config.draft_vocab_size < topk:
        return None
    graphs = TreeDraftGraphs(head, kv_caches, topk=topk, steps=steps, max_batch_size=runtime.max_batch_size,
                             max_seq_len=runtime.max_seq_len, block_size=runtime.block_size, device=runtime.device)
    if runtime.device.type == "cuda" and runtime.cuda_graphs:
        try:
            seconds = graphs.capture()
        except RuntimeError as e:  # not yet captured on every GPU and toolchain: the eager rounds always work
            graphs.release()
            logger.warning("EAGLE-3 tree drafts: capturing their rounds failed (%s); trees grow a round at a time",
                           e)
            return None
        logger.info("EAGLE-3 tree drafts: %d rounds of %d nodes captured for %d batch sizes in %.2f s", steps, topk,
                    len(graphs.sizes), seconds)
    return graphs
