"""Triton kernel for the step audit: each pool row's two checksums in one read, no copy.

A row seen through ``cache_rows`` is strided (paged's keys and values of one slot lie
``num_blocks * block_size`` rows apart), so the torch path copies groups of rows to
make them contiguous and widens them to int64 (``pool_rows.row_checksums``). Here
one program per row walks the row's elements in the row-major order of the view,
up to three (coalesced) inner dimensions with their own strides, reading each word
once and accumulating the sum and the position-weighted sum in int64, wrapping as
the torch path does: the same two numbers, bit for bit.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: elements each program loads per iteration
BLOCK = 1024
#: inner dimensions the kernel walks (after coalescing)
MAX_INNER = 3


@triton.jit
def _row_checksum_kernel(words_ptr, out_ptr, row_stride, n1, n2, n3, s1, s2, s3, width,
                         BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = words_ptr + row * row_stride
    total = tl.zeros([BLOCK], dtype=tl.int64)
    weighted = tl.zeros([BLOCK], dtype=tl.int64)
    for start in range(0, width, BLOCK):
        k = (start + tl.arange(0, BLOCK)).to(tl.int64)
        i1 = k // (n2 * n3)
        i2 = (k // n3) % n2
        i3 = k % n3
        x = tl.load(base + i1 * s1 + i2 * s2 + i3 * s3, mask=k < width, other=0)
        x = x.to(tl.int64)
        total += x
        weighted += x * (k + 1)
    tl.store(out_ptr + row * 2, tl.sum(total, axis=0))
    tl.store(out_ptr + row * 2 + 1, tl.sum(weighted, axis=0))


def inner_dims(rows: torch.Tensor) -> list[tuple[int, int]] | None:
    """The row's inner dimensions as ``(size, stride)``, adjacent ones merged where the
    layout allows; None when more than :data:`MAX_INNER` remain."""
    dims: list[tuple[int, int]] = []
    for size, stride in zip(rows.shape[1:], rows.stride()[1:], strict=True):
        if size == 1:
            continue
        if dims and dims[-1][1] == stride * size:
            dims[-1] = (dims[-1][0] * size, stride)
        else:
            dims.append((size, stride))
    return dims if len(dims) <= MAX_INNER else None


def row_checksums_triton(words: torch.Tensor, dims: list[tuple[int, int]]) -> torch.Tensor:
    """``[num_rows, 2]`` int64 for ``words`` (a pool's rows viewed as integers of their
    element size) whose inner dimensions are ``dims`` (:func:`inner_dims`)."""
    num_rows = words.shape[0]
    out = torch.empty((num_rows, 2), dtype=torch.int64, device=words.device)
    padded = [(1, 0)] * (MAX_INNER - len(dims)) + dims
    (n1, s1), (n2, s2), (n3, s3) = padded
    width = n1 * n2 * n3
    block = min(BLOCK, triton.next_power_of_2(max(width, 1)))
    if num_rows:
        _row_checksum_kernel[(num_rows,)](words, out, words.stride(0), n1, n2, n3, s1, s2, s3,
                                          width, BLOCK=block)
    return out
