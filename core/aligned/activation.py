"""The trainer's SwiGLU activation on the engine's."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrunner.aligned.engine_op import engine_op
from kvrunner.layers.activation import silu_and_mul


def _reference(gate_up: torch.Tensor) -> torch.Tensor:
    gate, up = gate_up.chunk(2, dim=-1)
    return F.silu(gate) * up


def aligned_silu_mul(gate_up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` of ``[..., 2 * d]`` = ``[gate | up]``, the engine's
    :func:`~kvrunner.layers.activation.silu_and_mul` (one Triton launch on CUDA)."""
    return engine_op(silu_and_mul, _reference, gate_up)
