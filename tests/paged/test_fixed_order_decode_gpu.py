"""Deterministic mode's decode tile on CUDA: a decode row attended in the 16-row tile
of ``FIXED_ORDER_DECODE_LAUNCH`` has the bits it has in the 128-row tile of
``LAUNCH`` (the tile a prefill, a prompt scoring or a recompute attends it in).

Compiled, the two tiles take different tensor-core instructions (``mma`` for 16 rows,
Hopper's ``wgmma`` for 128), which the interpreter cannot show: a difference in how
either sums a product's terms would break deterministic mode's promise that a token's
logprob is the same in prefill and in decode.
"""

from __future__ import annotations

import pytest
import torch

from kvrunner_paged.kernels.prefill import (
    FIXED_ORDER_DECODE_LAUNCH,
    LAUNCH,
    paged_prefill_attention,
)

pytestmark = pytest.mark.gpu
CUDA = torch.device("cuda")
BLOCK_SIZE = 16
CONTEXTS = [1, 17, 64, 250, 701, 1500]


def _attend(q: torch.Tensor, pools: torch.Tensor, tables: torch.Tensor, q_lens: list[int],
            ctx: list[int], launch) -> torch.Tensor:
    starts = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
    return paged_prefill_attention(
        q, pools[0], pools[1], tables, starts.to(CUDA),
        torch.tensor(ctx, dtype=torch.int32, device=CUDA), q.shape[-1] ** -0.5,
        num_seqs=len(ctx), max_query_len=max(q_lens), block_m=launch.block_m,
        block_n=launch.block_n, num_warps=launch.num_warps, num_stages=launch.num_stages,
        dot_precision=launch.dot_precision,
    )


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("heads", [(16, 8), (32, 8), (8, 8)], ids=["gqa2", "gqa4", "mha"])
def test_a_decode_row_has_the_bits_of_its_prefill_row(dtype: torch.dtype,
                                                      heads: tuple[int, int]) -> None:
    num_heads, num_kv_heads = heads
    gen = torch.Generator(device=CUDA).manual_seed(0)
    blocks = [-(-c // BLOCK_SIZE) for c in CONTEXTS]
    pools = torch.randn(2, sum(blocks) + 4, BLOCK_SIZE, num_kv_heads, 128, generator=gen,
                        device=CUDA).to(dtype)
    order = torch.randperm(sum(blocks) + 4, generator=gen, device=CUDA).tolist()
    tables = torch.zeros(len(CONTEXTS), max(blocks), dtype=torch.int32, device=CUDA)
    for i, n in enumerate(blocks):
        tables[i, :n] = torch.tensor(order[sum(blocks[:i]):sum(blocks[:i]) + n])
    q_full = torch.randn(sum(CONTEXTS), num_heads, 128, generator=gen, device=CUDA).to(dtype)

    prefill = _attend(q_full, pools, tables, CONTEXTS, CONTEXTS, LAUNCH[dtype])
    last = torch.tensor(CONTEXTS, device=CUDA).cumsum(0) - 1
    decode = _attend(q_full[last].contiguous(), pools, tables, [1] * len(CONTEXTS), CONTEXTS,
                     FIXED_ORDER_DECODE_LAUNCH[dtype])

    assert FIXED_ORDER_DECODE_LAUNCH[dtype].block_m < LAUNCH[dtype].block_m
    assert torch.equal(decode, prefill[last]), (
        f"{(decode != prefill[last]).sum().item()} of {decode.numel()} values differ")
