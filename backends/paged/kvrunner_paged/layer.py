"""The attention layer object ``make_layer`` returns: store this step's KV, then attend.

Each forward builds one
:class:`~kvrunner_paged.ops.paged_attention.inputs.PagedAttentionInputs` and hands it to
the entry chosen for the step: decode or varlen (prefill), or deterministic mode's
fixed order for both. On Triton a decode step stores and attends in one launch (the
record's ``new_kv``); prefill and the torch path store first, then attend. Every entry
and store gets the layer's scale table (``kv_scales.py``), which FP8 pools are scaled by.
A layer that calculates its scales (``calculate_kv_scales``) sets them from its first
real prefill's keys and values, before it stores them.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvrunner.plugin_api import ForwardContext
from kvrunner_paged.cache import PagedKVPools
from kvrunner_paged.kv_format import checked_scale
from kvrunner_paged.kv_scales import KVScales
from kvrunner_paged.metadata import PagedMetadata
from kvrunner_paged.ops.paged_attention.decode_torch import paged_decode_attention_torch
from kvrunner_paged.ops.paged_attention.fixed_order_torch import fixed_order_attention_torch
from kvrunner_paged.ops.paged_attention.inputs import NewKV, PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.prefill_torch import paged_prefill_attention_torch
from kvrunner_paged.ops.store_kv.store_torch import store_kv_torch
from kvrunner_paged.ops.utils import unit_last_dim

#: an attention entry: keyword-only, one inputs record
Attend = Callable[..., torch.Tensor]


class PagedAttention:
    """Full (softmax) attention for one layer over its paged KV pool.

    Implements :class:`kvrunner.plugin_api.layers.FullAttentionImpl`. Kernels are chosen
    once, at construction: the Triton launchers when ``use_triton`` (compiled on CUDA,
    interpreted under ``TRITON_INTERPRET=1``), else the plain-torch path.
    """

    def __init__(
        self,
        *,
        backend_name: str,
        layer_index: int,
        pools: PagedKVPools,
        scales: KVScales,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        max_model_len: int,
        use_triton: bool,
        deterministic: bool = False,
    ) -> None:
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} not a multiple of num_kv_heads {num_kv_heads}")
        self.backend_name = backend_name
        self.layer_index = layer_index
        self.pools = pools
        #: every served layer's FP8 scales; this layer reads its own table
        self.scales = scales
        self.scale_table = scales.of(layer_index)
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.max_model_len = max_model_len
        self.use_triton = use_triton
        #: batch-invariant: every token attended in one order, prefill and decode alike
        self.deterministic = deterministic
        self._num_sms = _streaming_multiprocessors(pools.device)
        #: the store, then the entries of a decode step and of a varlen one
        self._store: Callable[..., None] = store_kv_torch
        self._decode: Attend = paged_decode_attention_torch
        self._varlen: Attend = paged_prefill_attention_torch
        if deterministic:
            self._decode = self._varlen = fixed_order_attention_torch
        if use_triton:
            # Imported here so the torch path never needs Triton installed.
            from kvrunner_paged.ops.paged_attention.decode import (
                choose_num_splits,
                paged_decode_attention,
            )
            from kvrunner_paged.ops.paged_attention.fixed_order import (
                fixed_order_attention,
                use_split_programs,
            )
            from kvrunner_paged.ops.paged_attention.prefill import paged_prefill_attention
            from kvrunner_paged.ops.store_kv.store import store_kv

            def split_decode(*, inputs: PagedAttentionInputs) -> torch.Tensor:
                # From static shapes only: a captured graph keeps this split count forever.
                splits = choose_num_splits(inputs.q.shape[0], self.num_kv_heads,
                                           self.max_model_len, self._num_sms)
                return paged_decode_attention(inputs=inputs, num_splits=splits)

            def fixed_order(*, inputs: PagedAttentionInputs) -> torch.Tensor:
                """Deterministic mode: decode and prefill rows attended in one order (keys
                in splits of a fixed number, each walked in fixed tiles from its start,
                the splits folded in order), so a token's reduction order is its own
                (``ops/paged_attention/fixed_order.py``;
                ``ops/paged_attention/fixed_order_torch.py`` says why the torch path is)."""
                assert inputs.num_seqs is not None and inputs.max_query_len is not None
                # From static shapes only, like the default decode's split count.
                split = use_split_programs(inputs.max_query_len, inputs.num_seqs,
                                           self.num_kv_heads, self.max_model_len, self._num_sms)
                return fixed_order_attention(inputs=inputs, max_context_len=self.max_model_len,
                                             split_programs=split)

            self._store = store_kv
            self._decode, self._varlen = split_decode, paged_prefill_attention
            if deterministic:
                self._decode = self._varlen = fixed_order

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        """Write ``k``/``v`` at the step's slots (PAD rows write nothing), then attend.

        ``q``: ``[rows, num_heads, head_dim]``; ``rows`` may exceed the real tokens by a
        padded tail (graph replay), whose outputs are zeros and which write nothing.
        """
        md = ctx.for_backend(self.backend_name, PagedMetadata)
        rows = q.shape[0]
        if rows > md.slot_mapping.shape[0]:
            raise ValueError(f"{rows} token rows but metadata for {md.slot_mapping.shape[0]}")
        k_cache, v_cache = self.pools.kv(self.layer_index)
        slots = md.slot_mapping[:rows]
        # On Triton a decode step's launch stores its keys and values: one launch a layer
        # fewer. Everything else stores first.
        fused = self.use_triton and md.is_decode
        if md.calibrates and md.num_tokens and self.layer_index in self.scales.uncalibrated:
            # A host flag, set once: no decode step, so no captured graph, comes here.
            self.scales.calibrate(self.layer_index, k[: md.num_tokens], v[: md.num_tokens])
        if not fused:
            self._store(k=k, v=v, k_cache=k_cache, v_cache=v_cache, slot_mapping=slots,
                        scales=self.scale_table)
        inputs = PagedAttentionInputs(
            q=unit_last_dim(q) if self.use_triton else q, k_cache=k_cache, v_cache=v_cache,
            block_tables=md.block_tables, context_lens=md.context_lens, scale=self.scale,
            scales=self.scale_table,
            query_start_loc=md.query_start_loc,
            # A replayed graph's padded rows are empty sequences: they attend nothing.
            num_seqs=md.num_padded_seqs if md.is_decode else md.num_seqs,
            max_query_len=md.max_query_len,
            new_kv=NewKV(k=unit_last_dim(k), v=unit_last_dim(v), slot_mapping=slots)
            if fused else None,
        )  # fmt: skip
        return (self._decode if md.is_decode else self._varlen)(inputs=inputs)

    def check_kv_scale(self, which: str, scale: torch.Tensor) -> None:
        """Refuse, by its shape, a scale :meth:`load_kv_scale` would refuse (a dry run's
        tensors have no values)."""
        self.scales.check(which, scale)

    def load_kv_scale(self, which: str, scale: torch.Tensor) -> None:
        """Set this layer's key (``which="k"``) or value scales from a checkpoint or a
        weight update: one number, or one per KV head of this rank. In place, so a
        captured graph replays with it; the layer no longer calibrates. A pool in the
        model's dtype keeps 1.0 (the scale is checked and ignored, as vLLM ignores it
        under ``kv_cache_dtype = "auto"``)."""
        if self.pools.fmt.quantized:
            self.scales.load(self.layer_index, which, scale)
        else:
            checked_scale(scale, self.num_kv_heads, f"{which}_scale")


def _streaming_multiprocessors(device: torch.device) -> int:
    """SM count on CUDA (sizes split-KV); 1 elsewhere, which turns splitting off."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
