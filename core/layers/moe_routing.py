"""Router top-k: softmax over the experts, the ``top_k`` largest, optionally renormalised.

The arithmetic follows transformers' Qwen3-MoE / Qwen3-Next routers: logits in the
activation dtype (the gate is an ordinary linear layer), softmax and the
renormalisation in float32, the chosen weights rounded back to the activation
dtype. On CUDA (or with ``[kernels] triton_on_cpu``) one Triton program per token does
the softmax, selection and renormalisation; the torch code below is the reference.
"""

from __future__ import annotations

import torch

from kvrunner.layers.fused.dispatch import same_kernel_dtype, use_triton

#: widest expert count one routing program holds in registers (the torch path beyond)
MAX_TRITON_EXPERTS = 4096


def topk_softmax_torch(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` logits -> ``(weights [T, k] logits' dtype, expert ids [T, k] int32)``."""
    probs = torch.softmax(logits, dim=-1, dtype=torch.float32)
    weights, ids = torch.topk(probs, top_k, dim=-1)
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(logits.dtype), ids.to(torch.int32)


def topk_softmax(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """As :func:`topk_softmax_torch`, through the Triton kernel where it runs."""
    if (use_triton(logits) and same_kernel_dtype(logits)
            and logits.shape[-1] <= MAX_TRITON_EXPERTS):
        from kvrunner.layers.fused.moe_topk_triton import topk_softmax_triton

        return topk_softmax_triton(logits, top_k, renormalize)
    return topk_softmax_torch(logits, top_k, renormalize)
