"""A flat byte buffer one process fills and another reads: CUDA IPC or shared memory.

The sender allocates a :class:`SharedBuffer` once and refills it bucket after bucket;
:meth:`SharedBuffer.share` gives plain picklable data naming the memory. The engine
maps the same memory with :func:`open_buffer` and copies out of it; nothing is
copied in between.

- On CUDA the handle is the CUDA IPC handle of the buffer's allocation (torch's
  ``reduce_tensor``), opened in the engine process on the device with the same
  UUID, so the two processes need not number their devices alike. Each handle
  carries one of torch's cross-process references, which the engine's mapping gives
  back when it closes: a sender shares anew for every mapping (every push).
- On the CPU it is a POSIX shared-memory segment (``multiprocessing.shared_memory``)
  by name: the same protocol runs for real between two CPU processes.
"""

from __future__ import annotations

import contextlib
import mmap
import os
import weakref
from multiprocessing import shared_memory
from typing import Any

import attrs
import torch

from kvrunner.weight_sync.errors import WeightSyncError


@attrs.frozen
class BufferHandle:
    """What the engine needs to map a sender's buffer."""

    #: "cuda" or "cpu"
    kind: str
    nbytes: int
    #: cpu: the shared-memory segment's name; cuda: torch's rebuild arguments
    payload: Any
    #: cuda: the UUID of the sender's device (to find it under the engine's numbering)
    device_uuid: str = ""


def device_uuid(index: int) -> str:
    """The UUID of CUDA device ``index`` (the same GPU has the same UUID in every
    process, whatever each process numbers it)."""
    return str(torch.cuda.get_device_properties(index).uuid)


class SharedBuffer:
    """A flat ``uint8`` buffer on ``device`` that another process can map."""

    def __init__(self, nbytes: int, device: torch.device | str) -> None:
        device = torch.device(device)
        self._shm: shared_memory.SharedMemory | None = None
        if device.type == "cuda":
            self.tensor = torch.empty(nbytes, dtype=torch.uint8, device=device)
        elif device.type == "cpu":
            self._shm = shared_memory.SharedMemory(create=True, size=max(nbytes, 1))
            self.tensor = torch.frombuffer(self._shm.buf, dtype=torch.uint8, count=nbytes)
            # a sender never closed still unlinks its segment when it is collected or
            # its process exits, so nothing stays in /dev/shm (nor in the resource
            # tracker, which would warn of a leak)
            self._finalizer = weakref.finalize(self, _free_segment, self._shm)
        else:
            raise WeightSyncError(f"buckets live on CUDA or the CPU, not {device}")

    def share(self) -> BufferHandle:
        """The handle for one mapping of the buffer by the engine.

        On CUDA every call hands out a new IPC reference (torch counts one release per
        ``reduce_tensor``): a handle reused for a second mapping would be released
        twice, and torch would keep the buffer after :meth:`close`."""
        if self.tensor.is_cuda:
            from torch.multiprocessing.reductions import reduce_tensor

            _, args = reduce_tensor(self.tensor)
            return BufferHandle("cuda", self.tensor.numel(), args,
                                device_uuid(self.tensor.device.index))
        if self._shm is None:
            raise WeightSyncError("the buffer is closed")
        return BufferHandle("cpu", self.tensor.numel(), self._shm.name)

    def close(self) -> None:
        """Free the buffer (the engine must be done with it: every bucket acknowledged)."""
        cuda = self.tensor.is_cuda
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if cuda:
            # torch keeps a block it shared through CUDA IPC until the consumer lets go
            # (the engine unmaps its buffers before it answers the push's end) and it
            # is collected: without this the trainer holds the buffers after close()
            torch.cuda.ipc_collect()
        if self._shm is not None:
            self._finalizer()
            self._shm = None


def _free_segment(shm: shared_memory.SharedMemory) -> None:
    """Unmap and unlink a sender's segment (idempotent)."""
    with contextlib.suppress(BufferError):  # a stray view lives on: unmapped at exit
        shm.close()
    with contextlib.suppress(FileNotFoundError):
        shm.unlink()


class OpenedBuffer:
    """The engine's mapping of a sender's buffer; :meth:`close` unmaps it."""

    def __init__(self, tensor: torch.Tensor, mapping: mmap.mmap | None) -> None:
        self.tensor = tensor
        self._mapping = mapping

    @property
    def nbytes(self) -> int:
        return self.tensor.numel()

    def close(self) -> None:
        self.tensor = torch.empty(0, dtype=torch.uint8)
        if self._mapping is not None:
            with contextlib.suppress(BufferError):  # a stray view lives on: left to exit
                self._mapping.close()
            self._mapping = None


def _open_shared_memory(handle: BufferHandle) -> OpenedBuffer:
    """Map a sender's POSIX shared-memory segment by name. Opened directly rather
    than through ``SharedMemory``, which (before Python 3.13) registers the segment
    with this process's resource tracker, to be unlinked at its exit: the segment
    is the sender's to unlink."""
    import _posixshmem

    name = handle.payload
    try:
        fd = _posixshmem.shm_open("/" + str(name).lstrip("/"), os.O_RDWR, mode=0o600)
    except (OSError, TypeError, ValueError) as e:
        raise WeightSyncError(f"cannot map the trainer's shared memory {name!r}: {e}") from None
    try:
        size = os.fstat(fd).st_size
        if size < handle.nbytes:
            raise WeightSyncError(f"the shared memory {name!r} holds {size} bytes, fewer "
                                  f"than the {handle.nbytes} announced")
        mapping = mmap.mmap(fd, size)
    finally:
        os.close(fd)
    return OpenedBuffer(torch.frombuffer(mapping, dtype=torch.uint8, count=handle.nbytes),
                        mapping)


def local_cuda_index(uuid: str) -> int:
    """This process's index of the GPU with ``uuid``; WeightSyncError if it sees none."""
    for index in range(torch.cuda.device_count()):
        if device_uuid(index) == uuid:
            return index
    raise WeightSyncError(
        f"the trainer's memory lives on the GPU with UUID {uuid}, which this engine process "
        f"cannot see (CUDA IPC works between processes on the same GPU)"
    )


def open_buffer(handle: BufferHandle) -> OpenedBuffer:
    """Map the buffer ``handle`` names (read-only use: the engine only copies out)."""
    if not isinstance(handle, BufferHandle) or not isinstance(handle.nbytes, int):
        raise WeightSyncError(f"a buffer handle must be a BufferHandle, got {handle!r:.80}")
    if handle.kind == "cpu":
        return _open_shared_memory(handle)
    if handle.kind == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        args = list(handle.payload)
        args[6] = local_cuda_index(handle.device_uuid)  # storage_device, in our numbering
        tensor = rebuild_cuda_tensor(*args)
        if tensor.numel() < handle.nbytes:
            raise WeightSyncError("the trainer's CUDA buffer is smaller than announced")
        return OpenedBuffer(tensor.view(torch.uint8)[: handle.nbytes], None)
    raise WeightSyncError(f"unknown buffer kind {handle.kind!r} (want 'cuda' or 'cpu')")
