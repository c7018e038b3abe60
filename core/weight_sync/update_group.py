"""A process group for weights from other GPUs or nodes: the trainer's rank 0 and
every engine rank, over a store of its own (never the engine's TP group).

Rank ``0`` is the trainer's sender; engine rank ``r`` joins as ``rank_offset + r``. A
push is a sequence of broadcasts from rank 0, one per tensor (or, vLLM's packed
form, one per chunk of tensors: :mod:`~kvrunner.weight_sync.packed_broadcast`), in
the order of the names the engine was given; each engine rank receives the full
tensor and keeps its shard.

The group is the one the RL trainers make: AReaL's ``init_custom_process_group``,
slime's and OpenRLHF's ``init_process_group`` (torch's ``init_process_group`` made
to create a group beside the default one), and SGLang's engine side, all called
with ``init_method="tcp://host:port"``. Each meets through a TCP store at that
address (rank 0 serves it and waits until all ``world_size`` ranks have connected),
under the prefix ``group_name``, and builds the group with torch's own
``_new_process_group_helper``, which lays out the store keys every member must
agree on; this module does the same, so a trainer's group and
:class:`~kvrunner.weight_sync.broadcaster.WeightBroadcaster` are interchangeable.

A broadcast carries no size the receiver can ask for: each side gives its own
buffer. Under gloo a sender's buffer larger than the receiver's ends the receiving
process (gloo's transport aborts it from its own thread) and a smaller one fills
part of the buffer silently, so a gloo rank receives into a host buffer
:data:`GLOO_ROOM` times the announced size, filled with ``0xFF`` first, and reads
the size the trainer sent from where its bytes end (:func:`sent_bytes`); a size
other than the announced one is refused naming the tensor and both sizes, and the
rank leaves the group (the trainer's later broadcasts no longer match the engine's
receives). NCCL carries no size either and does not check one: a mismatch there
is seen only as the broadcast's timeout.
"""

from __future__ import annotations

import datetime
import math
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

from kvrunner.models.weight_specs import TensorSpec
from kvrunner.weight_sync.errors import WeightSyncError
from kvrunner.weight_sync.layout import DTYPES
from kvrunner.weight_sync.packed_broadcast import packed_chunks


def make_group(*, master_address: str, master_port: int, rank: int, world_size: int,
               backend: str, group_name: str, timeout_s: float, is_master: bool,
               device: torch.device | None = None) -> Any:
    """Join the weight-update group ``group_name`` as ``rank``: a gloo or NCCL process
    group meeting at ``tcp://master_address:master_port`` as torch's
    ``init_process_group`` meets there (torch.distributed's default group, if any,
    is untouched). ``is_master`` (rank 0) serves the store and returns once every
    rank has joined. Undo with :func:`leave_group`."""
    if backend not in ("gloo", "nccl"):
        raise WeightSyncError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    if not 0 <= rank < world_size:
        raise WeightSyncError(f"rank {rank} is outside a group of {world_size}")
    if is_master != (rank == 0):
        raise WeightSyncError(f"rank {rank} cannot {'serve' if is_master else 'join'} the "
                              f"store: rank 0 serves it")
    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        # torch's tcp:// rendezvous, without its torchelastic switch (a rank started by
        # torchrun would otherwise reach the launcher's store, not the trainer's)
        store = dist.TCPStore(master_address, master_port, world_size, is_master=is_master,
                              timeout=timeout, multi_tenant=True)
        if device is not None and device.type == "cuda":
            torch.cuda.set_device(device)
        group, _ = c10d._new_process_group_helper(
            world_size, rank, [], c10d.Backend(backend), dist.PrefixStore(group_name, store),
            group_name=group_name, timeout=timeout)
    except (RuntimeError, OSError, ValueError) as e:
        raise WeightSyncError(f"cannot join the weight-update group {group_name!r} at "
                              f"{master_address}:{master_port} as rank {rank}: {e}") from None
    # group rank r is rank r, as the trainers register it (dist.broadcast(src=0) reads it)
    c10d._world.pg_group_ranks[group] = {i: i for i in range(world_size)}
    return group


def leave_group(group: Any) -> None:
    """Destroy a group :func:`make_group` made, so its name may be joined again."""
    dist.destroy_process_group(group)


def broadcast(group: Any, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` in place from rank 0; a peer's failure is a WeightSyncError."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    try:
        group.broadcast([tensor], options).wait()
    except RuntimeError as e:
        raise WeightSyncError(f"a broadcast of the weight-update group failed (the trainer "
                              f"has probably gone): {e}") from None


#: how many times the announced bytes a gloo rank can receive without ending its
#: process: a float32 tensor sent where an FP8 one was announced still fits
GLOO_ROOM = 4
#: the least room past the announced bytes (small tensors: norms, biases)
GLOO_MIN_SLACK = 1 << 20
#: what a gloo receive buffer holds before the broadcast: NaN in every float weight
#: dtype, so a trainer's finite bytes are never taken for it
FILL = 0xFF


def sent_bytes(buffer: torch.Tensor, nbytes: int, itemsize: int) -> int:
    """How many bytes a broadcast wrote into ``buffer`` (``uint8``, filled with
    :data:`FILL` before it), announced as ``nbytes``: ``nbytes`` when the announced
    region ends in a byte of the trainer's and nothing past it was written, else the
    end of the last byte not :data:`FILL`, in whole elements of ``itemsize`` (a
    trainer's value of all-``0xFF`` bytes is NaN, which no weight holds)."""
    last = buffer[max(nbytes - itemsize, 0):nbytes]
    tail = buffer[nbytes:]
    if bool((tail == FILL).all()) and (nbytes == 0 or not bool((last == FILL).all())):
        return nbytes
    written = (buffer != FILL).nonzero()
    end = int(written[-1]) + 1 if written.numel() else 0
    return -(-end // itemsize) * itemsize


def announced_specs(names: list[str], dtypes: list[str], shapes: list[list[int]]
                    ) -> list[TensorSpec]:
    """The specs of an announced push (dtypes as ``"bfloat16"`` or ``"torch.bfloat16"``);
    lists of different lengths or a dtype weights cannot have are refused by name."""
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
    return specs


class UpdateGroup:
    """One engine rank's membership of a weight-update group."""

    def __init__(self, group: Any, device: torch.device, backend: str = "nccl") -> None:
        self.group = group
        self.device = device
        #: "gloo" or "nccl": how a broadcast is received (see :meth:`_received`)
        self.backend = backend

    def receive(self, names: list[str], dtypes: list[str], shapes: list[list[int]],
                load: Callable[[list[tuple[str, torch.Tensor]]], int],
                check: Callable[[list[TensorSpec]], None], *,
                packed_bytes: int | None = None) -> int:
        """Receive the announced tensors (full tensors, on this rank's device) and load
        each; returns how many loaded. Unpacked (``packed_bytes`` None), one broadcast
        per tensor; packed, vLLM's chunks of about ``packed_bytes``
        (:mod:`~kvrunner.weight_sync.packed_broadcast`), each loaded as one list. The
        announced names, dtypes and shapes are judged whole (``check``) before the
        first broadcast is received, so a refusal there loads nothing; a tensor's
        values are checked only as it arrives (``load``), after the ones before it
        loaded. Under gloo a broadcast of another size than announced is refused
        naming it and both sizes, and this rank leaves the group."""
        specs = announced_specs(names, dtypes, shapes)
        if packed_bytes is not None and packed_bytes < 1:
            raise WeightSyncError(f"packed_bytes must be at least 1, got {packed_bytes}")
        check(specs)
        if self.group is None:
            raise WeightSyncError("this engine left its weight-update group (a broadcast "
                                  "did not match its announced size): join again with "
                                  "init_weights_update_group")
        loaded = 0
        if packed_bytes is not None:
            for chunk in packed_chunks(specs, packed_bytes):
                what = (f"the packed chunk of {len(chunk.specs)} tensor(s) "
                        f"{chunk.specs[0].name!r} .. {chunk.specs[-1].name!r}")
                flat = self._received(chunk.nbytes, 1, what)
                loaded += load(chunk.unpack(flat))
            return loaded
        for spec in specs:
            dtype = DTYPES[spec.dtype]
            nbytes = math.prod(spec.shape) * dtype.itemsize
            flat = self._received(nbytes, dtype.itemsize,
                                  f"tensor {spec.name!r} ({spec.dtype} {list(spec.shape)})")
            loaded += load([(spec.name, flat.view(dtype).view(spec.shape))])
        return loaded

    def _received(self, nbytes: int, itemsize: int, what: str) -> torch.Tensor:
        """One broadcast of ``nbytes`` announced bytes, as ``uint8``: on this rank's
        device under NCCL; under gloo in a host buffer with room past them, checked
        for the size the trainer sent (module docstring)."""
        if self.backend != "gloo":
            flat = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            broadcast(self.group, flat)
            return flat
        room = max(GLOO_ROOM * nbytes, nbytes + GLOO_MIN_SLACK)
        buffer = torch.full((room,), FILL, dtype=torch.uint8)
        broadcast(self.group, buffer)
        sent = sent_bytes(buffer, nbytes, itemsize)
        if sent != nbytes:
            self.destroy()  # the trainer's next broadcasts no longer match this rank's
            raise WeightSyncError(
                f"{what}: the trainer broadcast {sent} bytes where {nbytes} were "
                f"announced; the update is refused and this engine left the weight-update "
                f"group (join again with init_weights_update_group)")
        return buffer[:nbytes]

    def destroy(self) -> None:
        """Leave the group (idempotent)."""
        if self.group is not None:
            group, self.group = self.group, None
            leave_group(group)
