"""EAGLE-3 greedy chain proposals in one CUDA graph: the head's catch-up over the positions the last verify step
added, the first draft, then the chain's K - 1 steps (eagle3_graphs), with one host sync a proposal.

After a verify step that kept a drafts, a request has a + 1 new tokens, and the head computes those positions
(reading the target's features of them) before it drafts: at most Q = K + 1 positions a request. Run eagerly,
that catch-up was the proposal's cost on a GPU (one head layer's ~20 kernels launched from Python, then a
sync to read the first draft). Here it is laid out like the target's verify graphs (worker/verify_graphs.py): Q
rows a sequence, the request's c real rows first, then padding rows that write no key (slot -1) and borrow the
last real row's position; the sequence's length counts the padding (start + Q), so a real row attends to keys
up to its own position only. The first draft is the argmax at each sequence's last real row (as the chain
takes it), and the head's prenorm state there starts the chain steps, which read the chain drafter's buffers
(whose block tables the catch-up reads too).

Elsewhere (the CPU, --no-cuda-graphs) the same function runs eagerly over the same buffers. Requests whose
catch-up is longer (the first proposal after a prefill), sampled or penalized rows, trees, and rows the chain
cannot take keep eagle3.py's path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence

import numpy as np
import torch

from kiln.model_defs.layers import ForwardContext
from kiln.runtime.speculative.eagle3_graphs import (
    _POSITION,
    _PROMPT,
    _TOKEN,
    _WANTED,
    ChainDraftGraphs,
    chain_row,
    draft_argmax,
)
from kiln.runtime.worker.graph_inputs import GraphInputs, capture_sizes_into, release_graphs
from kiln.runtime.worker.step_inputs import slots_of

logger = logging.getLogger("kiln.runtime")


class ProposalGraphs:
    """Whole greedy proposals (catch-up of up to `rows_per_seq` positions, then `chain`'s steps) for batches of up
    to chain.max_rows requests; `capture()` (CUDA only) captures them per batch size, else they run eagerly.
    `feature_width`: the target features' width (3 H')."""

    def __init__(self, chain: ChainDraftGraphs, *, rows_per_seq: int, feature_width: int) -> None:
        self.chain = chain
        self.q = q = rows_per_seq
        g = chain.max_rows
        device = chain.device
        # ints: [4, G*Q] int64 rows = token ids, positions, rope lengths, slots; last: [G] int64 each sequence's
        # last real row; seq_lens: [G] int32.
        self._inputs = GraphInputs({"ints": ((4, g * q), torch.int64), "last": ((g,), torch.int64),
                                    "seq_lens": ((g,), torch.int32)}, device)
        self._features = torch.zeros(g * q, feature_width, dtype=chain.head.fc.weight.dtype, device=device)
        self._query_start_loc = torch.arange(0, (g + 1) * q, q, dtype=torch.int32, device=device)  # [G+1]
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _propose(self, size: int) -> torch.Tensor:
        """[size, K] int64: each sequence's first draft, then its chain drafts (junk past what it wants)."""
        chain, head, b, t = self.chain, self.chain.head, self._inputs.buffers, size * self.q
        ints = b["ints"]
        ctx = ForwardContext(positions=ints[1, :t], rope_lengths=ints[2, :t], slot_mapping=ints[3, :t],
                             block_tables=chain._tables[:size], seq_lens=b["seq_lens"][:size],
                             query_start_loc=self._query_start_loc[:size + 1], kv_caches=chain.kv_caches)
        normed, prenorm = head(ints[0, :t], self._features[:t], ctx)  # [t, H] each
        last = b["last"][:size]  # [size]
        first = draft_argmax(head, normed.index_select(0, last), chain._in_draft_order)  # [size] int64
        chain._ints[_TOKEN, :size].copy_(first)
        chain._hidden[:size].copy_(prenorm.index_select(0, last))
        rest = chain._steps(size, chain.steps)  # [size, K - 1]
        return torch.cat([first[:, None], rest], dim=1)

    @torch.inference_mode()
    def capture(self, pool=None) -> float:
        """Captures every size of the chain's into `pool`, padding rows only (nothing written); returns seconds."""
        started = time.perf_counter()
        for buffer in self._inputs.buffers.values():
            buffer.zero_()
        self._inputs.buffers["ints"][2].fill_(1)
        self._inputs.buffers["ints"][3].fill_(-1)
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
    def propose(self, rows: Sequence[tuple[Sequence[int], int, torch.Tensor, int, int, Sequence[int]]]
                ) -> list[list[int]]:
        """rows: per request (its tokens, the first head position to compute `start`, the features of positions
        start..N-2 [c, F] on the device, its prompt length, the drafts it wants (<= K), its head block table);
        returns each request's drafts. At most chain.max_rows rows."""
        chain, q, n = self.chain, self.q, len(rows)
        size = next(s for s in chain.sizes if s >= n) if self._graphs else n
        stage, chain_stage = self._inputs.stage(), chain._inputs.stage()
        ints, last, seq_lens = (stage[k].numpy() for k in ("ints", "last", "seq_lens"))
        cints = chain_stage["ints"].numpy()
        ints[:, :size * q] = np.array([[0], [0], [1], [-1]], dtype=np.int64)
        last[:size], seq_lens[:size] = 0, 0
        cints[:, :size] = 0
        cints[_PROMPT, :size] = 1  # padding rows: no step wanted
        block_size = chain.block_size
        for i, (tokens, start, features, prompt, wanted, table) in enumerate(rows):
            end = len(tokens) - 1  # positions start..end-1; position j reads token j + 1
            c, lo = end - start, i * q
            ints[0, lo:lo + c] = tokens[start + 1:end + 1]
            ints[1, lo:lo + q] = [*range(start, end), *[end - 1] * (q - c)]
            ints[2, lo:lo + q] = np.maximum(ints[1, lo:lo + q] + 1, prompt)  # step_inputs.rope_length
            ints[3, lo:lo + c] = slots_of(table, start, end, block_size)
            last[i], seq_lens[i] = lo + c - 1, start + q
            # The chain's rows: the first draft (the graph writes it) sits at position N - 1; then wanted - 1 steps.
            cints[_POSITION, i], cints[_PROMPT, i], cints[_WANTED, i] = end, prompt, wanted - 1
            self._features[lo:lo + c].copy_(features)
        chain._mirror.gather([table for *_, table in rows], out=chain_stage["tables"].numpy()[:n])
        self._inputs.upload()
        chain._inputs.upload({"tables": size})
        if self._graphs:
            self._graphs[size].replay()
            self.replays += 1
            drafts = self._outputs[size][:n]
        else:
            drafts = self._propose(n)
        return [row[:wanted] for row, (*_, wanted, _) in zip(drafts.tolist(), rows)]


def draft_proposals(graphs: ProposalGraphs, block_table: Callable[[str], Sequence[int]], work: list) -> list:
    """Whole proposals for the requests of `work` (eagle3._Drafting, nothing computed this proposal yet) that
    these graphs can take: greedy chain rows whose catch-up is at most Q positions and that want at most K
    drafts; their drafts set and catch-up marked done. Returns the others, for eagle3.py's path."""
    chain, mine, rest = graphs.chain, [], []
    for w in work:
        request = w.request
        n, wanted = len(request.token_ids), request.max_tokens
        catch_up = n - 1 - w.computed
        prompt = len(request.row.prompt_token_ids)
        ok = (0 < catch_up <= graphs.q and 0 < wanted <= chain.steps + 1 and chain_row(request.row)
              and chain.fits_rope(n - 2 + wanted, prompt) and len(mine) < chain.max_rows)
        if not ok:
            rest.append(w)
            continue
        features = w.features[w.computed - w.first:n - 1 - w.first]  # [c, F]
        mine.append((w, (request.token_ids, w.computed, features, prompt, wanted, block_table(request.request_id))))
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
