"""Triton kernels: ``x @ W.T`` for the few rows of a decode step (M <= 64).

At decode the projections are weight-bound: the step reads every weight once for a
handful of rows. The profile of the Qwen3-0.6B decode step on an H200 shows cuBLAS's
kernels at M = 1 reading 4-12 MB weights at about 1 TB/s (10 µs a call) where the
copy bandwidth is 4.27 TB/s. These kernels stream ``W`` in ``[block_n, block_k]``
tiles along its contiguous dimension: a tensor-core product for several rows, a
multiply-and-sum (a GEMV) for one row, where a 16-row product would be mostly
padding and the tile can be narrower. K is split across programs when the output
alone gives too few programs to keep every SM reading: the split partial sums (fp32)
go to a workspace that a second small kernel adds up in a fixed order, so the result
does not depend on scheduling (no atomics).

Which tiles a shape gets is :func:`default_launch`; ``benchmarks/bench_skinny_gemm.py
--sweep`` times the alternatives on a GPU. Which projections take these kernels at
all (``[kernels] skinny_gemm``) is decided in ``layers/fused/dispatch.py`` from the
same benchmark.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from kvrunner.layers.fused.dispatch import SKINNY_GEMM_MAX_ROWS as MAX_ROWS
from kvrunner.layers.fused.silu_mul_triton import silu_mul_tile

#: the tensor-core tile's output columns and reduction depth (bf16: 16 KB)
BLOCK_N, BLOCK_K = 64, 128
#: programs wanted in flight: two per SM of an H200
TARGET_PROGRAMS = 264


@attrs.frozen
class SkinnyLaunch:
    """How one product is cut: ``[block_n, block_k]`` weight tiles, K in ``splits``
    slices (a second kernel sums them when > 1), and ``gemv`` for the one-row kernel."""

    block_n: int
    block_k: int
    splits: int
    gemv: bool = False


def choose_splits(n: int, k: int, block_n: int = BLOCK_N, block_k: int = BLOCK_K) -> int:
    """Splits of K so that output tiles x splits reach :data:`TARGET_PROGRAMS`, each
    split at least one ``block_k`` deep. Static shapes only: graph-capturable."""
    tiles = triton.cdiv(n, block_n)
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, tiles), triton.cdiv(k, block_k)))


#: the one-row kernel's tile (bf16: 8 KB) ...
GEMV_BLOCK_N, GEMV_BLOCK_K = 8, 512
#: ... and the most weight bytes one unsplit GEMV program streams before K is split
GEMV_MAX_UNSPLIT_BYTES = 32 * 1024


def default_launch(m: int, n: int, k: int, itemsize: int = 2) -> SkinnyLaunch:
    """The launch :func:`skinny_gemm` uses for an ``[m, k] x [k, n]`` product.

    One row takes the GEMV kernel in 8 x 512 tiles, K split only where an unsplit
    program would stream over 32 KB of weight. From ``bench_skinny_gemm.py --sweep`` on
    an H200 (bf16): that tile was the fastest of 15 candidates for every
    one-row projection of the 0.6B and 8B shapes but 8B gate_up (there the GEMV ran
    1.00x cuBLAS, the tensor-core tile 0.98x), unsplit
    for 0.6B o_proj (K = 2048, 32 KB a program: 5.3 us, cuBLAS 13.1) and split in 3
    for 0.6B down_proj (K = 3072: 6.0 us, cuBLAS 7.9). More rows keep the tensor-core
    tile, K split to fill the machine."""
    if m == 1:
        unsplit = k * GEMV_BLOCK_N * itemsize <= GEMV_MAX_UNSPLIT_BYTES
        splits = 1 if unsplit else choose_splits(n, k, GEMV_BLOCK_N, GEMV_BLOCK_K)
        return SkinnyLaunch(GEMV_BLOCK_N, GEMV_BLOCK_K, splits, gemv=True)
    return SkinnyLaunch(BLOCK_N, BLOCK_K, choose_splits(n, k))


@triton.jit
def _split_bounds(split, K, K_PER_SPLIT):
    """``[k_start, k_end)``: the slice of K split ``split`` reduces over."""
    k_start = split * K_PER_SPLIT
    return k_start, tl.minimum(k_start + K_PER_SPLIT, K)


@triton.jit
def _weight_tile(w_ptr, cols, ks, in_k, N, stride_wn):
    """``W[cols, ks]``: one program's weight tile, zeros outside N and its K slice."""
    return tl.load(w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :],
                   mask=(cols < N)[:, None] & in_k[None, :], other=0.0)


@triton.jit
def _skinny_gemm_kernel(
    x_ptr, w_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_os, stride_om,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr, SILU_MUL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start, k_end = _split_bounds(split, K, K_PER_SPLIT)
    for k in range(k_start, k_end, BLOCK_K):
        ks = k + depth
        in_k = ks < k_end
        w = _weight_tile(w_ptr, cols, ks, in_k, N, stride_wn)
        x_rows = x_ptr + rows[:, None] * stride_xm + ks[None, :]
        x_mask = (rows < M)[:, None] & in_k[None, :]
        x = tl.load(x_rows, mask=x_mask, other=0.0)
        if SILU_MUL:
            x = silu_mul_tile(x, tl.load(x_rows + K, mask=x_mask, other=0.0), dtype)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    out = out_ptr + split * stride_os + rows[:, None] * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _gemv_kernel(
    x_ptr, w_ptr, out_ptr,
    N, K,
    stride_wn, stride_os,
    K_PER_SPLIT,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SILU_MUL: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty  # the activation's rounding (out may be the fp32 splits)
    # Products accumulate lane by lane; one reduction at the end, in a fixed order.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start, k_end = _split_bounds(split, K, K_PER_SPLIT)
    for k in range(k_start, k_end, BLOCK_K):
        ks = k + depth
        in_k = ks < k_end
        w = _weight_tile(w_ptr, cols, ks, in_k, N, stride_wn)
        x = tl.load(x_ptr + ks, mask=in_k, other=0.0)
        if SILU_MUL:
            x = silu_mul_tile(x, tl.load(x_ptr + K + ks, mask=in_k, other=0.0), dtype)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + split * stride_os + cols, out.to(out_ptr.dtype.element_ty), mask=cols < N)


@triton.jit
def _sum_splits_kernel(part_ptr, out_ptr, total, SPLITS: tl.constexpr, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < total
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for s in range(SPLITS):  # a fixed order: the same sum on every call
        acc += tl.load(part_ptr + s * total + offs, mask=mask, other=0.0)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)


def sum_splits(parts: torch.Tensor, out: torch.Tensor) -> None:
    """``out`` (contiguous ``[M, N]``) set to the split-K slices ``parts``
    (contiguous float32 ``[splits, M, N]``) added in slice order from zero, in float32,
    in one launch: every split-K product here ends with this sum."""
    total, block = out.numel(), 1024
    _sum_splits_kernel[(triton.cdiv(total, block),)](parts, out, total,
                                                     SPLITS=parts.shape[0], BLOCK=block)


def skinny_gemm(x: torch.Tensor, weight: torch.Tensor, launch: SkinnyLaunch | None = None,
                *, silu_mul: bool = False) -> torch.Tensor:
    """``x @ weight.T`` for ``x`` of at most :data:`MAX_ROWS` rows (``[M, K]``, any
    leading shape flattened), ``weight`` ``[N, K]`` contiguous; fp32 accumulation,
    the result in ``x``'s dtype. No host sync: capturable in a CUDA graph.

    ``launch`` overrides :func:`default_launch` (benchmarks sweep it); a ``gemv``
    launch takes one row only. ``silu_mul``: each row of ``x`` is ``[gate | up]`` of
    ``2K`` and the product is ``silu_mul_triton(x) @ weight.T``, bit for bit (with the
    same launch), in one launch (the kernel reads gate and up and forms the input
    itself)."""
    lead, width = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, width)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    k = width // 2 if silu_mul else width
    m, n = rows.shape[0], weight.shape[0]
    assert m <= MAX_ROWS, f"skinny_gemm takes at most {MAX_ROWS} rows, got {m}"
    assert weight.shape[1] == k and weight.stride(-1) == 1
    assert not silu_mul or width == 2 * k, "silu_mul takes [gate | up] rows"
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:
        return out.zero_().reshape(*lead, n)
    launch = launch or default_launch(m, n, k, x.element_size())
    assert not launch.gemv or m == 1, f"a gemv launch takes one row, got {m}"
    per_split = triton.cdiv(triton.cdiv(k, launch.splits), launch.block_k) * launch.block_k
    splits = triton.cdiv(k, per_split)  # no empty split after rounding up
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32,
                                                  device=x.device)
    grid = (triton.cdiv(n, launch.block_n), splits)
    split_stride = target.stride(0) if splits > 1 else 0
    if launch.gemv:
        _gemv_kernel[grid](rows, weight, target, n, k, weight.stride(0), split_stride,
                           per_split, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
                           SILU_MUL=silu_mul, num_warps=4)
    else:
        _skinny_gemm_kernel[grid](
            rows, weight, target, m, n, k,
            rows.stride(0), weight.stride(0), split_stride, n,
            per_split,
            BLOCK_M=16 if m <= 16 else MAX_ROWS, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
            # fp32 stays fp32 (tl.dot would round it to TF32); 16-bit inputs ignore it
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32", SILU_MUL=silu_mul,
            num_warps=4,
        )  # fmt: skip
    if splits > 1:
        sum_splits(target, out)
    return out.reshape(*lead, n)
