"""Triton kernel: uniform noise for seeded sampling rows, one launch for the batch.

Each seeded row gets ``rand(seed, column)`` from Triton's counter-based Philox
generator: the value at ``(row, column)`` depends only on that row's seed and the
column, so a request's draw does not depend on its batch mates or its position, and
nothing is re-seeded on the host per row (which cost one generator call and one
launch per seeded row and step).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: columns per program: a vocabulary of 152k is 38 programs a row
BLOCK = 4096


@triton.jit
def _seeded_uniform_kernel(
    u_ptr,
    rows_ptr,
    seeds_ptr,
    stride_u,
    vocab,
    BLOCK_V: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < vocab
    row = tl.load(rows_ptr + i)
    seed = tl.load(seeds_ptr + i)
    tl.store(u_ptr + row * stride_u + cols, tl.rand(seed, cols), mask=mask)


def seeded_uniform_(u: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor) -> torch.Tensor:
    """Fill ``u[rows[i]]`` with uniform ``[0, 1)`` draws keyed by ``seeds[i]``; in place.

    :param u: ``[N, V]`` float32, last dimension contiguous.
    :param rows: ``[S]`` int64 row indices into ``u``.
    :param seeds: ``[S]`` int64 non-negative seeds (63 bits are used).
    No host sync: the launch is capturable in a CUDA graph.
    """
    assert u.dtype == torch.float32 and u.stride(-1) == 1
    assert rows.shape == seeds.shape and rows.dtype == seeds.dtype == torch.int64
    if rows.numel() == 0 or u.shape[1] == 0:
        return u
    vocab = u.shape[1]
    block = min(BLOCK, triton.next_power_of_2(vocab))
    _seeded_uniform_kernel[(rows.numel(), triton.cdiv(vocab, block))](
        u, rows, seeds, u.stride(0), vocab, BLOCK_V=block, num_warps=4
    )
    return u
