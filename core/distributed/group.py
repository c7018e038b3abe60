"""One tensor-parallel process group on torch.distributed, and its collectives.

:class:`DistGroup` is what a rank knows about its group: rank, size, device, the
torch.distributed process group, and the key-value store the ranks met through
(kept so a failing rank can leave a report where rank 0 finds it). It produces the
:class:`~kvrunner.layers.linear.TPGroup` the layers take, whose ``all_reduce`` sums
and whose ``all_gather`` concatenates along the last dimension.

Every collective is bounded by ``timeout_s`` (set on the process group: gloo applies
it per operation, NCCL's watchdog aborts a collective that overruns it), and a
failure inside one is re-raised as :class:`CollectiveError`, so the driver can tell
"this rank broke" from "this rank was left waiting by a peer that broke".
"""

from __future__ import annotations

import datetime

import attrs
import torch
import torch.distributed as dist

from kvrunner.config import ConfigError
from kvrunner.distributed import symm_all_reduce
from kvrunner.distributed.errors import CollectiveError
from kvrunner.layers.linear import SINGLE, Collective, TPGroup


def resolve_backend(name: str, device: torch.device) -> str:
    """``"auto"`` -> NCCL on CUDA, gloo on the CPU; an impossible pair is refused."""
    if name == "auto":
        return "nccl" if device.type == "cuda" else "gloo"
    if name == "nccl" and device.type != "cuda":
        raise ConfigError(f"distributed_backend 'nccl' needs a CUDA device, not {device}")
    if name not in ("gloo", "nccl"):
        raise ConfigError(f"unknown distributed_backend {name!r} (want auto, gloo or nccl)")
    return name


def check_all_reduce(all_reduce: str, backend: str) -> None:
    """``all_reduce="symm_mem"`` needs NCCL (ranks on CUDA); refuse it otherwise."""
    if all_reduce == "symm_mem" and backend != "nccl":
        raise ConfigError(f"all_reduce='symm_mem' needs NCCL on CUDA, not {backend}")


def _timeout(seconds: float) -> datetime.timedelta:
    return datetime.timedelta(seconds=seconds)


def connect_store(host: str, port: int, *, timeout_s: float, is_master: bool) -> dist.TCPStore:
    """The TCP store ranks meet through; the master (the driver) serves it.

    ``port=0`` on the master lets the OS pick a free port (``store.port``).
    """
    return dist.TCPStore(
        host,
        port,
        is_master=is_master,
        timeout=_timeout(timeout_s),
        wait_for_workers=False,
    )


@attrs.define(kw_only=True)
class DistGroup:
    """This process's rank in an initialised tensor-parallel process group."""

    rank: int
    size: int
    device: torch.device
    backend: str
    timeout_s: float
    store: dist.Store
    process_group: dist.ProcessGroup
    #: how the layers' all-reduce runs, set by :meth:`tp_group` ("nccl", "gloo",
    #: "symm_mem") with the reason for the choice
    all_reduce_impl: str = ""
    all_reduce_reason: str = ""

    @classmethod
    def init(
        cls,
        *,
        rank: int,
        size: int,
        device: torch.device,
        backend: str,
        timeout_s: float,
        store: dist.Store,
    ) -> DistGroup:
        """Initialise torch.distributed's default group over ``store``.

        On CUDA the device must already be this rank's (``torch.cuda.set_device``):
        NCCL binds its communicator to it.
        """
        backend = resolve_backend(backend, device)
        kwargs = {"device_id": device} if backend == "nccl" else {}
        dist.init_process_group(
            backend,
            store=store,
            rank=rank,
            world_size=size,
            timeout=_timeout(timeout_s),
            **kwargs,
        )
        return cls(
            rank=rank,
            size=size,
            device=device,
            backend=backend,
            timeout_s=timeout_s,
            store=store,
            process_group=dist.group.WORLD,
        )

    def tp_group(self, *, dtype: torch.dtype, all_reduce: str = "auto",
                 fixed_order: bool = False) -> TPGroup:
        """The collectives the tensor-parallel layers call (identity for one rank).

        ``fixed_order`` (deterministic mode): the all-reduce is an all-gather and a sum
        in rank order on every rank, so its bits do not follow the algorithm NCCL
        picks by message size (which follows the batch); ``all_reduce`` is not read.

        Collective when ``all_reduce`` is ``"auto"`` or ``"symm_mem"`` on NCCL: the
        ranks agree whether small all-reduces go through symmetric memory
        (:mod:`~kvrunner.distributed.symm_all_reduce`); ``"symm_mem"`` raises on
        every rank if any rank cannot. ``dtype`` is the activations' dtype.
        """
        if self.size == 1:
            return SINGLE
        gather = _all_gather_last_dim(self.process_group, self.size)
        if fixed_order:
            self.all_reduce_impl, self.all_reduce_reason = "gather-sum", "deterministic"
            return TPGroup(rank=self.rank, size=self.size,
                           all_reduce=_fixed_order_all_reduce(self.process_group, self.size),
                           all_gather=gather)
        check_all_reduce(all_reduce, self.backend)
        nccl_or_gloo = _all_reduce_sum(self.process_group)
        reduce, self.all_reduce_impl = nccl_or_gloo, self.backend
        self.all_reduce_reason = f"all_reduce={all_reduce!r}"
        if all_reduce != "nccl" and self.backend == "nccl":
            symmetric, self.all_reduce_reason = symm_all_reduce.setup(
                device=self.device, dtype=dtype, group_name=self.process_group.group_name,
                gather_ints=self.gather_ints,
            )
            if symmetric is not None:
                reduce, self.all_reduce_impl = _small_first(symmetric, nccl_or_gloo), "symm_mem"
            elif all_reduce == "symm_mem":
                raise ConfigError(f"all_reduce='symm_mem' is unavailable: {self.all_reduce_reason}")
        return TPGroup(
            rank=self.rank,
            size=self.size,
            all_reduce=reduce,
            all_gather=gather,
        )

    def gather_ints(self, value: int) -> list[int]:
        """Every rank's ``value``, in rank order, on every rank (one all-reduce)."""
        return [values[0] for values in self.gather_int_lists([value])]

    def gather_int_lists(self, values: list[int]) -> list[list[int]]:
        """Every rank's ``values`` (the same length on every rank), in rank order, on
        every rank, in one all-reduce.

        Each rank writes its values into its own slots of a zero vector and the
        vectors are summed, so everyone learns everyone's numbers (for an error that
        names the rank) at the cost of a single all-reduce.
        """
        n = len(values)
        slots = torch.zeros(self.size * n, dtype=torch.int64, device=self.device)
        slots[self.rank * n : (self.rank + 1) * n] = torch.tensor(values, dtype=torch.int64)
        _all_reduce_sum(self.process_group)(slots)
        flat = [int(v) for v in slots.tolist()]
        return [flat[r * n : (r + 1) * n] for r in range(self.size)]

    def broadcast_from_first(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` as rank 0 holds it, in place on every rank (on the device: the host
        does not wait for it on NCCL)."""
        try:
            dist.broadcast(x, src=0, group=self.process_group)
        except RuntimeError as e:  # as in the layers' collectives: a peer has failed
            raise CollectiveError(
                f"broadcast over the tensor-parallel group failed "
                f"(a peer rank has probably failed): {e}"
            ) from e
        return x

    def destroy(self) -> None:
        """Leave the group (idempotent); peers still in a collective see us go.

        With symmetric-memory buffers mapped, ``destroy_process_group`` hung in
        torch 2.11 on two H200s (every collective had finished); the group is then
        left to process exit, which releases the communicator and the mappings.
        """
        if dist.is_initialized() and self.all_reduce_impl != "symm_mem":
            dist.destroy_process_group()


def _all_reduce_sum(group: dist.ProcessGroup) -> Collective:
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        # In place on a fresh, contiguous activation (the layers hand in one).
        x = x.contiguous()
        try:
            dist.all_reduce(x, op=dist.ReduceOp.SUM, group=group)
        except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
            raise CollectiveError(
                f"all_reduce over the tensor-parallel group failed "
                f"(a peer rank has probably failed): {e}"
            ) from e
        return x

    return all_reduce


def _fixed_order_all_reduce(group: dist.ProcessGroup, size: int) -> Collective:
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        parts = _gather_parts(group, size, x, "all_gather (the fixed-order all-reduce)")
        # Rank 0's part, then rank 1's, ... in float32, rounded once: the same sum on
        # every rank and for every message size.
        total = parts[0].float()
        for part in parts[1:]:
            total += part
        return total.to(x.dtype)

    return all_reduce


def _small_first(symmetric: symm_all_reduce.SymmetricAllReduce, other: Collective) -> Collective:
    def all_reduce(x: torch.Tensor) -> torch.Tensor:
        x = x.contiguous()
        return symmetric(x) if symmetric.fits(x) else other(x)

    return all_reduce


def _all_gather_last_dim(group: dist.ProcessGroup, size: int) -> Collective:
    def all_gather(x: torch.Tensor) -> torch.Tensor:
        # The list form works on gloo and NCCL alike, and under CUDA-graph capture.
        x = x.contiguous()
        return torch.cat(_gather_parts(group, size, x, "all_gather"), dim=-1)

    return all_gather


def _gather_parts(
    group: dist.ProcessGroup, size: int, x: torch.Tensor, what: str
) -> list[torch.Tensor]:
    """Every rank's ``x``, in rank order; a failed peer is a :class:`CollectiveError`."""
    parts = [torch.empty_like(x) for _ in range(size)]
    try:
        dist.all_gather(parts, x, group=group)
    except RuntimeError as e:  # DistBackendError and gloo's errors are RuntimeErrors
        raise CollectiveError(
            f"{what} over the tensor-parallel group failed "
            f"(a peer rank has probably failed): {e}"
        ) from e
    return parts
