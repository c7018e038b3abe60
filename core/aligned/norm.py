"""The trainer's RMSNorms on the engine's norm, the residual add fused in as the engine
fuses it."""

from __future__ import annotations

import torch

from kvrunner.aligned.engine_op import engine_op
from kvrunner.aligned.memory import engine_layout
from kvrunner.layers.rmsnorm import RMSNorm


def engine_rmsnorm(weight: torch.Tensor, eps: float) -> RMSNorm:
    """The engine's :class:`~kvrunner.layers.rmsnorm.RMSNorm` over ``weight`` (no copy:
    its weight is ``weight`` itself where it starts where an engine weight would,
    ``memory.py``), so its kernel choice is the engine's."""
    norm = RMSNorm(weight.shape[0], eps, dtype=weight.dtype, device="meta")
    del norm.weight  # a plain tensor in the parameter's place
    norm.weight = engine_layout(weight)
    return norm


def rmsnorm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """Qwen3's RMSNorm in differentiable torch: statistics in float32, the normalised
    value rounded to ``x``'s dtype, then scaled."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def aligned_rmsnorm(x: torch.Tensor, weight: torch.Tensor, eps: float,
                    residual: torch.Tensor | None = None
                    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """``norm(x)``, or with ``residual`` ``(norm(x + residual), x + residual)``: the
    engine's call (one fused kernel on CUDA), the reference's gradient."""
    if residual is None:
        return engine_op(lambda x, w: engine_rmsnorm(w, eps)(x),
                         lambda x, w: rmsnorm_reference(x, w, eps), x, weight)

    def reference(x: torch.Tensor, r: torch.Tensor, w: torch.Tensor
                  ) -> tuple[torch.Tensor, torch.Tensor]:
        total = x + r
        return rmsnorm_reference(total, w, eps), total

    return engine_op(lambda x, r, w: engine_rmsnorm(w, eps)(x, r), reference,
                     x, residual, weight)
