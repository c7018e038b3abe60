"""Every running sequence's block table, kept in place in one preallocated array.

The block manager grows a sequence's table by a block every ``block_size`` tokens,
yet a step needs every table of the batch. Rebuilding them from the sequences' lists
each step (a tuple per sequence, then flattened again by the runner) cost about a
microsecond per sequence per step; here each table has a row of its own for as long
as the sequence holds blocks, is written only when it changes, and a step's tables
are one numpy gather (:meth:`TableRows.gather`).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from kvrunner.engine.step_io import BlockTables

#: rows and columns the array starts with; both double when outgrown
_INITIAL_ROWS, _INITIAL_WIDTH = 64, 16


class TableRows:
    """Block tables by row: row ``r`` holds ``lens[r]`` block ids, then zeros.

    Invariant (property-tested against the sequences' ``block_table`` lists): every
    entry past a row's length is 0, so a gathered slice is already the zero-padded
    array the runner reads, and a released row is all zeros.
    """

    def __init__(self) -> None:
        self.array = np.zeros((_INITIAL_ROWS, _INITIAL_WIDTH), np.int32)
        self.lens = np.zeros(_INITIAL_ROWS, np.int64)
        # Any free row will do (the runner never sees row ids): a stack.
        self._free: list[int] = list(range(_INITIAL_ROWS - 1, -1, -1))

    @property
    def num_rows_held(self) -> int:
        return len(self.array) - len(self._free)

    def acquire(self, blocks: Sequence[int]) -> int:
        """A row holding ``blocks``; its id."""
        if not self._free:
            self._grow_rows()
        row = self._free.pop()
        self.extend(row, blocks)
        return row

    def extend(self, row: int, blocks: Sequence[int]) -> None:
        """Append ``blocks`` to row ``row``'s table."""
        start = int(self.lens[row])
        end = start + len(blocks)
        if end > self.array.shape[1]:
            self._grow_width(end)
        self.array[row, start:end] = blocks
        self.lens[row] = end

    def release(self, row: int) -> None:
        """Empty row ``row`` (zeros again) and hand it back."""
        self.array[row, : self.lens[row]] = 0
        self.lens[row] = 0
        self._free.append(row)

    def table(self, row: int) -> list[int]:
        """Row ``row``'s block ids."""
        return self.array[row, : self.lens[row]].tolist()

    def gather(self, rows: Sequence[int]) -> BlockTables:
        """The tables of ``rows``, in that order, as a step carries them (a copy: the
        step keeps them after the rows change)."""
        return self.gather_rows(np.fromiter(rows, np.intp, len(rows)))

    def gather_rows(self, index: np.ndarray) -> BlockTables:
        """:meth:`gather` for rows already in an integer array."""
        lens = self.lens[index]
        width = max(int(lens.max(initial=0)), 1)
        return BlockTables(self.array[index, :width], lens)

    def _grow_rows(self) -> None:
        old = len(self.array)
        self.array = np.concatenate([self.array, np.zeros_like(self.array)])
        self.lens = np.concatenate([self.lens, np.zeros_like(self.lens)])
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def _grow_width(self, needed: int) -> None:
        width = self.array.shape[1]
        while width < needed:
            width *= 2
        grown = np.zeros((len(self.array), width), np.int32)
        grown[:, : self.array.shape[1]] = self.array
        self.array = grown
