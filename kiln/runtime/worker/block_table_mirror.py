"""The runner's host copy of the block tables it was given, brought up to date by what each table gained.

A request's table grows by one block every `block_size` tokens, yet a step needs the whole table of every
request, padded into one [S, width] int32 array. Building that array from Python ints each step costs the
host time proportional to every request's context; here each table (by its `BlockTable.stamp`) keeps a row
of its own across steps, so a step writes only the blocks each table gained since the mirror last saw it,
then copies the step's rows into schedule order in one numpy gather (a memcpy, not per-block Python work).
A row belongs to a table, not to a batch position: when a request ends and the others move up in the
batch, their rows stay put.

A table that lost blocks (rejected drafts) or was freed and allocated again (preemption) has a new stamp:
it gets a new row, written whole, and the old one is reused when rows run short (least recently used
first, never one that the last few gathers used). A table without a stamp (any plain sequence of block ids)
is written whole into the output.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence

import numpy as np

# A row used by one of the last this many gathers is not taken for another table: the mirror grows instead.
# Engines that take turns with one mirror (a draft model's steps between the target's) keep their rows.
RECENT_GATHERS = 8


class BlockTableMirror:
    """Rows of block ids, one per table seen lately, each its table's first blocks then zeros. Grows its rows
    when the recent gathers need more than it has, and its columns for a longer table (`num_rows` and
    `num_cols` are a start). Not thread-safe: one per stepping thread."""

    def __init__(self, num_rows: int = 0, num_cols: int = 0) -> None:
        self._array = np.zeros((num_rows, num_cols), dtype=np.int32)  # [rows, cols] int32
        self._filled = [0] * num_rows  # per row: how many leading entries may be nonzero
        self._free = list(range(num_rows - 1, -1, -1))
        # stamp -> [row, gather that last used it]; least recently used first.
        self._rows: OrderedDict[int, list[int]] = OrderedDict()
        self._gathers = 0

    @property
    def num_rows(self) -> int:
        return self._array.shape[0]

    def gather(self, tables: Sequence[Sequence[int]], width: int | None = None,
               out: np.ndarray | None = None) -> np.ndarray:
        """The tables as one int32 array [len(tables), width], row i = tables[i] padded with zeros; `width`
        defaults to the longest table (a longer table is a ValueError). With `out` (int32 [len(tables), >=
        width], e.g. a pinned staging buffer) it is written into out[:, :width] and that view returned; the
        columns past it are left as they are."""
        self._gathers += 1
        gather = self._gathers
        rows, filled = self._rows, self._filled
        index = [0] * len(tables)
        loose: list[int] = []  # tables without a stamp
        longest = 0
        for i, table in enumerate(tables):
            n = len(table)
            if n > longest:
                longest = n
            stamp = getattr(table, "stamp", 0)
            if not stamp:
                loose.append(i)
                continue
            entry = rows.get(stamp)
            if entry is not None:
                rows.move_to_end(stamp)
                entry[1] = gather
                row = entry[0]
                have = filled[row]
                if n > have:  # the same list, longer now: only the blocks it gained
                    self._write(row, have, table.since(have))  # type: ignore[attr-defined]
                elif n < have:
                    self._array[row, n:have] = 0
            else:
                row = self._take_row(gather)
                rows[stamp] = [row, gather]
                have = filled[row]
                self._write(row, 0, table.since(0))  # type: ignore[attr-defined]
                if have > n:  # what the row's previous table left past this one's end
                    self._array[row, n:have] = 0
            filled[row] = n
            index[i] = row
        if width is None:
            width = longest
        if longest > width or (out is not None and longest > out.shape[1]):
            raise ValueError(f"a block table of {longest} blocks does not fit a width of "
                             f"{width if out is None else min(width, out.shape[1])}")
        if self._array.shape[1] < width:
            self._grow(self.num_rows, width)
        out = np.empty((len(tables), width), dtype=np.int32) if out is None else out[:, :width]
        if len(loose) < len(tables):  # mode="clip": the rows are valid, and numpy then writes `out` directly
            np.take(self._array[:, :width], index, axis=0, out=out, mode="clip")
        for i in loose:
            table = tables[i]
            out[i, :len(table)] = table
            out[i, len(table):] = 0
        return out

    def _write(self, row: int, start: int, blocks: list[int]) -> None:
        end = start + len(blocks)
        if end > self._array.shape[1]:
            self._grow(self.num_rows, max(end, 2 * self._array.shape[1]))
        self._array[row, start:end] = blocks

    def _take_row(self, gather: int) -> int:
        """A row for a new table: a free one, else the least recently used one unless a recent gather used it
        (then the mirror grows)."""
        if not self._free:
            stamp, (row, last) = next(iter(self._rows.items()), (0, (0, gather)))
            if last <= gather - RECENT_GATHERS:
                del self._rows[stamp]
                return row
            self._grow(max(2 * self.num_rows, 16), self._array.shape[1])
        return self._free.pop()

    def _grow(self, num_rows: int, num_cols: int) -> None:
        old = self._array
        self._array = np.zeros((num_rows, num_cols), dtype=np.int32)
        self._array[:old.shape[0], :old.shape[1]] = old
        self._free.extend(range(num_rows - 1, old.shape[0] - 1, -1))
        self._filled.extend([0] * (num_rows - old.shape[0]))
