"""``PagedBackend``: the ``paged`` plugin, serving ``full_attention`` layers from a paged pool.

The hooks are thin: sizing and pools live in :mod:`.cache`, the backend's own
buffer and the metadata around it in :mod:`.builder`, the per-layer kernels in
:mod:`.layer`. Its one write target is ``slot_mapping``: the only buffer through
which its kernels write cache.
"""

from __future__ import annotations

import torch

from kvrunner.plugin_api import (
    PAD_SLOT_ID,
    PLUGIN_API_VERSION,
    BackendContext,
    CacheSpec,
    CacheWriteTarget,
    StepMetadata,
    hookimpl,
)
from kvrunner_paged.builder import PagedMetadataBuilder
from kvrunner_paged.cache import PagedKVPools, cache_rows
from kvrunner_paged.kv_format import KVFormat
from kvrunner_paged.kv_scales import KVScales
from kvrunner_paged.layer import PagedAttention
from kvrunner_paged.metadata import PagedMetadata

LAYER_TYPE = "full_attention"


class PagedBackend:
    """Paged KV cache + store/decode/prefill attention kernels, as a kvrunner backend."""

    plugin_api_version = PLUGIN_API_VERSION
    layer_types = (LAYER_TYPE,)
    #: how the conformance kit reads one KV slot of a pool
    cache_rows = staticmethod(cache_rows)
    #: its layers read everything but the pools and their scale tables (filled by no
    #: step's metadata) from the metadata it returns
    supports_overlap = True
    #: with ``context.deterministic`` every token is attended in one fixed order
    #: (``layer.py``, ``ops/paged_attention/fixed_order_torch.py``)
    batch_invariant = True
    #: "fp8": keys and values in float8 e4m3 with per-layer scales, per tensor or per KV
    #: head (``kv_format.py``; where they come from: ``kv_scales.py``), quantized by the
    #: store and scaled back by every attention entry, deterministic mode's included
    kv_cache_dtypes = ("auto", "fp8")

    def __init__(self, context: BackendContext) -> None:
        model = context.model
        if model.num_kv_heads < 1 or model.num_heads % model.num_kv_heads:
            raise ValueError(
                f"num_heads {model.num_heads} must be a positive multiple of "
                f"num_kv_heads {model.num_kv_heads}"
            )
        wrong = [i for i in context.layers if model.layer_types[i] != LAYER_TYPE]
        if wrong:
            raise ValueError(f"paged serves only {LAYER_TYPE} layers; asked for layers {wrong}")
        self.context = context
        self.name = context.name
        fmt = KVFormat.for_cache_dtype(context.kv_cache_dtype, context.dtype)
        self.pools = PagedKVPools(
            layers=context.layers,
            block_size=context.block_size,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            fmt=fmt,
            device=context.device,
        )
        #: the layers' FP8 scales: not a pool, so a sleep keeps them
        self.scales = KVScales(layers=context.layers, num_kv_heads=model.num_kv_heads,
                               device=context.device,
                               calculate=fmt.quantized and context.calculate_kv_scales)
        #: built by persistent_buffers, which the core calls before any metadata hook
        self.builder: PagedMetadataBuilder | None = None

    # -- sizing and allocation -------------------------------------------------------

    @hookimpl
    def cache_spec(self) -> CacheSpec:
        """Keys and values of one block over every served layer; no per-slot state."""
        return CacheSpec(bytes_per_block=self.pools.bytes_per_block)

    @hookimpl
    def allocate_cache(self, num_blocks: int) -> dict[str, torch.Tensor]:
        """One zeroed ``kv.<layer>`` pool per served layer."""
        return self.pools.allocate(num_blocks)

    @hookimpl
    def release_cache(self) -> None:
        """Drop the pools; layers find the next allocation by looking them up again."""
        self.pools.release()

    # -- forward_vars and metadata ---------------------------------------------------

    @hookimpl
    def persistent_buffers(self, max_batch: int, max_tokens: int) -> dict[str, torch.Tensor]:
        """``slot_mapping``: the only buffer paged owns (the read side is the core's)."""
        self.builder = PagedMetadataBuilder(
            max_batch=max_batch, max_tokens=max_tokens, device=self.context.device
        )
        return self.builder.buffers()

    @hookimpl
    def build_metadata(self, step: StepMetadata) -> PagedMetadata:
        """Fill ``slot_mapping`` (PAD past the real tokens); the read side is shared."""
        assert self.builder is not None  # the manager calls persistent_buffers first
        return self.builder.fill(step)

    @hookimpl
    def build_capture_metadata(self, step: StepMetadata) -> PagedMetadata:
        """The core's capture read side as is; ``slot_mapping`` untouched."""
        assert self.builder is not None
        return self.builder.fill_capture(step)

    # -- capture safety ----------------------------------------------------------------

    @hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        """``slot_mapping``: where ``store_kv`` writes each token's keys and values."""
        assert self.builder is not None
        return [CacheWriteTarget(name="slot_mapping", buffer=self.builder.slot_mapping,
                                 pad_value=PAD_SLOT_ID)]

    # -- layers ------------------------------------------------------------------------

    @hookimpl
    def make_layer(self, layer_index: int) -> PagedAttention:
        """A :class:`PagedAttention` over the layer's own pool."""
        model = self.context.model
        return PagedAttention(
            backend_name=self.name,
            layer_index=layer_index,
            pools=self.pools,
            scales=self.scales,
            num_heads=model.num_heads,
            num_kv_heads=model.num_kv_heads,
            head_dim=model.head_dim,
            max_model_len=self.context.max_model_len,
            use_triton=self.context.use_triton,
            deterministic=self.context.deterministic,
        )
