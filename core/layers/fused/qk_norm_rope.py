"""Per-head q/k RMSNorm followed by rotary: one fused launch, or the torch sequence.

Attention layers call :func:`qk_norm_rope` instead of ``q_norm``,
``k_norm`` and the rotary module in turn. The modules keep their weights (and so
their checkpoint names); this function only decides how to run them.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from kvrunner.layers.fused.dispatch import same_kernel_dtype, use_triton

if TYPE_CHECKING:  # runtime import would be circular: the norm modules import dispatch
    from kvrunner.layers.rmsnorm import RMSNorm
    from kvrunner.layers.rotary import RotaryEmbedding


def _fusable(
    q: torch.Tensor, k: torch.Tensor, q_norm: RMSNorm, k_norm: RMSNorm, rotary: RotaryEmbedding
) -> bool:
    """Whether the one-launch kernel computes exactly what the module sequence does."""
    return (
        use_triton(q)
        and q.dim() == 3
        and k.dim() == 3
        and q.shape[-1] == k.shape[-1] == rotary.head_dim == q_norm.weight.shape[0]
        and k_norm.weight.shape[0] == rotary.head_dim
        and q.stride(-1) == 1
        and k.stride(-1) == 1
        and same_kernel_dtype(q, k, q_norm.weight, k_norm.weight)
        and q_norm.eps == k_norm.eps
        and q_norm.kernel_zero_centered is not None
        and q_norm.kernel_zero_centered == k_norm.kernel_zero_centered
        and rotary.cos_sin_cache.dtype == torch.float32
    )


def qk_norm_rope(
    positions: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    q_norm: RMSNorm,
    k_norm: RMSNorm,
    rotary: RotaryEmbedding,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary(positions, q_norm(q), k_norm(k))``.

    :param positions: ``[T]`` integer.
    :param q: ``[T, Hq, head_dim]``, ``k``: ``[T, Hk, head_dim]``; may be strided
        views of a fused projection output (no copy is made on the Triton path).
    :returns: rotated ``q``, ``k`` (new tensors, same shapes and dtype).
    """
    if _fusable(q, k, q_norm, k_norm, rotary):
        from kvrunner.layers.fused.qk_norm_rope_triton import qk_norm_rope_triton

        return qk_norm_rope_triton(
            positions, q, k, rotary.cos_sin_cache, q_norm.weight, k_norm.weight, q_norm.eps,
            zero_centered=bool(q_norm.kernel_zero_centered),
        )
    return rotary(positions, q_norm(q), k_norm(k))
