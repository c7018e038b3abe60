"""Catching code that reads a tensor's value on the host, on any device, the CPU too.

On CUDA, ``tensor.item()``, ``int(t)``, ``bool(t)``, indexing with a 0-dim tensor, or
an op whose output shape depends on the data (``nonzero``, a boolean mask) makes
the host wait for the device: the step in flight drains, asynchronous steps stop
overlapping anything, and a CUDA graph capture fails. ``torch.cuda.set_sync_debug_mode``
finds these only on a GPU; :func:`forbid_host_reads` finds them wherever the code
runs, by watching the ops torch dispatches for the ones that hand a value (or a
value-dependent shape) to the host.

``tolist()``, ``numpy()`` and ``cpu()`` dispatch no op on a CPU tensor, so they are
caught where Python calls them. What it cannot see on the CPU: ``.to("cpu")``, which
there is the same call as a move to the (CPU) device. It guards code whose tensors all
live on the device (a layer's forward), not code that reads host copies by design (the
core's step preparation, a backend's ``build_metadata`` reading ``step.host``).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
#: ops that give the host a tensor's value, or a shape that depends on the values
VALUE_TO_HOST = frozenset(
    {
        aten._local_scalar_dense.default,  # item(), int(), float(), bool(), t[0-dim t]
        aten.is_nonzero.default,
        aten.equal.default,
        aten.nonzero.default,
        aten.argwhere.default,
        aten.masked_select.default,
        aten._unique2.default,
        aten.unique_dim.default,
        aten.unique_consecutive.default,
    }
)


#: tensor methods that hand values to the host without dispatching an op on the CPU
METHODS_TO_HOST = frozenset({torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.cpu})


class HostReadError(AssertionError):
    """Code under :func:`forbid_host_reads` read a tensor's value on the host."""


def _reads_values(func: Any, args: tuple, kwargs: dict) -> bool:
    if func in VALUE_TO_HOST:
        return True
    if func is aten.repeat_interleave.Tensor:  # the output size is the repeats' sum
        return kwargs.get("output_size") is None
    if func in (aten.index.Tensor, aten.index_put.default, aten.index_put_.default):
        # a boolean mask: the result has as many rows as the mask has True values
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        return any(i is not None and i.dtype in (torch.bool, torch.uint8) for i in indices)
    return False


def _refuse(what: str, op: object) -> HostReadError:
    return HostReadError(
        f"{what} read a tensor's value on the host ({op}): on CUDA that makes the host wait "
        f"for the device (asynchronous steps stall, a graph capture fails). Keep the value "
        f"on the device (index_select with a 1-element tensor, torch.where, masks as "
        f"multiplications), or take it from the step's host copies"
    )


class _Guard(TorchDispatchMode):
    """The dispatched ops (what ``.item()``, ``bool()``, masks... become)."""

    def __init__(self, what: str) -> None:
        super().__init__()
        self.what = what
        self.paused = 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        if not self.paused and _reads_values(func, args, kwargs):
            raise _refuse(self.what, func)
        return func(*args, **kwargs)


class _MethodGuard(TorchFunctionMode):
    """The tensor methods that read values without dispatching on the CPU."""

    def __init__(self, guard: _Guard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_function__(self, func: Any, types: Any, args: tuple = (),
                           kwargs: dict | None = None) -> Any:
        if not self.guard.paused and func in METHODS_TO_HOST:
            raise _refuse(self.guard.what, f"Tensor.{func.__name__}()")
        return func(*args, **(kwargs or {}))


_active: list[_Guard] = []


@contextmanager
def forbid_host_reads(what: str = "the guarded code") -> Iterator[None]:
    """Raise :class:`HostReadError` at the first op that reads a tensor's value on the
    host; ``what`` names the code in the message."""
    guard = _Guard(what)
    _active.append(guard)
    try:
        with guard, _MethodGuard(guard):
            yield
    finally:
        _active.remove(guard)


@contextmanager
def allow_host_reads() -> Iterator[None]:
    """Suspend every active :func:`forbid_host_reads` (for a test's stand-in of a
    library that is not under test)."""
    for guard in _active:
        guard.paused += 1
    try:
        yield
    finally:
        for guard in _active:
            guard.paused -= 1
