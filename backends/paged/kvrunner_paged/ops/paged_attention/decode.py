"""Decode attention in Triton: one query token per sequence, over the paged pool.

One program per (sequence row, KV head, split). It loads the query rows of every
query head that shares the KV head (GQA: the group is padded to 16 rows so the
score and value products are ``tl.dot``s), then walks its share of the sequence's
keys in tiles of ``BLOCK_N`` positions, looking each position's block up in the block
table, with an online softmax (running max and sum, base 2).

Split-KV (flash-decoding): with ``num_splits > 1`` each program covers one slice of
the positions and writes a normalised partial output plus its log-sum-exp; a second
kernel merges the slices. ``num_splits`` must be chosen from static shapes only (see
:func:`choose_num_splits`), since a captured graph fixes the launch grid while
``context_lens`` changes from step to step.

A row whose ``context_lens`` entry is 0 (a padded tail row) reads nothing and
outputs zeros.

Each program walks its slice's whole key tiles unmasked (``tile.walk_keys``), and
over an FP8 pool pipelines them two stages deep (:func:`decode_launch`): its tiles
are half the bytes of a 16-bit pool's, and keeping the next in flight while one is
attended pays there. A launch may take bf16 queries' products over an e4m3 pool in
float16 (``widen_f16``): e4m3 widens to float16 in one conversion, to bf16 only
through float32.

With ``new_kv`` the launch also stores the step's keys and values (what
:func:`~kvrunner_paged.ops.store_kv.store.store_kv` would do first, one launch fewer a
layer): the program whose slice holds a row's newest position (``context_lens - 1``)
writes that key and value to the row's slot (none for a PAD slot), waits at a
barrier of its own threads, and then walks its keys as usual. That slot is read by
that program only, so programs need no order between them.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrunner_paged.kv_format import is_fp8
from kvrunner_paged.ops.head_scales import head_scales, table_for
from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.tile import LOG2_E, walk_keys
from kvrunner_paged.ops.store_kv.store import newest_kv_args, store_newest_kv

#: ``2**-15``: queries up to ``2**15`` widen to float16 as they are (its largest is
#: 65504); past it :func:`_decode_kernel` scales a group's queries by a power of two.
F16_HEADROOM = tl.constexpr(2.0**-15)


@triton.jit
def _power_of_two(exponent):
    """``2.0**exponent`` in float32, exactly, for an int32 ``exponent`` in [-126, 127]:
    built from its exponent bits (``exp2`` is an approximation)."""
    return ((exponent + 127) << 23).to(tl.float32, bitcast=True)


# ``num_splits`` is a runtime argument, not specialised on its value: every split count
# the capture buckets choose shares one compiled kernel (a compile per count made the
# first capture of a fresh process seconds longer).
@triton.jit(do_not_specialize=["num_splits"])
def _decode_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, context_lens_ptr,
    out_ptr, part_out_ptr, part_lse_ptr,
    k_new_ptr, v_new_ptr, slot_ptr,
    scale_log2, scales_ptr, scale_row_stride,
    stride_qt, stride_qh,
    stride_knt, stride_knh, stride_vnt, stride_vnh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    block_size,
    num_splits,
    NUM_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    FUSE_STORE: tl.constexpr,
    QUANTIZE: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    WIDEN_F16: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)

    ctx_len = tl.load(context_lens_ptr + row)
    # An FP8 pool's scales of this KV head (1.0 for any other pool): the key scale folds
    # into the softmax scale, the value scale into the output, the reciprocals store.
    k_scale, v_scale, k_inv_scale, v_inv_scale = head_scales(scales_ptr, scale_row_stride,
                                                             kv_head, QUANTIZE)
    scale_log2 = scale_log2 * k_scale
    group_rows = tl.arange(0, GROUP_PAD)
    heads = kv_head * GROUP + group_rows
    head_mask = group_rows < GROUP
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    q_mask = head_mask[:, None] & dim_mask[None, :]
    q = tl.load(q_ptr + row * stride_qt + heads[:, None] * stride_qh + dims[None, :], mask=q_mask,
                other=0.0)
    if WIDEN_F16:
        # The tiles widen to q's dtype as they load (tile.attend_tile): float16 here.
        # float16 ends at 65504 where bf16 goes on to 3e38, so a group whose largest
        # query passes 2**15 is scaled down by a power of two first and the softmax
        # scale up by it: both exact, so the scores keep every bit they would have had,
        # and no query overflows to inf.
        q = q.to(tl.float32)
        q_max = tl.max(tl.max(tl.abs(q), 1), 0)
        shift = tl.minimum(tl.maximum(tl.ceil(tl.log2(q_max * F16_HEADROOM)), 0.0), 113.0)
        shift = shift.to(tl.int32)
        q = (q * _power_of_two(-shift)).to(tl.float16)
        scale_log2 = scale_log2 * _power_of_two(shift)

    if SPLIT:
        # This split's slice of positions, rounded to whole tiles.
        per_split = tl.cdiv(tl.cdiv(ctx_len, num_splits), BLOCK_N) * BLOCK_N
        lo = split * per_split
        hi = tl.minimum(lo + per_split, ctx_len)
    else:
        lo = 0
        hi = ctx_len

    table = block_tables_ptr + row * stride_bt
    if FUSE_STORE:
        # The program whose slice holds the newest position writes it first; after the
        # barrier its own walk reads it back like any other key. No other program reads
        # that slot, so programs need no order between them.
        store_newest_kv(
            row, kv_head, ctx_len - 1, lo, hi, k_new_ptr, v_new_ptr, slot_ptr,
            k_cache_ptr, v_cache_ptr, k_inv_scale, v_inv_scale,
            stride_knt, stride_knh, stride_vnt, stride_vnh,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            block_size, HEAD_DIM=HEAD_DIM, BLOCK_D=BLOCK_D, QUANTIZE=QUANTIZE,
        )  # fmt: skip
        tl.debug_barrier()
    # The slice's whole key tiles unmasked and pipelined NUM_STAGES deep, then its last,
    # part tile masked: every row sees keys up to the slice's end (its "position" here),
    # so the causal mask of the shared walk is the slice's bound.
    full_end = lo + (hi - lo) // BLOCK_N * BLOCK_N
    m_i, l_i, acc = walk_keys(
        q, hi - 1 + tl.zeros([GROUP_PAD], dtype=tl.int32), lo, hi, full_end, hi,
        table, k_cache_ptr, v_cache_ptr,
        stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        kv_head, block_size, scale_log2,
        GROUP_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_STAGES, DOT_PRECISION,
    )  # fmt: skip

    has_keys = l_i > 0
    out = acc / tl.where(has_keys, l_i, 1.0)[:, None] * v_scale
    if not SPLIT:
        dst = out_ptr + row * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)
    else:
        # Partials are contiguous [rows, NUM_HEADS, num_splits, HEAD_DIM] float32.
        cell = (row * NUM_HEADS + heads) * num_splits + split
        tl.store(part_out_ptr + cell[:, None] * HEAD_DIM + dims[None, :], out, mask=q_mask)
        lse = tl.where(has_keys, m_i + tl.log2(tl.where(has_keys, l_i, 1.0)), float("-inf"))
        tl.store(part_lse_ptr + cell, lse, mask=head_mask)


@triton.jit(do_not_specialize=["num_splits"])
def _merge_splits_kernel(
    part_out_ptr, part_lse_ptr, out_ptr,
    stride_ot, stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_mask = splits < num_splits
    dims = tl.arange(0, BLOCK_D)
    dim_mask = dims < HEAD_DIM

    cell = (row * NUM_HEADS + head) * num_splits + splits
    lse = tl.load(part_lse_ptr + cell, mask=split_mask, other=float("-inf"))
    m = tl.max(lse, 0)
    # Every split empty (a row with no keys): m is -inf; shift by 0 so weights are 0.
    m = tl.where(m > float("-inf"), m, 0.0)
    weight = tl.exp2(lse - m)
    total = tl.sum(weight, 0)
    parts = tl.load(part_out_ptr + cell[:, None] * HEAD_DIM + dims[None, :],
                    mask=split_mask[:, None] & dim_mask[None, :], other=0.0)
    out = tl.sum(parts * weight[:, None], 0) / tl.where(total > 0, total, 1.0)
    dst = out_ptr + row * stride_ot + head * stride_oh + dims
    tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=dim_mask)


#: Programs per SM a split launch fills, at most: a decode program is a chain of
#: dependent loads, so an SM needs several in flight to keep memory busy, but one
#: program past a full wave costs a whole extra wave. Measured on an H200 (bf16, 8 KV
#: heads, block_n 64, 132 SMs): B8 x 32k keys takes 267 us at 8 splits (512 programs,
#: 4.1 TB/s) and 363 us at 9 (576); B32 and up is fastest unsplit.
SPLIT_WAVES = 4
#: Fewest keys worth a split of their own: one tile of the default ``block_n``. A split
#: costs a partial write and the merge launch (about 2 us in a graph), where an unsplit
#: program walks its tiles as a chain of dependent loads: the profile of a batch-1
#: decode step of the 0.6B shape on an H200 (8 KV heads, so 8 programs on 132 SMs,
#: contexts of 136-384 keys) had this kernel at 8.5 us a layer, 19% of the step, when
#: this bound was 512 keys and ``max_model_len`` 400 left it unsplit.
SPLIT_MIN_KEYS = 64
MAX_SPLITS = 64


def choose_num_splits(
    num_rows: int, num_kv_heads: int, max_context_len: int, num_sms: int
) -> int:
    """Splits per sequence for one decode launch over ``num_sms`` streaming multiprocessors.

    Depends on static shapes only (batch rows, heads, the longest context the block
    table can describe), so a captured graph's split count is right for every replay;
    splits past a shorter real context find no keys and exit at once. Unsplit when the
    unsplit grid already covers every SM.
    """
    programs = max(1, num_rows * num_kv_heads)
    if programs >= num_sms:
        return 1
    wanted = (SPLIT_WAVES * num_sms) // programs
    return max(1, min(wanted, max_context_len // SPLIT_MIN_KEYS, MAX_SPLITS))


def decode_launch(k_cache: torch.Tensor) -> tuple[int, int]:
    """``(num_warps, num_stages)`` of a decode program over ``k_cache``'s pool: 4 warps,
    and the walk over whole key tiles pipelined 2 stages deep over an e4m3 pool, not
    at all over a 16-bit one. Measured on an H100 (``bench_decode_attention.py
    --kv-cache-dtype fp8``: bf16 queries, 32 query and 8 KV heads of 128, 64-key tiles,
    a layer's store and attend at batch 256 over 1,024 / 2,048 keys): e4m3 at 2 stages
    275.0 / 527.7 us, against 291.5 / 558.6 unpipelined and 302.0 / 580.9 at 3 stages;
    bf16 unpipelined 377.6 / 735.0 (2.84 / 2.92 TB/s of a 3.02 TB/s copy rate).
    128-key tiles with ``widen_f16`` took 262.7 / 485.9 us over e4m3 in another run
    (this launch 274.4 / 527.3 there); they are not the default: the engine's FP8 KV
    GPU tests have not run with them."""
    return (4, 2) if is_fp8(k_cache) else (4, 1)


def paged_decode_attention(
    *, inputs: PagedAttentionInputs, num_splits: int = 1, block_n: int = 64,
    num_warps: int | None = None, num_stages: int | None = None, out: torch.Tensor | None = None,
    widen_f16: bool = False,
) -> torch.Tensor:
    """One query token per row over that row's paged keys: ``out`` (allocated like q when
    not given), rows with no keys 0; with ``inputs.new_kv`` the launch stores each row's
    key and value to its slot before the program that owns that position attends it.
    ``num_splits``: the split-KV factor (1 = a single pass, no merge kernel; see
    :func:`choose_num_splits`); ``block_n``: keys per tile; ``num_warps`` and
    ``num_stages`` (how deep the walk over whole key tiles is pipelined, 1: not at all)
    default to :func:`decode_launch` of the pool; ``num_stages`` leaves every bit as it
    is (``tests/paged/test_paged_gpu.py``). ``widen_f16`` (bf16 queries over an e4m3
    pool only): the queries and the pool's tiles are widened to float16, not to bf16,
    for the products (e4m3 values are exact in both; the probabilities keep 3 more
    bits in float16; a group of queries past 2**15 is scaled by a power of two first,
    so none overflows); a launch ``bench_decode_attention.py --kv-cache-dtype fp8``
    times beside the default."""
    x = inputs
    if widen_f16 and not (is_fp8(x.k_cache) and x.q.dtype == torch.bfloat16):
        raise ValueError(f"widen_f16 widens an e4m3 pool for bf16 queries; got "
                         f"{x.q.dtype} queries over a {x.k_cache.dtype} pool")
    num_rows = x.sequences(varlen=False, triton=True, stores=True)
    q, k_cache, v_cache, block_tables = x.q, x.k_cache, x.v_cache, x.block_tables
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    if out is None:
        out = torch.empty_like(q)
    if num_rows == 0:
        return out
    group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))
    if num_splits > 1:
        part_out = torch.empty(
            (num_rows, num_heads, num_splits, head_dim), dtype=torch.float32, device=q.device
        )
        part_lse = torch.empty(
            (num_rows, num_heads, num_splits), dtype=torch.float32, device=q.device
        )
    else:  # never dereferenced: the single-pass kernel writes ``out`` directly
        part_out = part_lse = out
    k_new, v_new, slots = newest_kv_args(x.new_kv, q)
    scales, scale_row_stride = table_for(x.scales, k_cache)
    default_warps, default_stages = decode_launch(k_cache)
    _decode_kernel[(num_rows, num_kv_heads, num_splits)](
        q, k_cache, v_cache, block_tables, x.context_lens,
        out, part_out, part_lse,
        k_new, v_new, slots,
        x.scale * LOG2_E, scales, scale_row_stride,
        q.stride(0), q.stride(1),
        k_new.stride(0), k_new.stride(1), v_new.stride(0), v_new.stride(1),
        *x.pool_strides(),
        out.stride(0), out.stride(1),
        k_cache.shape[1],
        num_splits,
        NUM_HEADS=num_heads,
        GROUP=group,
        HEAD_DIM=head_dim,
        GROUP_PAD=max(16, triton.next_power_of_2(group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        SPLIT=num_splits > 1,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        FUSE_STORE=x.new_kv is not None,
        QUANTIZE=is_fp8(k_cache),
        NUM_STAGES=num_stages or default_stages,
        WIDEN_F16=widen_f16,
        num_warps=num_warps or default_warps,
    )
    if num_splits > 1:
        _merge_splits_kernel[(num_rows, num_heads)](
            part_out, part_lse, out,
            out.stride(0), out.stride(1),
            num_splits,
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            # two pads cover every count up to MAX_SPLITS (two compiles at most); the
            # small one keeps the usual few-split merge at 26 registers, not 167 (sm_90)
            SPLITS_PAD=8 if num_splits <= 8 else triton.next_power_of_2(max(num_splits,
                                                                            MAX_SPLITS)),
        )
    return out
