"""``TwoBatchOverlap``: the ``tbo`` overlap plugin.

It cuts a step in two (:mod:`.split`), gives each part every layer backend's
metadata in mirrors it owns and declares (:mod:`.mirrors`), and runs the layers so
one part's all-reduce overlaps the other's compute (:mod:`.schedule`). Steps too
small to pay run whole, unsplit, through the layer backends as if it were absent.
"""

from __future__ import annotations

import torch

from kvrunner.plugin_api import (
    PLUGIN_API_VERSION,
    CacheWriteTarget,
    LayerBackends,
    LayerStack,
    MicroBatch,
    OverlapContext,
    StepMetadata,
    hookimpl,
)
from kvrunner_tbo.mirrors import Mirrors
from kvrunner_tbo.schedule import StreamSchedule, run_in_turns
from kvrunner_tbo.split import PartBuffers, choose_cut


class TwoBatchOverlap:
    """Two micro-batches per step, their layers interleaved across two streams."""

    plugin_api_version = PLUGIN_API_VERSION
    plugin_role = "overlap"
    layer_types: tuple[str, ...] = ()

    def __init__(self, context: OverlapContext) -> None:
        self.context = context
        self.parts: PartBuffers | None = None
        self.mirrors: Mirrors | None = None
        cuda = context.device.type == "cuda"
        self.schedule = StreamSchedule(context.device) if cuda else None

    @hookimpl
    def overlap_buffers(
        self, layer_write_targets: list[CacheWriteTarget], max_batch: int, max_tokens: int
    ) -> dict[str, torch.Tensor]:
        """Each part's rebased read side, and a PAD-filled mirror of every layer
        backend's write target per part."""
        self.parts = PartBuffers(max_batch=max_batch, device=self.context.device)
        self.mirrors = Mirrors(layer_write_targets)
        return {**self.parts.buffers(), **self.mirrors.buffers()}

    @hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        """Every write-target mirror: each holds a part's copy of a backend's indices."""
        assert self.mirrors is not None  # the core calls overlap_buffers first
        return self.mirrors.write_targets()

    @hookimpl
    def plan_micro_batches(
        self, step: StepMetadata, layers: LayerBackends
    ) -> tuple[MicroBatch, ...] | None:
        """Two parts with their metadata in this plugin's mirrors, or ``None`` (too small)."""
        assert self.parts is not None and self.mirrors is not None
        cut = choose_cut(step, min_tokens=self.context.min_tokens,
                         min_decode_seqs=self.context.min_decode_seqs)
        if cut is None:
            return None
        parts = self.parts.split(step, cut)
        first_rows = parts[0].num_padded_tokens
        rows = (slice(0, first_rows), slice(first_rows, step.num_padded_tokens))
        out = []
        for m, (part, tokens) in enumerate(zip(parts, rows, strict=True)):
            own = (part.query_start_loc, part.context_lens, part.block_tables, part.positions)
            context = self.mirrors.relocate(m, layers.build(part), own, capture=step.is_capture)
            out.append(MicroBatch(tokens=tokens, step=part, context=context))
        return tuple(out)

    @hookimpl
    def forward_micro_batches(
        self, stack: LayerStack, micro_batches: tuple[MicroBatch, ...], input_ids: torch.Tensor
    ) -> torch.Tensor:
        """Layer by layer, part 0 one layer ahead; on two streams on CUDA."""
        if self.schedule is None:
            return run_in_turns(stack, micro_batches, input_ids)
        return self.schedule.run(stack, micro_batches, input_ids)
