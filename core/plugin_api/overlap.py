"""Data that crosses the boundary between the core and an *overlap* plugin.

An overlap plugin (``kvrunner-tbo`` is one) serves no layer type. It sits on top of
the layer backends: it may cut a step into micro-batches, give each one the layer
backends' metadata in buffers of its own, and run the model's layers over them in
an order that lets one micro-batch's communication overlap the other's compute.
Its hooks are the "overlap" section of :mod:`kvrunner.plugin_api.hookspecs`.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs
import torch

from kvrunner.plugin_api.step_data import CacheWriteTarget, ForwardContext, StepMetadata

#: ``layer(positions, hidden, residual, ctx) -> (hidden, residual)``; residual is
#: ``None`` before the first layer
DecoderLayer = Callable[
    [torch.Tensor, torch.Tensor, "torch.Tensor | None", ForwardContext],
    tuple[torch.Tensor, torch.Tensor],
]


@attrs.frozen(kw_only=True)
class OverlapContext:
    """What an overlap plugin is constructed with."""

    name: str
    device: torch.device
    max_num_seqs: int
    max_num_batched_tokens: int
    tensor_parallel_size: int
    #: prefill and mixed steps of fewer tokens than this run unsplit
    min_tokens: int
    #: decode steps (and decode graphs) of fewer sequences than this run unsplit
    min_decode_seqs: int


@attrs.frozen(kw_only=True)
class MicroBatch:
    """One part of a step: its token rows, its read side, every layer backend's metadata."""

    #: token rows of the whole step (padded rows included) this part computes
    tokens: slice
    #: the part as a step of its own; its tensors must live in persistent buffers
    step: StepMetadata
    #: the layer backends' metadata for this part, by backend name
    context: ForwardContext


@attrs.frozen(kw_only=True)
class LayerStack:
    """The model as an overlap plugin drives it: embedding, decoder layers, final norm.

    ``embed(input_ids)`` gives the first hidden states; every layer is a
    :data:`DecoderLayer`; ``norm(hidden, residual)`` gives the final hidden states.
    Running ``embed``, every layer in order, then ``norm`` over all rows is exactly
    the model's forward.
    """

    embed: Callable[[torch.Tensor], torch.Tensor]
    layers: Sequence[DecoderLayer]
    norm: Callable[[torch.Tensor, torch.Tensor | None], torch.Tensor]

    @classmethod
    def of(cls, decoder: Any) -> LayerStack:
        """From a decoder with ``embed_tokens``, ``layers`` and ``norm`` (every model here)."""
        return cls(
            embed=decoder.embed_tokens,
            layers=tuple(decoder.layers),
            norm=lambda x, residual: decoder.norm(x, residual)[0],
        )


class LayerBackends(Protocol):
    """The layer backends, as the core lets an overlap plugin call them."""

    def build(self, step: StepMetadata) -> ForwardContext:
        """Every layer backend's metadata for ``step``: ``build_capture_metadata`` when
        ``step.is_capture``, else ``build_metadata``. Each call overwrites the layer
        backends' own buffers; whatever must outlive the next call must be copied."""
        ...

    def write_targets(self) -> list[CacheWriteTarget]:
        """The layer backends' declared write targets (owned, validated)."""
        ...
