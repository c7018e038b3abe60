"""Batch-invariant products: every row of ``x @ W.T`` computed as it would be alone.

Deterministic mode (``EngineConfig.deterministic``) routes every projection of the
model (attention, MLP, experts, router, LM head) through :func:`invariant_linear`:

* Triton (CUDA, or ``[kernels] triton_on_cpu``): one kernel whose reduction (its K
  step, the K slices and their order) depends on the weight's shape only, however the
  work is spread (``layers/fused/invariant_gemm_triton.py``), where cuBLAS chooses
  tiles, split-K and instruction by row count.
* The CPU's torch path: one ``[1, K] x [K, N]`` product per row, so the BLAS library
  sees the same shape for every row of every batch and cannot pick another algorithm
  for another row count. Slow for long prompts; the CPU serves tests and tiny models.

:data:`INVARIANT_MOE_CONFIG` is the experts' one tile configuration in that mode (the
default one changes with the tokens per expert).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrunner.layers.activation import silu_and_mul
from kvrunner.layers.fused.dispatch import same_kernel_dtype, use_triton

#: the grouped expert kernels' tiles in deterministic mode, whatever the routing
INVARIANT_MOE_CONFIG = dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=128, num_warps=4, num_stages=3)


def invariant_linear(x: torch.Tensor, weight: torch.Tensor,
                     bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)``, each row's result independent of the others."""
    if use_triton(x) and same_kernel_dtype(x, weight) and weight.dim() == 2:
        from kvrunner.layers.fused.invariant_gemm_triton import invariant_gemm

        y = invariant_gemm(x, weight)
    else:
        y = rowwise_linear(x, weight)
    return y if bias is None else y + bias


def invariant_silu_mul_linear(gate_up: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``invariant_linear(silu_and_mul(gate_up), weight)``, bit for bit: one launch of
    the invariant GEMM that forms ``silu(gate) * up`` as it loads it, where the Triton
    kernel takes the rows (at most ``invariant_gemm_triton.SILU_MUL_MAX_ROWS``), else
    the activation and then :func:`invariant_linear`."""
    if (use_triton(gate_up) and same_kernel_dtype(gate_up, weight) and weight.dim() == 2
            and gate_up.shape[-1] == 2 * weight.shape[-1]):
        from kvrunner.layers.fused import invariant_gemm_triton as gemm

        if gate_up.numel() // gate_up.shape[-1] <= gemm.SILU_MUL_MAX_ROWS:
            return gemm.invariant_gemm(gate_up, weight, silu_mul=True)
    return invariant_linear(silu_and_mul(gate_up), weight)


def rowwise_linear(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """The torch path: one product per row, each of the shape ``[1, K]``."""
    lead, k = x.shape[:-1], x.shape[-1]
    rows = x.reshape(-1, k)
    out = torch.empty(rows.shape[0], weight.shape[0], dtype=torch.result_type(x, weight),
                      device=x.device)
    for i in range(rows.shape[0]):
        out[i : i + 1] = F.linear(rows[i : i + 1], weight)
    return out.reshape(*lead, weight.shape[0])
