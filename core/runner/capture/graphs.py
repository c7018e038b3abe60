"""Decode graphs: CUDA graphs on CUDA, an eager stand-in elsewhere.

Both kinds are built by the same capture loop and replayed the same way: the
step's rows are copied into forward_vars and the backends' buffers, the graph runs
over its whole (padded) batch with the metadata built at capture, and the caller
reads the first ``num_seqs`` rows of its output. The stand-in re-runs that forward
eagerly, so on the CPU a backend whose captured metadata would go stale (a Python
value that should have lived in a buffer) shows up as a wrong answer in tests.
"""

from __future__ import annotations

import contextlib
import gc
from collections.abc import Callable, Iterator
from typing import Any

import torch

from kvrunner.plugin_api.step_data import ForwardContext

#: ``(rows, ctx) -> outputs``: a tensor, or any structure of tensors (the runner's
#: ``DecodeOutputs``); a CUDA graph's replay refills the same tensors
Forward = Callable[[int, ForwardContext], Any]


def default_capture_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then steps of 16 up to ``max_num_seqs`` (always included)."""
    sizes = [s for s in (1, 2, 4, 8) if s <= max_num_seqs]
    sizes += list(range(16, max_num_seqs + 1, 16))
    if max_num_seqs not in sizes:
        sizes.append(max_num_seqs)
    return sorted(set(sizes))


@contextlib.contextmanager
def garbage_collection_paused() -> Iterator[None]:
    """No automatic garbage collection inside: a collection during a CUDA graph capture
    runs the finalizers of whatever dead cycles it finds (an engine dropped before this
    one, with its graphs, events and pinned blocks), and a CUDA call that a capture
    forbids aborts the process. The garbage waits for the next automatic collection,
    outside the capture."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


class DecodeGraph:
    """One captured decode forward for a fixed batch size."""

    def __init__(self, batch_size: int, ctx: ForwardContext) -> None:
        self.batch_size = batch_size
        self.ctx = ctx
        self.output: Any = None
        self._graph: torch.cuda.CUDAGraph | None = None
        self._forward: Forward | None = None

    def capture(
        self, forward: Forward, *, pool: object | None, device: torch.device, warmup: bool = True
    ) -> None:
        """Warmup forward, then the captured forward (a real CUDA graph on CUDA).

        ``warmup=False`` skips the first: on a recapture every kernel is compiled and
        every workspace exists already, and the warmup was half the capture's time.
        """
        self._forward = forward
        if warmup:
            forward(self.batch_size, self.ctx)  # kernels compile, workspaces settle
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            self._graph = torch.cuda.CUDAGraph()
            # relaxed: in the default (global) mode a CUDA call another thread makes
            # while this one captures (a server thread's query, the pinned-memory
            # cache querying the events of the copies a weight load staged) makes the
            # capture fail; what the graph holds is checked by its own means (write
            # targets blanked and audited), not by the driver's prohibited-call list
            with garbage_collection_paused(), torch.cuda.graph(
                    self._graph, pool=pool, capture_error_mode="relaxed"):
                self.output = forward(self.batch_size, self.ctx)
        else:
            self.output = forward(self.batch_size, self.ctx)

    def replay(self) -> Any:
        if self._graph is not None:
            self._graph.replay()
        else:
            assert self._forward is not None, "replay before capture"
            self.output = self._forward(self.batch_size, self.ctx)
        assert self.output is not None
        return self.output
