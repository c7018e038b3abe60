"""Whether a backend's ``release_cache`` really let its pools go.

``release_cache`` is a promise: drop every reference to the pools. A backend that
keeps one (a list "for reuse", a layer holding a view) frees nothing, and on a GPU
shared with a trainer that memory is lost to it. So before a release the core takes
a weak reference to the storage of every pool each backend allocated; once the core
has dropped its own references and collected garbage, a storage still alive is
memory the backend kept. The same record says what the release freed: the bytes of
the storages that are gone, measured, not the bytes the specs declare.
"""

from __future__ import annotations

from collections.abc import Mapping

import attrs
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from kvrunner import process_heap
from kvrunner.plugin_api.errors import BackendError


@attrs.frozen
class _Watched:
    backend: str
    pool: str
    ref: StorageWeakRef
    nbytes: int


class PoolRelease:
    """Weak references to the storage of every pool, by the backend that allocated it."""

    def __init__(self, pools: Mapping[str, torch.Tensor]) -> None:
        """:param pools: ``"<backend>.<name>"`` -> pool, as ``allocate_cache`` returned
            them; storages shared by several pools count once."""
        self._watched: list[_Watched] = []
        seen: set[tuple[str, int]] = set()
        for qualified, pool in pools.items():
            storage = pool.untyped_storage()
            key = (str(pool.device), storage.data_ptr())
            if key in seen:
                continue
            seen.add(key)
            backend, _, name = qualified.partition(".")
            self._watched.append(_Watched(backend, name, StorageWeakRef(storage), storage.nbytes()))

    def kept(self, *, collected: bool = False) -> dict[str, list[tuple[str, int]]]:
        """``backend -> [(pool, bytes)]`` for each storage still alive.

        :param collected: the caller ran a full collection after dropping its own
            references (a sleep does, to return the memory); else this collects first.
            A full collection walks the whole process heap, which in a trainer's
            process can take a second, so a sleep runs one, not two.
        """
        if not collected:
            process_heap.collect()  # layers and graphs hold reference cycles
        kept: dict[str, list[tuple[str, int]]] = {}
        for w in self._watched:
            if not w.ref.expired():
                kept.setdefault(w.backend, []).append((w.pool, w.nbytes))
        return kept

    def freed_bytes(self) -> int:
        """Bytes of the watched storages that are gone."""
        return sum(w.nbytes for w in self._watched if w.ref.expired())

    def require_released(self, *, collected: bool = False) -> None:
        """Raise :class:`~kvrunner.plugin_api.BackendError` naming each backend whose
        release kept a pool's storage alive (``collected``: as :meth:`kept` takes it)."""
        kept = self.kept(collected=collected)
        if not kept:
            return
        parts = []
        for backend, pools in sorted(kept.items()):
            mib = sum(n for _, n in pools) / 2**20
            names = ", ".join(name for name, _ in pools)
            parts.append(f"backend {backend!r}: release_cache kept {mib:.1f} MiB of its "
                         f"pools alive ({names})")
        raise BackendError(
            "; ".join(parts) + ". The sleep freed none of that memory: release_cache must "
            "drop every reference to the tensors allocate_cache returned (layers look "
            "their pool up again on the next forward)"
        )
