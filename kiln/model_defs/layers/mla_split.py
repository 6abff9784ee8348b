"""Which sequences of an eager step MLA computes in the explicit form, worked out once per step for all layers.

Absorbed attention (mla.py) costs per (query, key) pair a dot and an accumulation of width kv_lora_rank + rope
(576 for DeepSeek, ~3.4x the explicit form's 192 + 128), while the explicit form pays once per key for the
up-projection of its latent (one GEMM, [L, r] x [r, Hl (dn + dv)]) and then runs ordinary causal attention,
on CUDA the flash kernel. A long prompt has many queries per key, so it is computed explicitly; a decode row,
a verify step's few drafts or a short chunk over a long prefix has few, and stays absorbed.

`ForwardContext.mla_split` makes the `MLASplit` from the host lists `build_context` sets (each sequence's query
count and key count): the explicit sequences' rows and cache slots, and the absorbed rest as its own smaller
step (rows, block tables, lengths, query starts, reference plan). A context without the host lists (every
CUDA-graph context) or with tree drafts has no split: everything stays absorbed.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import cached_property

import torch

from kiln.plugins.host_tensors import to_device
from kiln.plugins.step_plan import StepPlan, step_plan

# A sequence with at least this many query tokens in the step is computed in the explicit form. The explicit
# form's up-projection of every key (prefix included) is paid back by the cheaper attention only where each key
# serves many queries; below a few dozen queries the absorbed kernel's extra width is the smaller cost and the
# up-projected keys' memory is not worth spending. The crossover depends on the GPU and the prefix length;
# 32 keeps decode, speculative verify rows and short chunks absorbed.
EXPLICIT_MIN_QUERY = 32


@dataclass(frozen=True)
class ExplicitSequence:
    """One sequence computed in the explicit form: its queries are the packed rows `rows` (its last
    positions), its keys the rows `keys` of `MLASplit.key_slots`."""

    rows: slice  # n rows of the packed batch
    seq_len: int  # L: keys after the step (cached prefix, earlier chunks and this step's own tokens)
    keys: slice  # L entries of key_slots


class AbsorbedSubset:
    """The step's other sequences as a step of their own, for `mla_attention`."""

    def __init__(self, sequences: list[int], query_lens: tuple[int, ...], starts: list[int],
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                 block_size: int) -> None:
        device = seq_lens.device
        rows = [r for s in sequences for r in range(starts[s], starts[s + 1])]
        self.rows = to_device(rows, torch.int64, device)  # [Ta]: their rows in the packed batch
        index = to_device(sequences, torch.int64, device)  # [Sa]
        self.block_tables = block_tables.index_select(0, index)  # [Sa, max_blocks] int32
        self.seq_lens = seq_lens.index_select(0, index)  # [Sa] int32
        loc = [0]
        for s in sequences:
            loc.append(loc[-1] + query_lens[s])
        self.query_start_loc = to_device(loc, torch.int32, device)  # [Sa + 1]
        self._slot_mapping = slot_mapping
        self._block_size = block_size

    @cached_property
    def plan(self) -> StepPlan | None:
        """The subset's reference plan (eager CPU), made on first use and shared by every layer."""
        return step_plan(self.block_tables, self.seq_lens, self.query_start_loc,
                         self._slot_mapping.index_select(0, self.rows), self._block_size)


class MLASplit:
    """One step's sequences split by form. `explicit`: the sequences of at least EXPLICIT_MIN_QUERY queries;
    `key_slots` [sum L] int64: the cache slot of each of their keys, sequence after sequence; `absorbed`: the
    rest (None where there is none)."""

    def __init__(self, explicit: list[int], query_lens: tuple[int, ...], host_seq_lens: tuple[int, ...],
                 block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor,
                 block_size: int) -> None:
        starts = [0]
        for n in query_lens:
            starts.append(starts[-1] + n)
        self.num_tokens = starts[-1]
        sequences, slots, first = [], [], 0
        offsets = torch.arange(block_size, device=block_tables.device)  # [block_size]
        for s in explicit:
            length = host_seq_lens[s]
            sequences.append(ExplicitSequence(slice(starts[s], starts[s + 1]), length, slice(first, first + length)))
            first += length
            blocks = block_tables[s, :-(-length // block_size)].long()  # [ceil(L / block_size)]
            slots.append((blocks[:, None] * block_size + offsets).reshape(-1)[:length])  # [L]
        self.explicit = tuple(sequences)
        self.key_slots = slots[0] if len(slots) == 1 else torch.cat(slots)  # [sum L] int64
        chosen = set(explicit)
        rest = [s for s in range(len(query_lens)) if s not in chosen]
        self.absorbed = AbsorbedSubset(rest, query_lens, starts, block_tables, seq_lens, slot_mapping,
                                       block_size) if rest else None


def mla_split(host_query_lens: tuple[int, ...] | None, host_seq_lens: tuple[int, ...] | None,
              block_tables: torch.Tensor, seq_lens: torch.Tensor, slot_mapping: torch.Tensor, block_size: int,
              tree: bool) -> MLASplit | None:
    """The step's split, or None where every sequence stays absorbed: the host lists unknown (CUDA-graph
    contexts), a tree-verify step (`tree`), or no sequence of EXPLICIT_MIN_QUERY queries."""
    if host_query_lens is None or host_seq_lens is None or tree:
        return None
    explicit = [s for s, n in enumerate(host_query_lens) if n >= EXPLICIT_MIN_QUERY]
    if not explicit:
        return None
    return MLASplit(explicit, host_query_lens, host_seq_lens, block_tables, seq_lens, slot_mapping, block_size)
