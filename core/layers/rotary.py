"""Rotary position embedding, neox style (rotate the two halves), as HF Qwen3.

Dimension ``i < d/2`` of a head is paired with dimension ``i + d/2`` and the pair is
rotated by ``position * theta ** (-2i / d)``. The cos/sin table is built once for
every position up to ``max_position`` and indexed by the step's positions, so a
forward is a gather and a few multiply-adds (and stays capturable in a graph).

On CUDA (or with ``[kernels] triton_on_cpu``) the forward is one Triton launch for q
and k together; attention layers that normalise q and k first use
:func:`kvrunner.layers.fused.qk_norm_rope`, which folds the norms into that launch.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrunner.layers.fused.dispatch import same_kernel_dtype, use_triton


class RotaryEmbedding(nn.Module):
    """Apply rotary embedding to q and k of shape ``[T, heads, head_dim]``.

    ``rotary_dim < head_dim`` rotates only the leading ``rotary_dim`` dimensions
    (partial rotary, e.g. Qwen3-Next); the rest pass through unchanged.
    """

    def __init__(
        self,
        head_dim: int,
        *,
        max_position: int,
        base: float,
        rotary_dim: int | None = None,
        device: torch.device | str = "cpu",
    ) -> None:
        super().__init__()
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim % 2 or not 0 < rotary_dim <= head_dim:
            raise ValueError(f"rotary_dim must be even and in (0, {head_dim}], got {rotary_dim}")
        self.head_dim, self.rotary_dim = head_dim, rotary_dim
        # Same float32 arithmetic as HF so fp32 results agree to rounding: integer
        # positions are exact in float32 below 2**24.
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.float) / rotary_dim))
        freqs = torch.arange(max_position, dtype=torch.float)[:, None] * inv_freq[None, :]
        # [max_position, rotary_dim]: cos of each half-pair then sin, kept in float32.
        cache = torch.cat([freqs.cos(), freqs.sin()], dim=-1).to(device)
        self.register_buffer("cos_sin_cache", cache, persistent=False)

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        rot, rest = x[..., : self.rotary_dim], x[..., self.rotary_dim :]
        x1, x2 = rot.float().chunk(2, dim=-1)
        out = torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1).to(x.dtype)
        return out if rest.shape[-1] == 0 else torch.cat([out, rest], dim=-1)

    def _use_kernel(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether the Triton kernel applies: ``[T, heads, head_dim]`` unit-strided heads."""
        return (
            use_triton(q)
            and q.dim() == 3
            and k.dim() == 3
            and q.shape[-1] == k.shape[-1] == self.head_dim
            and q.stride(-1) == 1
            and k.stride(-1) == 1
            and same_kernel_dtype(q, k)
            and self.cos_sin_cache.dtype == torch.float32
        )

    def forward(
        self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """:param positions: ``[T]`` long. :returns: rotated ``q``, ``k`` (same shapes, dtypes)."""
        if self._use_kernel(q, k):
            from kvrunner.layers.fused.qk_norm_rope_triton import qk_norm_rope_triton

            return qk_norm_rope_triton(positions, q, k, self.cos_sin_cache, None, None, 0.0)
        cos, sin = self.cos_sin_cache[positions].unsqueeze(-2).chunk(2, dim=-1)  # [T, 1, r/2]
        return self._rotate(q, cos, sin), self._rotate(k, cos, sin)
