"""Triton kernel: uniform noise for seeded sampling rows, one launch for the batch.

Row ``i`` gets ``rand(key, column)`` from Triton's counter-based Philox generator,
keyed by ``seed * KEY_STRIDE + count`` (int64, wrapping) where ``count`` is the
tokens its request generated so far: the value at ``(row, column)`` depends only on
``(seed, count, column)``, so a request's draw does not depend on its batch mates or
its position, and nothing is re-seeded or hashed on the host per row (re-seeding a
generator cost one call and one launch per seeded row and step).

Two draws share a key only if ``(seed - seed') * KEY_STRIDE == count' - count``
modulo 2^64: never for seeds closer than 2^32 with counts below ``KEY_STRIDE``.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: columns per program: a vocabulary of 152k is 38 programs a row
BLOCK = 4096
#: odd, and above any count of generated tokens a request reaches
KEY_STRIDE = 2**31 - 1


@triton.jit
def _seeded_uniform_kernel(
    u_ptr,
    rows_ptr,
    seeds_ptr,
    counts_ptr,
    stride_u,
    vocab,
    KEY_STRIDE: tl.constexpr,
    BLOCK_V: tl.constexpr,
):
    i = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask = cols < vocab
    row = tl.load(rows_ptr + i)
    key = tl.load(seeds_ptr + i) * KEY_STRIDE + tl.load(counts_ptr + i)
    tl.store(u_ptr + row * stride_u + cols, tl.rand(key, cols), mask=mask)


def seeded_uniform_(
    u: torch.Tensor, rows: torch.Tensor, seeds: torch.Tensor, counts: torch.Tensor
) -> torch.Tensor:
    """Fill ``u[rows[i]]`` with uniform ``[0, 1)`` draws keyed by ``(seeds[i],
    counts[i])``; in place.

    :param u: ``[N, V]`` float32, last dimension contiguous.
    :param rows: ``[S]`` int64 row indices into ``u``.
    :param seeds: ``[S]`` int64 request seeds; ``counts``: ``[S]`` int64 tokens each
        request generated so far.
    No host sync: the launch is capturable in a CUDA graph.
    """
    assert u.dtype == torch.float32 and u.stride(-1) == 1
    assert rows.shape == seeds.shape == counts.shape
    assert rows.dtype == seeds.dtype == counts.dtype == torch.int64
    if rows.numel() == 0 or u.shape[1] == 0:
        return u
    vocab = u.shape[1]
    block = min(BLOCK, triton.next_power_of_2(vocab))
    _seeded_uniform_kernel[(rows.numel(), triton.cdiv(vocab, block))](
        u, rows, seeds, counts, u.stride(0), vocab,
        KEY_STRIDE=KEY_STRIDE, BLOCK_V=block, num_warps=4,
    )  # fmt: skip
    return u
