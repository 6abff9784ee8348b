"""EAGLE-3 chain drafts on the device: the head's greedy draft steps after the catch-up, with no host sync
between them, captured in CUDA graphs per batch size.

After the catch-up (eagle3.py) each request has its first draft d1 and the head's prenorm state at position
N-2. Each later step reads the draft before it at the next position with the state of the step before, and
for a greedy row the draft is the argmax over the target vocabulary: nothing the host must see. So the
K-1 steps run as one function of static device buffers (`_draft_steps`): each step works out its slots,
sequence lengths and rope lengths on the device, runs the head, takes the argmax and feeds token and state to
the next; the drafts land in a [G, K-1] buffer read once. On CUDA with the runtime's cuda_graphs on, it is
captured per batch size (`capture_sizes`, one memory pool, largest first) and a batch replays the graph of
the smallest size that holds it; its extra rows are padding, as in the target's decode graphs: they want no
step, so they write no key (slot -1) and read none (length 0). Elsewhere it runs eagerly, still without a
sync between steps.

A row is drafted here when the eager path would take the plain argmax too: greedy, no logit_bias and no
penalty (`Sampler.draw_with_probs` applies those; min_tokens and bad words it does not). Sampled rows, trees,
and heads whose rope needs per-length tables (dynamic NTK past the trained context) keep eagle3.py's path.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from kiln.model_defs.eagle3_head import Eagle3Head
from kiln.model_defs.layers import ForwardContext
from kiln.runtime.sampling.sampler import SamplingRow
from kiln.runtime.speculative.config import MAX_SPECULATIVE_TOKENS
from kiln.runtime.worker.block_table_mirror import BlockTableMirror
from kiln.runtime.worker.cuda_graphs import capture_sizes
from kiln.runtime.worker.graph_inputs import GraphInputs, capture_sizes_into, release_graphs
from kiln.runtime.worker.kv_cache import LayerCache
from kiln.runtime.worker.step_inputs import rope_length

logger = logging.getLogger("kiln.runtime")

# The largest batch one graph drafts for; a larger one runs in chunks of it (a head step at this size is
# GPU-bound already, and every size captured costs startup time).
MAX_GRAPH_BATCH = 256

# The int rows of the input buffer, [4, G] int64: the first draft (the token step 0 reads), its position, the
# request's prompt length (rope lengths), the steps the row wants (0: a padding row).
_TOKEN, _POSITION, _PROMPT, _WANTED = range(4)


def chain_row(row: SamplingRow) -> bool:
    """Whether the raw argmax is the draft `Sampler.draw_with_probs` takes for this row: greedy, no logit_bias,
    no repetition / frequency / presence penalty."""
    p = row.params
    return (p.greedy and not p.logit_bias and p.repetition_penalty == 1.0 and p.frequency_penalty == 0.0
            and p.presence_penalty == 0.0)


def draft_argmax(head: Eagle3Head, normed: torch.Tensor, in_draft_order: bool) -> torch.Tensor:
    """normed: [B, H] -> [B] int64 target ids: the argmax of `head.target_logits(normed)`. `in_draft_order`:
    the head's draft -> target map is increasing, so the argmax over the draft vocabulary, mapped, is the same
    token (ties included: both take the lowest id) without the [B, V] logits."""
    if in_draft_order:
        return head.draft_to_target.index_select(0, head.lm_head(normed).argmax(-1))
    return head.target_logits(normed).argmax(-1)


def _draft_steps(head: Eagle3Head, kv_caches: tuple[LayerCache, ...], ints: torch.Tensor, tables: torch.Tensor,
                 hidden: torch.Tensor, drafts: torch.Tensor, query_start_loc: torch.Tensor, *, size: int, steps: int,
                 block_size: int, in_draft_order: bool) -> torch.Tensor:
    """`steps` greedy head steps over the first `size` rows of the static buffers, all on the device.

    ints: [4, G] int64 rows (first draft, its position p, prompt length, steps wanted); tables: [G, MB] int32
    head block tables; hidden: [G, H] the head's prenorm state at p - 1; drafts: [G, >= steps] int64, where
    step i writes each row's draft (row r's drafts past its wanted count are junk); query_start_loc: [G + 1]
    int32, arange. Step i computes position p + i of the rows that want more than i steps; the others write
    no key (slot -1) and read none (length 0). Returns drafts[:size, :steps]."""
    tokens, start, prompt, wanted = (ints[k, :size] for k in (_TOKEN, _POSITION, _PROMPT, _WANTED))  # [B] each
    tables = tables[:size]  # [B, MB]
    state = hidden[:size]  # [B, H]
    last_block = tables.shape[1] - 1
    for i in range(steps):
        live = wanted > i  # [B] bool
        pos = torch.where(live, start + i, 0)  # [B] int64; 0 for rows done (their rope rows stay in range)
        blocks = tables.gather(1, (pos // block_size).clamp(max=last_block)[:, None]).squeeze(1).long()  # [B]
        ctx = ForwardContext(
            positions=pos,
            rope_lengths=torch.where(live, torch.maximum(pos + 1, prompt), 1),  # step_inputs.rope_length
            slot_mapping=torch.where(live, blocks * block_size + pos % block_size, -1),
            block_tables=tables,
            seq_lens=torch.where(live, pos + 1, 0).to(torch.int32),
            query_start_loc=query_start_loc[:size + 1],
            kv_caches=kv_caches)
        normed, state = head(tokens, state, ctx)  # [B, H] each
        tokens = draft_argmax(head, normed, in_draft_order)  # [B] int64
        drafts[:size, i].copy_(tokens)
    return drafts[:size, :steps]


class HeadDraftGraphs:
    """What the head's device drafters (chains here, trees in eagle3_tree_graphs.py) share: a graph per batch size
    over static buffers (`_inputs`, whose "ints" row `_PROMPT_ROW` holds prompt lengths, and `_hidden`), captured
    with padding rows only, replayed by the smallest size that holds a batch. A subclass sets those, `head`,
    `steps`, `sizes`, `device`, `_graphs`, `_outputs`, and `_steps(size, steps)`."""

    _PROMPT_ROW = _PROMPT

    def fits_rope(self, position: int, prompt_len: int) -> bool:
        """Whether a row whose last step computes `position` needs only the head's fixed rope tables."""
        rotary = self.head.rotary
        return rotary is not None and not rotary.needs_per_length_tables(rope_length(position, prompt_len))

    def _steps(self, size: int, steps: int) -> torch.Tensor:
        raise NotImplementedError

    @torch.inference_mode()
    def capture(self, pool=None) -> float:
        """Captures every size into `pool` (None: a new one), with padding rows only (nothing written); returns
        seconds."""
        started = time.perf_counter()
        for buffer in self._inputs.buffers.values():
            buffer.zero_()
        self._inputs.buffers["ints"][self._PROMPT_ROW].fill_(1)  # rope lengths of at least 1
        self._hidden.zero_()
        capture_sizes_into(self.sizes, lambda size: self._steps(size, self.steps), pool, self._graphs,
                           self._outputs)
        return time.perf_counter() - started

    def release(self) -> None:
        """Destroys the captured graphs (later batches run eagerly)."""
        release_graphs(self._graphs, self.device)
        self._outputs.clear()


class ChainDraftGraphs(HeadDraftGraphs):
    """Greedy chain drafts of `steps` (the engine's K - 1) head steps for batches of up to `max_batch_size` rows;
    `capture()` (CUDA only) captures them per batch size, else `draft` runs them eagerly. `replays` counts the
    graphs replayed."""

    def __init__(self, head: Eagle3Head, kv_caches: tuple[LayerCache, ...], *, steps: int, max_batch_size: int,
                 max_seq_len: int, block_size: int, device: torch.device) -> None:
        self.head = head
        self.kv_caches = kv_caches
        self.steps = steps
        self.block_size = block_size
        self.device = device
        g = min(max_batch_size, MAX_GRAPH_BATCH)
        self.sizes = capture_sizes(g)
        self.max_rows = g
        # A head table holds a request's positions and its fed drafts (eagle3.Eagle3Proposer.load's count).
        mb = -(-(max_seq_len + MAX_SPECULATIVE_TOKENS) // block_size)
        self._inputs = GraphInputs({"ints": ((4, g), torch.int64), "tables": ((g, mb), torch.int32)}, device)
        self._ints, self._tables = self._inputs.buffers["ints"], self._inputs.buffers["tables"]
        self._hidden = torch.zeros(g, head.config.layer.hidden_size, dtype=head.fc.weight.dtype, device=device)
        self._drafts = torch.zeros(g, max(steps, 1), dtype=torch.int64, device=device)  # [G, K-1]
        self._query_start_loc = torch.arange(g + 1, dtype=torch.int32, device=device)
        self._mirror = BlockTableMirror(2 * g, mb)
        ids = head.draft_to_target
        self._in_draft_order = bool((ids[1:] > ids[:-1]).all())  # once, at load
        self._graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self._outputs: dict[int, torch.Tensor] = {}
        self.replays = 0

    def _steps(self, size: int, steps: int) -> torch.Tensor:
        return _draft_steps(self.head, self.kv_caches, self._ints, self._tables, self._hidden, self._drafts,
                            self._query_start_loc, size=size, steps=steps, block_size=self.block_size,
                            in_draft_order=self._in_draft_order)

    @torch.inference_mode()
    def draft(self, first: Sequence[int], hidden: torch.Tensor, positions: Sequence[int],
              prompt_lens: Sequence[int], wanted: Sequence[int],
              tables: Sequence[Sequence[int]]) -> list[list[int]]:
        """Each row's next `wanted[r]` (<= steps) drafts: row r's first draft `first[r]` sits at `positions[r]`,
        read with the head's prenorm state hidden[r] ([B, H] on the device) of the position before, in the head
        blocks `tables[r]` (which hold every position it computes). One host sync per chunk of rows."""
        out: list[list[int]] = []
        for lo in range(0, len(first), self.max_rows):
            hi = min(lo + self.max_rows, len(first))
            out.extend(self._chunk(first[lo:hi], hidden[lo:hi], positions[lo:hi], prompt_lens[lo:hi],
                                   wanted[lo:hi], tables[lo:hi]))
        return out

    def _chunk(self, first, hidden, positions, prompt_lens, wanted, tables) -> list[list[int]]:
        n = len(first)
        size = next(s for s in self.sizes if s >= n) if self._graphs else n
        stage = self._inputs.stage()
        ints = stage["ints"].numpy()
        for row, values in ((_TOKEN, first), (_POSITION, positions), (_PROMPT, prompt_lens), (_WANTED, wanted)):
            ints[row, :n] = values
        ints[:, n:size] = [[0], [0], [1], [0]]  # padding rows: no step wanted
        self._mirror.gather(tables, out=stage["tables"].numpy()[:n])
        self._inputs.upload({"tables": size})
        self._hidden[:n].copy_(hidden)
        if self._graphs:
            self._graphs[size].replay()
            self.replays += 1
            drafts = self._outputs[size][:n]
        else:  # as many steps as the batch wants
            drafts = self._steps(n, max(wanted))
        return [row[:k] for row, k in zip(drafts.tolist(), wanted)]


def draft_chains(chain: ChainDraftGraphs, block_table, work: list) -> list:
    """The draft steps after the catch-up for the requests of `work` (eagle3._Drafting, each with its first draft
    and `hidden`) that the chain can draft, their drafts appended; returns the others, for the eager path.
    `block_table(request_id)`: the request's head blocks."""
    mine, rest = [], []
    for w in work:
        request, wanted = w.request, w.request.max_tokens - len(w.drafts)
        position = len(request.token_ids) + len(w.drafts) - 2  # as eagle3's _decode: the last draft's
        ok = (0 < wanted <= chain.steps and chain_row(request.row)
              and chain.fits_rope(position + wanted - 1, len(request.row.prompt_token_ids)))
        (mine if ok else rest).append((w, position, wanted) if ok else w)
    if mine:
        drafts = chain.draft([w.drafts[-1] for w, _, _ in mine], torch.cat([w.hidden for w, _, _ in mine]),
                             [p for _, p, _ in mine], [len(w.request.row.prompt_token_ids) for w, _, _ in mine],
                             [k for _, _, k in mine], [block_table(w.request.request_id) for w, _, _ in mine])
        for (w, _, _), more in zip(mine, drafts):
            w.drafts.extend(more)
    return rest


def chain_for(head: Eagle3Head, kv_caches: tuple[LayerCache, ...], runtime, steps: int) -> ChainDraftGraphs | None:
    """The chain drafter of an engine drafting K = steps + 1 tokens (None for K = 1), captured on CUDA when the
    runtime's cuda_graphs is on. `runtime`: the target's RuntimeConfig."""
    if steps < 1:
        return None
    chain = ChainDraftGraphs(head, kv_caches, steps=steps, max_batch_size=runtime.max_batch_size,
                             max_seq_len=runtime.max_seq_len, block_size=runtime.block_size, device=runtime.device)
    if runtime.device.type == "cuda" and runtime.cuda_graphs:
        seconds = chain.capture()
        logger.info("EAGLE-3 chain drafts: %d head steps captured for %d batch sizes in %.2f s", steps,
                    len(chain.sizes), seconds)
    return chain
