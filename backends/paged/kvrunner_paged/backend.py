"""``PagedBackend``: the ``paged`` plugin, serving ``full_attention`` layers from a paged pool.

The hooks are thin: sizing and pools live in :mod:`.cache`, the persistent buffers
and the metadata they hold in :mod:`.builder`, the per-layer kernels in :mod:`.layer`.
Its one write target is ``slot_mapping``: the only buffer through which its kernels
write cache.
"""

from __future__ import annotations

from typing import Any

import torch

import kvrunner
from kvrunner.contract import (
    PAD_SLOT_ID,
    BackendContext,
    CacheSpec,
    CacheWriteTarget,
    StepBatch,
)
from kvrunner_paged.builder import MetadataBuilder
from kvrunner_paged.cache import PagedKVPools
from kvrunner_paged.layer import PagedAttention
from kvrunner_paged.metadata import PagedMetadata

LAYER_TYPE = "full_attention"


class PagedBackend:
    """Paged KV cache + store/decode/prefill attention kernels, as a kvrunner backend."""

    plugin_api_version = kvrunner.PLUGIN_API_VERSION
    layer_types = (LAYER_TYPE,)
    write_targets = ("slot_mapping",)

    def __init__(self, context: BackendContext) -> None:
        model = context.model
        if model.num_kv_heads < 1 or model.num_heads % model.num_kv_heads:
            raise ValueError(
                f"num_heads {model.num_heads} must be a positive multiple of "
                f"num_kv_heads {model.num_kv_heads}"
            )
        foreign = [i for i in context.layers if model.layer_types[i] != LAYER_TYPE]
        if foreign:
            raise ValueError(f"paged serves {LAYER_TYPE} layers only; asked for layers {foreign}")
        self.context = context
        self.name = context.name
        #: enough logical blocks for the longest sequence the model allows
        self.max_blocks_per_seq = -(-context.max_model_len // context.block_size)
        self.pools = PagedKVPools(
            layers=context.layers,
            block_size=context.block_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            dtype=context.dtype,
            device=context.device,
        )
        self.builder: MetadataBuilder | None = None

    def _require_builder(self, hook: str) -> MetadataBuilder:
        if self.builder is None:
            raise RuntimeError(f"{hook} called before persistent_buffers")
        return self.builder

    # --- sizing and allocation -------------------------------------------------------

    @kvrunner.hookimpl
    def cache_spec(self) -> CacheSpec:
        return CacheSpec(backend=self.name, bytes_per_block=self.pools.bytes_per_block)

    @kvrunner.hookimpl
    def allocate_cache(self, num_blocks: int, num_slots: int) -> dict[str, torch.Tensor]:
        del num_slots  # paged KV has no per-request state
        return self.pools.allocate(num_blocks)

    @kvrunner.hookimpl
    def release_cache(self) -> None:
        self.pools.release()

    # --- forward_vars and metadata ---------------------------------------------------

    @kvrunner.hookimpl
    def persistent_buffers(self, max_batch: int, max_tokens: int) -> dict[str, torch.Tensor]:
        """Created once; a repeated call with the same sizes returns the same tensors."""
        if self.builder is not None:
            same = (self.builder.max_batch, self.builder.max_tokens) == (max_batch, max_tokens)
            if not same:
                raise RuntimeError(
                    "paged persistent buffers already exist for "
                    f"({self.builder.max_batch}, {self.builder.max_tokens}); refusing to "
                    f"reallocate them for ({max_batch}, {max_tokens}) under captured graphs"
                )
            return self.builder.buffers()
        self.builder = MetadataBuilder(
            max_batch=max_batch,
            max_tokens=max_tokens,
            max_blocks_per_seq=self.max_blocks_per_seq,
            device=self.context.device,
        )
        return self.builder.buffers()

    @kvrunner.hookimpl
    def build_metadata(self, batch: StepBatch) -> tuple[str, PagedMetadata]:
        return self.name, self._require_builder("build_metadata").fill(batch)

    @kvrunner.hookimpl
    def build_capture_metadata(self, batch_size: int) -> tuple[str, PagedMetadata]:
        return self.name, self._require_builder("build_capture_metadata").fill_capture(batch_size)

    # --- capture safety --------------------------------------------------------------

    @kvrunner.hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        builder = self._require_builder("cache_write_targets")
        return [
            CacheWriteTarget(
                backend=self.name,
                name="slot_mapping",
                buffer=builder.slot_mapping,
                pad_value=PAD_SLOT_ID,
            )
        ]

    # --- layers ----------------------------------------------------------------------

    @kvrunner.hookimpl
    def make_layer(self, layer_index: int, layer_type: str) -> Any | None:
        if layer_type != LAYER_TYPE or layer_index not in self.context.layers:
            return None
        model = self.context.model
        return PagedAttention(
            backend_name=self.name,
            layer_index=layer_index,
            pools=self.pools,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            max_model_len=self.context.max_model_len,
            use_triton=self.context.use_triton,
        )
