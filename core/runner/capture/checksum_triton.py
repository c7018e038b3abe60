"""Triton kernel for the capture audit: per-chunk checksums of a pool in one read.

One program per chunk: it streams the chunk's words once, accumulating their sum
and their position-weighted sum in int64 (wrapping, as the torch path does), and
writes the two numbers. A pool of ``B`` bytes costs one read of ``B`` bytes, so an
audit pass over a full H200 pool is tens of milliseconds, not a copy of the pool.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: words each program loads per iteration
BLOCK = 4096


@triton.jit
def _chunk_checksum_kernel(words_ptr, out_ptr, n_words, CHUNK: tl.constexpr, BLOCK: tl.constexpr):
    chunk = tl.program_id(0).to(tl.int64)
    start = chunk * CHUNK
    total = tl.zeros([BLOCK], dtype=tl.int64)
    weighted = tl.zeros([BLOCK], dtype=tl.int64)
    for offset in range(0, CHUNK, BLOCK):
        within = offset + tl.arange(0, BLOCK)
        index = start + within
        x = tl.load(words_ptr + index, mask=(within < CHUNK) & (index < n_words), other=0)
        x = x.to(tl.int64)
        total += x
        weighted += x * (within + 1).to(tl.int64)
    tl.store(out_ptr + chunk * 2, tl.sum(total, axis=0))
    tl.store(out_ptr + chunk * 2 + 1, tl.sum(weighted, axis=0))


def chunk_checksums_triton(words: torch.Tensor, chunk_words: int) -> torch.Tensor:
    """``[num_chunks, 2]`` int64 for a flat int32 or uint8 tensor (see
    :func:`kvrunner.runner.capture.capture_safety.chunk_checksums`)."""
    n = words.numel()
    chunks = -(-n // chunk_words)
    out = torch.empty((chunks, 2), dtype=torch.int64, device=words.device)
    block = min(BLOCK, triton.next_power_of_2(chunk_words))
    _chunk_checksum_kernel[(chunks,)](words, out, n, CHUNK=chunk_words, BLOCK=block)
    return out
