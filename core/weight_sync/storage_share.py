"""A trainer tensor's own storage, shared with the engine's process in place.

The direct push (:class:`~kvrunner.weight_sync.direct_sender.DirectSender`) does not
pack the trainer's tensors: it hands the engine each tensor's storage, which the
engine maps once (:func:`open_storage`) and copies out of straight into its weights.
A :class:`StorageHandle` is plain picklable data naming the memory.

- On CUDA it is torch's CUDA IPC description of the storage
  (``torch.multiprocessing.reductions.reduce_tensor`` of a flat byte view over it),
  opened in the engine on the device with the same UUID. torch's IPC reference
  counting applies: the trainer's process keeps a shared block alive (in its
  "limbo", even after the trainer drops the tensor) while the engine holds the
  mapping; once the engine lets the mapping go, ``torch.cuda.ipc_collect()`` (or the
  allocator, when an allocation would fail) frees it.
- On the CPU the storage is moved to shared memory in place, once
  (``UntypedStorage._share_filename_cpu_``, the ``file_system`` form of
  ``share_memory_()``: every tensor on the storage follows it), and the handle names
  the segment, which torch's shared-memory manager unlinks once neither process
  holds it.
"""

from __future__ import annotations

from typing import Any

import attrs
import torch

from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.shared_buffer import device_uuid, local_cuda_index


@attrs.frozen
class StorageHandle:
    """What the engine needs to map one trainer storage: the sender's number for it
    (how later pushes name it), its kind, its size, and the payload."""

    #: the sender's number for this storage, never reused by that sender
    id: int
    #: "cuda" or "cpu"
    kind: str
    nbytes: int
    #: cpu: (manager socket, segment name, size); cuda: torch's rebuild arguments
    payload: Any
    #: cuda: the UUID of the trainer's device (to find it under the engine's numbering)
    device_uuid: str = ""


def flat_bytes(storage: torch.UntypedStorage) -> torch.Tensor:
    """A flat uint8 tensor over the whole of ``storage``."""
    flat = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return flat.set_(storage, 0, (storage.nbytes(),), (1,))


def share_storage(storage: torch.UntypedStorage, storage_id: int) -> StorageHandle:
    """Share ``storage`` with another process (on the CPU: moved to shared memory in
    place first, if it is not there yet); returns its handle.

    On CUDA each call hands out one IPC reference, which the engine's mapping holds
    and gives back when it is released: call this once per mapping the engine makes
    (the sender shares a storage only when the engine does not hold it)."""
    device = storage.device
    if device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        _, args = reduce_tensor(flat_bytes(storage))
        return StorageHandle(storage_id, "cuda", storage.nbytes(), args,
                             device_uuid(device.index))
    if device.type == "cpu":
        manager, name, size = storage._share_filename_cpu_()
        return StorageHandle(storage_id, "cpu", storage.nbytes(), (manager, name, size))
    raise WeightSyncError(f"a storage on {device} cannot be shared; the direct push takes "
                          f"CUDA or CPU tensors")


def open_storage(handle: StorageHandle) -> torch.Tensor:
    """Map the storage ``handle`` names: a flat uint8 tensor of ``handle.nbytes``
    (the engine only reads it). Dropping every reference to it releases the mapping."""
    if not (isinstance(handle, StorageHandle) and isinstance(handle.nbytes, int)
            and handle.nbytes >= 0):
        raise WeightSyncError(f"a storage handle must be a StorageHandle, got {handle!r:.80}")
    what = f"storage {handle.id!r}"
    if handle.kind == "cpu":
        try:
            manager, name, size = handle.payload
            storage = torch.UntypedStorage._new_shared_filename_cpu(manager, name, size)
        except (RuntimeError, TypeError, ValueError) as e:
            raise WeightSyncError(f"cannot map the trainer's shared memory for {what}: "
                                  f"{e}") from None
    elif handle.kind == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(handle.payload)
        args[6] = local_cuda_index(handle.device_uuid)  # storage_device, in our numbering
        storage = rebuild_cuda_tensor(*args).untyped_storage()
    else:
        raise WeightSyncError(f"{what}: unknown storage kind {handle.kind!r} "
                              f"(want 'cuda' or 'cpu')")
    if storage.nbytes() < handle.nbytes:
        raise WeightSyncError(f"{what}: the trainer's storage holds {storage.nbytes()} "
                              f"bytes, fewer than the {handle.nbytes} announced")
    return flat_bytes(storage)[: handle.nbytes]
