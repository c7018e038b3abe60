"""Deterministic mode's attention (``kernels/fixed_order.py``): the naive reference's
values, with keys cut into splits of a fixed number of keys, in either layout.

Under the interpreter (``tl.dot`` is numpy's product, which may round a row by its
place in the tile) these show the values and that the two layouts of a decode step
agree bit for bit; test_fixed_order_attention_gpu.py shows on the GPU that a token
gets the same bits as a decode row, in a prompt and in a chunk.
"""

from __future__ import annotations

import attrs
import pytest
import torch
from hypothesis import example, given
from paged_cases import TRITON_DEVICE, PagedCase, assert_matches_reference, paged_cases

from kvrunner_paged.kernels.fixed_order import (
    KEY_SPLIT,
    LAUNCH,
    fixed_order_attention,
    use_split_programs,
)
from kvrunner_paged.kernels.reference import reference_paged_attention

#: small tiles and splits, so the tiny cases cross several splits
SMALL = attrs.evolve(LAUNCH[torch.float32], block_m=16, block_n=16)
SPLIT = 16


def _inputs(case: PagedCase) -> dict[str, torch.Tensor]:
    gen = case.generator()
    pool = case.pool(gen, poison_unread=True)
    return {
        "q": torch.randn((case.num_tokens, case.num_heads, case.head_dim), generator=gen),
        "k_cache": pool[0],
        "v_cache": pool[1],
        "block_tables": case.block_table_tensor(case.num_seqs),
        "query_start_loc": case.query_start_loc(),
        "context_lens": case.context_lens_tensor(case.num_seqs),
    }


def _attend(case: PagedCase, x: dict[str, torch.Tensor], split_programs: bool) -> torch.Tensor:
    return fixed_order_attention(
        **{k: t.to(TRITON_DEVICE) for k, t in x.items()}, scale=case.scale,
        num_seqs=case.num_seqs, max_query_len=max(case.query_lens),
        max_context_len=case.max_blocks_per_seq * case.block_size,
        split_programs=split_programs, key_split=SPLIT, launch=SMALL,
    ).cpu()  # fmt: skip


def _case(context_lens: tuple[int, ...], query_lens: tuple[int, ...]) -> PagedCase:
    """Sequences of these contexts in a shuffled pool of 8-slot blocks, GQA 2."""
    blocks = [-(-c // 8) for c in context_lens]
    order = torch.randperm(sum(blocks), generator=torch.Generator().manual_seed(3)).tolist()
    tables = tuple(tuple(order[sum(blocks[:i]) : sum(blocks[: i + 1])])
                   for i in range(len(blocks)))
    return PagedCase(block_size=8, num_blocks=sum(blocks), num_heads=4, num_kv_heads=2,
                     head_dim=16, max_blocks_per_seq=max(blocks), query_lens=query_lens,
                     context_lens=context_lens, block_tables=tables, num_pad_rows=0, seed=5)


# Five splits of one long prompt, a chunk after a prefix crossing three, a short one.
@example(case=_case((77, 40, 9), (77, 30, 9)))
@given(case=paged_cases(max_query_len=40))
def test_prompts_and_chunks_match_the_reference(case: PagedCase) -> None:
    x = _inputs(case)
    ref = reference_paged_attention(**x, scale=case.scale)
    assert_matches_reference(_attend(case, x, split_programs=False), ref)


@example(case=_case((5, 16, 17, 40, 77), (1, 1, 1, 1, 1)))
@given(case=paged_cases(decode=True))
def test_a_decode_step_gets_the_same_bits_in_either_layout(case: PagedCase) -> None:
    """A program per split and a fold in split order, or one program walking the
    splits: the same values, bit for bit (the layout follows the step's shape)."""
    x = _inputs(case)
    walked = _attend(case, x, split_programs=False)
    split = _attend(case, x, split_programs=True)
    assert_matches_reference(split, reference_paged_attention(**x, scale=case.scale))
    assert torch.equal(split, walked)


def test_split_programs_serve_small_decode_steps_over_long_contexts() -> None:
    assert use_split_programs(1, num_seqs=4, num_kv_heads=8, max_context_len=4096, num_sms=132)
    # the unsplit grid already covers every SM, or contexts fit one split, or a prompt
    assert not use_split_programs(1, 17, 8, 4096, 132)
    assert not use_split_programs(1, 4, 8, KEY_SPLIT, 132)
    assert not use_split_programs(2, 4, 8, 4096, 132)


def test_split_programs_refuse_prompt_rows() -> None:
    case = _case((20,), (20,))
    with pytest.raises(AssertionError, match="decode rows only"):
        _attend(case, _inputs(case), split_programs=True)
