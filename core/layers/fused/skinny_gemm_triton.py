"""Triton kernel: ``x @ W.T`` for the few rows of a decode step (M <= 64).

At decode the projections are weight-bound: the step reads every weight once for a
handful of rows. The profile of the Qwen3-0.6B decode step on an H200 shows cuBLAS's
kernels at M = 1 reading 4-12 MB weights at about 1 TB/s (10 µs a call) where the
copy bandwidth is 4.27 TB/s. This kernel streams ``W`` in ``[BLOCK_N, BLOCK_K]``
tiles along its contiguous dimension and splits K across programs when the output
alone gives too few programs to keep every SM reading: the split partial sums (fp32)
go to a workspace that a second small kernel adds up in a fixed order, so the result
does not depend on scheduling (no atomics).

``benchmarks/bench_skinny_gemm.py`` measured it on an H200 against cuBLAS: faster at
one row with K >= 2048 (0.54-0.99x cuBLAS's time), slower on shallow weights and at
8-64 rows. So by default (``KVRUNNER_SKINNY_GEMM=auto``, see ``layers/fused/dispatch.py``)
only those projections take it; ``1`` sends every decode-sized one here.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrunner.layers.fused.dispatch import SKINNY_GEMM_MAX_ROWS as MAX_ROWS

#: output columns and reduction depth of one program's weight tile (bf16: 16 KB)
BLOCK_N, BLOCK_K = 64, 128
#: programs wanted in flight: two per SM of an H200
TARGET_PROGRAMS = 264


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_os, stride_om,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start = split * K_PER_SPLIT
    k_end = tl.minimum(k_start + K_PER_SPLIT, K)
    for k in range(k_start, k_end, BLOCK_K):
        ks = k + depth
        in_k = ks < k_end
        w = tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                    mask=(cols < N)[:, None] & in_k[None, :], other=0.0)
        x = tl.load(x_ptr + rows[:, None] * stride_xm + ks[None, :],
                    mask=(rows < M)[:, None] & in_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    out = out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, total, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLITS):  # a fixed order: the same sum on every call
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def choose_splits(n: int, k: int) -> int:
    """Splits of K so that output tiles x splits reach :data:`TARGET_PROGRAMS`, each
    split at least one ``BLOCK_K`` deep. Static shapes only: graph-capturable."""
    tiles = triton.cdiv(n, BLOCK_N)
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, tiles), triton.cdiv(k, BLOCK_K)))


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` of at most :data:`MAX_ROWS` rows (``[M, K]``, any
    leading shape flattened), ``weight`` ``[N, K]`` contiguous; fp32 accumulation,
    the result in ``x``'s dtype. No host sync: capturable in a CUDA graph."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    m, n = rows.shape[0], weight.shape[0]
    assert m <= MAX_ROWS, f"skinny_gemm takes at most {MAX_ROWS} rows, got {m}"
    assert weight.shape[1] == k and weight.stride(-1) == 1
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:
        return out.zero_().reshape(*lead, n)
    splits = choose_splits(n, k)
    per_split = triton.cdiv(triton.cdiv(k, splits), BLOCK_K) * BLOCK_K
    splits = triton.cdiv(k, per_split)  # no empty split after rounding up
    block_m = 16 if m <= 16 else MAX_ROWS
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32,
                                                  device=x.device)
    _skinny_gemm_kernel[(triton.cdiv(n, BLOCK_N), splits)](
        rows, weight, target, m, n, k,
        rows.stride(0), weight.stride(0), target.stride(0) if splits > 1 else 0, n,
        per_split,
        BLOCK_M=block_m, BLOCK_N=BLOCK_N, BLOCK_K=BLOCK_K,
        # fp32 stays fp32 (tl.dot would round it to TF32); 16-bit inputs ignore it
        PRECISION="ieee" if x.dtype == torch.float32 else "tf32", num_warps=4,
    )  # fmt: skip
    if splits > 1:
        block = 1024
        _sum_splits_kernel[(triton.cdiv(m * n, block),)](target, out, m * n, SPLITS=splits,
                                                         BLOCK=block)
    return out.reshape(*lead, n)
