"""The cross-rank check before a wake allocates anything, and the agreement after.

A wake must give every rank exactly the pool the engine's block manager was built
on. Before any rank allocates, each computes the bytes it needs (the saved pool,
plus the weights if they wake too) and what it may take, and the ranks exchange
both figures in one all-reduce. If any rank is short, every rank raises the same
:class:`~kvrunner.errors.WakeError` naming each short rank, having allocated
nothing. If the figures pass but an allocation still fails on some rank, the ranks
agree on that too (:func:`agree_allocated`): everyone frees what it took and raises.
Nobody waits on a peer that gave up, nobody shrinks, nobody is left half awake.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvrunner.config import CacheConfig
from kvrunner.distributed.group import DistGroup
from kvrunner.errors import WakeError

MiB = 1 << 20


def available_bytes(cache: CacheConfig, device: torch.device, *, held_bytes: int) -> int:
    """Bytes this rank can still take for what wakes.

    CUDA: what the device has free plus what this process's allocator holds unused.
    Not ``gpu_memory_utilization`` again: that sized the pool once, at start-up, and
    what came after sizing (decode graphs, NCCL's buffers) already sits above it, so
    the same pool would never fit the same fraction twice. The question at a wake is
    whether the same allocations succeed now, with room for the activation peak
    (which the caller adds to what it needs). CPU: the configured pool budget, less
    the pools still held (``held_bytes``).
    """
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return free + cached
    return cache.cpu_cache_bytes - held_bytes


def _exchange(values: list[int], group: DistGroup | None) -> list[list[int]]:
    """Every rank's ``values``, in rank order (just ours for a single rank)."""
    return [values] if group is None or group.size == 1 else group.gather_int_lists(values)


def preflight(*, need: int, available: int, what: str, group: DistGroup | None) -> None:
    """Raise the same :class:`WakeError` on every rank if any rank cannot fit ``need``."""
    figures = _exchange([need, available], group)
    short = {r: n - a for r, (n, a) in enumerate(figures) if n > a}
    if short:
        detail = "; ".join(
            f"rank {r} needs {figures[r][0] / MiB:.1f} MiB, may take "
            f"{max(figures[r][1], 0) / MiB:.1f} MiB ({b / MiB:.1f} MiB short)"
            for r, b in short.items()
        )
        raise WakeError(
            f"wake_up({what}) refused before allocating anything: {detail}. The engine "
            f"stays asleep with the same pool; free device memory (on the CPU: raise "
            f"cpu_cache_bytes) and call wake_up again",
            short=short,
        )


def agree_allocated(
    allocate: Callable[[], None], undo: Callable[[], None], *, what: str, group: DistGroup | None
) -> None:
    """Run ``allocate``; if it failed on any rank, ``undo`` (whatever part of it this rank
    got done) and raise :class:`WakeError` on every rank, chaining this rank's own error
    where it failed."""
    error: BaseException | None = None
    try:
        allocate()
    except (torch.OutOfMemoryError, RuntimeError, MemoryError) as e:
        error = e
    failed = [r for r, (ok,) in enumerate(_exchange([0 if error else 1], group)) if not ok]
    if not failed:
        return
    undo()
    message = (
        f"wake_up({what}) passed the preflight but allocation failed on rank(s) {failed}"
        + (f" (here: {error})" if error is not None else "")
        + "; every rank freed what it took and the engine stays asleep: retry wake_up"
    )
    raise WakeError(message) from error
