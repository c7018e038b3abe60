"""Triton kernel: ``x @ W.T`` computed the same way for every row count.

cuBLAS (and the skinny-GEMM kernel) pick tiles, split-K and even the instruction by
the row count M, so a row's product changes with the batch it shares. This kernel's
launch depends on ``(N, K)`` only: ``[BLOCK_M, BLOCK_N]`` output tiles, K walked in
``BLOCK_K`` steps from its start, and K cut into a number of splits chosen from the
weight's shape (a decode-sized product needs them to keep the machine reading). Each
split's partial sums (float32) land in a workspace that a second kernel adds in split
order. An output element is therefore always the same chain of the same ``tl.dot``
instructions over the same K slices, whichever tile row it lands in and however
many rows share the launch: its value depends on its own row and the weight alone.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrunner.layers.fused.skinny_gemm_triton import _sum_splits_kernel

#: the fixed tile: rows, output columns, reduction depth (bf16: 8 KB of x, 8 KB of W)
BLOCK_M, BLOCK_N, BLOCK_K = 64, 64, 64
#: output tiles x splits wanted in flight (two per SM of an H200), and the most splits
TARGET_PROGRAMS = 264
MAX_SPLITS = 4
#: the shallowest split worth its partial write
MIN_SPLIT_DEPTH = 512


def invariant_splits(n: int, k: int) -> int:
    """K splits for a ``[k] -> [n]`` product: from the weight's shape alone, never the
    row count, so every batch reduces each output over the same K slices."""
    tiles = triton.cdiv(n, BLOCK_N)
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, tiles), k // MIN_SPLIT_DEPTH, MAX_SPLITS))


@triton.jit
def _invariant_gemm_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_os, stride_om,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0).to(tl.int64)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k in range(k_start, k_end, BLOCK_K):
        ks = k + depth
        in_k = ks < k_end
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows < M)[:, None] & in_k[None, :], other=0.0)
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=(cols < N)[:, None] & in_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    out = out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


def invariant_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` (``x`` ``[..., K]``, ``weight`` ``[N, K]`` contiguous along K),
    float32 accumulation, the result in ``x``'s dtype; each row's result is the same
    whatever the other rows. No host sync: capturable in a CUDA graph."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if weight.stride(-1) != 1:
        weight = weight.contiguous()
    m, n = rows.shape[0], weight.shape[0]
    assert weight.shape[1] == k, f"x has {k} features, the weight {weight.shape[1]}"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:
        return out.zero_().reshape(*lead, n)
    splits = invariant_splits(n, k)
    per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(k, per_split)  # no empty split after rounding up
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32,
                                                  device=x.device)
    grid = (triton.cdiv(m, BLOCK_M), triton.cdiv(n, BLOCK_N), splits)
    _invariant_gemm_kernel[grid](
        rows, weight, target, m, n, k,
        rows.stride(0), weight.stride(0), target.stride(0) if splits > 1 else 0, n,
        per_split,
        BLOCK_M=BLOCK_M, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        # fp32 stays fp32 (tl.dot would round it to TF32); 16-bit inputs ignore it
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](target, out, m * n, SPLITS=splits,
                                                         BLOCK=block)
    return out.reshape(*lead, n)
