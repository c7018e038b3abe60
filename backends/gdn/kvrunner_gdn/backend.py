"""``GDNBackend``: the ``gdn`` plugin, serving ``linear_attention`` layers.

The hooks are thin: the per-slot state pools live in :mod:`.state`, the backend's
own index buffers and the metadata around them in :mod:`.metadata`, the per-layer
kernels in :mod:`.layer`. Write targets (every buffer through which a kernel writes
state; PAD = -1):

- ``decode_state_indices``: decode write side, in forward_vars;
- ``prefill_state_indices_in_tensor``: prefill/mixed write side, on the builder
  only (not in forward_vars) -- blanking it proves the core reaches past forward_vars.
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
from kvrunner_gdn.layer import GDNLayer
from kvrunner_gdn.metadata import GDNMetadata, GDNMetadataBuilder
from kvrunner_gdn.ops.utils import DEFAULT_CHUNK
from kvrunner_gdn.prefill_choice import choose_prefill_kernel
from kvrunner_gdn.state import GDNShapes, GDNStatePool, cache_rows

LAYER_TYPE = "linear_attention"


class GDNBackend:
    """Gated-DeltaNet recurrent-state backend (Qwen3-Next linear attention)."""

    plugin_api_version = PLUGIN_API_VERSION
    layer_types = (LAYER_TYPE,)
    #: how the conformance kit reads one request slot of a pool
    cache_rows = staticmethod(cache_rows)
    #: its layers read everything but the pools from the metadata it returns
    supports_overlap = True
    #: its recurrent and convolution state stays in the model's dtype whatever
    #: ``kv_cache_dtype`` says: it holds no keys and values, and a state in FP8 would
    #: carry its rounding into every later token (vLLM keeps mamba state apart from
    #: ``--kv-cache-dtype`` too). So an fp8 KV engine over a hybrid model runs, with
    #: fp8 keys and values in the full-attention layers only.
    kv_cache_dtypes = ("auto", "fp8")
    #: tokens per chunk of the chunked prefill (rounded up to a power of two >= 16 by
    #: the Triton kernel); an instance attribute may override it before make_layer.
    chunk_size = DEFAULT_CHUNK

    def __init__(self, context: BackendContext) -> None:
        wrong = [i for i in context.layers if context.model.layer_types[i] != LAYER_TYPE]
        if wrong:
            raise ValueError(f"gdn serves only {LAYER_TYPE} layers; asked for layers {wrong}")
        self.context = context
        self.name = context.name
        self.shapes = GDNShapes.from_model(context.model)
        self.pool = GDNStatePool(self.shapes, context.layers, context.device)
        #: "fla", "triton" or "torch": every layer's chunked prefill, chosen here once
        #: (``[kernels] gdn_prefill``, see :mod:`kvrunner_gdn.prefill_choice`)
        self.prefill_kernel = choose_prefill_kernel(
            use_triton=context.use_triton, device=context.device, dtype=context.dtype,
            head_k_dim=self.shapes.head_k_dim, mode=context.options.get("prefill", "auto"),
        )
        #: built by persistent_buffers, which the core calls before any metadata hook
        self.builder: GDNMetadataBuilder | None = None

    # -- sizing and allocation -------------------------------------------------------

    @hookimpl
    def cache_spec(self) -> CacheSpec:
        """Conv and recurrent state of one request slot over every served layer."""
        return CacheSpec(bytes_per_slot=self.pool.bytes_per_slot)

    @hookimpl
    def allocate_cache(self, num_slots: int) -> dict[str, torch.Tensor]:
        """``conv.<layer>`` and ``ssm.<layer>`` per served layer, one row per slot."""
        return self.pool.allocate(num_slots)

    @hookimpl
    def release_cache(self) -> None:
        """Drop the pools; layers find the next allocation by looking them up again."""
        self.pool.release()

    # -- forward_vars and metadata ---------------------------------------------------

    @hookimpl
    def persistent_buffers(self, max_batch: int, max_tokens: int) -> dict[str, torch.Tensor]:
        """The decode state indices (the prefill side stays on the builder)."""
        del max_tokens  # state is indexed per sequence, never per token
        self.builder = GDNMetadataBuilder(
            max_batch=max_batch, max_num_seqs=self.context.max_num_seqs,
            device=self.context.device,
        )
        return self.builder.buffers()

    @hookimpl
    def build_metadata(self, step: StepMetadata) -> GDNMetadata:
        """Fill the read and write state indices (PAD past the real sequences)."""
        assert self.builder is not None  # the manager calls persistent_buffers first
        return self.builder.build(step)

    @hookimpl
    def build_capture_metadata(self, step: StepMetadata) -> GDNMetadata:
        """Read indices PAD (no history); the write side untouched."""
        assert self.builder is not None
        return self.builder.build_capture(step)

    # -- capture safety ----------------------------------------------------------------

    @hookimpl
    def cache_write_targets(self) -> list[CacheWriteTarget]:
        """Both write-index buffers, the one outside forward_vars included."""
        assert self.builder is not None
        b = self.builder
        return [
            CacheWriteTarget(name="decode_state_indices", buffer=b.decode_state_indices,
                             pad_value=PAD_SLOT_ID),
            CacheWriteTarget(name="prefill_state_indices_in_tensor",
                             buffer=b.prefill_state_indices_in_tensor, pad_value=PAD_SLOT_ID),
        ]

    # -- layers ------------------------------------------------------------------------

    @hookimpl
    def make_layer(self, layer_index: int) -> GDNLayer:
        """A :class:`GDNLayer` over the layer's own conv and recurrent state."""
        return GDNLayer(
            layer_index=layer_index,
            backend_name=self.name,
            shapes=self.shapes,
            pool=self.pool,
            use_triton=self.context.use_triton,
            chunk_size=self.chunk_size,
            prefill_kernel=self.prefill_kernel,
        )
