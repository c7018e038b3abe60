"""Block quantization of a weight to FP8 e4m3 and back, 128 x 128 blocks.

A ``[..., M, N]`` tensor is cut into blocks of ``BLOCK`` rows by ``BLOCK`` columns (the
last row and column of blocks may be partial). Each block has one float32 scale,
``amax / FP8_MAX`` of the block (its ``weight_scale_inv``: the value one stored unit
stands for), and its elements are stored as ``clamp(w / scale)`` rounded to e4m3.
A block of zeros has scale 1 (any scale stores it exactly); a block so small that
``amax / 448`` underflows float32 keeps scale 1 too and stores zeros. Dequantizing
multiplies back: ``q * scale``. Everything is computed in float32 with IEEE-rounded
divisions, so the same input gives the same bytes on every device.
"""

from __future__ import annotations

import torch

#: rows and columns of one scale block (the checkpoints' ``weight_block_size``)
BLOCK = 128
#: the largest finite float8_e4m3fn value
FP8_MAX = 448.0
FP8_DTYPE = torch.float8_e4m3fn


def cdiv(a: int, b: int) -> int:
    """``ceil(a / b)`` for non-negative integers."""
    return -(-a // b)


def scale_shape(shape: tuple[int, ...] | torch.Size) -> tuple[int, ...]:
    """The ``weight_scale_inv`` shape of a weight of ``shape`` (the last two dims in blocks)."""
    *lead, m, n = shape
    return (*lead, cdiv(m, BLOCK), cdiv(n, BLOCK))


def _padded_blocks(w: torch.Tensor) -> torch.Tensor:
    """``[..., M, N]`` float32 -> ``[..., Mb, BLOCK, Nb, BLOCK]``, zero-padded."""
    *lead, m, n = w.shape
    mb, nb = cdiv(m, BLOCK), cdiv(n, BLOCK)
    padded = w.new_zeros(*lead, mb * BLOCK, nb * BLOCK)
    padded[..., :m, :n] = w
    return padded.view(*lead, mb, BLOCK, nb, BLOCK)


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``w`` ``[..., M, N]`` (any float dtype) -> ``(q, scale_inv)``: ``q`` the same
    shape in ``float8_e4m3fn``, ``scale_inv`` float32 of :func:`scale_shape`."""
    if w.dim() < 2:
        raise ValueError(f"FP8 block quantization needs a matrix, got shape {tuple(w.shape)}")
    *lead, m, n = w.shape
    blocks = _padded_blocks(w.float())
    amax = blocks.abs().amax(dim=(-3, -1), keepdim=True)
    # divided by a tensor, not a number: CUDA torch multiplies by a number's float32
    # reciprocal, which can differ in the last bit from the IEEE quotient the CPU and
    # the Triton kernel take
    scale = amax / torch.full_like(amax, FP8_MAX)
    scale = torch.where(scale > 0, scale, torch.ones_like(scale))
    q = (blocks / scale).clamp_(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
    q = q.view(*lead, cdiv(m, BLOCK) * BLOCK, cdiv(n, BLOCK) * BLOCK)[..., :m, :n]
    return q.contiguous(), scale.squeeze(-1).squeeze(-2).contiguous()


def dequantize_blocks(q: torch.Tensor, scale_inv: torch.Tensor,
                      dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``q * scale_inv`` per block, computed in float32 and returned in ``dtype``."""
    if tuple(scale_inv.shape) != scale_shape(q.shape):
        raise ValueError(f"FP8 scales of shape {tuple(scale_inv.shape)} do not fit a weight of "
                         f"shape {tuple(q.shape)} (want {scale_shape(q.shape)})")
    *lead, m, n = q.shape
    blocks = _padded_blocks(q.float())
    out = blocks * scale_inv.float()[..., :, None, :, None]
    out = out.view(*lead, cdiv(m, BLOCK) * BLOCK, cdiv(n, BLOCK) * BLOCK)[..., :m, :n]
    return out.to(dtype)


def fp8_nan_count(q: torch.Tensor) -> int:
    """How many elements of a ``float8_e4m3fn`` tensor are NaN (e4m3fn has no infinity;
    its NaNs are the bytes ``x111_1111``): torch has no ``isfinite`` for the dtype."""
    return int(((q.view(torch.uint8) & 0x7F) == 0x7F).sum())


def is_fp8(t: torch.Tensor) -> bool:
    """Whether ``t`` holds float8 values (of either format)."""
    return t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2)
