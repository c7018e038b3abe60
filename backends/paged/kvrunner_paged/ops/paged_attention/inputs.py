"""What every paged-attention entry takes: one step's queries over the paged KV pool.

Shapes, throughout the paged backend:

* ``k_cache`` / ``v_cache``: ``[num_blocks, block_size, num_kv_heads, head_dim]``; slot
  ``s`` is block ``s // block_size``, offset ``s % block_size``
* ``block_tables``: ``[>= S, max_blocks_per_seq]`` physical block per logical block
* ``context_lens``: ``[>= S]`` cached tokens *including* this step's queries
* ``query_start_loc``: ``[>= S + 1]`` cumulative query lengths

The decode entries (``decode*``) take one query per row: row ``i`` is sequence ``i``,
its query at position ``context_lens[i] - 1``, and they read neither
``query_start_loc`` nor the host sizes. The varlen entries (``prefill*``,
``fixed_order*``) take concatenated sequences: sequence ``s`` owns rows
``query_start_loc[s]:query_start_loc[s+1]``, the last ``q_len`` positions of its
``context_lens[s]`` keys, and its query ``j`` sees keys at positions
``<= context_lens[s] - q_len + j`` (a decode row is a sequence of one query). Either
way a sequence with no keys outputs zeros, and no entry reads a slot outside a
sequence's context.

FP8 caches (``float8_e4m3fn``) hold keys over their key scale and values over their
value scale, one of each per KV head, from the layer's scale table ``scales``
(:func:`~kvrunner_paged.kv_format.scale_table`): every entry attends ``stored * scale``
(the Triton kernels fold a head's key scale into the softmax scale and its value scale
into the output), and an entry that stores (``new_kv``) quantizes by them.
"""

from __future__ import annotations

from collections.abc import Iterator

import attrs
import torch


@attrs.frozen(kw_only=True)
class NewKV:
    """A decode step's keys and values, for an entry that stores them as it attends."""

    #: ``[rows, num_kv_heads, head_dim]``: row ``i``'s key for position
    #: ``context_lens[i] - 1``; any row/head strides, a unit last-dim stride
    k: torch.Tensor
    v: torch.Tensor  #: likewise, the values
    slot_mapping: torch.Tensor  #: ``[>= rows]`` int: row ``i``'s slot; one < 0 stores nothing


@attrs.frozen(kw_only=True)
class PagedAttentionInputs:
    """One step's inputs; the pools are written only through ``new_kv``."""

    q: torch.Tensor  #: ``[T, num_heads, head_dim]``; the output has its shape and dtype
    k_cache: torch.Tensor  #: ``[num_blocks, block_size, num_kv_heads, head_dim]``
    v_cache: torch.Tensor  #: likewise, the values
    block_tables: torch.Tensor  #: ``[>= S, max_blocks_per_seq]`` int32
    context_lens: torch.Tensor  #: ``[>= S]`` int32; 0 for a padded sequence
    scale: float  #: the softmax scale (``head_dim ** -0.5`` for the model)
    #: FP8 caches: the layer's ``[4, num_kv_heads]`` float32 scale table (rows: key
    #: scales, value scales, their reciprocals), read on the device; None: every scale
    #: 1.0. Ignored for caches in any other dtype.
    scales: torch.Tensor | None = None
    #: varlen entries: ``[>= S + 1]`` int32 cumulative query lengths
    query_start_loc: torch.Tensor | None = None
    #: varlen entries: ``S``, the step's sequences (a host int)
    num_seqs: int | None = None
    #: varlen Triton entries: the longest ``q_len`` (a host int: it sizes the grid)
    max_query_len: int | None = None
    #: the entries that store as they attend (Triton decode, and fixed order for one
    #: query a sequence): this step's keys and values, stored to their slots before
    #: they are attended. Without it the pools must already hold every position.
    new_kv: NewKV | None = None

    def sequences(self, *, varlen: bool, triton: bool = False, stores: bool = False) -> int:
        """Check shapes for a varlen or a decode entry (for a ``triton`` one also the unit
        last-dim strides its kernels address by; ``new_kv`` only where the entry
        ``stores``); the number of sequences."""
        q, k_cache, v_cache, tables = self.q, self.k_cache, self.v_cache, self.block_tables
        if q.dim() != 3 or k_cache.dim() != 4 or v_cache.shape != k_cache.shape:
            raise ValueError(f"expected q [T, H, D] and caches [blocks, block_size, Hkv, D], got "
                             f"q {tuple(q.shape)}, caches {tuple(k_cache.shape)} and "
                             f"{tuple(v_cache.shape)}")
        num_kv_heads = k_cache.shape[2]
        if q.shape[2] != k_cache.shape[3] or q.shape[1] % num_kv_heads:
            raise ValueError(f"q {tuple(q.shape)}: num_heads must be a multiple of num_kv_heads "
                             f"{num_kv_heads} and head_dim the caches' {k_cache.shape[3]}")
        if varlen:
            if self.query_start_loc is None or self.num_seqs is None:
                raise ValueError("a varlen entry needs query_start_loc and num_seqs")
            if triton and self.max_query_len is None:
                raise ValueError("a Triton varlen entry needs max_query_len (it sizes the grid)")
            seqs = self.num_seqs
            if self.query_start_loc.shape[0] < seqs + 1:
                raise ValueError(f"{seqs} sequences but query_start_loc "
                                 f"{tuple(self.query_start_loc.shape)}")
        else:
            seqs = q.shape[0]  # one query per row
        if tables.shape[0] < seqs or self.context_lens.shape[0] < seqs:
            raise ValueError(f"{seqs} sequences but block tables for {tables.shape[0]} and "
                             f"context lengths for {self.context_lens.shape[0]}")
        if triton and any(t.stride(-1) != 1 for t in (q, k_cache, v_cache, tables)):
            raise ValueError("q, the caches and block_tables need a unit last-dim stride")
        if self.new_kv is not None:
            k, v = self.new_kv.k, self.new_kv.v
            if not stores:
                raise ValueError("this entry stores nothing: store_kv first, then attend")
            if k.shape != (q.shape[0], num_kv_heads, q.shape[2]) or v.shape != k.shape:
                raise ValueError(f"new_kv k {tuple(k.shape)} and v {tuple(v.shape)} must be "
                                 f"[{q.shape[0]}, {num_kv_heads}, {q.shape[2]}]")
            if k.stride(-1) != 1 or v.stride(-1) != 1:
                raise ValueError("new_kv's k and v need a unit last-dim stride")
        return seqs

    def pool_strides(self) -> tuple[int, ...]:
        """The Triton kernels' pool strides, in the order they take them: the key cache's
        block, slot and head strides, the value cache's, the block tables' row stride."""
        return (*self.k_cache.stride()[:3], *self.v_cache.stride()[:3],
                self.block_tables.stride(0))

    def sequence_rows(self) -> Iterator[tuple[int, int, int, int]]:
        """The varlen torch paths' host loop: ``(sequence, first row, end row, context
        length)`` of every sequence with both queries and keys (the offsets are read
        back to the host)."""
        assert self.query_start_loc is not None and self.num_seqs is not None  # by sequences
        starts = self.query_start_loc[: self.num_seqs + 1].tolist()
        lens = self.context_lens[: self.num_seqs].tolist()
        for i in range(self.num_seqs):
            if starts[i + 1] != starts[i] and lens[i] != 0:
                yield i, starts[i], starts[i + 1], lens[i]
