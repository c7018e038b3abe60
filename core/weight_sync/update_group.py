"""A process group for weights from other GPUs or nodes: the trainer's rank 0 and
every engine rank, over a store of its own (never the engine's TP group).

Rank ``0`` is the trainer's sender (:class:`~kvrunner.weight_sync.broadcaster.WeightBroadcaster`,
which serves the store); engine rank ``r`` joins as ``rank_offset + r``. A push is a
sequence of broadcasts from rank 0, one per tensor, in the order of the names the
engine was given; each engine rank receives the full tensor and keeps its shard.
"""

from __future__ import annotations

import datetime
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from kvrunner.models.weight_specs import TensorSpec
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.layout import DTYPES


def make_group(*, master_address: str, master_port: int, rank: int, world_size: int,
               backend: str, group_name: str, timeout_s: float, is_master: bool,
               device: torch.device | None = None) -> Any:
    """A standalone gloo or NCCL process group (torch.distributed's default group, if
    any, is untouched), meeting through a TCP store prefixed by ``group_name``."""
    if backend not in ("gloo", "nccl"):
        raise WeightSyncError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"rank {rank} is outside a group of {world_size}")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = dist.TCPStore(master_address, master_port, is_master=is_master,
                              timeout=timeout, wait_for_workers=False)
        store = dist.PrefixStore(group_name, store)
        if backend == "gloo":
            return dist.ProcessGroupGloo(store, rank, world_size, timeout)
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timeout
        if device is not None:
            torch.cuda.set_device(device)
        return dist.ProcessGroupNCCL(store, rank, world_size, options)
    except (RuntimeError, OSError) as e:
        raise WeightSyncError(f"cannot join the weight-update group {group_name!r} at "
                              f"{master_address}:{master_port} as rank {rank}: {e}") from None


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` in place from rank 0; a peer's failure is a WeightSyncError."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    try:
        group.broadcast([tensor], options).wait()
    except RuntimeError as e:
        raise WeightSyncError(f"a broadcast of the weight-update group failed (the trainer "
                              f"has probably gone): {e}") from None


class UpdateGroup:
    """One engine rank's membership of a weight-update group."""

    def __init__(self, group: Any, device: torch.device) -> None:
        self.group = group
        self.device = device

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load: Callable[[list[tuple[str, torch.Tensor]]], int],
                check: Callable[[list[TensorSpec]], None]) -> int:
        """Receive one broadcast per name (full tensors, on this rank's device) and
        load each; returns how many loaded. The announced names, dtypes and shapes
        are judged whole (``check``) before the first broadcast is received, so a
        refusal there loads nothing; a tensor's values are checked only as it
        arrives (``load``), after the ones before it loaded."""
        if not (len(names) == len(dtypes) == len(shapes)):
            raise WeightSyncError(f"names, dtypes and shapes differ in length "
                                  f"({len(names)}, {len(dtypes)}, {len(shapes)})")
        specs = []
        for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
            dtype = str(dtype).removeprefix("torch.")
            if dtype not in DTYPES:
                raise WeightSyncError(f"tensor {name!r}: dtype {dtype!r} is not one of "
                                      f"{sorted(DTYPES)}")
            specs.append(TensorSpec(name, tuple(shape), dtype, DTYPES[dtype].is_floating_point))
        check(specs)
        loaded = 0
        for spec in specs:
            tensor = torch.empty(spec.shape, dtype=DTYPES[spec.dtype], device=self.device)
            broadcast(self.group, tensor)
            loaded += load([(spec.name, tensor)])
        return loaded

    def destroy(self) -> None:
        self.group = None
