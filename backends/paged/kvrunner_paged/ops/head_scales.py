"""One KV head's FP8 scales, read by the Triton kernels from a layer's scale table
(``[4, num_kv_heads]`` float32: :func:`~kvrunner_paged.kv_format.scale_table`).

The table is read on the device at every launch, never passed as numbers: a captured
graph then uses whatever the table holds at replay (scales loaded or calibrated after
the capture). For a pool in the model's dtype nothing is read at all and every scale
is 1.0, so those launches compute exactly what they did without scales.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from kvrunner_paged.kv_format import K_INV, K_SCALE, V_INV, V_SCALE, is_fp8

_K_SCALE = tl.constexpr(K_SCALE)
_V_SCALE = tl.constexpr(V_SCALE)
_K_INV = tl.constexpr(K_INV)
_V_INV = tl.constexpr(V_INV)


@triton.jit
def head_scales(scales_ptr, row_stride, kv_head, QUANTIZE: tl.constexpr):
    """``(k_scale, v_scale, 1 / k_scale, 1 / v_scale)`` of ``kv_head``; all 1.0 unless
    ``QUANTIZE`` (an FP8 pool)."""
    if QUANTIZE:
        k = tl.load(scales_ptr + _K_SCALE * row_stride + kv_head)
        v = tl.load(scales_ptr + _V_SCALE * row_stride + kv_head)
        k_inv = tl.load(scales_ptr + _K_INV * row_stride + kv_head)
        v_inv = tl.load(scales_ptr + _V_INV * row_stride + kv_head)
    else:
        k = 1.0
        v = 1.0
        k_inv = 1.0
        v_inv = 1.0
    return k, v, k_inv, v_inv


def table_for(scales: torch.Tensor | None, k_cache: torch.Tensor) -> tuple[torch.Tensor, int]:
    """The table a launch reads and its row stride: ``scales``; where none is given,
    ones for an FP8 pool (scale 1.0) and, for any other, a placeholder no kernel reads."""
    if scales is None:
        if not is_fp8(k_cache):
            return k_cache, 0
        scales = torch.ones((4, k_cache.shape[2]), dtype=torch.float32, device=k_cache.device)
    if scales.dtype != torch.float32 or scales.shape != (4, k_cache.shape[2]):
        raise ValueError(f"the scale table must be [4, {k_cache.shape[2]}] float32, got "
                         f"{tuple(scales.shape)} {scales.dtype}")
    if scales.stride(-1) != 1:
        scales = scales.contiguous()
    return scales, scales.stride(0)


@triton.jit
def inverse_scales(scales_ptr, row_stride, heads, head_mask, QUANTIZE: tl.constexpr):
    """``(1 / k_scale, 1 / v_scale)`` of the KV heads ``heads`` (a tensor of them, 1.0
    where ``head_mask`` is off); 1.0 unless ``QUANTIZE``: what a store multiplies by."""
    if QUANTIZE:
        k_inv = tl.load(scales_ptr + _K_INV * row_stride + heads, mask=head_mask, other=1.0)
        v_inv = tl.load(scales_ptr + _V_INV * row_stride + heads, mask=head_mask, other=1.0)
    else:
        k_inv = 1.0
        v_inv = 1.0
    return k_inv, v_inv
