"""The trainer storages an engine has mapped for direct pushes, kept across pushes.

Mapping a CUDA IPC handle costs time, and a trainer's parameters keep their storages
from step to step (an optimizer updates them in place), so the engine keeps what a
direct push mapped (:class:`SenderStorages`, one per sender) and the next push from
the same sender names those storages by number: it sends only metadata. The rule
(docs/weight_sync.md, "The mapped storages"):

* a push starts by taking its sender's storages (:meth:`MappedStorages.take`), and
  the engine tells the sender which numbers it holds; any other storage comes with
  its handle;
* at the end of a successful push the engine keeps exactly the storages that push
  named (a storage not seen is unmapped: the sender dropped or replaced it), and the
  push's connection stays open as the *lease* on them (:meth:`MappedStorages.keep`);
* they are all unmapped when the push fails, when the sender sends ``Release``
  (:meth:`DirectSender.close`) or its process goes away (the lease's connection
  closes), and when the engine shuts down (:meth:`MappedStorages.close`).

A daemon thread per lease waits on its connection (and on a wake-up pipe, so that
the next push takes the storages back at once); it touches nothing but the lease.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection, wait

import torch

from kvrunner.weight_sync import messages
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.layout import TensorSlot
from kvrunner.weight_sync.messages import Release, Released, SharedTensor
from kvrunner.weight_sync.storage_share import StorageHandle, open_storage


class SenderStorages:
    """The storages one sender's pushes have mapped: storage number -> flat bytes."""

    def __init__(self, sender: str) -> None:
        self.sender = sender
        self.mapped: dict[int, torch.Tensor] = {}
        #: numbers the current push has named (what :meth:`retain_named` keeps)
        self.named: set[int] = set()
        #: how many storages the current push mapped (0 in a steady-state push)
        self.newly_mapped = 0

    def begin(self) -> None:
        """A push starts: nothing named yet."""
        self.named, self.newly_mapped = set(), 0

    def map(self, handles: tuple[StorageHandle, ...], *, where: str) -> None:
        """Map every storage ``handles`` names (one the engine held is replaced)."""
        if not isinstance(handles, tuple):
            raise WeightSyncError(f"{where}: storages must be a tuple of StorageHandle")
        for handle in handles:
            if not isinstance(handle, StorageHandle) or not isinstance(handle.id, int):
                raise WeightSyncError(f"{where}: a storage handle is a "
                                      f"{type(handle).__name__}, not a StorageHandle")
            self.mapped[handle.id] = open_storage(handle)
            self.newly_mapped += 1

    def views(self, tensors: tuple[SharedTensor, ...], *, where: str
              ) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` read in place from the mapped storages; every tensor is
        checked (its storage mapped, its bytes inside it) before any view is made."""
        if not isinstance(tensors, tuple):
            raise WeightSyncError(f"{where}: tensors must be a tuple of SharedTensor")
        for i, tensor in enumerate(tensors):
            if not (isinstance(tensor, SharedTensor) and isinstance(tensor.slot, TensorSlot)):
                raise WeightSyncError(f"{where}, tensor {i} is a {type(tensor).__name__}, "
                                      f"not a SharedTensor of a TensorSlot")
            flat = self.mapped.get(tensor.storage) if isinstance(tensor.storage, int) else None
            if flat is None:
                raise WeightSyncError(
                    f"{where}, tensor {tensor.slot.name!r}: storage {tensor.storage!r} is "
                    f"not mapped (its handle never came, or the engine let it go)")
            tensor.slot.check(flat.numel(), where=f"{where}, storage {tensor.storage}")
        self.named.update(t.storage for t in tensors)
        return [(t.slot.name, t.slot.view(self.mapped[t.storage])) for t in tensors]

    def retain_named(self) -> None:
        """Keep only the storages the push named: any other was dropped or replaced by
        the sender, and its memory is the trainer's to free."""
        for storage_id in set(self.mapped) - self.named:
            del self.mapped[storage_id]

    def release(self) -> None:
        """Unmap everything (the trainer may then free the memory)."""
        self.mapped.clear()
        self.named = set()


class _Lease:
    """A sender's storages between its pushes, and the connection that holds them."""

    def __init__(self, storages: SenderStorages, conn: Connection,
                 forget: Callable[[_Lease], None]) -> None:
        self.storages = storages
        self._conn = conn
        self._forget = forget
        self._lock = threading.Lock()
        self._taken = False  # the next push took the storages back
        self._ended = False  # the sender released them or went away
        self._wake_read, self._wake_write = os.pipe()
        self._thread = threading.Thread(target=self._watch, daemon=True,
                                        name=f"kvrunner-lease-{storages.sender[:8]}")
        self._thread.start()

    def take(self) -> SenderStorages | None:
        """Stop watching and hand the storages back (None: they were released)."""
        with self._lock:
            if self._ended:
                return None
            self._taken = True
        os.write(self._wake_write, b"x")
        self._thread.join()
        return self.storages

    def _watch(self) -> None:
        try:
            wait([self._conn, self._wake_read])
            with self._lock:
                if self._taken:
                    return
                self._ended = True
            try:  # Release, or the sender's process is gone (EOF): unmap either way
                message = messages.receive(self._conn, 1.0, waiting_for="a Release")
            except WeightSyncError:
                message = None
            self.storages.release()
            self._forget(self)
            if isinstance(message, Release):
                with contextlib.suppress(WeightSyncError):
                    messages.send(self._conn, Released())
        finally:
            self._conn.close()
            os.close(self._wake_read)
            os.close(self._wake_write)


class MappedStorages:
    """One engine's mapped trainer storages, by sender (see the module's rule)."""

    def __init__(self) -> None:
        self._leases: dict[str, _Lease] = {}
        self._lock = threading.Lock()

    def take(self, sender: str) -> SenderStorages:
        """The storages ``sender``'s earlier pushes left mapped (empty if none), for
        the push now starting; the lease on them ends."""
        with self._lock:
            lease = self._leases.pop(sender, None)
        storages = lease.take() if lease is not None else None
        storages = storages if storages is not None else SenderStorages(sender)
        storages.begin()
        return storages

    def keep(self, storages: SenderStorages, conn: Connection) -> bool:
        """After a successful push: keep the storages it named, held by ``conn`` (the
        push's connection, which this now owns). False (and ``conn`` closed) if none
        is left to keep."""
        storages.retain_named()
        if not storages.mapped:
            conn.close()
            return False
        with self._lock:
            self._leases[storages.sender] = _Lease(storages, conn, self._forget)
        return True

    def held(self) -> dict[str, int]:
        """How many storages are mapped, by sender (between pushes)."""
        with self._lock:
            return {s: len(lease.storages.mapped) for s, lease in self._leases.items()}

    def _forget(self, lease: _Lease) -> None:
        with self._lock:
            if self._leases.get(lease.storages.sender) is lease:
                del self._leases[lease.storages.sender]

    def close(self) -> None:
        """Unmap everything (the engine shuts down; idempotent)."""
        with self._lock:
            leases, self._leases = list(self._leases.values()), {}
        for lease in leases:
            storages = lease.take()
            if storages is not None:
                storages.release()
