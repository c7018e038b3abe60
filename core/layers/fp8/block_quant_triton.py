"""Triton kernel: a weight quantized to e4m3 by 128 x 128 blocks, written in place.

A push into FP8 weights quantizes every projection as it lands. The torch path
(:func:`~kvrunner.layers.fp8.blocks.quantize_blocks`, the reference) pads the weight
in float32 and spends a pass over it on each step (the cast, the padding, abs, amax,
the division, the clamp, the cast to e4m3, the copy into the parameter): about 60
bytes of memory traffic per weight element. This kernel reads each element once and
writes its byte and its block's scale straight into the parameter's storage: 3 bytes
per bf16 element.

One program per block: it loads the block (masked where the weight ends inside it),
takes ``amax / 448`` as the scale (IEEE-rounded, ``div_rn``; 1 where that is not
positive), divides each element by it (``div_rn``), clamps to +-448 and casts to
e4m3, which rounds to nearest even with saturation as torch's cast does. So on the
GPU bytes and scales equal the reference's bit for bit, for finite weights (a load
checks finiteness first unless ``check_finite`` is off; a block holding NaN may then
get another scale than the reference gives it). Triton's interpreter rounds
to e4m3 ties-away, so under it only the scales are checked bitwise.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrunner.layers.fp8.blocks import BLOCK, FP8_MAX, scale_shape


@triton.jit
def _block_quant_kernel(w_ptr, q_ptr, s_ptr, M, N, stride_wm, stride_wn, stride_qm,
                        stride_qn, stride_sm, stride_sn,
                        BLOCK_SIZE: tl.constexpr, FP8_LIMIT: tl.constexpr):  # fmt: skip
    bi = tl.program_id(0)
    bj = tl.program_id(1)
    rows = (bi * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    cols = (bj * BLOCK_SIZE + tl.arange(0, BLOCK_SIZE)).to(tl.int64)
    mask = (rows[:, None] < M) & (cols[None, :] < N)
    w = tl.load(w_ptr + rows[:, None] * stride_wm + cols[None, :] * stride_wn, mask=mask,
                other=0.0).to(tl.float32)
    amax = tl.max(tl.max(tl.abs(w), axis=1), axis=0)
    scale = tl.math.div_rn(amax, tl.full((), FP8_LIMIT, tl.float32))
    scale = tl.where(scale > 0, scale, 1.0)
    q = tl.math.div_rn(w, scale)
    q = tl.minimum(tl.maximum(q, -FP8_LIMIT), FP8_LIMIT)
    tl.store(q_ptr + rows[:, None] * stride_qm + cols[None, :] * stride_qn,
             q.to(q_ptr.dtype.element_ty), mask=mask)
    tl.store(s_ptr + bi * stride_sm + bj * stride_sn, scale)


def quantize_blocks_triton(w: torch.Tensor, q_out: torch.Tensor,
                           scale_out: torch.Tensor) -> None:
    """Quantize the matrix ``w`` ``[M, N]`` (any float dtype, any strides, finite)
    into ``q_out`` (``float8_e4m3fn``, ``[M, N]``) and ``scale_out`` (float32,
    :func:`~kvrunner.layers.fp8.blocks.scale_shape`), both possibly views of a larger
    parameter: the values :func:`~kvrunner.layers.fp8.blocks.quantize_blocks` gives.
    No host sync; the caller checked the shapes (``weights.quantize_blocks_into``)."""
    m, n = w.shape
    if m == 0 or n == 0:
        return
    mb, nb = scale_shape(w.shape)
    _block_quant_kernel[(mb, nb)](
        w, q_out, scale_out, m, n, w.stride(0), w.stride(1), q_out.stride(0),
        q_out.stride(1), scale_out.stride(0), scale_out.stride(1),
        BLOCK_SIZE=BLOCK, FP8_LIMIT=FP8_MAX, num_warps=8)
