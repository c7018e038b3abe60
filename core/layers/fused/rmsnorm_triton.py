"""Triton kernel: (residual add +) RMSNorm of each row, in one launch.

One program per row holds the whole row in registers, so the add, the float32
statistics, the scaling and the weight multiply read ``x`` (and ``residual``) once
and write once. The rounding steps follow the torch path exactly:

- the residual sum is rounded to the activation dtype before it is normalised (the
  torch path normalises the stored ``x + residual``);
- plain (Qwen3): ``weight * (x / rms).to(dtype)``: two roundings, the product of
  two dtype values computed in float32 as torch computes a bf16 multiply;
- zero-centred (Qwen3-Next): ``(x / rms * (1 + weight)).to(dtype)``: one rounding.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrunner.layers.fused.dispatch import MAX_NORM_ROW


@triton.jit
def _rmsnorm_kernel(
    x_ptr,
    res_ptr,
    w_ptr,
    out_ptr,
    res_out_ptr,
    stride_x,
    stride_res,
    stride_out,
    stride_res_out,
    eps,
    N: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_N)
    mask = cols < N
    dtype = out_ptr.dtype.element_ty

    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    if HAS_RESIDUAL:
        r = tl.load(res_ptr + row * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
        # Round the sum first: it is both the new residual and what gets normalised.
        summed = (x + r).to(dtype)
        tl.store(res_out_ptr + row * stride_res_out + cols, summed, mask=mask)
        x = summed.to(tl.float32)

    # Masked lanes are zero, so they add nothing to the sum of squares.
    rstd = tl.rsqrt(tl.sum(x * x, axis=0) / N + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    if ZERO_CENTERED:
        y = x * rstd * (1.0 + w)
    else:
        y = (x * rstd).to(dtype).to(tl.float32) * w
    tl.store(out_ptr + row * stride_out + cols, y.to(dtype), mask=mask)


def _rows(x: torch.Tensor) -> torch.Tensor:
    """``x`` as ``[rows, N]`` with unit column stride (a view whenever one exists)."""
    rows = x.reshape(-1, x.shape[-1])
    return rows if rows.stride(-1) == 1 else rows.contiguous()


def _num_warps(block: int) -> int:
    # ~8 elements per thread keeps the row in registers without spilling.
    return max(1, min(8, block // 256))


def rmsnorm_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    residual: torch.Tensor | None = None,
    *,
    zero_centered: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """RMSNorm over the last dimension; with ``residual``: ``(norm(x + r), x + r)``.

    :param x: ``[..., N]``, ``N <= MAX_NORM_ROW``; ``residual`` has its shape; ``x``,
        ``residual`` and ``weight`` share one dtype (the caller checks).
    :returns: new contiguous tensors of ``x``'s shape and dtype. No host sync: the
        launch is capturable in a CUDA graph.
    """
    n = x.shape[-1]
    assert n <= MAX_NORM_ROW, f"row of {n} exceeds MAX_NORM_ROW={MAX_NORM_ROW}"
    xr = _rows(x)
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    out_r = out.view(-1, n)
    if residual is None:
        res_r = res_out_r = xr  # unused: HAS_RESIDUAL is off
        res_out = None
    else:
        res_r = _rows(residual)
        res_out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
        res_out_r = res_out.view(-1, n)
    if xr.shape[0] > 0:
        block = triton.next_power_of_2(n)
        _rmsnorm_kernel[(xr.shape[0],)](
            xr,
            res_r,
            weight,
            out_r,
            res_out_r,
            xr.stride(0),
            res_r.stride(0),
            out_r.stride(0),
            res_out_r.stride(0),
            eps,
            N=n,
            BLOCK_N=block,
            HAS_RESIDUAL=residual is not None,
            ZERO_CENTERED=zero_centered,
            num_warps=_num_warps(block),
        )
    return out if res_out is None else (out, res_out)
