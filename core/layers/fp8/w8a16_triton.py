"""Triton kernels: ``x @ dequant(W).T`` with FP8 weights and 16-bit activations (w8a16),
for the rows of a decode step.

At decode a projection is weight-bound: the step reads every weight once for a few
hundred rows at most. An e4m3 weight is half the bytes of a bf16 one, so a product that
streams the stored bytes and dequantizes each tile on chip reads half as much as the
bf16 product, where dequantizing the whole weight first (``F.linear`` on
``dequantize_blocks``) reads and writes it three times over. The activations are not
quantized: each program loads its ``[block_n, block_k]`` e4m3 tile, multiplies it by its
128 x 128 block's ``weight_scale_inv`` in float32, rounds it to the activations' dtype
(as ``dequantize_blocks(W, s, x.dtype)`` rounds the weight) and multiplies as a 16-bit
tile would, accumulating in float32: the FP8 experts' tiles
(``layers/fused/moe_triton.py``) are dequantized the same way.

The cut follows the bf16 skinny GEMM's (``layers/fused/skinny_gemm_triton.py``): a
tensor-core product over ``[block_m, block_n]`` output tiles, a multiply-and-sum (a
GEMV) for one row, and K split across programs when the output tiles alone are too few
to keep every SM reading, the float32 partial sums added by a second kernel in a fixed
order (no atomics: the result does not depend on scheduling). Each tile's rows lie in
one block row of scales (``block_n`` divides 128); a tensor-core K step lies in one
block column too (``block_k`` divides 128), so its scale is one number, while the
GEMV's wider K steps load one scale per column. Launches depend on the shapes only:
no host sync, capturable in a CUDA graph.
"""

from __future__ import annotations

import attrs
import torch
import triton
import triton.language as tl

from kvrunner.layers.fp8.blocks import BLOCK as SCALE_BLOCK
from kvrunner.layers.fp8.blocks import FP8_DTYPE, scale_shape

# the split-K pieces of the bf16 skinny product: a slice's bounds, a weight tile as
# stored (e4m3 here), the slices' fixed-order sum
from kvrunner.layers.fused.skinny_gemm_triton import _split_bounds, _weight_tile, sum_splits

#: the most rows ``fp8_linear`` sends here: a decode step's batch (a rollout's 256
#: sequences included); more rows are a prefill's, whose product is compute-bound
MAX_ROWS = 256
#: the most rows it sends here where the w8a8 product (FP8 tensor cores) could take
#: them: on an H100 this kernel beats bf16 at one row on every 8B projection, but
#: loses to bf16 at 64 rows on three of four and at 256 on all (``bench_fp8.py``'s
#: product table)
MAX_ROWS_BESIDE_W8A8 = 16
#: the tensor-core tile's output columns and reduction depth (e4m3: 8 KB)
BLOCK_N, BLOCK_K = 64, 128
#: programs wanted in flight: two per SM of an H100 or H200
TARGET_PROGRAMS = 264
#: the one-row kernel's tile (e4m3: 4 KB) ...
GEMV_BLOCK_N, GEMV_BLOCK_K = 8, 512
#: ... and the most weight bytes one unsplit GEMV program streams before K is split
GEMV_MAX_UNSPLIT_BYTES = 32 * 1024


@attrs.frozen
class W8A16Launch:
    """How one product is cut: ``[block_m, block_n]`` output tiles reading
    ``[block_n, block_k]`` weight tiles, K in ``splits`` slices (a second kernel sums
    them when > 1), and ``gemv`` for the one-row kernel (``block_m`` unused)."""

    block_m: int
    block_n: int
    block_k: int
    splits: int
    gemv: bool = False

    def __attrs_post_init__(self) -> None:
        if SCALE_BLOCK % self.block_n:
            raise ValueError(f"w8a16: block_n {self.block_n} must divide the scale block "
                             f"{SCALE_BLOCK} (a tile's rows share one row of scales)")
        if not self.gemv and SCALE_BLOCK % self.block_k:
            raise ValueError(f"w8a16: block_k {self.block_k} must divide the scale block "
                             f"{SCALE_BLOCK} (a K step of the tensor-core kernel has one scale)")
        if not self.gemv and min(self.block_m, self.block_n, self.block_k) < 16:
            raise ValueError(f"w8a16: tl.dot takes tiles of 16 and up, got block_m "
                             f"{self.block_m}, block_n {self.block_n}, block_k {self.block_k}")
        if self.splits < 1:
            raise ValueError(f"w8a16: splits must be at least 1, got {self.splits}")


def choose_splits(tiles: int, k: int, block_k: int) -> int:
    """Splits of K so that ``tiles`` output tiles x splits reach :data:`TARGET_PROGRAMS`,
    each split at least one ``block_k`` deep. Static shapes only: graph-capturable."""
    return max(1, min(triton.cdiv(TARGET_PROGRAMS, tiles), triton.cdiv(k, block_k)))


def rows_tile(m: int) -> int:
    """The tensor-core tile's rows for ``m`` rows: the smallest of 16, 32, 64 that holds
    them, 64 beyond (a 256-row step runs four row tiles over each weight tile, which
    programs next to each other read while it is in L2)."""
    return 16 if m <= 16 else 32 if m <= 32 else 64


def default_launch(m: int, n: int, k: int) -> W8A16Launch:
    """The launch :func:`w8a16_linear` uses for an ``[m, k] x [k, n]`` product: one row
    takes the GEMV in 8 x 512 tiles (the bf16 skinny GEMM's best one-row tile), K split
    only where an unsplit program would stream over 32 KB of weight; more rows take the
    tensor-core kernel in 64 x 128 weight tiles, K split to fill the machine."""
    if m == 1:
        unsplit = k * GEMV_BLOCK_N <= GEMV_MAX_UNSPLIT_BYTES
        splits = 1 if unsplit else choose_splits(triton.cdiv(n, GEMV_BLOCK_N), k, GEMV_BLOCK_K)
        return W8A16Launch(1, GEMV_BLOCK_N, GEMV_BLOCK_K, splits, gemv=True)
    block_m = rows_tile(m)
    tiles = triton.cdiv(n, BLOCK_N) * triton.cdiv(m, block_m)
    return W8A16Launch(block_m, BLOCK_N, BLOCK_K, choose_splits(tiles, k, BLOCK_K))


@triton.jit
def _w8a16_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_wn, stride_sn, stride_os, stride_om,
    K_PER_SPLIT,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
    SCALE_BLOCK: tl.constexpr, PRECISION: tl.constexpr,
):  # fmt: skip
    # the row tiles of one weight tile are neighbours in the launch order: they run
    # together and the tile is read from memory once
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    split = tl.program_id(2)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty
    # every column of the tile lies in one block row of scales (BLOCK_N divides it)
    s_row = s_ptr + ((pid_n * BLOCK_N) // SCALE_BLOCK) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    k_start, k_end = _split_bounds(split, K, K_PER_SPLIT)
    for k in range(k_start, k_end, BLOCK_K):
        ks = k + depth
        in_k = ks < k_end
        # the K step lies in one block column (BLOCK_K divides it, steps start on a
        # multiple of BLOCK_K): one scale for the tile
        scale = tl.load(s_row + k // SCALE_BLOCK)
        w = (_weight_tile(w_ptr, cols, ks, in_k, N, stride_wn).to(tl.float32) * scale).to(dtype)
        x = tl.load(x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :],
                    mask=(rows < M)[:, None] & in_k[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w), input_precision=PRECISION)
    out = out_ptr + split * stride_os + rows[:, None].to(tl.int64) * stride_om + cols[None, :]
    tl.store(out, acc.to(out_ptr.dtype.element_ty), mask=(rows < M)[:, None] & (cols < N)[None, :])


@triton.jit
def _w8a16_gemv_kernel(
    x_ptr, w_ptr, s_ptr, out_ptr,
    N, K,
    stride_wn, stride_sn, stride_os,
    K_PER_SPLIT,
    BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, SCALE_BLOCK: tl.constexpr,
):  # fmt: skip
    pid_n = tl.program_id(0)
    split = tl.program_id(1)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    dtype = x_ptr.dtype.element_ty  # the weight's rounding (out may be the fp32 splits)
    s_row = s_ptr + ((pid_n * BLOCK_N) // SCALE_BLOCK) * stride_sn
    # Products accumulate lane by lane; one reduction at the end, in a fixed order.
    acc = tl.zeros([BLOCK_N, BLOCK_K], dtype=tl.float32)
    k_start, k_end = _split_bounds(split, K, K_PER_SPLIT)
    for k in range(k_start, k_end, BLOCK_K):
        ks = k + depth
        in_k = ks < k_end
        # a step may span several block columns: each column's scale
        scale = tl.load(s_row + ks // SCALE_BLOCK, mask=in_k, other=0.0)
        w = (_weight_tile(w_ptr, cols, ks, in_k, N, stride_wn).to(tl.float32)
             * scale[None, :]).to(dtype)
        x = tl.load(x_ptr + ks, mask=in_k, other=0.0)
        acc += w.to(tl.float32) * x.to(tl.float32)[None, :]
    out = tl.sum(acc, axis=1)
    tl.store(out_ptr + split * stride_os + cols, out.to(out_ptr.dtype.element_ty), mask=cols < N)


#: activation dtypes the kernels take (float32 multiplies in full precision)
ACTIVATION_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def w8a16_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                 launch: W8A16Launch | None = None) -> torch.Tensor:
    """``x @ dequantize_blocks(weight, scale_inv, x.dtype).T`` for ``x`` ``[..., K]``
    (any leading shape flattened; bf16, fp16 or fp32), ``weight`` ``[N, K]`` e4m3
    contiguous along K, ``scale_inv`` float32 of :func:`~.blocks.scale_shape`; float32
    accumulation, the result in ``x``'s dtype. No host sync: capturable in a CUDA graph.
    Any row count runs; :data:`MAX_ROWS` is how many ``fp8_linear`` sends.

    ``launch`` overrides :func:`default_launch` (tests and benchmarks vary it); a
    ``gemv`` launch takes one row only."""
    if x.dtype not in ACTIVATION_DTYPES:
        raise ValueError(f"w8a16: activations must be one of {ACTIVATION_DTYPES}, got {x.dtype}")
    if weight.dtype != FP8_DTYPE or weight.dim() != 2 or weight.stride(-1) != 1:
        raise ValueError(f"w8a16: the weight must be a {FP8_DTYPE} matrix contiguous along K, "
                         f"got {weight.dtype} of shape {tuple(weight.shape)}, strides "
                         f"{weight.stride()}")
    if tuple(scale_inv.shape) != scale_shape(weight.shape) or scale_inv.dtype != torch.float32:
        raise ValueError(f"w8a16: scales must be float32 of shape {scale_shape(weight.shape)} "
                         f"for a weight of shape {tuple(weight.shape)}, got {scale_inv.dtype} "
                         f"of shape {tuple(scale_inv.shape)}")
    n, k = weight.shape
    if x.shape[-1] != k:
        raise ValueError(f"w8a16: activations of width {x.shape[-1]} do not fit a weight of "
                         f"shape {tuple(weight.shape)}")
    lead = x.shape[:-1]
    rows = x.reshape(lead.numel(), k)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    if scale_inv.stride(-1) != 1:
        scale_inv = scale_inv.contiguous()
    m = rows.shape[0]
    out = torch.empty(m, n, dtype=x.dtype, device=x.device)
    if m == 0 or n == 0:
        return out.reshape(*lead, n)
    if k == 0:
        return out.zero_().reshape(*lead, n)
    launch = launch or default_launch(m, n, k)
    if launch.gemv and m != 1:
        raise ValueError(f"w8a16: a gemv launch takes one row, got {m}")
    per_split = triton.cdiv(triton.cdiv(k, launch.splits), launch.block_k) * launch.block_k
    splits = triton.cdiv(k, per_split)  # no empty split after rounding up
    target = out if splits == 1 else torch.empty(splits, m, n, dtype=torch.float32,
                                                  device=x.device)
    split_stride = target.stride(0) if splits > 1 else 0
    if launch.gemv:
        _w8a16_gemv_kernel[(triton.cdiv(n, launch.block_n), splits)](
            rows, weight, scale_inv, target, n, k,
            weight.stride(0), scale_inv.stride(0), split_stride, per_split,
            BLOCK_N=launch.block_n, BLOCK_K=launch.block_k, SCALE_BLOCK=SCALE_BLOCK,
            num_warps=4,
        )  # fmt: skip
    else:
        grid = (triton.cdiv(m, launch.block_m), triton.cdiv(n, launch.block_n), splits)
        _w8a16_kernel[grid](
            rows, weight, scale_inv, target, m, n, k,
            rows.stride(0), weight.stride(0), scale_inv.stride(0), split_stride, n,
            per_split,
            BLOCK_M=launch.block_m, BLOCK_N=launch.block_n, BLOCK_K=launch.block_k,
            SCALE_BLOCK=SCALE_BLOCK,
            # fp32 stays fp32 (tl.dot would round it to TF32); 16-bit inputs ignore it
            PRECISION="ieee" if x.dtype == torch.float32 else "tf32",
            num_warps=4,
        )  # fmt: skip
    if splits > 1:
        sum_splits(target, out)
    return out.reshape(*lead, n)
