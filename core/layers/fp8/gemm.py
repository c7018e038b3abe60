"""The FP8 linear's product, ``y = x @ dequant(W).T (+ b)``.

Three paths compute it:

* **dequantize, then multiply** (the CPU path, and CUDA where neither of the next two
  serves): the weight is dequantized to the activations' dtype by its block scales and
  multiplied as a bf16 weight would be, so on the CPU an FP8 engine gives exactly the
  tokens of a bf16 engine holding the dequantized weights.
* **w8a16 on CUDA** for a small decode step's rows (16-bit activations; at most
  ``w8a16_triton.MAX_ROWS_BESIDE_W8A8`` where the w8a8 product serves, else at most
  ``w8a16_triton.MAX_ROWS``): a Triton kernel streams the e4m3 weight and dequantizes each tile on
  chip by its block's scale, rounding it to the activations' dtype as the first path
  does, and multiplies it with the activations as they are, accumulating in float32
  (``layers/fp8/w8a16_triton.py``). A decode step waits on the weight's bytes, and these
  are half of bf16's.
* **w8a8 on CUDA** for more rows (sm90, every dimension of the product a multiple of
  128 in K and of 16 in N): the activations are quantized per token and per 128 columns
  (1 x 128 groups, dynamic, as vLLM's and SGLang's ``per_token_group_quant_fp8``) and
  torch's ``scaled_mm`` multiplies them with the weight's 128 x 128 blocks (CUTLASS's
  DeepSeek-style kernel), accumulating in float32 and writing the activations' dtype;
  or, for at most ``W8A8_TRITON_MAX_ROWS`` rows (a decode step of up to 64
  sequences), the same product on Triton's FP8 tensor cores
  (``layers/fp8/w8a8_triton.py``), which was faster there on an H100.

A shape the w8a8 kernel refuses is remembered and takes the first path from then on,
so a refusal costs one failed call, before any graph is captured (the warmup runs
every size eagerly first).
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from kvrunner.layers.fp8.blocks import BLOCK, FP8_DTYPE, FP8_MAX, cdiv, dequantize_blocks

if TYPE_CHECKING:  # the CPU path runs without Triton installed
    from kvrunner.layers.fp8.w8a8_triton import W8A8Launch

#: the w8a8 product's activation rows are padded with zero rows to a multiple of this:
#: cuBLAS's block-scaled kernel refused M = 1 and M = 26 on an H100, and took M = 16,
#: 32 and every multiple of 64 it was given
W8A8_ROWS_MULTIPLE = 16
#: (N, K) shapes the w8a8 kernel refused on this process's device
_REFUSED: set[tuple[int, int]] = set()
#: a w8a8 product of at most this many rows takes the Triton kernel
#: (``w8a8_triton.py``) rather than torch's ``scaled_mm``; read at call time. On an H100,
#: the four 8B projections summed, ms a layer: Triton 0.099 / 0.107 / 0.109 against
#: ``scaled_mm``'s 0.114 / 0.116 / 0.118 at 32 / 48 / 64 rows; ties at 96 and 128
#: (0.121, 0.126); ``scaled_mm`` ahead from 192 (0.148 against 0.163, and at 256 0.153
#: against the best launch per projection's 0.180)
W8A8_TRITON_MAX_ROWS = 64


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x [..., K]`` times the FP8 ``weight [N, K]`` with its block scales, plus ``bias``;
    the result in ``x``'s dtype (see the module docstring for the path taken)."""
    if w8a16_serves(x, weight):
        from kvrunner.layers.fp8.w8a16_triton import w8a16_linear

        y = w8a16_linear(x, weight, scale_inv)
        return y if bias is None else y + bias
    if w8a8_serves(x, weight):
        if x.numel() // x.shape[-1] <= W8A8_TRITON_MAX_ROWS:
            return w8a8_triton_linear(x, weight, scale_inv, bias)
        try:
            return w8a8_linear(x, weight, scale_inv, bias)
        except (RuntimeError, ValueError) as refused:  # torch's checks raise both
            _REFUSED.add(tuple(weight.shape))
            print(f"kvrunner: FP8: torch's scaled_mm refused the w8a8 product "
                  f"{tuple(x.shape)} x {tuple(weight.shape)} "
                  f"({str(refused).splitlines()[0][:300]}); this shape dequantizes from now on",
                  file=sys.stderr)
    return F.linear(x, dequantize_blocks(weight, scale_inv, x.dtype), bias)


def w8a16_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the w8a16 kernel takes the product: CUDA activations in a 16-bit dtype, a
    weight matrix contiguous along K, and at most ``w8a16_triton.MAX_ROWS_BESIDE_W8A8``
    rows where the w8a8 product serves (else ``w8a16_triton.MAX_ROWS``)."""
    if not (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16) and x.dim() > 0
            and weight.dim() == 2 and weight.stride(-1) == 1):
        return False
    # imported here: the CPU path runs without Triton installed
    from kvrunner.layers.fp8.w8a16_triton import MAX_ROWS, MAX_ROWS_BESIDE_W8A8

    rows = x.numel() // max(1, x.shape[-1])
    return rows <= MAX_ROWS_BESIDE_W8A8 or (rows <= MAX_ROWS and not w8a8_serves(x, weight))


def w8a8_serves(x: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the w8a8 path may run: a CUDA sm90 device with torch's block-scaled
    ``scaled_mm``, a 16-bit activation dtype, K a multiple of 128, N of 16."""
    n, k = weight.shape
    return (x.is_cuda and x.dtype in (torch.bfloat16, torch.float16)
            and hasattr(F, "scaled_mm") and k % BLOCK == 0 and n % 16 == 0
            and (n, k) not in _REFUSED and _is_sm90(x.device.index))


@functools.cache
def _is_sm90(index: int | None) -> bool:
    """Asked once per device: every projection of an eager step asks."""
    return torch.cuda.get_device_capability(index) == (9, 0)


def quantize_token_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x [M, K]`` -> ``(q [M, K] e4m3, scales [M, K / 128] float32)``, one scale per
    token and 128 columns, ``amax x (1 / 448)`` (1 for a zero group);
    the scales laid out column-major, as ``scaled_mm``'s 1 x 128 recipe reads them.
    The reference of the Triton kernel the CUDA path runs
    (``layers/fp8/token_groups_triton.py``)."""
    m, k = x.shape
    groups = x.float().view(m, k // BLOCK, BLOCK)
    # times the float32 reciprocal, as CUDA torch computes a division by a number: the
    # scales are then the same bits on every device and in the Triton kernel
    scale = groups.abs().amax(dim=-1, keepdim=True) * (1.0 / FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (groups / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE).view(m, k)
    return q, scale.view(m, k // BLOCK).t().contiguous().t()


def w8a8_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
    """The CUDA path: activations quantized per 1 x 128 group, then torch's block-scaled
    ``scaled_mm`` (1 x 128 by 128 x 128) into ``x``'s dtype."""
    from torch.nn.functional import ScalingType

    from kvrunner.layers.fp8.token_groups_triton import quantize_token_groups_triton

    lead, k = x.shape[:-1], x.shape[-1]
    x2 = x.reshape(-1, k)
    # one launch for the activations' quantization (the torch steps are nine); the rows
    # padded to a multiple of W8A8_ROWS_MULTIPLE with zeros, which cuBLAS needs
    xq, xs = quantize_token_groups_triton(x2, rows_multiple=W8A8_ROWS_MULTIPLE)
    kb = cdiv(k, BLOCK)
    # scaled_mm reads the weight's scales as [round_up(K/128, 4), N/128], column-major.
    pad = -kb % 4
    ws = (F.pad(scale_inv, (0, pad)) if pad else scale_inv).t()
    y = F.scaled_mm(xq, weight.t(), xs, ScalingType.BlockWise1x128, ws,
                    ScalingType.BlockWise128x128, output_dtype=x.dtype)[: x2.shape[0]]
    if bias is not None:
        y = y + bias
    return y.view(*lead, weight.shape[0])


def w8a8_triton_linear(x: torch.Tensor, weight: torch.Tensor, scale_inv: torch.Tensor,
                       bias: torch.Tensor | None = None,
                       launch: W8A8Launch | None = None) -> torch.Tensor:
    """The w8a8 product on Triton's FP8 tensor-core kernel
    (``layers/fp8/w8a8_triton.py``): activations quantized per 1 x 128 group, as
    :func:`w8a8_linear` quantizes them, then one block-scaled launch (``launch``
    overrides its default) into ``x``'s dtype. Any row count; K a multiple of 128."""
    from kvrunner.layers.fp8.token_groups_triton import quantize_token_groups_triton
    from kvrunner.layers.fp8.w8a8_triton import w8a8_block_linear

    lead, k = x.shape[:-1], x.shape[-1]
    xq, xs = quantize_token_groups_triton(x.reshape(-1, k))
    y = w8a8_block_linear(xq, xs, weight, scale_inv, x.dtype, launch=launch)
    if bias is not None:
        y = y + bias
    return y.view(*lead, weight.shape[0])
