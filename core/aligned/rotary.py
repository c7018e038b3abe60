"""The trainer's q/k norms and rotary embedding on the engine's: its float32 cos/sin
table and its fused norm-then-rotate."""

from __future__ import annotations

import torch

from kvrunner.aligned.engine_op import engine_op
from kvrunner.aligned.norm import engine_rmsnorm, rmsnorm_reference
from kvrunner.layers.fused import qk_norm_rope
from kvrunner.layers.rotary import RotaryEmbedding


def _rotate_reference(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Neox-style rotation of whole heads in float32, rounded to ``x``'s dtype."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)


def aligned_qk_norm_rope(positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor,
                         q_weight: torch.Tensor, k_weight: torch.Tensor, eps: float,
                         rotary: RotaryEmbedding) -> tuple[torch.Tensor, torch.Tensor]:
    """``rotary(q_norm(q), k_norm(k))`` for ``q`` ``[T, Hq, D]`` and ``k`` ``[T, Hk, D]``
    at ``positions`` ``[T]``, as the engine's attention computes it
    (:func:`~kvrunner.layers.fused.qk_norm_rope`)."""
    if rotary.rotary_dim != rotary.head_dim:
        raise ValueError("aligned rotary: partial rotary is not supported (Qwen3 rotates "
                         "whole heads)")

    def kernel(pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor, qw: torch.Tensor,
               kw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return qk_norm_rope(pos, q, k, engine_rmsnorm(qw, eps), engine_rmsnorm(kw, eps), rotary)

    def reference(pos: torch.Tensor, q: torch.Tensor, k: torch.Tensor, qw: torch.Tensor,
                  kw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = rotary.cos_sin_cache[pos].unsqueeze(-2).chunk(2, dim=-1)
        return (_rotate_reference(rmsnorm_reference(q, qw, eps), cos, sin),
                _rotate_reference(rmsnorm_reference(k, kw, eps), cos, sin))

    return engine_op(kernel, reference, positions, q, k, q_weight, k_weight)
