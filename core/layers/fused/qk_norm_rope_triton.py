"""Triton kernel: per-head RMSNorm of q and k, then neox rotary, in one launch.

One program per ``(token, head)`` over the q heads followed by the k heads, so a
decode step of one token still spreads over ``num_heads + num_kv_heads`` programs.
Each program loads its head twice: as itself and with the two rotary halves
swapped (the "partner" of dim ``i < r/2`` is ``i + r/2`` and vice versa), which
lets every lane finish its rotation without moving data between lanes. Only the
leading ``rotary_dim`` dims rotate; the rest pass through normalised.

Rounding follows the torch path (``q_norm(q)``, ``k_norm(k)``, then
``RotaryEmbedding``): the normalised head is rounded to the activation dtype (as
the norm module returns it), rotated in float32 and rounded once more.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _norm_rope_head(
    src,
    dst,
    w_ptr,
    cos_sin_row,
    eps,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    """Normalise (optionally) and rotate one head: ``src`` -> ``dst``, both unit-strided."""
    HALF = ROT_DIM // 2
    dtype = dst.dtype.element_ty
    d = tl.arange(0, BLOCK_D)
    in_head = d < HEAD_DIM
    rotated = d < ROT_DIM
    first_half = d < HALF
    partner = tl.where(first_half, d + HALF, d - HALF)

    x = tl.load(src + d, mask=in_head, other=0.0).to(tl.float32)
    xp = tl.load(src + partner, mask=rotated, other=0.0).to(tl.float32)
    if HAS_NORM:
        rstd = tl.rsqrt(tl.sum(x * x, axis=0) / HEAD_DIM + eps)
        w = tl.load(w_ptr + d, mask=in_head, other=0.0).to(tl.float32)
        wp = tl.load(w_ptr + partner, mask=rotated, other=0.0).to(tl.float32)
        if ZERO_CENTERED:
            x = (x * rstd * (1.0 + w)).to(dtype).to(tl.float32)
            xp = (xp * rstd * (1.0 + wp)).to(dtype).to(tl.float32)
        else:
            x = ((x * rstd).to(dtype).to(tl.float32) * w).to(dtype).to(tl.float32)
            xp = ((xp * rstd).to(dtype).to(tl.float32) * wp).to(dtype).to(tl.float32)

    # The table row is [cos of each pair | sin of each pair], float32. Past
    # ROT_DIM the masked loads give cos = 1, sin = 0 and a partner value of 0, so
    # those dims come out as x * 1 + 0 * 0 = x: they pass through unrotated.
    freq = tl.where(first_half, d, d - HALF)
    cos = tl.load(cos_sin_row + freq, mask=rotated, other=1.0)
    sin = tl.load(cos_sin_row + HALF + freq, mask=rotated, other=0.0)
    # First half: x1*cos - x2*sin; second half: x2*cos + x1*sin (x = this dim).
    y = tl.where(first_half, x * cos - xp * sin, x * cos + xp * sin)
    tl.store(dst + d, y.to(dtype), mask=in_head)


@triton.jit
def _qk_norm_rope_kernel(
    q_ptr,
    k_ptr,
    q_out_ptr,
    k_out_ptr,
    qw_ptr,
    kw_ptr,
    pos_ptr,
    cos_sin_ptr,
    stride_qt,
    stride_qh,
    stride_kt,
    stride_kh,
    stride_qot,
    stride_qoh,
    stride_kot,
    stride_koh,
    stride_cs,
    eps,
    NUM_Q_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROT_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    HAS_NORM: tl.constexpr,
    ZERO_CENTERED: tl.constexpr,
):
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    pos = tl.load(pos_ptr + token).to(tl.int64)
    cos_sin_row = cos_sin_ptr + pos * stride_cs
    if head < NUM_Q_HEADS:
        _norm_rope_head(
            q_ptr + token * stride_qt + head * stride_qh,
            q_out_ptr + token * stride_qot + head * stride_qoh,
            qw_ptr, cos_sin_row, eps,
            HEAD_DIM, ROT_DIM, BLOCK_D, HAS_NORM, ZERO_CENTERED,
        )
    else:
        kh = head - NUM_Q_HEADS
        _norm_rope_head(
            k_ptr + token * stride_kt + kh * stride_kh,
            k_out_ptr + token * stride_kot + kh * stride_koh,
            kw_ptr, cos_sin_row, eps,
            HEAD_DIM, ROT_DIM, BLOCK_D, HAS_NORM, ZERO_CENTERED,
        )


def qk_norm_rope_triton(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    cos_sin_cache: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    *,
    zero_centered: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotated (and, given weights, first per-head RMS-normalised) q and k.

    :param positions: ``[T]`` integer; each must index a row of ``cos_sin_cache``
        (not checked: that would sync the host).
    :param q: ``[T, Hq, D]``, ``k``: ``[T, Hk, D]``; any token and head strides, unit
        stride over ``D`` (row-strided views of a fused projection need no copy).
    :param cos_sin_cache: ``[max_position, rotary_dim]`` float32, contiguous.
    :param q_weight: ``[D]`` norm weight for q (``k_weight`` for k); both ``None``
        for rotary only.
    :returns: new contiguous ``q``, ``k`` of the inputs' shapes and dtype.
    """
    t, hq, d = q.shape
    hk = k.shape[1]
    assert q.stride(-1) == 1 and k.stride(-1) == 1, "head_dim must be unit-strided"
    rot = cos_sin_cache.shape[-1]
    q_out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
    k_out = torch.empty(k.shape, dtype=k.dtype, device=k.device)
    if t == 0:
        return q_out, k_out
    has_norm = q_weight is not None
    _qk_norm_rope_kernel[(t, hq + hk)](
        q,
        k,
        q_out,
        k_out,
        q_weight if has_norm else q,  # unused when HAS_NORM is off
        k_weight if has_norm else k,
        positions,
        cos_sin_cache,
        q.stride(0),
        q.stride(1),
        k.stride(0),
        k.stride(1),
        q_out.stride(0),
        q_out.stride(1),
        k_out.stride(0),
        k_out.stride(1),
        cos_sin_cache.stride(0),
        eps,
        NUM_Q_HEADS=hq,
        HEAD_DIM=d,
        ROT_DIM=rot,
        BLOCK_D=triton.next_power_of_2(d),
        HAS_NORM=has_norm,
        ZERO_CENTERED=zero_centered,
        num_warps=1 if d <= 128 else 2,
    )
    return q_out, k_out
