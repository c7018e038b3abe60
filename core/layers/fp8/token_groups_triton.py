"""Triton kernel: activations quantized to e4m3 per token and per 128 columns, the
input of the FP8 w8a8 product (``layers/fp8/gemm.py``).

One program per (row, group): it reads the group once, takes ``amax x (1 / 448)`` as
the group's scale (1 for an all-zero group) and writes the quantized bytes and the
scale, where the torch path (:func:`~kvrunner.layers.fp8.gemm.quantize_token_groups`,
the reference) spends a launch on each of its nine steps. The scale is the same float32
product the reference takes, the division by it is IEEE-rounded (``div_rn``) and the
cast to e4m3 rounds to nearest even with saturation, as torch's does, so on the GPU the
bytes and scales equal the reference's bit for bit. (Triton's
interpreter rounds to e4m3 ties-away, so the equality is checked on the GPU only.)
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrunner.layers.fp8.blocks import BLOCK, FP8_DTYPE, FP8_MAX


@triton.jit
def _token_group_quant_kernel(x_ptr, q_ptr, scale_ptr, stride_x, stride_q, M, M_valid,
                              GROUP: tl.constexpr, FP8_LIMIT: tl.constexpr,
                              INV_LIMIT: tl.constexpr):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    group = tl.program_id(1)
    cols = group * GROUP + tl.arange(0, GROUP)
    # a padding row (past M_valid) quantizes as zeros: bytes 0, scale 1
    end = tl.where(row < M_valid, (group + 1) * GROUP, 0)
    x = tl.load(x_ptr + row * stride_x + cols, mask=cols < end, other=0.0).to(tl.float32)
    amax = tl.max(tl.abs(x), axis=0)
    scale = amax * INV_LIMIT
    scale = tl.where(scale > 0, scale, 1.0)
    q = tl.math.div_rn(x, scale)
    q = tl.minimum(tl.maximum(q, -FP8_LIMIT), FP8_LIMIT)
    tl.store(q_ptr + row * stride_q + cols, q.to(q_ptr.dtype.element_ty))
    # [groups, M] row-major: the column-major [M, groups] that scaled_mm reads
    tl.store(scale_ptr + group * M + row, scale)


def quantize_token_groups_triton(x: torch.Tensor, *, rows_multiple: int = 1
                                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` (K a multiple of 128) -> ``(q [R, K] e4m3, scales [R, K / 128]
    float32, column-major)``: the reference's values in the first M rows, and zero
    rows (bytes 0, scale 1) up to ``R``, ``M`` rounded up to ``rows_multiple``.
    No host sync: capturable."""
    m, k = x.shape
    assert k % BLOCK == 0, f"K = {k} is not a multiple of {BLOCK}"
    if x.stride(-1) != 1:
        x = x.contiguous()
    rows = -(-m // rows_multiple) * rows_multiple
    q = torch.empty(rows, k, dtype=FP8_DTYPE, device=x.device)
    scales = torch.empty(k // BLOCK, rows, dtype=torch.float32, device=x.device)
    if rows:
        _token_group_quant_kernel[(rows, k // BLOCK)](x, q, scales, x.stride(0), q.stride(0),
                                                      rows, m, GROUP=BLOCK, FP8_LIMIT=FP8_MAX,
                                                      INV_LIMIT=1.0 / FP8_MAX, num_warps=1)
    return q, scales.t()
