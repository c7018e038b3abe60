"""The online-softmax tile loop every paged attention kernel runs (Triton, base 2).

One call attends a block of query rows to ``BLOCK_N`` key positions of one sequence:
it looks each position's block up in the block table, loads keys and values, and
folds the tile into the running max ``m_i``, denominator ``l_i`` and accumulator
``acc``. The rows may be several query heads of one GQA group (decode: the group of
one token; prefill: a tile of tokens times the group), since they share the keys.

Two masks, each compiled in or out (``tl.constexpr``), so the tiles that need none
(prefill tiles wholly before the diagonal, the bulk of the work) pay nothing for them:

* ``MASK_KEYS``: positions at or past ``hi`` are neither read (no stale or unwritten
  slot is ever touched) nor seen (their score is ``-inf``, unless ``CAUSAL`` masks
  them already, see below);
* ``CAUSAL``: a row sees keys at positions ``<= query_pos`` of the row.

:func:`walk_keys` walks a range of key positions with it for a tile of query rows,
and :func:`query_tile` loads such a tile (the prefill and fixed-order kernels).

Keys and values are widened to the queries' dtype as they load: exact for an FP8
pool, whose scales the callers fold in (``k_scale`` into ``scale_log2``, ``v_scale``
into the finished output), and nothing at all for a pool in the queries' dtype.

The running max ``m_i`` is kept in scaled units (``scores * scale_log2``) while the
raw scores are scaled only inside ``exp2``: ``max`` commutes with a positive scale,
and ``s * scale - m`` is one fused multiply-add per score instead of two operations.
"""

from __future__ import annotations

import triton
import triton.language as tl

#: ``exp(x) == exp2(x * LOG2_E)``: the launchers scale by it once
LOG2_E = 1.4426950408889634
# A finite stand-in for -inf as the running max: exp2(x - NEG_BIG) stays 0 and
# NEG_BIG - NEG_BIG stays 0, so all-masked tiles never produce NaN.
NEG_BIG = tl.constexpr(-1.0e30)


@triton.jit
def _load_kv_rows(
    ptrs, pos, hi, dims, MASK_KEYS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr
):
    """``[BLOCK_N, BLOCK_D]`` rows at ``ptrs``; masked positions and padded dims read as 0."""
    if MASK_KEYS:
        rows = tl.load(ptrs, mask=(pos < hi)[:, None] & (dims < HEAD_DIM)[None, :], other=0.0)
    elif HEAD_DIM == BLOCK_D:
        rows = tl.load(ptrs)  # whole tile inside the context, no padded dims: no mask at all
    else:
        rows = tl.load(ptrs, mask=(dims < HEAD_DIM)[None, :], other=0.0)
    return rows


@triton.jit
def attend_tile(
    q, m_i, l_i, acc,
    start, hi, query_pos,
    table, k_cache_ptr, v_cache_ptr,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    kv_head, block_size, scale_log2,
    MASK_KEYS: tl.constexpr,
    CAUSAL: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pos = start + tl.arange(0, BLOCK_N)
    dims = tl.arange(0, BLOCK_D)
    # int64 before the multiply: block * stride overflows int32 on large pools.
    if MASK_KEYS:
        block = tl.load(table + pos // block_size, mask=pos < hi, other=0).to(tl.int64)
    else:
        block = tl.load(table + pos // block_size).to(tl.int64)
    offset = (pos % block_size).to(tl.int64)
    # An FP8 pool's keys and values widen to q's dtype exactly (the callers fold their
    # scales into scale_log2 and the output); for any other pool this is no-op.
    k = _load_kv_rows(k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks
                      + kv_head * stride_kh + dims[None, :], pos, hi, dims,
                      MASK_KEYS, HEAD_DIM, BLOCK_D).to(q.dtype)  # fmt: skip
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION)
    if CAUSAL:
        # No ``pos < hi`` term: callers set ``hi`` past every real row's position, so
        # only rows that are never stored could see a position >= hi, and those keys
        # were read as zeros (finite scores), never from the pool.
        s = tl.where(pos[None, :] <= query_pos[:, None], s, float("-inf"))
    elif MASK_KEYS:
        s = tl.where((pos < hi)[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1) * scale_log2)
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s * scale_log2 - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = _load_kv_rows(v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
                      + kv_head * stride_vh + dims[None, :], pos, hi, dims,
                      MASK_KEYS, HEAD_DIM, BLOCK_D).to(q.dtype)  # fmt: skip
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def walk_keys(
    q, query_pos, lo, hi, full_end, kv_end,
    table, k_cache_ptr, v_cache_ptr,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    kv_head, block_size, scale_log2,
    ROWS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr, NUM_STAGES: tl.constexpr, DOT_PRECISION: tl.constexpr,
):
    """The state ``(m_i, l_i, acc)`` of causal query rows over keys ``[lo, hi)``, from
    a fresh start. Key tiles before ``full_end`` (at or before the tile's first
    query, so every row sees them whole, inside the context) run without any mask,
    pipelined ``NUM_STAGES`` deep; the rest are masked by position (the diagonal: at
    most a couple of tiles, not worth a pipeline's shared memory). ``lo`` and
    ``full_end`` are multiples of ``BLOCK_N``; ``kv_end`` is past every real row's
    position."""
    m_i = tl.full([ROWS], NEG_BIG, dtype=tl.float32)
    l_i = tl.zeros([ROWS], dtype=tl.float32)
    acc = tl.zeros([ROWS, BLOCK_D], dtype=tl.float32)
    for start in tl.range(lo, tl.minimum(hi, full_end), BLOCK_N, num_stages=NUM_STAGES):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, start, kv_end, query_pos, table, k_cache_ptr, v_cache_ptr,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            kv_head, block_size, scale_log2,
            MASK_KEYS=False, CAUSAL=False, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
            BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    for start in tl.range(tl.maximum(lo, full_end), hi, BLOCK_N, num_stages=1):
        m_i, l_i, acc = attend_tile(
            q, m_i, l_i, acc, start, kv_end, query_pos, table, k_cache_ptr, v_cache_ptr,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            kv_head, block_size, scale_log2,
            MASK_KEYS=True, CAUSAL=True, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D,
            BLOCK_N=BLOCK_N, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    return m_i, l_i, acc


@triton.jit
def query_tile(
    q_ptr, stride_qt, stride_qh, q_start, q_len, prefix, tile, kv_head,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, BLOCK_Q: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr,
):
    """Query tile ``tile`` of a sequence for one KV head: ``BLOCK_Q`` tokens times the
    group's query heads (padded to ``GROUP_PAD``), token-major (row ``r`` is token
    ``r // GROUP_PAD``, head ``r % GROUP_PAD``: a token's group heads are adjacent in
    ``q``, one contiguous run). Returns the rows ``q`` (0 where masked), each row's
    position, token and head, the dims, and the row and element masks."""
    rows = tl.arange(0, BLOCK_Q * GROUP_PAD)
    query = tile * BLOCK_Q + rows // GROUP_PAD  # the row's query within the sequence
    member = rows % GROUP_PAD  # the row's head within the group
    row_mask = (query < q_len) & (member < GROUP)
    dims = tl.arange(0, BLOCK_D)
    q_mask = row_mask[:, None] & (dims < HEAD_DIM)[None, :]
    tokens = (q_start + query).to(tl.int64)
    heads = kv_head * GROUP + member
    q = tl.load(q_ptr + tokens[:, None] * stride_qt + heads[:, None] * stride_qh + dims[None, :],
                mask=q_mask, other=0.0)
    return q, prefix + query, tokens, heads, dims, row_mask, q_mask
