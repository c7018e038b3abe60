"""Where the weights live while the engine sleeps: on the device, in host memory, or nowhere.

A sleep at level 2 frees the device memory of every parameter and buffer of the
model by shrinking its *storage* to zero bytes (as FSDP frees a flat parameter).
The ``Parameter`` objects, and every view of them a layer may keep, stay the
same Python objects: a wake grows the storages back and every view sees them.
The device addresses change, which is why the decode graphs are always dropped at
sleep and recaptured at wake.

Shared storages (tied embeddings) are handled once. Buffers (the rotary table) are
not checkpoint tensors, so they are always kept in host memory, even when the
parameters are discarded.

On CUDA the weights live in an allocator pool of their own (``torch.cuda.MemPool``).
The caching allocator carves many tensors out of one segment and returns a segment
to the device only when every block in it is free: with the weights in the shared
pool, one live tensor allocated later beside them (a colocated trainer's, a pushed
copy of the weights) kept a whole segment reserved after a level-2 sleep. In their
own pool, the weights' segments hold nothing else. ``empty_cache`` does not release
the segments of a pool that is still alive, so a sleep drops the pool once every
storage is empty, and a wake makes a fresh one.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import attrs
import torch
from torch import nn


@attrs.define
class _Storage:
    storage: torch.UntypedStorage
    nbytes: int
    is_parameter: bool
    #: host buffer for the offloaded bytes (pinned when the device is CUDA); kept
    #: after a wake, since pinning gigabytes again at every sleep costs seconds
    host: torch.Tensor | None = None
    #: whether ``host`` holds this storage's bytes now
    offloaded: bool = False


def _bytes_view(storage: torch.UntypedStorage, nbytes: int, device: torch.device) -> torch.Tensor:
    """A flat uint8 tensor over the whole storage (to copy it in one go)."""
    return torch.empty(0, dtype=torch.uint8, device=device).set_(storage, 0, (nbytes,), (1,))


def _weight_pool_supported(device: torch.device) -> bool:
    return device.type == "cuda" and all(
        hasattr(torch.cuda, name) for name in ("MemPool", "use_mem_pool")
    )


class WeightResidency:
    """Offload, discard and restore one model's weights, in place.

    Made right after the weights load: on CUDA it moves them into their own
    allocator pool (one storage at a time, so the move needs one storage's bytes
    on top), before the KV pool is sized on what is left.
    """

    def __init__(self, model: nn.Module, device: torch.device) -> None:
        self.device = device
        self.state = "resident"  # "resident" | "offloaded" | "discarded"
        seen: dict[int, _Storage] = {}
        tensors = [(p, True) for p in model.parameters()] + [(b, False) for b in model.buffers()]
        for tensor, is_parameter in tensors:
            storage = tensor.untyped_storage()
            key = storage.data_ptr()
            if key not in seen:
                seen[key] = _Storage(storage, storage.nbytes(), is_parameter)
        self._storages = list(seen.values())
        #: the weights' own allocator pool while they are resident (CUDA only)
        self.pool: torch.cuda.MemPool | None = None
        if _weight_pool_supported(device):
            self._move_into_own_pool()

    @contextlib.contextmanager
    def _allocating_in_own_pool(self) -> Iterator[None]:
        """Route this thread's allocations on the device to the weights' pool."""
        if not _weight_pool_supported(self.device):
            yield
            return
        if self.pool is None:
            self.pool = torch.cuda.MemPool()
        # an index: "cuda" alone is refused by use_mem_pool
        index = self.device.index if self.device.index is not None else torch.cuda.current_device()
        with torch.cuda.use_mem_pool(self.pool, device=index):
            yield

    def _move_into_own_pool(self) -> None:
        for s in self._storages:
            kept = _bytes_view(s.storage, s.nbytes, self.device).clone()
            s.storage.resize_(0)
            with self._allocating_in_own_pool():
                s.storage.resize_(s.nbytes)
            _bytes_view(s.storage, s.nbytes, self.device).copy_(kept)
            del kept
        torch.cuda.synchronize(self.device)
        torch.cuda.empty_cache()  # the segments the weights loaded into

    def _drop_pool(self) -> None:
        """Let the allocator release the weights' segments (every storage is empty)."""
        self.pool = None

    @property
    def nbytes(self) -> int:
        """Device bytes of the weights while resident."""
        return sum(s.nbytes for s in self._storages)

    def release(self, *, discard: bool) -> int:
        """Free the weights' device memory; returns the bytes released.

        ``discard``: parameters are dropped (their values must be pushed again);
        otherwise they are copied to host memory first. Buffers are always kept.
        The host buffers are allocated at the first offload and reused after.
        """
        if self.state != "resident":
            raise RuntimeError(f"weights are already {self.state}")
        pin = self.device.type == "cuda"
        for s in self._storages:
            s.offloaded = not (s.is_parameter and discard)
            if not s.offloaded:
                continue
            if s.host is None:
                s.host = torch.empty(s.nbytes, dtype=torch.uint8, pin_memory=pin)
            s.host.copy_(_bytes_view(s.storage, s.nbytes, self.device), non_blocking=pin)
        if pin:
            torch.cuda.synchronize(self.device)  # the copies must land before the memory goes
        for s in self._storages:
            s.storage.resize_(0)
        self._drop_pool()
        self.state = "discarded" if discard else "offloaded"
        return self.nbytes

    def restore(self) -> None:
        """Allocate every storage again and copy back what was kept.

        Discarded parameters come back with undefined contents: the caller refuses
        to serve until they are pushed.
        """
        if self.state == "resident":
            return
        done: list[_Storage] = []
        try:
            with self._allocating_in_own_pool():
                for s in self._storages:
                    s.storage.resize_(s.nbytes)
                    done.append(s)
        except BaseException:
            for s in done:  # all or nothing: a failed wake leaves the weights asleep
                s.storage.resize_(0)
            self._drop_pool()
            raise
        pin = self.device.type == "cuda"
        for s in self._storages:
            if s.offloaded:
                _bytes_view(s.storage, s.nbytes, self.device).copy_(s.host, non_blocking=pin)
            s.offloaded = False
        if pin:
            torch.cuda.synchronize(self.device)
        self.state = "resident"
