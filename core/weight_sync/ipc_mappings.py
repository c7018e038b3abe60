"""The trainer storages one rank has opened by CUDA IPC during one weight update.

torch counts consumer releases per share: every ``reduce_tensor`` of a storage gives
the handle a counter slot set to one, the consumer releases that slot when the
storage it opened is freed, and the trainer gets the memory back (``ipc_collect``)
once the slot reads zero. A trainer may send one share several times: vLLM's packed
producer shares its buffer once per transfer and sends that handle with every chunk
it packs into the buffer. Opened afresh for each chunk and freed after it, the one
slot would be released once per chunk, driving it past zero, and the trainer would
never get its buffer back.

:class:`IpcMappings` keeps the storages it opened, and serves a handle it has already
opened (the same storage and counter slot) as a view of that mapping, without asking
torch to open or release it again: each slot is released exactly once, however often
it arrives. A mapping lives while the calls of the update keep naming it: once a
call's handles are open, the mappings that call did not name are let go
(:meth:`keep_only_named`), so a trainer that packs each chunk into a new buffer
(SkyRL) gets each buffer back as soon as the next chunk arrives; the update's end lets
go of the rest (:meth:`release`).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.multiprocessing.reductions as reductions

from kvrunner.weight_sync.errors import WeightSyncError

#: the argument of torch's rebuild_cuda_tensor that names the device (the engine puts
#: its own index there)
DEVICE_ARG = 6
#: the arguments that name one share: the storage handle and offset, the counter slot
_SHARE_ARGS = (7, 9, 11, 12)


class IpcMappings:
    """One rank's opened trainer storages, each held from the first handle that names
    it until a call of the update does not name it (:meth:`keep_only_named`) or the
    update ends (:meth:`release`)."""

    def __init__(self) -> None:
        self._open: dict[tuple[Any, ...], torch.UntypedStorage] = {}
        #: the shares named since the last :meth:`keep_only_named`
        self._named: set[tuple[Any, ...]] = set()

    def __len__(self) -> int:
        return len(self._open)

    def open(self, args: tuple[Any, ...], device: torch.device, where: str) -> torch.Tensor:
        """The tensor behind rebuild arguments ``args`` (what ``reduce_tensor`` gave the
        trainer) on ``device``: opened by torch the first time its share arrives, a view
        of the same mapping when it arrives again.

        :raises WeightSyncError: the driver cannot open the handle, naming ``where``.
        """
        key = tuple(args[i] for i in _SHARE_ARGS)
        self._named.add(key)
        storage = self._open.get(key)
        if storage is not None:
            size, stride, offset, dtype = args[1], args[2], args[3], args[5]
            view = torch.empty(0, dtype=dtype, device=storage.device)
            return view.set_(storage, offset, size, stride)
        tensor = _rebuild(args, device, where)
        self._open[key] = tensor.untyped_storage()
        return tensor

    def keep_only_named(self) -> None:
        """Let go of the mappings no handle named since the last call of this (a call's
        handles are all open: what it did not name, an earlier call's copies are done
        with)."""
        for key in self._open.keys() - self._named:
            del self._open[key]
        self._named.clear()

    def release(self) -> None:
        """Let go of every mapping (each share's one release, once the tensors viewing
        it are gone): call it once the update's copies are done on the device."""
        self._open.clear()
        self._named.clear()


def _rebuild(args: tuple[Any, ...], device: torch.device, where: str) -> torch.Tensor:
    """torch's rebuild on the rank's own device (the sender's index replaced)."""
    index = device.index if device.index is not None else torch.cuda.current_device()
    args = (*args[:DEVICE_ARG], index, *args[DEVICE_ARG + 1:])
    try:
        return reductions.rebuild_cuda_tensor(*args)
    except Exception as e:  # a handle the driver cannot open (stale, another process's)
        raise WeightSyncError(f"{where}: the CUDA IPC handle cannot be opened: "
                              f"{type(e).__name__}: {e}") from None
