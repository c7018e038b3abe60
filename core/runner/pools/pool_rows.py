"""A pool seen row by row: each KV slot's or each request slot's bytes, and their checksums.

The core never knows how a backend lays out its pools. What it does know is the
factory's ``cache_rows(pool_name, pool)``: a view whose row ``i`` is everything the
pool holds for KV slot ``i`` (``"kv"``) or request slot ``i`` (``"state"``). Through
it the step audit asks one question of every pool after a step: which rows changed?
It answers with two checksums per row (:func:`row_checksums`): the sum of the row's
raw words and their position-weighted sum, so a changed word and a moved word both
show, and NaN bit patterns compare as they sit in memory.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch

from kvrunner.layers.fused.dispatch import use_triton
from kvrunner.plugin_api.errors import BackendError
from kvrunner.plugin_api.factory import CacheRows

#: integer views of a row's elements, by element size: raw bits, whatever the dtype
_WORDS = {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}
#: elements widened to int64 at once: bounds the temporaries to 2 x 64 MiB
GROUP_ELEMENTS = 1 << 23
#: the two kinds of row a pool can have
ROW_KINDS = ("kv", "state")


@attrs.frozen
class PoolRows:
    """One pool through its backend's ``cache_rows``: ``rows[i]`` is slot ``i``'s bytes."""

    #: ``"<backend>.<buffer>"``, as the pools are keyed
    pool_name: str
    backend: str
    #: the pool's name within its backend (``"kv.3"``)
    buffer: str
    #: ``"kv"`` (row ``i`` is KV slot ``i``) or ``"state"`` (row ``i`` is request slot ``i``)
    kind: str
    #: a view of the pool, one row per slot
    rows: torch.Tensor

    @property
    def layer(self) -> int | None:
        """The model layer the buffer name ends with (``"kv.3"`` -> 3), where it says one."""
        tail = self.buffer.rsplit(".", 1)[-1]
        return int(tail) if tail.isdigit() else None


def pool_rows(pools: Mapping[str, torch.Tensor], cache_rows: Mapping[str, CacheRows]
              ) -> list[PoolRows]:
    """Every pool in ``pools`` (``"<backend>.<buffer>"``) through its backend's
    ``cache_rows``; a backend whose ``cache_rows`` answers with anything but a view
    of the pool, in one of the two kinds, is refused (a copy would hide every write)."""
    seen = []
    for pool_name, pool in pools.items():
        backend, buffer = pool_name.split(".", 1)
        kind, rows = cache_rows[backend](buffer, pool)
        if kind not in ROW_KINDS:
            raise BackendError(
                f"backend {backend!r}: cache_rows gave kind {kind!r} for pool {buffer!r}; "
                f"it must be one of {ROW_KINDS}"
            )
        if not _is_view_of(rows, pool):
            raise BackendError(
                f"backend {backend!r}: cache_rows({buffer!r}, pool) returned a tensor that "
                f"is not a view of the pool (a copy, or another tensor): the audit and the "
                f"kit read the pool through it, so a copy would hide every write; return "
                f"pool.permute/view/transpose(...) instead"
            )
        seen.append(PoolRows(pool_name, backend, buffer, kind, rows))
    return seen


def _is_view_of(rows: torch.Tensor, pool: torch.Tensor) -> bool:
    """Whether ``rows`` reads ``pool``'s memory (same storage, every element within it)."""
    if not isinstance(rows, torch.Tensor) or rows.ndim < 1:
        return False
    storage = pool.untyped_storage()
    if rows.untyped_storage().data_ptr() != storage.data_ptr() or rows.device != pool.device:
        return False
    return rows.numel() <= pool.numel() and rows.element_size() == pool.element_size()


def row_checksums(rows: torch.Tensor) -> torch.Tensor:
    """``[num_rows, 2]`` int64: each row's sum of raw words and their position-weighted
    sum (wrapping; positions in the row-major order of the view), computed where
    ``rows`` lives: one Triton pass over the strided rows where Triton runs, else in
    groups of rows whose widened copy stays under :data:`GROUP_ELEMENTS` elements."""
    num_rows = rows.shape[0]
    width = rows[0].numel() if num_rows else 0
    out = torch.zeros((num_rows, 2), dtype=torch.int64, device=rows.device)
    if width == 0:
        return out
    word = _WORDS[rows.element_size()]
    if use_triton(rows):
        from kvrunner.runner.pools.row_checksums_triton import inner_dims, row_checksums_triton

        dims = inner_dims(rows)
        if dims is not None:
            return row_checksums_triton(rows.view(word), dims)
    weight = torch.arange(1, width + 1, dtype=torch.int64, device=rows.device)
    per_group = max(GROUP_ELEMENTS // width, 1)
    for first in range(0, num_rows, per_group):
        last = min(first + per_group, num_rows)
        # reshape copies a strided group only; view(word) reinterprets the bits in place
        wide = rows[first:last].reshape(last - first, width).view(word).to(torch.int64)
        out[first:last, 0] = wide.sum(dim=1)
        out[first:last, 1] = (wide * weight).sum(dim=1)
    return out
