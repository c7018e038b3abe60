"""Gated activations for fused gate/up projections."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrunner.layers.fused.dispatch import same_kernel_dtype, use_triton


def silu_and_mul(x: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` where the input is ``[..., 2 * d]`` = ``[gate | up]``.

    The gate and up projections run as one matmul (:class:`MergedColumnParallelLinear`)
    and this splits the result; under tensor parallelism each rank holds its own
    ``[gate_slice | up_slice]``, so the split stays rank-local.

    On CUDA (or with ``[kernels] triton_on_cpu``) this is one Triton launch with the
    same two roundings; the torch code below is the reference. A one-row SwiGLU fuses
    it into the down projection instead (``layers/linear.py``, ``project_silu_mul``).
    """
    if use_triton(x) and x.shape[-1] % 2 == 0 and same_kernel_dtype(x):
        from kvrunner.layers.fused.silu_mul_triton import silu_mul_triton

        return silu_mul_triton(x)
    gate, up = x.chunk(2, dim=-1)
    return F.silu(gate) * up
