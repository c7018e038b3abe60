"""The tokens each constrained row of a step may sample, as packed bitmasks.

The engine fills one row per sampled row whose request has a structured-output
constraint (``engine/step_grammars.py``) before the step is launched; the sampler sets
every other token of those rows to -inf (``layers/token_mask.py``). A step without such
a row carries none, so the common step costs nothing.

The layout is xgrammar's: row ``k`` is ``ceil(vocab / 32)`` int32 words and bit ``j`` of
word ``w`` allows token ``32 * w + j``. No torch here: the masks cross to the runner as
two numpy arrays.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import numpy as np


def mask_width(vocab_size: int) -> int:
    """How many int32 words hold one row's mask over ``vocab_size`` tokens."""
    return -(-vocab_size // 32)


@attrs.frozen(eq=False)
class TokenMasks:
    """The masks of some rows of a step's sampling columns."""

    #: [k] int64, ascending: the rows (of the sampling columns) the masks constrain
    rows: np.ndarray
    #: [k, words] int32: each row's allowed tokens, one bit a token
    bits: np.ndarray

    def __attrs_post_init__(self) -> None:
        if self.bits.dtype != np.int32 or self.bits.ndim != 2 or len(self.bits) != len(self.rows):
            raise ValueError(
                f"token masks of {len(self.rows)} rows need an int32 array of shape "
                f"({len(self.rows)}, words), got {self.bits.dtype} {self.bits.shape}"
            )
        if len(self.rows) > 1 and not (np.diff(self.rows) > 0).all():
            raise ValueError(f"token mask rows must ascend, got {self.rows.tolist()}")

    def take(self, index: np.ndarray | Sequence[int]) -> TokenMasks | None:
        """The masks of the rows ``index`` picks, renumbered as ``take`` renumbers the
        sampling columns (position in ``index``); None when it picks no masked row."""
        index = np.asarray(index, np.int64)
        at = np.searchsorted(self.rows, index)
        hit = at < len(self.rows)
        hit[hit] = self.rows[at[hit]] == index[hit]
        if not hit.any():
            return None
        return TokenMasks(np.flatnonzero(hit).astype(np.int64), self.bits[at[hit]])

    def allows(self, row: int, token: int) -> bool:
        """Whether row ``row`` of the step may sample ``token`` (True for a row without
        a mask)."""
        k = np.searchsorted(self.rows, row)
        if k == len(self.rows) or self.rows[k] != row:
            return True
        return bool((int(self.bits[k, token // 32]) >> (token % 32)) & 1)

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, TokenMasks):
            return NotImplemented
        return np.array_equal(self.rows, other.rows) and np.array_equal(self.bits, other.bits)

    __hash__ = None  # type: ignore[assignment]  # arrays, like a list

    def __repr__(self) -> str:
        return f"TokenMasks(rows={self.rows.tolist()!r}, words={self.bits.shape[1]})"

    def __reduce__(self) -> tuple:
        return (TokenMasks, (self.rows, self.bits))
