"""The online-softmax tile loop both paged attention kernels run (Triton, base 2).

One call attends a block of query rows to ``BLOCK_N`` key positions of one sequence:
it looks each position's block up in the block table, loads keys and values, and
folds the tile into the running max ``m_i``, denominator ``l_i`` and accumulator
``acc``. The decode kernel masks only positions past its slice; the prefill kernel
also masks keys past each query's own position (``CAUSAL``).
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
def attend_tile(
    q, m_i, l_i, acc,
    start, hi, query_pos,
    table, k_cache_ptr, v_cache_ptr,
    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
    kv_head, block_size, dims, dim_mask, scale_log2,
    CAUSAL: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    pos = start + tl.arange(0, BLOCK_N)
    pos_mask = pos < hi
    # int64 before the multiply: block * stride overflows int32 on large pools.
    block = tl.load(table + pos // block_size, mask=pos_mask, other=0).to(tl.int64)
    offset = (pos % block_size).to(tl.int64)
    kv_mask = pos_mask[:, None] & dim_mask[None, :]
    k = tl.load(k_cache_ptr + block[:, None] * stride_kb + offset[:, None] * stride_ks
                + kv_head * stride_kh + dims[None, :], mask=kv_mask, other=0.0)
    s = tl.dot(q, tl.trans(k), input_precision=DOT_PRECISION) * scale_log2
    if CAUSAL:
        visible = pos_mask[None, :] & (pos[None, :] <= query_pos[:, None])
    else:
        visible = pos_mask[None, :]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    alpha = tl.exp2(m_i - m_new)
    p = tl.exp2(s - m_new[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    v = tl.load(v_cache_ptr + block[:, None] * stride_vb + offset[:, None] * stride_vs
                + kv_head * stride_vh + dims[None, :], mask=kv_mask, other=0.0)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc
