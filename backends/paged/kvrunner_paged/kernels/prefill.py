"""Triton kernel: causal varlen attention over the paged pool, with a cached prefix.

One program per (query tile, sequence, query head). Sequence ``i`` has ``q_len``
new queries at positions ``ctx_len - q_len .. ctx_len - 1`` (the cached prefix is
everything before); the tile walks key positions from 0 up to its last query's
position in tiles of ``BLOCK_N``, looks each position's block up in the block table,
and keeps an online softmax (base 2). Keys past a query's own position are masked,
so the tiles after the diagonal are never loaded at all.

This path also serves mixed batches: a decoding sequence is one with ``q_len == 1``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrunner_paged.kernels.tile import LOG2_E, NEG_BIG, attend_tile


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    out_ptr,
    scale_log2,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    block_size,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    seq = tl.program_id(1).to(tl.int64)
    head = tl.program_id(2)
    kv_head = head // GROUP

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_M < q_len:
        ctx_len = tl.load(context_lens_ptr + seq)
        prefix = ctx_len - q_len  # position of the sequence's first query
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < q_len
        query_pos = prefix + rows
        dims = tl.arange(0, BLOCK_D)
        dim_mask = dims < HEAD_DIM
        q_mask = row_mask[:, None] & dim_mask[None, :]
        tokens = (q_start + rows).to(tl.int64)
        q = tl.load(q_ptr + tokens[:, None] * stride_qt + head * stride_qh + dims[None, :],
                    mask=q_mask, other=0.0)

        m_i = tl.full([BLOCK_M], NEG_BIG, dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        table = block_tables_ptr + seq * stride_bt
        # Causality bounds the keys this tile needs: up to its last real query.
        kv_end = tl.minimum(ctx_len, prefix + tl.minimum((tile + 1) * BLOCK_M, q_len))
        for start in range(0, kv_end, BLOCK_N):
            m_i, l_i, acc = attend_tile(
                q, m_i, l_i, acc, start, kv_end, query_pos, table, k_cache_ptr, v_cache_ptr,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                kv_head, block_size, dims, dim_mask, scale_log2,
                CAUSAL=True, BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
            )  # fmt: skip

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
        dst = out_ptr + tokens[:, None] * stride_ot + head * stride_oh + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    context_lens: torch.Tensor,
    scale: float,
    *,
    num_seqs: int,
    max_query_len: int,
    block_m: int = 64,
    block_n: int = 32,
    num_warps: int = 4,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of each sequence's new queries over its paged keys.

    :param q: ``[num_tokens, num_heads, head_dim]``; sequence ``i`` owns rows
        ``query_start_loc[i]:query_start_loc[i+1]``.
    :param k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]`` (``v_cache`` too),
        already holding this step's keys (store first, then attend).
    :param block_tables: ``[>= num_seqs, max_blocks_per_seq]`` int32.
    :param query_start_loc: ``[>= num_seqs + 1]`` int32 cumulative query lengths.
    :param context_lens: ``[>= num_seqs]`` int32, cached prefix + new queries.
    :param max_query_len: the longest ``q_len`` (sizes the grid; host-known).
    :returns: ``out`` (allocated like ``q`` when not given). Rows of ``q`` owned by no
        sequence are left as they were in ``out`` (zeros when allocated here).
    """
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "num_heads must be a multiple of num_kv_heads"
    assert q.stride(-1) == 1 and k_cache.stride(-1) == 1 and v_cache.stride(-1) == 1
    assert block_tables.stride(-1) == 1
    if out is None:
        out = torch.zeros_like(q)
    if num_seqs == 0 or max_query_len == 0:
        return out
    grid = (triton.cdiv(max_query_len, block_m), num_seqs, num_heads)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, query_start_loc, context_lens,
        out,
        scale * LOG2_E,
        q.stride(0), q.stride(1),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_tables.stride(0),
        out.stride(0), out.stride(1),
        k_cache.shape[1],
        GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        num_warps=num_warps,
    )
    return out
