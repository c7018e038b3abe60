"""Triton kernel: ``silu(gate) * up`` over a fused ``[gate | up]`` projection output.

Programs tile ``(row, column block)``; each reads its gate and up columns once and
writes the product. Rounding follows the torch path (``F.silu(gate) * up``): the
SiLU is computed in float32 and rounded to the activation dtype, then the product
of two dtype values is computed in float32 and rounded again.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

#: columns per program: wide enough to stream, small enough for many programs at T=1
BLOCK = 1024


@triton.jit
def silu_mul_tile(gate, up, dtype: tl.constexpr):
    """``silu(gate) * up`` in ``dtype``: the SiLU computed in float32 and rounded to
    ``dtype``, then the product of the two ``dtype`` values in float32, rounded again.
    This kernel's whole arithmetic, and that of the GEMMs that form a SwiGLU down
    projection's input as they load ``[gate | up]`` (the skinny and the invariant
    GEMM), so they give its bits."""
    g = gate.to(tl.float32)
    act = (g / (1.0 + tl.exp(-g))).to(dtype).to(tl.float32)
    return (act * up.to(tl.float32)).to(dtype)


@triton.jit
def _silu_mul_kernel(
    x_ptr,
    out_ptr,
    stride_x,
    stride_out,
    D: tl.constexpr,
    BLOCK_D: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_D + tl.arange(0, BLOCK_D)
    mask = cols < D
    dtype = out_ptr.dtype.element_ty
    src = x_ptr + row * stride_x
    gate = tl.load(src + cols, mask=mask, other=0.0)
    up = tl.load(src + D + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * stride_out + cols, silu_mul_tile(gate, up, dtype), mask=mask)


def silu_mul_triton(x: torch.Tensor) -> torch.Tensor:
    """``[..., 2d]`` -> ``[..., d]``; a new contiguous tensor of ``x``'s dtype.

    No host sync: the launch is capturable in a CUDA graph.
    """
    d = x.shape[-1] // 2
    rows = x.reshape(-1, 2 * d)
    if rows.stride(-1) != 1:
        rows = rows.contiguous()
    out = torch.empty(*x.shape[:-1], d, dtype=x.dtype, device=x.device)
    out_rows = out.view(-1, d)
    if rows.shape[0] > 0 and d > 0:
        block = min(BLOCK, triton.next_power_of_2(d))
        _silu_mul_kernel[(rows.shape[0], triton.cdiv(d, block))](
            rows,
            out_rows,
            rows.stride(0),
            out_rows.stride(0),
            D=d,
            BLOCK_D=block,
            num_warps=max(1, min(4, block // 256)),
        )
    return out
