"""One step's metadata as the PyTorch reference ops read it, worked out once and shared by every layer.

A decode step of a small model on the CPU is mostly per-op overhead, so what each layer's attention and KV
write would otherwise derive again from the same step tensors (host copies of the lengths, the slots of every
key, the masks, whether any token skips its KV write) is made once per step: `ForwardContext.plan` builds a
`StepPlan` on first use where the references run (eager CPU tensors) and the wrappers take it as `plan=`.
The GPU kernels need none (their launches stay free of host syncs, for CUDA graphs).
"""

from __future__ import annotations

import torch

from ._eager import runs_reference_directly


class KeyGroup:
    """Sequences whose queries attend in one batched call, their keys padded to the longest (L): the decode
    rows together (B sequences, one query each) or one prefill chunk (one sequence, n queries)."""

    def __init__(self, tables: torch.Tensor, lengths: torch.Tensor, lens: list[int], query_positions: torch.Tensor,
                 block_size: int) -> None:
        # tables: [B, max_blocks] int32; lengths: [B] int32, `lens` the same on the host;
        # query_positions: [B, n] int64, the position of each query in its sequence
        self.lens = lens
        self.longest = max(lens)
        self.query_positions = query_positions
        self._by_window: dict[tuple[int, int], tuple[torch.Tensor | slice, torch.Tensor | None]] = {}
        if self.longest == 0:
            return
        positions = torch.arange(self.longest, device=tables.device)  # [L]
        blocks = tables.index_select(1, positions // block_size).long()  # [B, L]
        self.slots = blocks * block_size + positions % block_size  # [B, L]: the cache slot of each key
        self.key_positions = positions
        self.lengths = lengths

    def keys(self, sliding_window: int, kv_heads: int) -> tuple[torch.Tensor | slice, torch.Tensor | None]:
        """Where to read the keys and the mask, worked out once per step for each sliding window.

        reads: [B * Hk * L] int64, the row of each (sequence, KV head, key) in the cache viewed as
        [slots * Hk, D], so that the keys read come out as [B, Hk, L, D], contiguous per head (a slot stands in
        where a key is hidden from every query of its sequence); or, for one sequence whose keys sit in
        consecutive slots, the slice of those slots, read in place. mask: [B, 1, n, L] float32, additive (0
        where a query sees a key, -inf where not), None where every query sees every key."""
        if (sliding_window, kv_heads) not in self._by_window:
            slots, mask = self.slots, None  # [B, L]
            if min(self.lens) < self.longest or self.query_positions.shape[1] > 1 or \
                    0 < sliding_window < self.longest:  # some query must not see some key
                q_pos = self.query_positions[:, :, None]  # [B, n, 1]
                k_pos = self.key_positions  # [L]
                allowed = k_pos <= q_pos  # [B, n, L]: causal, and not past the sequence's end
                if sliding_window > 0:
                    allowed &= k_pos > q_pos - sliding_window
                # The slot of each sequence's last key (this step's, written before attention reads it) stands in
                # for the keys no query of the sequence may see: a slot no sequence owns may hold anything, NaN
                # included, which the mask would not hide (NaN - inf is NaN, 0 * NaN is NaN), while a finite
                # stand-in's weight is exactly 0.
                last = (self.lengths.long() - 1).clamp_(min=0)[:, None]  # [B, 1]
                slots = torch.where(allowed.any(1), slots, slots.gather(1, last))
                mask = torch.zeros(allowed.shape, dtype=torch.float32, device=allowed.device)
                mask = mask.masked_fill_(~allowed, float("-inf"))[:, None]  # [B, 1, n, L]
            reads: torch.Tensor | slice
            if slots.shape[0] == 1 and bool((slots.diff() == 1).all()):
                # One sequence in consecutive blocks (a lone request's usually are): no copy of its keys.
                first = int(slots[0, 0])
                reads = slice(first, first + self.longest)
            else:
                heads = torch.arange(kv_heads, device=slots.device)[None, :, None]  # [1, Hk, 1]
                reads = (slots[:, None, :] * kv_heads + heads).reshape(-1)  # [B * Hk * L]
            self._by_window[sliding_window, kv_heads] = (reads, mask)
        return self._by_window[sliding_window, kv_heads]


class PagedAttentionPlan:
    """One step's attention metadata as the reference reads it, worked out once for all layers: the host
    copies of the sequence lengths and query starts, and per batched call (the decode rows together, each
    prefill chunk alone) the cache slots of its keys and its masks. The reference makes its own when given
    no `StepPlan`."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 block_size: int) -> None:
        # block_tables: [S, max_blocks] int32; seq_lens: [S] int32; query_start_loc: [S+1] int32
        self.block_tables, self.seq_lens, self.query_start_loc = block_tables, seq_lens, query_start_loc
        self.block_size = block_size
        starts = query_start_loc.tolist()
        lens = seq_lens.tolist()
        decodes = [s for s in range(len(lens)) if starts[s + 1] - starts[s] == 1]
        # Every single-token sequence in one batched call: a decode step costs a few ops per layer, not a few
        # per sequence.
        self.decode_rows: slice | torch.Tensor | None = None  # the decode rows of q (and of the output)
        self.decode: KeyGroup | None = None
        self.decode_only = bool(decodes) and len(decodes) == len(lens)
        if decodes:
            if self.decode_only:  # T == S: query s is token s
                self.decode_rows = slice(0, len(lens))
                tables, lengths = block_tables, seq_lens
            else:
                self.decode_rows = torch.tensor([starts[s] for s in decodes], device=seq_lens.device)
                index = torch.tensor(decodes, device=seq_lens.device)
                tables, lengths = block_tables[index], seq_lens[index]
            self.decode = KeyGroup(tables, lengths, [lens[s] for s in decodes], lengths.long()[:, None] - 1,
                                    block_size)
        # Each prefill chunk (a sequence's last n > 1 tokens) with the rows of its queries.
        self.chunks: list[tuple[slice, KeyGroup]] = []
        for s, seq_len in enumerate(lens):
            n = starts[s + 1] - starts[s]
            if n > 1:
                positions = torch.arange(seq_len - n, seq_len, device=seq_lens.device)[None]  # [1, n]
                self.chunks.append((slice(starts[s], starts[s + 1]), KeyGroup(
                    block_tables[s:s + 1], seq_lens[s:s + 1], [seq_len], positions, block_size)))
        self.num_tokens = starts[-1]

    def describes(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                  block_size: int) -> bool:
        """Whether the plan was made from these very tensors (their values are the caller's promise)."""
        return (self.block_tables is block_tables and self.seq_lens is seq_lens
                and self.query_start_loc is query_start_loc and self.block_size == block_size)


class StepPlan:
    """The reference ops' plan of one step: its attention (`attention`) and whether its slot_mapping holds -1
    entries, tokens that write no KV (`skips_slots`). The wrappers check by identity that they are given the
    tensors the plan was made from; their values must not change while the plan is in use."""

    def __init__(self, block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
                 slot_mapping: torch.Tensor, block_size: int) -> None:
        # block_tables: [S, max_blocks] int32; seq_lens: [S] int32; query_start_loc: [S+1] int32;
        # slot_mapping: [T] int64
        self.attention = PagedAttentionPlan(block_tables, seq_lens, query_start_loc, block_size)
        self.slot_mapping = slot_mapping
        self.skips_slots = slots_skip(slot_mapping)


def slots_skip(slot_mapping: torch.Tensor) -> bool:
    """Whether any token's slot is -1 (padding that writes nothing): one host sync."""
    return bool(slot_mapping.numel()) and int(slot_mapping.min()) < 0


def step_plan(block_tables: torch.Tensor, seq_lens: torch.Tensor, query_start_loc: torch.Tensor,
              slot_mapping: torch.Tensor, block_size: int) -> StepPlan | None:
    """The step's plan where the reference ops run on these tensors (eager CPU), None elsewhere."""
    if not runs_reference_directly(seq_lens):
        return None
    return StepPlan(block_tables, seq_lens, query_start_loc, slot_mapping, block_size)
