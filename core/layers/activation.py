"""Gated activations for fused gate/up projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn


class SiluAndMul(nn.Module):
    """``silu(gate) * up`` where the input is ``[..., 2 * d]`` = ``[gate | up]``.

    The gate and up projections run as one matmul (:class:`MergedColumnParallelLinear`)
    and this splits the result; under tensor parallelism each rank holds its own
    ``[gate_slice | up_slice]``, so the split stays rank-local.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = x.chunk(2, dim=-1)
        return F.silu(gate) * up
