"""Deterministic mode's attention on CUDA (``ops/paged_attention/fixed_order.py``): a token
attended as a decode row (one query of its sequence, in either layout), inside a
whole-sequence prefill, and inside a prefill chunk after a cached prefix gets the same
bits in all four, over contexts of one to three key splits.

Compiled, a row shares its tile with different neighbours, masks and key-tile splits
in each case, which the interpreter (numpy's products) cannot show.
"""

from __future__ import annotations

import pytest
import torch

from kvrunner_paged.ops.paged_attention.fixed_order import (
    KEY_SPLIT,
    fixed_order_attention,
)
from kvrunner_paged.ops.paged_attention.inputs import PagedAttentionInputs

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BLOCK_SIZE = 16
CONTEXTS = [1, 17, 64, 250, 701, KEY_SPLIT, KEY_SPLIT + 1, 1500, 2 * KEY_SPLIT + 600]


def _attend(q: torch.Tensor, pools: torch.Tensor, tables: torch.Tensor, q_lens: list[int],
            ctx: list[int], split_programs: bool = False) -> torch.Tensor:
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    inputs = PagedAttentionInputs(
        q=q, k_cache=pools[0], v_cache=pools[1], block_tables=tables,
        query_start_loc=starts.to(CUDA),
        context_lens=torch.tensor(ctx, dtype=torch.int32, device=CUDA), scale=q.shape[-1] ** -0.5,
        num_seqs=len(ctx), max_query_len=max(q_lens),
    )
    return fixed_order_attention(inputs=inputs, max_context_len=max(ctx),
                                 split_programs=split_programs)


def _sequences(contexts: list[int], dtype: torch.dtype, num_heads: int, num_kv_heads: int
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Random pools, block tables over shuffled blocks, and every position's query."""
    gen = torch.Generator(device=CUDA).manual_seed(0)
    blocks = [-(-c // BLOCK_SIZE) for c in contexts]
    pools = torch.randn(2, sum(blocks) + 4, BLOCK_SIZE, num_kv_heads, 128, generator=gen,
                        device=CUDA).to(dtype)
    order = torch.randperm(sum(blocks) + 4, generator=gen, device=CUDA).tolist()
    tables = torch.zeros(len(contexts), max(blocks), dtype=torch.int32, device=CUDA)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(order[sum(blocks[:i]):sum(blocks[:i]) + n])
    q_full = torch.randn(sum(contexts), num_heads, 128, generator=gen, device=CUDA).to(dtype)
    return pools, tables, q_full


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (8, 8)], ids=["gqa2", "gqa4", "mha"])
def test_a_token_has_the_same_bits_in_decode_prefill_and_a_chunk(
        dtype: torch.dtype, heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    pools, tables, q_full = _sequences(CONTEXTS, dtype, num_heads, num_kv_heads)

    ends = torch.tensor(CONTEXTS, device=CUDA).cumsum(0)
    prefill = _attend(q_full, pools, tables, CONTEXTS, CONTEXTS)
    last = q_full[ends - 1].contiguous()
    decode = _attend(last, pools, tables, [1] * len(CONTEXTS), CONTEXTS)
    split = _attend(last, pools, tables, [1] * len(CONTEXTS), CONTEXTS, split_programs=True)
    chunk = [min(c, 24) for c in CONTEXTS]  # the last 24 tokens, after a cached prefix
    rows = torch.cat([torch.arange(e - n, e, device=CUDA)
                      for e, n in zip(ends.tolist(), chunk, strict=True)])
    chunked = _attend(q_full[rows].contiguous(), pools, tables, chunk, CONTEXTS)

    assert torch.equal(decode, prefill[ends - 1]), (
        f"{(decode != prefill[ends - 1]).sum().item()} of {decode.numel()} values differ")
    assert torch.equal(split, decode)
    assert torch.equal(chunked, prefill[rows])


@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (8, 8)], ids=["gqa2", "gqa4", "mha"])
def test_a_decode_step_that_fills_the_machine_gives_each_row_its_prefill_bits(
        heads: tuple[int, int]) -> None:
    """Enough sequences for a (sequence, KV head) program on every SM: each row still
    gets the bits the prefill gives it."""
    num_heads, num_kv_heads = heads
    sms = torch.cuda.get_device_properties(CUDA).multi_processor_count
    contexts = CONTEXTS * -(-sms // (num_kv_heads * len(CONTEXTS)))
    pools, tables, q_full = _sequences(contexts, torch.bfloat16, num_heads, num_kv_heads)

    ends = torch.tensor(contexts, device=CUDA).cumsum(0)
    prefill = _attend(q_full, pools, tables, contexts, contexts)
    decode = _attend(q_full[ends - 1].contiguous(), pools, tables, [1] * len(contexts),
                     contexts)
    assert torch.equal(decode, prefill[ends - 1]), (
        f"{(decode != prefill[ends - 1]).sum().item()} of {decode.numel()} values differ")
