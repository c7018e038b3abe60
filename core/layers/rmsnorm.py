"""Root-mean-square layer norm, as Qwen3 (and Llama, T5) define it."""

from __future__ import annotations

import torch
from torch import nn


class RMSNorm(nn.Module):
    """``weight * x / sqrt(mean(x^2) + eps)`` over the last dimension.

    The statistics are computed in float32 whatever the activation dtype (bf16
    squares lose too much precision); the normalized value is cast back to the
    input dtype *before* the weight multiplies it, which is the order Hugging Face
    Qwen3 uses, so bf16 results match it bit for bit in the common case.

    ``forward(x, residual)`` fuses the residual add that precedes every norm in a
    pre-norm transformer: it returns ``(norm(x + residual), x + residual)``.
    """

    def __init__(
        self, dim: int, eps: float = 1e-6, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim, dtype=dtype, device=device), requires_grad=False)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * xf.to(x.dtype)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"
