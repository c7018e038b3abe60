"""The capture loop: one decode graph per batch size, largest first, never unsafe.

For each size: blank the union of every active backend's write targets to PAD,
synthesize the shared read side (the core's step builder) and each backend's own
(``build_capture_metadata``), warmup forward,
captured forward. In audit mode every integer buffer the core can reach that is not
a declared write target is first seeded with in-range row indices (what serving
leaves), and every pool's checksums must be unchanged after each size.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
from tqdm.auto import tqdm

from kvrunner.config import CaptureConfig
from kvrunner.plugins import BackendManager
from kvrunner.runner.capture_safety import (
    PoolSnapshot,
    blank_write_targets,
    seed_undeclared_index_buffers,
)
from kvrunner.runner.forward_vars import ForwardVars
from kvrunner.runner.graphs import DecodeGraph, Forward
from kvrunner.runner.step_metadata import StepMetadataBuilder


def capture_decode_graphs(
    *,
    sizes: Sequence[int],
    backends: BackendManager,
    forward: Forward,
    forward_vars: ForwardVars,
    step_builder: StepMetadataBuilder,
    pools: Mapping[str, torch.Tensor],
    config: CaptureConfig,
    device: torch.device,
    index_bound: int,
    warmup: bool = True,
    progress: bool = False,
) -> tuple[dict[int, DecodeGraph], float]:
    """Capture every size; returns the graphs by batch size and the seconds it took.

    :param index_bound: row indices below this are valid for every pool (the audit's
        seeding of undeclared buffers stays in range).
    :param warmup: run a warmup forward before each capture (needed the first time,
        when kernels compile; a recapture can skip it).
    """
    start = time.perf_counter()
    snapshot = PoolSnapshot(pools) if config.audit else None
    graphs: dict[int, DecodeGraph] = {}
    shared_pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
    ordered = sorted(sizes, reverse=True)  # largest first: later graphs reuse its memory
    for batch_size in tqdm(ordered, desc="capturing decode graphs", disable=not progress):
        targets = backends.cache_write_targets()
        if config.audit:
            seed_undeclared_index_buffers(forward_vars.values(), targets, bound=index_bound)
        if config.blank_write_targets:
            blank_write_targets(targets)
        # The read side: token 0 at position 0, one key at block 0 (positions and the
        # shared step buffers are filled by the step builder).
        forward_vars["input_ids"][:batch_size].zero_()
        step = step_builder.fill_capture(batch_size)
        graph = DecodeGraph(batch_size, backends.build_capture_metadata(step))
        graph.capture(forward, pool=shared_pool, device=device, warmup=warmup)
        if snapshot is not None:
            if device.type == "cuda":
                torch.cuda.synchronize(device)
            snapshot.require_unchanged(
                batch_size=batch_size, blanked=targets if config.blank_write_targets else []
            )
        graphs[batch_size] = graph
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return graphs, time.perf_counter() - start
