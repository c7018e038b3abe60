"""Prefill (and mixed) attention over the paged pool agrees with the naive reference."""

from __future__ import annotations

import torch
from hypothesis import example, given
from hypothesis import strategies as st
from paged_cases import TRITON_DEVICE, PagedCase, assert_matches_reference, paged_cases

from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs
from kvrunner_paged.ops.paged_attention.naive import naive_paged_attention
from kvrunner_paged.ops.paged_attention.prefill import (
    LAUNCH,
    LONG_RUN_LAUNCH,
    LONG_RUN_QUERY_LEN,
    MAX_OUTER_GRID,
    launch_for,
    paged_prefill_attention,
    prefill_grid,
)
from kvrunner_paged.ops.paged_attention.prefill_torch import paged_prefill_attention_torch


def _prefill_inputs(case: PagedCase) -> dict[str, torch.Tensor]:
    """Token rows = real tokens + a padded tail owned by no sequence; unread slots hold NaN."""
    gen = case.generator()
    pool = case.pool(gen, poison_unread=True)
    rows = case.num_tokens + case.num_pad_rows
    return {
        "q": torch.randn((rows, case.num_heads, case.head_dim), generator=gen),
        "k_cache": pool[0],
        "v_cache": pool[1],
        "block_tables": case.block_table_tensor(case.num_seqs),
        "query_start_loc": case.query_start_loc(),
        "context_lens": case.context_lens_tensor(case.num_seqs),
    }


def _reference(case: PagedCase, x: dict[str, torch.Tensor]) -> torch.Tensor:
    return naive_paged_attention(**x, scale=case.scale)


def _triton_inputs(case: PagedCase, x: dict[str, torch.Tensor]) -> PagedAttentionInputs:
    """The case's inputs on the Triton device, as the varlen entries take them."""
    return PagedAttentionInputs(
        **{k: t.to(TRITON_DEVICE) for k, t in x.items()}, scale=case.scale,
        num_seqs=case.num_seqs, max_query_len=max(case.query_lens),
    )


@given(case=paged_cases())
def test_triton_prefill_matches_reference(case: PagedCase) -> None:
    x = _prefill_inputs(case)
    out = paged_prefill_attention(inputs=_triton_inputs(case, x), block_m=16, block_n=16)
    assert_matches_reference(out.cpu(), _reference(case, x))


@given(case=paged_cases())
def test_torch_prefill_matches_reference(case: PagedCase) -> None:
    x = _prefill_inputs(case)
    out = paged_prefill_attention_torch(
        inputs=PagedAttentionInputs(**x, scale=case.scale, num_seqs=case.num_seqs))
    assert_matches_reference(out, _reference(case, x))


def test_reference_is_causal_over_the_cached_prefix() -> None:
    """Pin the oracle itself: the first new query sees the prefix and itself, nothing later."""
    k_cache = torch.zeros((2, 4, 1, 16))
    v_cache = torch.zeros((2, 4, 1, 16))
    v_cache[0, :, 0, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # value = position + 1
    q = torch.zeros((2, 1, 16))  # zero queries: uniform weights over what is visible
    out = naive_paged_attention(
        q, k_cache, v_cache, torch.tensor([[0]], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32), torch.tensor([4], dtype=torch.int32), 0.25,
    )
    # Queries at positions 2 and 3: means of (1, 2, 3) and (1, 2, 3, 4).
    assert out[:, 0, 0].tolist() == [2.0, 2.5]


#: (query heads, kv heads): groups of 1, 2, 3 (padded to 4 rows), 4, 8, 16 and 32
GQA_SHAPES = ((1, 1), (2, 1), (6, 2), (4, 1), (8, 1), (16, 2), (16, 1), (32, 1))


# Always run one padded group (3 heads in 4 rows, whose spare row must store nothing)
# whose queries cross tiles; the draws alone can miss the one such shape at few examples.
@example(
    case=PagedCase(
        block_size=4, num_blocks=13, num_heads=6, num_kv_heads=2, head_dim=16,
        max_blocks_per_seq=7, query_lens=(20, 7), context_lens=(23, 7),
        block_tables=((0, 7, 6, 5, 12, 1), (3, 11)), num_pad_rows=1, seed=44577,
    ),
    block_m=32,
    block_n=16,
    tiles_outer=True,
)  # fmt: skip
@given(
    case=paged_cases(head_shapes=GQA_SHAPES, head_dims=(16, 24), max_query_len=40, max_seqs=3),
    block_m=st.sampled_from([16, 32]),
    block_n=st.sampled_from([16, 32]),
    tiles_outer=st.booleans(),
)
def test_triton_prefill_packs_any_group_into_its_tiles(
    case: PagedCase, block_m: int, block_n: int, tiles_outer: bool
) -> None:
    """Tiles of ``block_m // group`` tokens: queries cross several tiles, prefixes cross
    blocks and key tiles, a group of 3 is padded to 4 rows, a group as wide as the tile
    or wider (16, 32 heads) gets one token per tile, and a head_dim of 24 is padded to 32
    (the unmasked key tiles still mask the padded dims). Either grid order (query tiles
    outermost or innermost) computes the same attention."""
    x = _prefill_inputs(case)
    out = paged_prefill_attention(
        inputs=_triton_inputs(case, x), block_m=block_m, block_n=block_n, tiles_outer=tiles_outer,
    )
    assert_matches_reference(out.cpu(), _reference(case, x))


@given(max_query_len=st.integers(1, 3 * LONG_RUN_QUERY_LEN))
def test_runs_of_4096_queries_and_more_take_the_long_run_launch(max_query_len) -> None:
    """Where the H200 measured wider key tiles faster (one sequence of 4,096 queries or
    more) every dtype takes its long-run launch; shorter runs keep the default, and a
    dtype without entries takes fp32's."""
    table = LONG_RUN_LAUNCH if max_query_len >= LONG_RUN_QUERY_LEN else LAUNCH
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert launch_for(dtype, max_query_len) == table[dtype]
    assert launch_for(torch.float64, max_query_len) == table[torch.float32]
    assert LONG_RUN_LAUNCH[torch.bfloat16] != LAUNCH[torch.bfloat16]


@given(tiles=st.integers(1, 3 * MAX_OUTER_GRID), tiles_outer=st.booleans())
def test_query_tiles_go_outermost_only_where_the_grid_holds_them(tiles, tiles_outer) -> None:
    """The outer grid axes take at most 65,535 programs: a longer run of tiles stays on
    the first axis, in the per-(sequence, head) order, rather than fail to launch."""
    grid, outer = prefill_grid(8, 3, tiles, tiles_outer)
    assert outer == (tiles_outer and tiles <= MAX_OUTER_GRID)
    assert grid == ((8, 3, tiles) if outer else (tiles, 3, 8))
    assert max(grid[1:]) <= MAX_OUTER_GRID
