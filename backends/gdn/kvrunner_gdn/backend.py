"""``GDNBackend``: the ``gdn`` entry point, serving ``linear_attention`` layers.

One instance per runner, built by :class:`kvrunner.plugins.BackendManager` from a
:class:`~kvrunner.contract.BackendContext`. It owns the per-slot state pools
(:mod:`kvrunner_gdn.state`), the index buffers and their builder
(:mod:`kvrunner_gdn.metadata`) and hands the model one :class:`GDNLayer` per layer.

Write targets (every buffer through which a kernel writes state; PAD = -1):

- ``decode_state_indices``: decode write side, in forward_vars;
- ``prefill_state_indices_in_tensor``: prefill/mixed write side, on the builder
  only (not in forward_vars) -- blanking it proves the core reaches past forward_vars.
"""

from __future__ import annotations

from typing import Any

import torch

from kvrunner.contract import (
    PAD_SLOT_ID,
    PLUGIN_API_VERSION,
    BackendContext,
    CacheSpec,
    CacheWriteTarget,
    StepBatch,
)
from kvrunner.hookspecs import hookimpl
from kvrunner_gdn.kernels.chunked_prefill import DEFAULT_CHUNK
from kvrunner_gdn.layer import GDNLayer
from kvrunner_gdn.metadata import GDNMetadata, GDNMetadataBuilder
from kvrunner_gdn.state import GDNShapes, GDNStatePool

LAYER_TYPE = "linear_attention"


class GDNBackend:
    """Gated-DeltaNet recurrent-state backend (Qwen3-Next linear attention)."""

    plugin_api_version = PLUGIN_API_VERSION
    layer_types = (LAYER_TYPE,)
    write_targets = ("decode_state_indices", "prefill_state_indices_in_tensor")
    #: tokens per chunk of the chunked prefill (rounded up to a power of two >= 16 by
    #: the Triton kernel); an instance attribute may override it before make_layer.
    chunk_size = DEFAULT_CHUNK

    def __init__(self, context: BackendContext) -> None:
        self.context = context
        self.name = context.name
        self.shapes = GDNShapes.from_model(context.model)
        types = context.model.layer_types
        wrong = [i for i in context.layers if types[i] != LAYER_TYPE]
        if wrong:
            raise ValueError(f"gdn serves only {LAYER_TYPE} layers; asked for layers {wrong}")
        self.layers = tuple(context.layers)
        self.pool = GDNStatePool(self.shapes, self.layers, context.device)
        self.builder = GDNMetadataBuilder(context.max_num_seqs, context.device)

    # -- sizing / allocation -------------------------------------------------------

    @hookimpl
    def cache_spec(self) -> CacheSpec:
        return CacheSpec(
            backend=self.name, bytes_per_block=0, bytes_per_slot=self.pool.bytes_per_slot
        )

    @hookimpl
    def allocate_cache(self, num_blocks: int, num_slots: int) -> dict[str, torch.Tensor]:
        # num_blocks is irrelevant: GDN state is per request slot, not per KV block.
        return self.pool.allocate(num_slots)

    @hookimpl
    def release_cache(self) -> None:
        self.pool.release()

    # -- forward_vars / metadata ---------------------------------------------------

    @hookimpl
    def persistent_buffers(self, max_batch: int, max_tokens: int) -> dict[str, torch.Tensor]:
        self.builder.ensure_decode_capacity(max_batch)
        return {
            "decode_state_indices": self.builder.decode_state_indices,
            "decode_read_indices": self.builder.decode_read_indices,
        }

    @hookimpl
    def build_metadata(self, batch: StepBatch) -> tuple[str, GDNMetadata]:
        return self.name, self.builder.build(batch)

    @hookimpl
    def build_capture_metadata(self, batch_size: int) -> tuple[str, GDNMetadata]:
        return self.name, self.builder.build_capture(batch_size)

    # -- capture safety ------------------------------------------------------------

    @hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        b = self.builder
        return [
            CacheWriteTarget(backend=self.name, name="decode_state_indices",
                             buffer=b.decode_state_indices, pad_value=PAD_SLOT_ID),
            CacheWriteTarget(backend=self.name, name="prefill_state_indices_in_tensor",
                             buffer=b.prefill_state_indices_in_tensor, pad_value=PAD_SLOT_ID),
        ]

    # -- layers --------------------------------------------------------------------

    @hookimpl
    def make_layer(self, layer_index: int, layer_type: str) -> Any | None:
        if layer_type != LAYER_TYPE or layer_index not in self.layers:
            return None
        return GDNLayer(
            layer_index=layer_index,
            backend_name=self.name,
            shapes=self.shapes,
            pool=self.pool,
            use_triton=self.context.use_triton,
            chunk_size=self.chunk_size,
        )
