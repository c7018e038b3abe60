"""Triton kernel: the w8a8 block-scaled product, e4m3 activations in 1 x 128 groups
times an e4m3 weight in 128 x 128 blocks, on FP8 tensor cores.

``y[m, n] = sum over K blocks b of (xq[m, b] . wq[n, b]) * xs[m, b] * ws[n / 128, b]``:
each K step is one 128-deep block, so it has one activation scale per row and, as a
tile's columns lie in one block row (``block_n`` divides 128), one weight scale; the
step's ``tl.dot`` of the e4m3 tiles accumulates in float32 and is scaled before it is
added, as torch's block-scaled ``scaled_mm`` (the other w8a8 path of
``layers/fp8/gemm.py``) promotes each block. The activations come quantized by
``token_groups_triton.quantize_token_groups_triton``.

The cut is the w8a16 kernel's (``layers/fp8/w8a16_triton.py``): ``[block_m, block_n]``
output tiles, the row tiles of one weight tile neighbours in the launch order (read from
memory once while they run), and K split across programs when the tiles alone would not
keep every SM reading, the float32 slices added by a second kernel in a fixed order.
Launches depend on the shapes only: no host sync, capturable in a CUDA graph.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from kvrunner.layers.fp8.blocks import BLOCK as SCALE_BLOCK
from kvrunner.layers.fp8.blocks import FP8_DTYPE, scale_shape
from kvrunner.layers.fp8.w8a16_triton import TARGET_PROGRAMS, choose_splits
from kvrunner.layers.fused.skinny_gemm_triton import sum_splits

#: up to this many rows a decode step's product with few tiles splits K
SPLIT_ROWS = 64


@attrs.frozen
class W8A8Launch:
    """How one product is cut: ``[block_m, block_n]`` output tiles, K in ``splits``
    slices of whole 128-deep blocks (a second kernel sums them when > 1), and the
    kernel's warps and software-pipeline stages."""

    block_m: int
    block_n: int
    splits: int = 1
    num_warps: int = 4
    num_stages: int = 4

    def __attrs_post_init__(self) -> None:
        if SCALE_BLOCK % self.block_n:
            raise ValueError(f"w8a8: block_n {self.block_n} must divide the scale block "
                             f"{SCALE_BLOCK} (a tile's columns share one weight scale)")
        if min(self.block_m, self.block_n) < 16:
            raise ValueError(f"w8a8: tl.dot takes tiles of 16 and up, got block_m "
                             f"{self.block_m}, block_n {self.block_n}")
        if self.splits < 1:
            raise ValueError(f"w8a8: splits must be at least 1, got {self.splits}")


def default_launch(m: int, n: int, k: int) -> W8A8Launch:
    """The launch :func:`w8a8_block_linear` uses for an ``[m, k] x [k, n]`` product:
    128 x 128 output tiles for a prefill's rows; 16 x 128 tiles, K split to fill the
    machine, for up to 16 rows; 64 x 64 tiles for a larger decode step, K split four
    ways for up to 64 rows where the tiles are fewer than the machine takes.

    Chosen on an H100 (the four 8B projections summed, ms a layer, each call replayed
    in a CUDA graph): at 32 / 48 / 64 rows 64 x 64 tiles split four ways take 0.099 /
    0.107 / 0.116, unsplit 0.104 / 0.108 / 0.109, and 32- or 64-row by 128 tiles with a
    machine-filling split 0.108 / 0.110 / 0.118, against torch's ``scaled_mm`` at
    0.114 / 0.116 / 0.118; from 96 rows unsplit 64 x 64 tiles were the fastest tried,
    and per projection at 64 rows (``bench_fp8.py --sweep-w8a8``) the one with the most
    tiles (gate_up) was fastest unsplit, the other three split four ways."""
    if m > 256:
        return W8A8Launch(128, 128, 1, num_warps=8, num_stages=3)
    if m <= 16:
        return W8A8Launch(16, 128, choose_splits(triton.cdiv(n, 128), k, SCALE_BLOCK))
    tiles = triton.cdiv(m, 64) * triton.cdiv(n, 64)
    few_tiles = m <= SPLIT_ROWS and tiles < TARGET_PROGRAMS
    return W8A8Launch(64, 64, max(1, min(4, k // SCALE_BLOCK)) if few_tiles else 1)


@triton.jit
def _w8a8_block_kernel(
    x_ptr, xs_ptr, w_ptr, ws_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xsm, stride_xsk, stride_wn, stride_wsn, stride_os, stride_om,
    BLOCKS_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SCALE_BLOCK: tl.constexpr,
    NUM_STAGES: tl.constexpr,
):  # fmt: skip
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, SCALE_BLOCK)
    in_rows = rows < M
    in_cols = cols < N
    x_rows = x_ptr + rows[:, None].to(tl.int64) * stride_xm + depth[None, :]
    w_cols = w_ptr + cols[:, None].to(tl.int64) * stride_wn + depth[None, :]
    xs_rows = xs_ptr + rows * stride_xsm
    # every column of the tile lies in one block row of weight scales
    ws_row = ws_ptr + ((pid_n * BLOCK_N) // SCALE_BLOCK) * stride_wsn
    first = split * BLOCKS_PER_SPLIT
    last = tl.minimum(first + BLOCKS_PER_SPLIT, tl.cdiv(K, SCALE_BLOCK))
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for b in tl.range(first, last, num_stages=NUM_STAGES):
        x = tl.load(x_rows + b * SCALE_BLOCK, mask=in_rows[:, None], other=0.0)
        w = tl.load(w_cols + b * SCALE_BLOCK, mask=in_cols[:, None], other=0.0)
        x_scale = tl.load(xs_rows + b * stride_xsk, mask=in_rows, other=0.0)
        w_scale = tl.load(ws_row + b)
        acc += tl.dot(x, tl.trans(w), out_dtype=tl.float32) * (x_scale * w_scale)[:, None]
    out = out_ptr + split * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=in_rows[:, None] & in_cols[None, :])


def w8a8_block_linear(xq: torch.Tensor, x_scales: torch.Tensor, weight: torch.Tensor,
                      scale_inv: torch.Tensor, out_dtype: torch.dtype, rows: int | None = None,
                      launch: W8A8Launch | None = None) -> torch.Tensor:
    """``(xq, x_scales) x (weight, scale_inv)`` in ``out_dtype``: ``xq [R, K]`` e4m3 with
    ``x_scales [R, K / 128]`` float32 (any strides: the column-major layout the token
    quantization writes is read as it is), ``weight [N, K]`` e4m3 contiguous along K with
    ``scale_inv`` of :func:`~.blocks.scale_shape`; K a multiple of 128. The first
    ``rows`` rows of ``xq`` (all by default) are multiplied; the result is ``[rows, N]``.

    ``launch`` overrides :func:`default_launch` (tests and benchmarks vary it)."""
    if xq.dtype != FP8_DTYPE or weight.dtype != FP8_DTYPE:
        raise ValueError(f"w8a8: activations and weight must be {FP8_DTYPE}, got {xq.dtype} "
                         f"and {weight.dtype}")
    if weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"w8a8: the weight must be a matrix contiguous along K, got shape "
                         f"{tuple(weight.shape)}, strides {weight.stride()}")
    n, k = weight.shape
    if xq.dim() != 2 or xq.shape[1] != k or xq.stride(-1) != 1:
        raise ValueError(f"w8a8: activations must be [rows, {k}] contiguous along K, got shape "
                         f"{tuple(xq.shape)}, strides {xq.stride()}")
    if k % SCALE_BLOCK:
        raise ValueError(f"w8a8: K = {k} is not a multiple of {SCALE_BLOCK}")
    if tuple(x_scales.shape) != (xq.shape[0], k // SCALE_BLOCK) or x_scales.dtype != torch.float32:
        raise ValueError(f"w8a8: activation scales must be float32 of shape "
                         f"{(xq.shape[0], k // SCALE_BLOCK)}, got {x_scales.dtype} of shape "
                         f"{tuple(x_scales.shape)}")
    if tuple(scale_inv.shape) != scale_shape(weight.shape) or scale_inv.dtype != torch.float32:
        raise ValueError(f"w8a8: weight scales must be float32 of shape "
                         f"{scale_shape(weight.shape)}, got {scale_inv.dtype} of shape "
                         f"{tuple(scale_inv.shape)}")
    m = xq.shape[0] if rows is None else rows
    out = torch.empty(m, n, dtype=out_dtype, device=xq.device)
    if m == 0 or n == 0:
        return out
    if k == 0:
        return out.zero_()
    if scale_inv.stride(-1) != 1:
        scale_inv = scale_inv.contiguous()
    launch = launch or default_launch(m, n, k)
    blocks = k // SCALE_BLOCK
    per_split = triton.cdiv(blocks, launch.splits)
    splits = triton.cdiv(blocks, per_split)  # no empty split after rounding up
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32,
                                                  device=xq.device)
    grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), splits)
    _w8a8_block_kernel[grid](
        xq, x_scales, weight, scale_inv, target, m, n, k,
        xq.stride(0), x_scales.stride(0), x_scales.stride(1), weight.stride(0),
        scale_inv.stride(0), target.stride(0) if splits > 1 else 0, n, per_split,
        BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, SCALE_BLOCK=SCALE_BLOCK,
        NUM_STAGES=launch.num_stages, num_warps=launch.num_warps,
    )  # fmt: skip
    if splits > 1:
        sum_splits(target, out)
    return out
