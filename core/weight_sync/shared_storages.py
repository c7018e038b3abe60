"""The trainer storages a direct sender has shared, and the numbers the engine knows
them by.

A storage is recognised across pushes by identity (torch's ``StorageImpl``, held
weakly: the sender never keeps a trainer tensor alive) and by where its bytes are
(data pointer and size, both recorded after sharing): a storage that was freed,
resized or re-allocated is a new storage with a new number, so an engine can never
read a stale mapping for it. Numbers are never reused by one sender.
"""

from __future__ import annotations

from collections.abc import Iterable

import attrs
import torch
from torch.multiprocessing.reductions import StorageWeakRef

from kvrunner.weight_sync.storage_share import StorageHandle, share_storage


@attrs.define
class _Entry:
    id: int
    ref: StorageWeakRef
    data_ptr: int
    nbytes: int

    def same(self, storage: torch.UntypedStorage) -> bool:
        return (not self.ref.expired() and self.data_ptr == storage.data_ptr()
                and self.nbytes == storage.nbytes())


class SharedStorages:
    """Storage identity -> number, and which numbers the engine holds this push."""

    def __init__(self) -> None:
        self._entries: dict[int, _Entry] = {}  # by the StorageImpl's address
        self._next_id = 0
        self._engine_has: set[int] = set()
        #: handles sent in the current push
        self.new_storages = 0

    def begin(self, engine_holds: Iterable[int]) -> None:
        """A push starts; ``engine_holds``: the numbers the engine still has mapped."""
        self._entries = {k: e for k, e in self._entries.items() if not e.ref.expired()}
        live = {e.id for e in self._entries.values()}
        self._engine_has = live.intersection(engine_holds)
        self.new_storages = 0

    def locate(self, tensor: torch.Tensor) -> tuple[int, StorageHandle | None]:
        """The number of ``tensor``'s storage, and its handle if the engine does not
        hold it yet (sharing it: on the CPU that moves it to shared memory in place)."""
        storage = tensor.untyped_storage()
        entry = self._entries.get(storage._cdata)
        if entry is not None and entry.same(storage) and entry.id in self._engine_has:
            return entry.id, None
        storage_id = entry.id if entry is not None and entry.same(storage) else self._new_id()
        handle = share_storage(storage, storage_id)
        storage = tensor.untyped_storage()  # the CPU share may have moved its bytes
        self._entries[storage._cdata] = _Entry(storage_id, StorageWeakRef(storage),
                                               storage.data_ptr(), storage.nbytes())
        self._engine_has.add(storage_id)
        self.new_storages += 1
        return storage_id, handle

    def forget(self) -> None:
        """The engine holds none of them any more (a failed push, or the close)."""
        self._engine_has = set()

    def _new_id(self) -> int:
        self._next_id += 1
        return self._next_id
