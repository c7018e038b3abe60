"""Deterministic mode's attention in Triton: one order for every token.

A query row is attended the same way wherever it sits (a prompt, a prefill chunk
after a cached prefix, a decode step; any batch): its sequence's keys are cut at
fixed positions into splits of :data:`KEY_SPLIT` keys (split-KV by a number of keys,
never by a count chosen from the batch); each split is walked from its start in
tiles of ``BLOCK_N`` keys with an online softmax (``tile.py``'s loop) in a tile of
``BLOCK_M`` rows; the splits' states (running max, sum and accumulator, float32) are
folded in split order by :func:`fold_split`; the result is divided by the sum once.
A split past a row's own position, and a key tile past it inside a split, leave its
state exactly as it was.

Two layouts of that one order, chosen from static shapes by :func:`use_split_programs`:

* **walk**: a program per (query tile, sequence, KV head) walks every split, folding
  each into its state in registers. Prompts, and decode steps of many sequences.
* **split programs** (decode steps only, one query a sequence): a program per
  (sequence, KV head, split) writes its split's state, and ``_fold_splits_kernel``
  folds them in split order, so a step of few sequences over long contexts still
  fills the machine. A row with one split is finished where it is attended.

A row's bits are the same in both: the same tile loop, the same fold (its
multiply-adds written as ``tl.fma``, so the compiler cannot contract them one way in
one kernel and another way in the other) and the same division.

A decode step may also store its keys and values in the same launch (``new_kv``, as
the default decode kernel does): the program whose keys hold a row's newest position
writes them before it walks.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from kvrunner_paged.kv_format import is_fp8
from kvrunner_paged.ops.head_scales import head_scales, table_for
from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.prefill import LAUNCH as PREFILL_LAUNCH
from kvrunner_paged.ops.paged_attention.prefill import PrefillLaunch, prefill_grid
from kvrunner_paged.ops.paged_attention.tile import LOG2_E, NEG_BIG, query_tile, walk_keys
from kvrunner_paged.ops.store_kv.store import newest_kv_args, store_newest_kv

#: keys per split: positions ``[s * KEY_SPLIT, (s + 1) * KEY_SPLIT)`` are split ``s``
KEY_SPLIT = 1024

#: One launch for prompts and decode rows alike: the prefill launch's key tile and
#: precision in a tile of the fewest rows a ``tl.dot`` takes, so every token is
#: attended by the same instruction in the same layout wherever it sits. A decode
#: step has one token a sequence, which fills two of the tile's 16 rows (two of 128
#: in the prefill launch's); a prompt reloads each key tile for every 8 tokens of a
#: GQA-2 model. 16-bit queries pipeline their key walk 2 stages deep (the stages only
#: stage the loads: the same bits): on an H100 (``bench_invariant_kernels.py
#: --attention-only``, µs per layer) a prefill of 16 x 1,024 takes 1,005.0 against
#: 1,409.3 at 3 stages, and each decode step of fewer programs than SMs timed there in
#: the walk layout is as fast or faster (batch 1 over 384 / 1,280 / 8,192 keys and
#: batch 8 over 8,192: 17.8 / 49.0 / 287.5 / 287.7 against 18.3 / 50.1 / 290.4 / 293.2).
#: The warps are the same for every step, however many programs it has: the warps
#: split a tile's keys, so a row's sum of its tile's probabilities (``tl.sum`` in
#: ``tile.attend_tile``) is added across them, and another warp count adds it in
#: another order, which can change the row's bits.
LAUNCH: dict[torch.dtype, PrefillLaunch] = {
    dtype: attrs.evolve(launch, block_m=16, num_warps=4,
                        num_stages=2 if dtype.itemsize == 2 else launch.num_stages)
    for dtype, launch in PREFILL_LAUNCH.items()
}


def use_split_programs(max_query_len: int, num_seqs: int, num_kv_heads: int,
                       max_context_len: int, num_sms: int, key_split: int | None = None) -> bool:
    """The split-programs layout for a decode step whose (sequence, KV head) programs
    would not cover every SM and whose contexts may span several splits. Static
    shapes only (the padded sequence count, the engine's longest context): a captured
    graph keeps its layout, and both layouts give the same bits. ``key_split``
    defaults to :data:`KEY_SPLIT` as it is when called."""
    return (max_query_len == 1 and num_seqs * num_kv_heads < num_sms
            and max_context_len > (key_split or KEY_SPLIT))


@triton.jit
def fold_split(m, total, acc, m_s, total_s, acc_s):
    """The state ``(m, total, acc)`` (running max in scaled base-2 units, as
    ``attend_tile`` keeps it; sum; accumulator) with split state ``(m_s, total_s,
    acc_s)`` folded in."""
    m_new = tl.maximum(m, m_s)
    a = tl.exp2(m - m_new)
    b = tl.exp2(m_s - m_new)
    return m_new, tl.fma(total, a, total_s * b), tl.fma(acc, a[:, None], acc_s * b[:, None])


@triton.jit
def _finish(acc, l_i, v_scale):
    """The attention output of a state: the accumulator over the sum (0 for no keys),
    times the value scale (1.0 but for an FP8 pool, whose values the tiles read unscaled)."""
    return acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale


@triton.jit
def _fixed_order_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    out_ptr, part_acc_ptr, part_ml_ptr,
    k_new_ptr, v_new_ptr, slot_ptr,
    scale_log2, scales_ptr, scale_row_stride,
    stride_qt, stride_qh,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    block_size, max_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KEY_SPLIT: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    SPLIT_PROGRAMS: tl.constexpr,
    TILES_OUTER: tl.constexpr,
    FUSE_STORE: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    # Walk: the last (longest) query tiles first, as the prefill kernel orders them.
    # Split programs: one query tile (decode), axis 2 is the split.
    if SPLIT_PROGRAMS:
        tile = 0
        split = tl.program_id(2)
        seq = tl.program_id(1).to(tl.int64)
        kv_head = tl.program_id(0)
    elif TILES_OUTER:
        tile = tl.num_programs(2) - 1 - tl.program_id(2)
        split = 0
        seq = tl.program_id(1).to(tl.int64)
        kv_head = tl.program_id(0)
    else:
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        split = 0
        seq = tl.program_id(1).to(tl.int64)
        kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    ctx_len = tl.load(context_lens_ptr + seq)
    prefix = ctx_len - q_len  # position of the sequence's first query
    # An FP8 pool's scales of this KV head (1.0 for any other pool): the key scale folds
    # into the softmax scale, the value scale into the output, the reciprocals store.
    k_scale, v_scale, k_inv_scale, v_inv_scale = head_scales(scales_ptr, scale_row_stride,
                                                             kv_head, QUANTIZE)
    scale_log2 = scale_log2 * k_scale
    # Causality bounds the keys this tile needs: up to its last real query.
    kv_end = tl.minimum(ctx_len, prefix + tl.minimum((tile + 1) * BLOCK_Q, q_len))
    if (tile * BLOCK_Q < q_len) & (split * KEY_SPLIT < kv_end):
        q, query_pos, tokens, heads, dims, row_mask, q_mask = query_tile(
            q_ptr, stride_qt, stride_qh, q_start, q_len, prefix, tile, kv_head,
            GROUP, GROUP_PAD, BLOCK_Q, HEAD_DIM, BLOCK_D,
        )  # fmt: skip
        table = block_tables_ptr + seq * stride_bt
        # Key tiles at or before the tile's first query are seen whole by every row.
        full_end = ((prefix + tile * BLOCK_Q + 1) // BLOCK_N) * BLOCK_N
        dst = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        # Splits end at multiples of BLOCK_N (or at kv_end): no key tile crosses one.
        lo = split * KEY_SPLIT
        if FUSE_STORE:
            # Decode rows: the program whose keys hold the row's newest position writes
            # its key and value first; after the barrier its walk reads them back like
            # any other key. No other program reads that slot.
            if SPLIT_PROGRAMS:
                keys_end = tl.minimum(lo + KEY_SPLIT, kv_end)
            else:
                keys_end = kv_end
            store_newest_kv(
                q_start, kv_head, ctx_len - 1, lo, keys_end,
                k_new_ptr, v_new_ptr, slot_ptr, k_cache_ptr, v_cache_ptr,
                k_inv_scale, v_inv_scale,
                stride_knt, stride_knh, stride_vnt, stride_vnh,
                stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                block_size, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, QUANTIZE=QUANTIZE,
            )  # fmt: skip
            tl.debug_barrier()
        m_i, l_i, acc = walk_keys(
            q, query_pos, lo, tl.minimum(lo + KEY_SPLIT, kv_end), full_end, kv_end,
            table, k_cache_ptr, v_cache_ptr,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            kv_head, block_size, scale_log2,
            BLOCK_Q * GROUP_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_STAGES, DOT_PRECISION,
        )  # fmt: skip
        if SPLIT_PROGRAMS:
            # A row of one split is finished here; a longer row's state waits for the fold.
            alone = query_pos < KEY_SPLIT
            tl.store(dst, _finish(acc, l_i, v_scale).to(out_ptr.dtype.element_ty),
                     mask=q_mask & alone[:, None])
            cell = (tokens * NUM_HEADS + heads) * max_splits + split
            keep = row_mask & ~alone
            tl.store(part_acc_ptr + cell[:, None] * HEAD_DIM + dims[None, :], acc,
                     mask=keep[:, None] & (dims < HEAD_DIM)[None, :])
            tl.store(part_ml_ptr + cell * 2, m_i, mask=keep)
            tl.store(part_ml_ptr + cell * 2 + 1, l_i, mask=keep)
        else:
            for s in range(1, tl.cdiv(kv_end, KEY_SPLIT)):
                lo = s * KEY_SPLIT
                m_s, l_s, acc_s = walk_keys(
                    q, query_pos, lo, tl.minimum(lo + KEY_SPLIT, kv_end), full_end, kv_end,
                    table, k_cache_ptr, v_cache_ptr,
                    stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
                    kv_head, block_size, scale_log2,
                    BLOCK_Q * GROUP_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_STAGES,
                    DOT_PRECISION,
                )  # fmt: skip
                m_f, l_f, acc_f = fold_split(m_i, l_i, acc, m_s, l_s, acc_s)
                # Rows before this split keep their state untouched (not folded with
                # an empty state, which could still flip the sign of a zero).
                seen = query_pos >= lo
                m_i = tl.where(seen, m_f, m_i)
                l_i = tl.where(seen, l_f, l_i)
                acc = tl.where(seen[:, None], acc_f, acc)
            tl.store(dst, _finish(acc, l_i, v_scale).to(out_ptr.dtype.element_ty), mask=q_mask)


@triton.jit
def _fold_splits_kernel(
    part_acc_ptr, part_ml_ptr, context_lens_ptr, out_ptr, scales_ptr, scale_row_stride,
    stride_ot, stride_oh, max_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    KEY_SPLIT: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    """Per (decode row, KV head): the row's split states folded in split order and
    finished, for rows of more than one split (the others are finished already)."""
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    splits = tl.cdiv(tl.load(context_lens_ptr + row), KEY_SPLIT)
    if splits > 1:
        member = tl.arange(0, GROUP_PAD)
        heads = kv_head * GROUP + member
        in_group = member < GROUP
        dims = tl.arange(0, BLOCK_D)
        mask = in_group[:, None] & (dims < HEAD_DIM)[None, :]
        first = (row * NUM_HEADS + heads) * max_splits
        m_i = tl.load(part_ml_ptr + first * 2, mask=in_group, other=NEG_BIG)
        l_i = tl.load(part_ml_ptr + first * 2 + 1, mask=in_group, other=0.0)
        acc = tl.load(part_acc_ptr + first[:, None] * HEAD_DIM + dims[None, :], mask=mask,
                      other=0.0)
        for s in range(1, splits):
            cell = first + s
            m_s = tl.load(part_ml_ptr + cell * 2, mask=in_group, other=NEG_BIG)
            l_s = tl.load(part_ml_ptr + cell * 2 + 1, mask=in_group, other=0.0)
            acc_s = tl.load(part_acc_ptr + cell[:, None] * HEAD_DIM + dims[None, :], mask=mask,
                            other=0.0)
            m_i, l_i, acc = fold_split(m_i, l_i, acc, m_s, l_s, acc_s)
        _, v_scale, _, _ = head_scales(scales_ptr, scale_row_stride, kv_head, QUANTIZE)
        dst = out_ptr + row * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, _finish(acc, l_i, v_scale).to(out_ptr.dtype.element_ty), mask=mask)


def fixed_order_attention(
    *,
    inputs: PagedAttentionInputs,
    max_context_len: int,
    split_programs: bool = False,
    key_split: int | None = None,
    launch: PrefillLaunch | None = None,
) -> torch.Tensor:
    """Causal varlen attention over the paged pool (decode rows are sequences of one
    query), every row in the order of the module doc: a new tensor like q, rows owned by
    no sequence 0. With ``inputs.new_kv`` (decode steps only) the launch stores each
    row's key and value before it is attended, as the default decode kernel does.

    :param max_context_len: the longest context a row may have (the engine's
        ``max_model_len``): the split-programs layout's grid and workspace.
    :param split_programs: that layout (:func:`use_split_programs`); needs
        ``inputs.max_query_len == 1``. Both layouts give a row the same bits.
    :param key_split: keys per split, a multiple of the launch's ``block_n``; a row's
        bits follow it, so one engine keeps one value. Defaults to :data:`KEY_SPLIT` as
        it is when called (``benchmarks/bench_deterministic.py --sweep-splits`` varies it).
    :param launch: defaults to :data:`LAUNCH` for q's dtype (fp32's for others).
    """
    x = inputs
    num_seqs = x.sequences(varlen=True, triton=True, stores=True)
    q, k_cache, v_cache, block_tables = x.q, x.k_cache, x.v_cache, x.block_tables
    max_query_len, new_kv = x.max_query_len, x.new_kv
    assert max_query_len is not None  # checked by sequences
    num_tokens, num_heads, head_dim = q.shape
    num_kv_heads = k_cache.shape[2]
    launch = launch or LAUNCH.get(q.dtype, LAUNCH[torch.float32])
    key_split = key_split or KEY_SPLIT
    assert key_split % launch.block_n == 0, f"key_split {key_split} not whole key tiles"
    assert not split_programs or max_query_len <= 1, "split programs attend decode rows only"
    assert new_kv is None or max_query_len <= 1, "new_kv stores decode rows only"
    out = torch.zeros_like(q)
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    block_q = max(1, launch.block_m // group_pad)
    block_d = max(16, triton.next_power_of_2(head_dim))
    max_splits = max(1, triton.cdiv(max_context_len, key_split))
    if split_programs:
        grid, tiles_outer = (num_kv_heads, num_seqs, max_splits), True
        part_acc = torch.empty(num_tokens, num_heads, max_splits, head_dim, dtype=torch.float32,
                               device=q.device)
        part_ml = torch.empty(num_tokens, num_heads, max_splits, 2, dtype=torch.float32,
                              device=q.device)
    else:
        grid, tiles_outer = prefill_grid(num_kv_heads, num_seqs,
                                         triton.cdiv(max_query_len, block_q), True)
        part_acc = part_ml = out  # never dereferenced: the walk folds in registers
    k_new, v_new, slots = newest_kv_args(new_kv, q)
    scales, scale_row_stride = table_for(x.scales, k_cache)
    _fixed_order_kernel[grid](
        q, k_cache, v_cache, block_tables, x.query_start_loc, x.context_lens,
        out, part_acc, part_ml,
        k_new, v_new, slots,
        x.scale * LOG2_E, scales, scale_row_stride,
        q.stride(0), q.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        *x.pool_strides(),
        out.stride(0), out.stride(1),
        k_cache.shape[1], max_splits,
        NUM_HEADS=num_heads,
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_Q=block_q,
        BLOCK_N=launch.block_n,
        BLOCK_D=block_d,
        KEY_SPLIT=key_split,
        NUM_STAGES=launch.num_stages,
        DOT_PRECISION=launch.dot_precision,
        SPLIT_PROGRAMS=split_programs,
        TILES_OUTER=tiles_outer,
        FUSE_STORE=new_kv is not None,
        QUANTIZE=is_fp8(k_cache),
        num_warps=launch.num_warps,
    )  # fmt: skip
    if split_programs:
        _fold_splits_kernel[(num_seqs, num_kv_heads)](
            part_acc, part_ml, x.context_lens, out, scales, scale_row_stride,
            out.stride(0), out.stride(1), max_splits,
            NUM_HEADS=num_heads,
            GROUP=group,
            GROUP_PAD=group_pad,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            KEY_SPLIT=key_split,
            QUANTIZE=is_fp8(k_cache),
        )  # fmt: skip
    return out
