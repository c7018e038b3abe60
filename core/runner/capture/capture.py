"""The capture loop: one decode graph per batch size, largest first, never unsafe.

For each size: blank the union of every active backend's write targets to PAD,
synthesize the shared read side (the core's step builder) and each backend's own
(``build_capture_metadata``), warmup forward,
captured forward. In audit mode every integer buffer the core can reach that is not
a declared write target (forward_vars and the backends' builders) is first seeded
with in-range row indices (what serving leaves), the capture metadata must not
depend on that seeding, and every pool's checksums must be unchanged after each
size (:mod:`~kvrunner.runner.capture.capture_audit`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import torch
from tqdm.auto import tqdm

from kvrunner.config import CaptureConfig
from kvrunner.plugin_api.step_data import ForwardContext
from kvrunner.plugin_host.backend_manager import BackendManager
from kvrunner.runner.capture.capture_audit import CaptureAudit
from kvrunner.runner.capture.capture_safety import blank_write_targets
from kvrunner.runner.capture.graphs import DecodeGraph, Forward
from kvrunner.runner.step.forward_vars import ForwardVars
from kvrunner.runner.step.step_metadata import StepMetadataBuilder


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
    vocab_size: int = 1,
) -> tuple[dict[int, DecodeGraph], float]:
    """Capture every size; returns the graphs by batch size and the seconds it took.

    :param index_bound: row indices below this are valid for every pool (the audit's
        seeding of undeclared buffers stays in range).
    :param warmup: run a warmup forward before each capture (needed the first time,
        when kernels compile; a recapture can skip it).
    :param vocab_size: input tokens below this are valid (the audit's probes vary them).
    """
    start = time.perf_counter()
    audit = CaptureAudit(
        backends=backends, forward_vars=forward_vars, pools=pools, index_bound=index_bound,
        blanking=config.blank_write_targets, device=device, vocab_size=vocab_size,
    ) if config.audit else None  # fmt: skip
    graphs: dict[int, DecodeGraph] = {}
    shared_pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
    ordered = sorted(sizes, reverse=True)  # largest first: later graphs reuse its memory
    for batch_size in tqdm(ordered, desc="capturing decode graphs", disable=not progress):
        targets = backends.cache_write_targets()

        def build(batch_size: int = batch_size, targets: list = targets,
                  pad: int | None = None) -> ForwardContext:
            if config.blank_write_targets:
                blank_write_targets(targets, pad)
            # The read side: token 0 at position 0, one key at block 0 (positions and
            # the shared step buffers are filled by the step builder).
            forward_vars["input_ids"][:batch_size].zero_()
            return backends.build_capture_metadata(step_builder.fill_capture(batch_size))

        if audit is not None:
            audit.seed(targets)
        ctx, moved = build(), []
        if audit is not None:
            ctx, moved = audit.rebuild_reseeded(ctx, build, targets)
        graph = DecodeGraph(batch_size, ctx)
        graph.capture(forward, pool=shared_pool, device=device, warmup=warmup)
        if audit is not None:

            def probe(token: int, pad: int | None = None, batch_size: int = batch_size,
                      build=build) -> None:
                probe_ctx = build(pad=pad)
                forward_vars["input_ids"][:batch_size].fill_(token)
                forward(batch_size, probe_ctx)

            audit.require_pools_unchanged(batch_size, targets, probe)
            audit.require_read_side_from_step(batch_size, moved)
        graphs[batch_size] = graph
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return graphs, time.perf_counter() - start
