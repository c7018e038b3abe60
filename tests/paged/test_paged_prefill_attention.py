"""Prefill (and mixed) attention over the paged pool agrees with the naive reference."""

from __future__ import annotations

import torch
from hypothesis import given
from paged_cases import TRITON_DEVICE, PagedCase, assert_matches_reference, paged_cases

from kvrunner_paged.kernels.prefill import paged_prefill_attention
from kvrunner_paged.kernels.reference import reference_paged_attention
from kvrunner_paged.kernels.torch_ops import paged_prefill_attention_torch


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
    return reference_paged_attention(**x, scale=case.scale)


@given(case=paged_cases())
def test_triton_prefill_matches_reference(case: PagedCase) -> None:
    x = _prefill_inputs(case)
    out = paged_prefill_attention(
        **{k: t.to(TRITON_DEVICE) for k, t in x.items()}, scale=case.scale,
        num_seqs=case.num_seqs, max_query_len=max(case.query_lens), block_m=16, block_n=16,
    )
    assert_matches_reference(out.cpu(), _reference(case, x))


@given(case=paged_cases())
def test_torch_prefill_matches_reference(case: PagedCase) -> None:
    x = _prefill_inputs(case)
    out = paged_prefill_attention_torch(**x, scale=case.scale, num_seqs=case.num_seqs)
    assert_matches_reference(out, _reference(case, x))


def test_reference_is_causal_over_the_cached_prefix() -> None:
    """Pin the oracle itself: the first new query sees the prefix and itself, nothing later."""
    k_cache = torch.zeros((2, 4, 1, 16))
    v_cache = torch.zeros((2, 4, 1, 16))
    v_cache[0, :, 0, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # value = position + 1
    q = torch.zeros((2, 1, 16))  # zero queries: uniform weights over what is visible
    out = reference_paged_attention(
        q, k_cache, v_cache, torch.tensor([[0]], dtype=torch.int32),
        torch.tensor([0, 2], dtype=torch.int32), torch.tensor([4], dtype=torch.int32), 0.25,
    )
    # Queries at positions 2 and 3: means of (1, 2, 3) and (1, 2, 3, 4).
    assert out[:, 0, 0].tolist() == [2.0, 2.5]
