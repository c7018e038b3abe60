"""Root-mean-square layer norm: Qwen3's (as Llama, T5) and Qwen3-Next's zero-centred one.

On CUDA (or with ``[kernels] triton_on_cpu``) the residual add and the norm run as
one Triton kernel with the same rounding steps; each class's :meth:`_norm` is the
torch path and the reference the kernel is tested against.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrunner.layers.fused.dispatch import MAX_NORM_ROW, same_kernel_dtype, use_triton


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

    @property
    def kernel_zero_centered(self) -> bool | None:
        """The kernels' ``zero_centered`` flag for this exact class; ``None`` for a
        subclass the kernels know nothing of (its ``_norm`` may be another formula)."""
        return _KERNEL_VARIANT.get(type(self))

    def _use_kernel(self, x: torch.Tensor, residual: torch.Tensor | None) -> bool:
        """Whether the fused kernel computes exactly what the torch path would."""
        n = x.shape[-1]
        if self.kernel_zero_centered is None or n > MAX_NORM_ROW or n != self.weight.shape[0]:
            return False
        if not use_triton(x):
            return False
        if residual is None:
            return same_kernel_dtype(x, self.weight)
        # A broadcasting residual is the torch path's business.
        return residual.shape == x.shape and same_kernel_dtype(x, residual, self.weight)

    def forward(
        self, x: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        if self._use_kernel(x, residual):
            from kvrunner.layers.fused.rmsnorm_triton import rmsnorm_triton

            return rmsnorm_triton(
                x, self.weight, self.eps, residual, zero_centered=bool(self.kernel_zero_centered)
            )
        if residual is None:
            return self._norm(x)
        residual = x + residual
        return self._norm(residual), residual

    def extra_repr(self) -> str:
        return f"{self.weight.shape[0]}, eps={self.eps}"


class ZeroCenteredRMSNorm(RMSNorm):
    """RMSNorm whose stored weight is an offset from 1: ``x/rms * (1 + w)``, in float32
    (Qwen3-Next); rounded to the activation dtype once, at the end."""

    def __init__(
        self, dim: int, eps: float, *, dtype: torch.dtype, device: torch.device | str
    ) -> None:
        super().__init__(dim, eps, dtype=dtype, device=device)
        nn.init.zeros_(self.weight)

    def _norm(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * (1.0 + self.weight.float())).to(x.dtype)


#: exact class -> the kernels' ``zero_centered`` flag reproducing its ``_norm``
_KERNEL_VARIANT: dict[type[RMSNorm], bool] = {RMSNorm: False, ZeroCenteredRMSNorm: True}
