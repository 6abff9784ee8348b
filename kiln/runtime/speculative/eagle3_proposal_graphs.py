"""EAGLE-3 greedy chain proposals in one CUDA graph: the head's catch-up over the positions the last verify step
added (eagle3_catch_up.py), the first draft, then the chain's K - 1 steps (eagle3_graphs), with one host sync a
proposal.

Run eagerly, that catch-up was the proposal's cost on a GPU (one head layer's ~20 kernels launched from Python,
then a sync to read the first draft). Here the first draft is the argmax at each sequence's last real catch-up
row (as the chain takes it), and the head's prenorm state there starts the chain steps, which read the chain
drafter's buffers (whose block tables the catch-up reads too).

Elsewhere (the CPU, --no-cuda-graphs) the same function runs eagerly over the same buffers. Requests whose
catch-up is longer (the first proposal after a prefill), sampled or penalized rows, trees, and rows the chain
cannot take keep eagle3.py's path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import torch

from kiln.runtime.speculative.eagle3_catch_up import CatchUpInputs, CatchUpRow, catch_up_row
from kiln.runtime.speculative.eagle3_graphs import (
    _POSITION,
    _PROMPT,
    _TOKEN,
    _WANTED,
    ChainDraftGraphs,
    chain_row,
    draft_argmax,
)
from kiln.runtime.worker.graph_inputs import capture_sizes_into, release_graphs

logger = logging.getLogger("kiln.runtime")


class ProposalGraphs:
    """Whole greedy proposals (catch-up of up to `rows_per_seq` positions, then `chain`'s steps) for batches of up to
    chain.max_rows requests; `capture()` (CUDA only) captures them per batch size, else they run eagerly.
    `feature_width`: the target features' width (3 H')."""

    def __init__(self, chain: ChainDraftGraphs, *, rows_per_seq: int, feature_width: int) -> None:
        self.chain = chain
        self.q = rows_per_seq
        self.catch_up = CatchUpInputs(chain.head, chain.kv_caches, max_rows=chain.max_rows, rows_per_seq=rows_per_seq,
                                      feature_width=feature_width, block_size=chain.block_size, device=chain.device)
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _propose(self, size: int) -> torch.Tensor:
        """[size, K] int64: each sequence's first draft, then its chain drafts (junk past what it wants)."""
        chain = self.chain
        normed, prenorm = self.catch_up.run(size, chain._tables)  # [size, H] each
        first = draft_argmax(chain.head, normed, chain._in_draft_order)  # [size] int64
        chain._ints[_TOKEN, :size].copy_(first)
        chain._hidden[:size].copy_(prenorm)
        rest = chain._steps(size, chain.steps)  # [size, K - 1]
        return torch.cat([first[:, None], rest], dim=1)

    @torch.inference_mode()
    def capture(self, pool=None) -> float:
        """Captures every size of the chain's into `pool`, padding rows only (nothing written); returns seconds."""
        started = time.perf_counter()
        self.catch_up.zero_for_capture()
        chain = self.chain
        chain._ints.zero_()
        chain._ints[_PROMPT].fill_(1)
        chain._tables.zero_()
        capture_sizes_into(chain.sizes, self._propose, pool, self._graphs, self._outputs)
        return time.perf_counter() - started

    def release(self) -> None:
        release_graphs(self._graphs, self.chain.device)
        self._outputs.clear()

    @torch.inference_mode()
    def propose(self, rows: Sequence[tuple[CatchUpRow, int, Sequence[int]]]) -> list[list[int]]:
        """rows: per request (its catch-up (eagle3_catch_up.CatchUpRow), the drafts it wants (<= K), its head block
        table); returns each request's drafts. At most chain.max_rows rows."""
        chain, n = self.chain, len(rows)
        size = next(s for s in chain.sizes if s >= n) if self._graphs else n
        chain_stage = chain._inputs.stage()
        cints = chain_stage["ints"].numpy()
        cints[:, :size] = 0
        cints[_PROMPT, :size] = 1  # padding rows: no step wanted
        for i, ((tokens, _, _, prompt), wanted, _) in enumerate(rows):
            # The chain's rows: the first draft (the graph writes it) sits at position N - 1; then wanted - 1 steps.
            cints[_POSITION, i], cints[_PROMPT, i], cints[_WANTED, i] = len(tokens) - 1, prompt, wanted - 1
        tables = [table for *_, table in rows]
        self.catch_up.stage([row for row, _, _ in rows], tables, size)
        chain._mirror.gather(tables, out=chain_stage["tables"].numpy()[:n])
        chain._inputs.upload({"tables": size})
        if self._graphs:
            self._graphs[size].replay()
            self.replays += 1
            drafts = self._outputs[size][:n]
        else:
            drafts = self._propose(n)
        return [row[:wanted] for row, (_, wanted, _) in zip(drafts.tolist(), rows)]


def draft_proposals(graphs: ProposalGraphs, block_table: Callable[[str], Sequence[int]], work: list) -> list:
    """Whole proposals for the requests of `work` (eagle3._Drafting, nothing computed this proposal yet) that
    these graphs can take: greedy chain rows whose catch-up is at most Q positions and that want at most K
    drafts; their drafts set and catch-up marked done. Returns the others, for eagle3.py's path."""
    chain, mine, rest = graphs.chain, [], []
    for w in work:
        request = w.request
        n, wanted = len(request.token_ids), request.max_tokens
        row = catch_up_row(w, graphs.q)
        prompt = len(request.row.prompt_token_ids)
        ok = (row is not None and 0 < wanted <= chain.steps + 1 and chain_row(request.row)
              and chain.fits_rope(n - 2 + wanted, prompt) and len(mine) < chain.max_rows)
        if not ok:
            rest.append(w)
            continue
        mine.append((w, (row, wanted, block_table(request.request_id))))
    if mine:
        for (w, _), drafts in zip(mine, graphs.propose([row for _, row in mine])):
            w.drafts.extend(drafts)
            w.computed = len(w.request.token_ids) - 1
    return rest


def proposals_for(chain: ChainDraftGraphs | None, runtime, num_speculative_tokens: int,
                  feature_width: int) -> ProposalGraphs | None:
    """The whole-proposal graphs over `chain` (None without one), captured on CUDA when the runtime's
    cuda_graphs is on. `runtime`: the target's RuntimeConfig."""
    if chain is None:
        return None
    graphs = ProposalGraphs(chain, rows_per_seq=num_speculative_tokens + 1, feature_width=feature_width)
    if runtime.device.type == "cuda" and runtime.cuda_graphs:
        seconds = graphs.capture()
        logger.info("EAGLE-3 proposals (catch-up of up to %d positions + %d chain steps) captured for %d batch "
                    "sizes in %.2f s", graphs.q, chain.steps, len(chain.sizes), seconds)
    return graphs
