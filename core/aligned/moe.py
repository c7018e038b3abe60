"""The trainer's mixture-of-experts block on the engine's routing and experts.

The engine routes with its top-k softmax (one Triton program a token on CUDA) and
sums each token's chosen experts' weighted outputs slot by slot
(:class:`~kvrunner.layers.moe.FusedMoE`: the grouped Triton kernel with deterministic
mode's one tiling, or the per-expert row-invariant products on the CPU). transformers
instead adds each expert's rows into the output expert by expert, another order.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrunner.aligned.engine_op import engine_op
from kvrunner.aligned.linear import aligned_linear
from kvrunner.aligned.memory import engine_layout
from kvrunner.layers.moe import FusedMoE
from kvrunner.layers.moe_routing import topk_softmax


def engine_experts(w13: torch.Tensor, w2: torch.Tensor) -> FusedMoE:
    """The engine's :class:`~kvrunner.layers.moe.FusedMoE` over the stacked expert
    weights ``w13`` ``[E, 2I, H]`` and ``w2`` ``[E, H, I]`` (copied only where they
    do not start where an engine weight would, ``memory.py``)."""
    experts = FusedMoE(w13.shape[0], w13.shape[2], w2.shape[2], dtype=w13.dtype, device="meta")
    del experts.w13, experts.w2
    experts.w13, experts.w2 = engine_layout(w13), engine_layout(w2)
    return experts


def experts_reference(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
                      weights: torch.Tensor, ids: torch.Tensor) -> torch.Tensor:
    """Each token's chosen experts' SwiGLU outputs, weighted and summed (differentiable)."""
    top_k = ids.shape[1]
    flat = ids.reshape(-1).long()
    token = torch.arange(x.shape[0], device=x.device).repeat_interleave(top_k)
    out = torch.zeros_like(x)
    for expert in flat.unique().tolist():
        chosen = (flat == expert).nonzero().squeeze(1)
        gate, up = F.linear(x[token[chosen]], w13[expert]).chunk(2, dim=-1)
        y = F.linear(F.silu(gate) * up, w2[expert]) * weights.reshape(-1)[chosen, None]
        out = out.index_add(0, token[chosen], y)
    return out


def _routing_reference(logits: torch.Tensor, ids: torch.Tensor, renormalize: bool
                       ) -> torch.Tensor:
    """The chosen experts' softmax weights (float32 softmax, optionally renormalised)."""
    chosen = torch.softmax(logits, dim=-1, dtype=torch.float32).gather(1, ids.long())
    if renormalize:
        chosen = chosen / chosen.sum(dim=-1, keepdim=True)
    return chosen.to(logits.dtype)


def aligned_moe(x: torch.Tensor, router: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, *,
                top_k: int, renormalize: bool, router_dtype: torch.dtype | None) -> torch.Tensor:
    """A sparse block's output for tokens ``x`` ``[T, H]`` as the engine computes it
    (:class:`~kvrunner.layers.moe.SparseMoeBlock` with no shared expert):
    ``router`` ``[E, H]`` logits (in ``router_dtype`` where set: ``fp32_router_logits``),
    top-k softmax, the experts summed slot by slot."""
    if router_dtype is None:
        logits = aligned_linear(x, router)
    else:
        logits = aligned_linear(x.to(router_dtype), router.to(router_dtype))
    with torch.no_grad():
        weights, ids = topk_softmax(logits, top_k, renormalize)
    # the router learns through the chosen weights; the kernel's bits are kept
    weights = engine_op(lambda _logits: weights.clone(),
                        lambda logits: _routing_reference(logits, ids, renormalize), logits)
    weights = weights.to(x.dtype)
    return engine_op(
        lambda x, w13, w2, weights: engine_experts(w13, w2)(x, weights, ids),
        lambda x, w13, w2, weights: experts_reference(x, w13, w2, weights, ids),
        x, w13, w2, weights,
    )
