"""The head's catch-up laid out for a CUDA graph: the static buffers and the head step that whole proposals
(a greedy chain's, eagle3_proposal_graphs.py; a tree's, eagle3_tree_proposals.py) start with.

After a verify step that kept a drafts, a request has a + 1 new tokens, and the head computes those positions
(reading the target's features of them) before it drafts: at most Q = K + 1 positions a request. They are laid
out like the target's verify graphs (worker/verify_graphs.py): Q rows a sequence, the request's c real rows
first, then padding rows that write no key (slot -1) and borrow the last real row's position; the sequence's
length counts the padding (start + Q), so a real row attends to keys up to its own position only. What a
proposal drafts from is the head's output at each sequence's last real row.
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

from kiln.model_defs.eagle3_head import Eagle3Head
from kiln.model_defs.layers import ForwardContext
from kiln.runtime.worker.graph_inputs import GraphInputs
from kiln.runtime.worker.kv_cache import LayerCache
from kiln.runtime.worker.step_inputs import slots_of

# One request's catch-up: (its tokens, the first head position to compute `start`, the target's features of
# positions start..N-2 [c, F] on the device, its prompt length).
CatchUpRow = tuple[Sequence[int], int, torch.Tensor, int]


class CatchUpInputs:
    """Catch-ups of up to `rows_per_seq` positions for up to `max_rows` requests. `padding_len`: the length a
    padding sequence reads (0 for none; the tree drafter's CPU reference needs keys under every query)."""

    def __init__(self, head: Eagle3Head, kv_caches: tuple[LayerCache, ...], *, max_rows: int, rows_per_seq: int,
                 feature_width: int, block_size: int, device: torch.device, padding_len: int = 0) -> None:
        self.head, self.kv_caches = head, kv_caches
        self.q = q = rows_per_seq
        self.block_size, self.padding_len = block_size, padding_len
        g = max_rows
        # ints: [4, G*Q] int64 rows = token ids, positions, rope lengths, slots; last: [G] int64 each sequence's
        # last real row; seq_lens: [G] int32.
        self._inputs = GraphInputs({"ints": ((4, g * q), torch.int64), "last": ((g,), torch.int64),
                                    "seq_lens": ((g,), torch.int32)}, device)
        self._features = torch.zeros(g * q, feature_width, dtype=head.fc.weight.dtype, device=device)
        self._query_start_loc = torch.arange(0, (g + 1) * q, q, dtype=torch.int32, device=device)  # [G+1]

    def run(self, size: int, tables: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The head over the first `size` sequences' rows (tables: [>= size, MB] int32 head block tables) ->
        (normed, prenorm) at each sequence's last real row, [size, H] each."""
        b, t = self._inputs.buffers, size * self.q
        ints = b["ints"]
        ctx = ForwardContext(positions=ints[1, :t], rope_lengths=ints[2, :t], slot_mapping=ints[3, :t],
                             block_tables=tables[:size], seq_lens=b["seq_lens"][:size],
                             query_start_loc=self._query_start_loc[:size + 1], kv_caches=self.kv_caches)
        normed, prenorm = self.head(ints[0, :t], self._features[:t], ctx)  # [t, H] each
        last = b["last"][:size]  # [size]
        return normed.index_select(0, last), prenorm.index_select(0, last)

    def zero_for_capture(self) -> None:
        """Padding rows only (nothing written), as graphs are captured."""
        for buffer in self._inputs.buffers.values():
            buffer.zero_()
        self._inputs.buffers["ints"][2].fill_(1)  # rope lengths of at least 1
        self._inputs.buffers["ints"][3].fill_(-1)  # no key written

    def stage(self, rows: Sequence[CatchUpRow], tables: Sequence[Sequence[int]], size: int) -> None:
        """Stages `rows` (each with its head block table) padded to `size` sequences and queues their upload."""
        q, block_size = self.q, self.block_size
        stage = self._inputs.stage()
        ints, last, seq_lens = (stage[name].numpy() for name in ("ints", "last", "seq_lens"))
        ints[:, :size * q] = np.array([[0], [0], [1], [-1]], dtype=np.int64)
        last[:size], seq_lens[:size] = 0, self.padding_len
        for i, ((tokens, start, features, prompt), table) in enumerate(zip(rows, tables)):
            end = len(tokens) - 1  # positions start..end-1; position j reads token j + 1
            c, lo = end - start, i * q
            ints[0, lo:lo + c] = tokens[start + 1:end + 1]
            ints[1, lo:lo + q] = [*range(start, end), *[end - 1] * (q - c)]
            ints[2, lo:lo + q] = np.maximum(ints[1, lo:lo + q] + 1, prompt)  # step_inputs.rope_length
            ints[3, lo:lo + c] = slots_of(table, start, end, block_size)
            last[i], seq_lens[i] = lo + c - 1, start + q
            self._features[lo:lo + c].copy_(features)
        self._inputs.upload()


def catch_up_row(w, q: int) -> CatchUpRow | None:
    """The catch-up of `w` (eagle3._Drafting, nothing computed this proposal yet) when it is 1..q positions,
    else None."""
    request = w.request
    n = len(request.token_ids)
    if not 0 < n - 1 - w.computed <= q:
        return None
    features = w.features[w.computed - w.first:n - 1 - w.first]  # [c, F]
    return request.token_ids, w.computed, features, len(request.row.prompt_token_ids)
