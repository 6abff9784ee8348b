"""A request's block table as the block manager hands it out: a snapshot that is shared, not copied (plain
Python, no torch).

A table only grows at its end while a request runs (a block every `block_size` tokens), so copying it into
every step would make the host's work per request grow with its context. Instead the block manager keeps each
table in a list it only ever appends to, and a `BlockTable` reads the first `len` entries of that list: later
appends do not change it. A table that loses blocks (`BlockManager.trim`) continues in a new list, and a
request that is freed and scheduled again (preemption) starts a new one.

Every such list has its own `stamp` (unique in the process, never 0). Two BlockTables with the same stamp
agree on every position both hold, so whoever keeps a copy of a table's first k blocks brings it up to date
with `since(k)`, the blocks added after them (`block_table_mirror.py` does that for the runner).
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator, Sequence

_stamps = itertools.count(1)


def new_stamp() -> int:
    """A stamp no other block list of this process has had."""
    return next(_stamps)


class BlockTable(Sequence[int]):
    """The first `length` entries of `ids`, a list its owner only appends to; `stamp` names that list (0: a
    table with no such list behind it, which nobody can bring up to date incrementally). Compares equal to a
    tuple of the same blocks, and pickles as one (with its stamp)."""

    __slots__ = ("_ids", "_len", "stamp")

    def __init__(self, ids: list[int], length: int | None = None, stamp: int = 0) -> None:
        self._ids = ids
        self._len = len(ids) if length is None else length
        self.stamp = stamp

    def since(self, start: int) -> list[int]:
        """The blocks from index `start` on (those a copy of the first `start` blocks lacks)."""
        return self._ids[start:self._len]

    def __len__(self) -> int:
        return self._len

    def __getitem__(self, index):
        if isinstance(index, slice):
            return tuple(self._ids[:self._len][index])
        if index < 0:
            index += self._len
        if not 0 <= index < self._len:
            raise IndexError("block table index out of range")
        return self._ids[index]

    def __iter__(self) -> Iterator[int]:
        return itertools.islice(self._ids, self._len)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, BlockTable):
            if other._ids is self._ids:
                return other._len == self._len
            return self._ids[:self._len] == other._ids[:other._len]
        if isinstance(other, tuple):
            return tuple(self._ids[:self._len]) == other
        return NotImplemented

    def __hash__(self) -> int:
        return hash(tuple(self._ids[:self._len]))

    def __repr__(self) -> str:
        return f"BlockTable({self._ids[:self._len]}, stamp={self.stamp})"

    def __reduce__(self):
        # Only the blocks it holds travel (to a tensor-parallel rank): the rank's mirror keys on the stamp.
        return BlockTable, (self._ids[:self._len], self._len, self.stamp)
