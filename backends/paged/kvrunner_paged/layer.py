"""The attention layer object ``make_layer`` returns: store this step's KV, then attend.

On Triton a decode step does both in one launch (the decode kernel stores the keys
and values it attends); prefill and the torch path store first, then attend.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

from kvrunner.plugin_api import ForwardContext
from kvrunner_paged.cache import PagedKVPools
from kvrunner_paged.kernels import torch_ops
from kvrunner_paged.kernels.invariant_torch import fixed_order_attention_torch
from kvrunner_paged.metadata import PagedMetadata


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
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = head_dim**-0.5
        self.max_model_len = max_model_len
        self.use_triton = use_triton
        #: batch-invariant: every token attended in one order, prefill and decode alike
        self.deterministic = deterministic
        self._num_sms = _streaming_multiprocessors(pools.device)
        if use_triton:
            # Imported here so the torch path never needs Triton installed.
            from kvrunner_paged.kernels.decode import choose_num_splits, paged_decode_attention
            from kvrunner_paged.kernels.fixed_order import (
                fixed_order_attention,
                use_split_programs,
            )
            from kvrunner_paged.kernels.prefill import paged_prefill_attention
            from kvrunner_paged.kernels.store_kv import store_kv

            self._store: Callable[..., None] = store_kv
            self._decode = paged_decode_attention
            self._prefill = paged_prefill_attention
            self._choose_splits = choose_num_splits
            self._fixed_order = fixed_order_attention
            self._use_split_programs = use_split_programs
        else:
            self._store = torch_ops.store_kv_torch

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
        if self.deterministic:
            return self._fixed_order_attention(q, k, v, k_cache, v_cache, slots, md)
        if md.is_decode:
            return self._decode_attention(q, k, v, k_cache, v_cache, slots, md)
        self._store(k, v, k_cache, v_cache, slots)
        return self._prefill_attention(q, k_cache, v_cache, md)

    def _decode_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        md: PagedMetadata,
    ) -> torch.Tensor:
        rows = q.shape[0]
        if rows > md.context_lens.shape[0]:
            raise ValueError(f"{rows} decode rows but metadata for {md.context_lens.shape[0]}")
        if not self.use_triton:
            self._store(k, v, k_cache, v_cache, slots)
            return torch_ops.paged_decode_attention_torch(
                q, k_cache, v_cache, md.block_tables, md.context_lens, self.scale
            )
        # From static shapes only: a captured graph keeps this split count forever.
        splits = self._choose_splits(rows, self.num_kv_heads, self.max_model_len, self._num_sms)
        # The kernel stores this step's keys and values itself: one launch a layer fewer.
        return self._decode(
            _contiguous_rows(q), k_cache, v_cache, md.block_tables, md.context_lens, self.scale,
            num_splits=splits,
            new_kv=(_contiguous_rows(k), _contiguous_rows(v), slots),
        )

    def _prefill_attention(
        self, q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, md: PagedMetadata
    ) -> torch.Tensor:
        if not self.use_triton:
            return torch_ops.paged_prefill_attention_torch(
                q, k_cache, v_cache, md.block_tables, md.query_start_loc, md.context_lens,
                self.scale, md.num_seqs,
            )
        # The launcher allocates zeros, so token rows owned by no sequence stay finite.
        return self._prefill(
            _contiguous_rows(q), k_cache, v_cache, md.block_tables, md.query_start_loc,
            md.context_lens, self.scale, num_seqs=md.num_seqs, max_query_len=md.max_query_len,
        )


    def _fixed_order_attention(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        k_cache: torch.Tensor,
        v_cache: torch.Tensor,
        slots: torch.Tensor,
        md: PagedMetadata,
    ) -> torch.Tensor:
        """Deterministic mode: decode and prefill rows attended in one order (keys in
        splits of a fixed number, each walked in fixed tiles from its start, the
        splits folded in order), so a token's reduction order is its own
        (``kernels/fixed_order.py``; ``kernels/invariant_torch.py`` says why the
        torch path is)."""
        # A replayed graph's padded rows are empty sequences: they attend nothing.
        num_seqs = md.num_padded_seqs if md.is_decode else md.num_seqs
        if not self.use_triton:
            self._store(k, v, k_cache, v_cache, slots)
            return fixed_order_attention_torch(
                q, k_cache, v_cache, md.block_tables, md.query_start_loc, md.context_lens,
                self.scale, num_seqs,
            )
        # A decode step stores its keys in the attending launch (one launch a layer fewer).
        new_kv = (_contiguous_rows(k), _contiguous_rows(v), slots) if md.is_decode else None
        if new_kv is None:
            self._store(k, v, k_cache, v_cache, slots)
        # From static shapes only, like the default decode's split count.
        split = self._use_split_programs(md.max_query_len, num_seqs, self.num_kv_heads,
                                         self.max_model_len, self._num_sms)
        return self._fixed_order(
            _contiguous_rows(q), k_cache, v_cache, md.block_tables, md.query_start_loc,
            md.context_lens, self.scale, num_seqs=num_seqs, max_query_len=md.max_query_len,
            max_context_len=self.max_model_len, split_programs=split, new_kv=new_kv,
        )


def _contiguous_rows(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def _streaming_multiprocessors(device: torch.device) -> int:
    """SM count on CUDA (sizes split-KV); 1 elsewhere, which turns splitting off."""
    if device.type == "cuda" and torch.cuda.is_available():
        return torch.cuda.get_device_properties(device).multi_processor_count
    return 1
