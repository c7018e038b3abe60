"""Prefill (and mixed) attention in Triton: causal varlen attention over the paged pool,
with a cached prefix.

One program per (query tile, sequence, KV head), the longest (last) tiles first.
Its tile packs ``BLOCK_Q`` query tokens times every query head of the KV head's GQA
group into ``BLOCK_Q * GROUP_PAD`` rows (token-major: row ``r`` is token ``r //
GROUP_PAD``, head ``r % GROUP_PAD`` of the group), so each key tile is loaded once
per group rather than once per query head, and both products are ``tl.dot``s that
many rows tall.

Sequence ``i`` has ``q_len`` new queries at positions ``ctx_len - q_len .. ctx_len -
1`` (the cached prefix is everything before). The tile walks key positions from 0 up
to its last query's position in tiles of ``BLOCK_N``, looking each position's block
up in the block table, with an online softmax (base 2). Key tiles wholly at or before
the tile's first query are seen by every row and run without any mask; only the
one or two tiles that cross the diagonal are masked, and tiles past it are never
loaded at all.

This path also serves mixed batches: a decoding sequence is one with ``q_len == 1``.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from kvrunner_paged.kv_format import is_fp8
from kvrunner_paged.ops.head_scales import head_scales, table_for
from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.tile import LOG2_E, query_tile, walk_keys


@attrs.frozen
class PrefillLaunch:
    """Launch parameters of the prefill kernel for one input dtype."""

    block_m: int  #: rows of a program's tile: query tokens x (padded) group heads
    block_n: int  #: key positions per inner step
    num_warps: int
    num_stages: int  #: software-pipeline depth of the unmasked key loop
    dot_precision: str  #: ``tl.dot`` input precision (only fp32 inputs read it)


#: Chosen for an H200 (Hopper: 228 KB shared memory and 64K registers per SM) by
#: ``benchmarks/bench_prefill.py`` per case (it takes overrides of every field).
LAUNCH: dict[torch.dtype, PrefillLaunch] = {
    # 128 rows = two warpgroups of 64 (one wgmma M each); the fp32 accumulator is 64
    # registers a thread at 8 warps. K and V tiles of 64 x 128 bf16 are 16 KB each, so
    # 3 stages are 96 KB plus 32 KB of Q: well inside shared memory. 64/64/4/3 and
    # 64/128/4/2 were slower in 11 and 12 of the 12 cases.
    torch.bfloat16: PrefillLaunch(128, 64, 8, 3, "tf32"),
    torch.float16: PrefillLaunch(128, 64, 8, 3, "tf32"),
    # fp32: three TF32 products (hi*hi + hi*lo + lo*hi, the same trick as torch's fp32
    # memory-efficient SDPA): errors near 2^-21 relative per product, far inside the
    # fp32 tests' 1e-4 / 1e-5, on tensor cores rather than fp32 FMA units (plain
    # "tf32" errs by 1e-3; "ieee" ran about 6x SDPA). Small tiles (8 tokens of a group
    # of 4, 16 of a group of 2): more programs, each with a shorter walk along the
    # diagonal. Against 128/32/8/2 per case (H200, ours / SDPA): 8B 1024 x 1 1.40 ->
    # 1.08, 0.6B 1024 x 1 1.42 -> 1.25; 64/32/4/2 and 64/32/4/3 were slower everywhere.
    torch.float32: PrefillLaunch(32, 32, 4, 2, "tf32x3"),
}

#: From this many queries in one sequence, a run takes :data:`LONG_RUN_LAUNCH`
LONG_RUN_QUERY_LEN = 4096
#: Wider key tiles for long runs: each program walks many key tiles, so fewer, larger
#: steps pay. H200, query tiles outermost, CUDA-graph timing, ours / SDPA against the
#: default launch: bf16 128/128/8/2 (160 KB of shared memory at 2 stages) 0.6B 4096 x
#: 1 0.88 -> 0.77, 8192 x 1 1.13 -> 0.96, 8B 4096 x 1 0.99 -> 0.95, 8192 x 1 1.13 ->
#: 1.06 (but slower on runs of 1,024: 8B 1024 x 8 1.13 -> 1.31); fp32 32/64/4/2 0.6B
#: 4096 x 1 1.23 -> 1.04, 8192 x 1 1.14 -> 1.09 (against 128/32/8/2), 8B 4096 x 1
#: 1.11 -> 1.03, 8192 x 1 1.17 -> 1.07 (but 0.6B 1024 x 8 1.08 -> 1.36).
LONG_RUN_LAUNCH: dict[torch.dtype, PrefillLaunch] = {
    torch.bfloat16: PrefillLaunch(128, 128, 8, 2, "tf32"),
    torch.float16: PrefillLaunch(128, 128, 8, 2, "tf32"),
    torch.float32: PrefillLaunch(32, 64, 4, 2, "tf32x3"),
}
#: CUDA's limit on a grid's second and third axes
MAX_OUTER_GRID = 65535


def prefill_grid(
    num_kv_heads: int, num_seqs: int, tiles: int, tiles_outer: bool
) -> tuple[tuple[int, int, int], bool]:
    """The launch grid and the order it takes: query tiles on the outermost axis where
    asked and where they fit (a grid's outer axes hold at most :data:`MAX_OUTER_GRID`
    programs, its first 2^31 - 1), else on the first."""
    if tiles_outer and tiles <= MAX_OUTER_GRID:
        return (num_kv_heads, num_seqs, tiles), True
    return (tiles, num_seqs, num_kv_heads), False


def launch_for(dtype: torch.dtype, max_query_len: int) -> PrefillLaunch:
    """The launch parameters for one call: :data:`LAUNCH` for ``dtype``, or its
    :data:`LONG_RUN_LAUNCH` from :data:`LONG_RUN_QUERY_LEN` queries on (other dtypes
    take fp32's)."""
    table = LONG_RUN_LAUNCH if max_query_len >= LONG_RUN_QUERY_LEN else LAUNCH
    return table.get(dtype, table[torch.float32])


@triton.jit
def _prefill_kernel(
    q_ptr, k_cache_ptr, v_cache_ptr, block_tables_ptr, query_start_loc_ptr, context_lens_ptr,
    out_ptr,
    scale_log2, scales_ptr, scale_row_stride,
    stride_qt, stride_qh,
    stride_kb, stride_ks, stride_kh,
    stride_vb, stride_vs, stride_vh,
    stride_bt,
    stride_ot, stride_oh,
    block_size,
    GROUP: tl.constexpr,
    GROUP_PAD: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_D: tl.constexpr,
    NUM_STAGES: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    TILES_OUTER: tl.constexpr,
    QUANTIZE: tl.constexpr,
):
    # Last tiles first: they reach furthest along the diagonal (the most keys), so
    # starting them first leaves short programs, not long ones, for the final wave.
    # Programs start in order of their linear id (axis 0 fastest): with the tiles on
    # the outer axis every sequence's and head's last tile starts before any shorter.
    if TILES_OUTER:
        tile = tl.num_programs(2) - 1 - tl.program_id(2)
        seq = tl.program_id(1).to(tl.int64)
        kv_head = tl.program_id(0)
    else:
        tile = tl.num_programs(0) - 1 - tl.program_id(0)
        seq = tl.program_id(1).to(tl.int64)
        kv_head = tl.program_id(2)

    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    if tile * BLOCK_Q < q_len:
        ctx_len = tl.load(context_lens_ptr + seq)
        prefix = ctx_len - q_len  # position of the sequence's first query
        q, query_pos, tokens, heads, dims, row_mask, q_mask = query_tile(
            q_ptr, stride_qt, stride_qh, q_start, q_len, prefix, tile, kv_head,
            GROUP, GROUP_PAD, BLOCK_Q, HEAD_DIM, BLOCK_D,
        )  # fmt: skip
        # Causality bounds the keys this tile needs: up to its last real query.
        kv_end = tl.minimum(ctx_len, prefix + tl.minimum((tile + 1) * BLOCK_Q, q_len))
        # Key tiles ending at or before the first query's position: every row sees all
        # of them (and they lie inside the context), so neither mask is compiled in.
        # kv_end > first query's position, so full_end <= kv_end.
        full_end = ((prefix + tile * BLOCK_Q + 1) // BLOCK_N) * BLOCK_N
        # An FP8 pool's key scale folds into the softmax scale, its value scale into
        # the output (1.0 both for any other pool)
        k_scale, v_scale, _, _ = head_scales(scales_ptr, scale_row_stride, kv_head, QUANTIZE)
        m_i, l_i, acc = walk_keys(
            q, query_pos, 0, kv_end, full_end, kv_end,
            block_tables_ptr + seq * stride_bt, k_cache_ptr, v_cache_ptr,
            stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
            kv_head, block_size, scale_log2 * k_scale,
            BLOCK_Q * GROUP_PAD, HEAD_DIM, BLOCK_D, BLOCK_N, NUM_STAGES, DOT_PRECISION,
        )  # fmt: skip

        out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None] * v_scale
        dst = out_ptr + tokens[:, None] * stride_ot + heads[:, None] * stride_oh + dims[None, :]
        tl.store(dst, out.to(out_ptr.dtype.element_ty), mask=q_mask)


def paged_prefill_attention(
    *,
    inputs: PagedAttentionInputs,
    block_m: int | None = None,
    block_n: int | None = None,
    num_warps: int | None = None,
    num_stages: int | None = None,
    dot_precision: str | None = None,
    tiles_outer: bool = True,
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """Causal varlen attention of each sequence's new queries over its paged keys, which
    the pools already hold (store first, then attend).

    :param block_m: rows of a program's tile, query tokens times the group's query heads
        (padded to a power of two); a power of two >= 16. ``block_n``: keys per step, a
        power of two >= 16. These, ``num_warps``, ``num_stages`` and
        ``dot_precision`` default to :func:`launch_for` q's dtype and
        ``inputs.max_query_len``.
    :param tiles_outer: the grid order (see :func:`prefill_grid`): query tiles
        outermost, so every sequence's and head's last tile starts before any
        shorter one (the default: on an H200 it took the worst of 12 cases from 1.34
        to 1.23x SDPA in bf16 and 1.43 to 1.27 in fp32); else each (sequence,
        head)'s tiles together.
    :returns: ``out`` (allocated like q when not given). Rows of q owned by no
        sequence are left as they were in ``out`` (zeros when allocated here).
    """
    x = inputs
    num_seqs = x.sequences(varlen=True, triton=True)
    q, k_cache, v_cache, block_tables = x.q, x.k_cache, x.v_cache, x.block_tables
    max_query_len = x.max_query_len
    assert max_query_len is not None  # checked by sequences
    num_heads, head_dim = q.shape[1:]
    num_kv_heads = k_cache.shape[2]
    launch = launch_for(q.dtype, max_query_len)
    block_m = block_m or launch.block_m
    block_n = block_n or launch.block_n
    for name, size in (("block_m", block_m), ("block_n", block_n)):
        assert size >= 16 and size & (size - 1) == 0, f"{name} {size}: a power of two >= 16"
    if out is None:
        out = torch.zeros_like(q)
    if num_seqs == 0 or max_query_len == 0:
        return out
    group = num_heads // num_kv_heads
    group_pad = triton.next_power_of_2(group)
    # Tokens per tile; a group wider than block_m gets one token (rows = group_pad).
    block_q = max(1, block_m // group_pad)
    tiles = triton.cdiv(max_query_len, block_q)
    grid, tiles_outer = prefill_grid(num_kv_heads, num_seqs, tiles, tiles_outer)
    scales, scale_row_stride = table_for(x.scales, k_cache)
    _prefill_kernel[grid](
        q, k_cache, v_cache, block_tables, x.query_start_loc, x.context_lens,
        out,
        x.scale * LOG2_E, scales, scale_row_stride,
        q.stride(0), q.stride(1),
        *x.pool_strides(),
        out.stride(0), out.stride(1),
        k_cache.shape[1],
        GROUP=group,
        GROUP_PAD=group_pad,
        HEAD_DIM=head_dim,
        BLOCK_Q=block_q,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        NUM_STAGES=num_stages or launch.num_stages,
        DOT_PRECISION=dot_precision or launch.dot_precision,
        TILES_OUTER=tiles_outer,
        QUANTIZE=is_fp8(k_cache),
        num_warps=num_warps or launch.num_warps,
    )  # fmt: skip
    return out
