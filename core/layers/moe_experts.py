"""The experts' computation without Triton: the CPU path and the naive test oracle.

Both take routed assignments (``topk_weights``, ``topk_ids``: ``[T, top_k]``) and the
fused expert weights ``w13`` ``[E, 2I, H]`` (gate rows, then up rows) and ``w2``
``[E, H, I]``, the layout the Triton kernels read.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrunner.layers.batch_invariant import invariant_linear
from kvrunner.layers.fused.dispatch import batch_invariant


def grouped_experts_torch(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``[T, H]`` -> ``[T, top_k, H]``: each assignment's weighted expert output.

    Assignments are grouped by expert and each used expert runs as two matmuls over
    its tokens. The per-expert row counts come to the host (one sync), so this path
    is for the CPU (where a "graph" replays eagerly) and for comparison, never for a
    captured CUDA graph.
    """
    t, top_k = topk_ids.shape
    h, num_experts = x.shape[1], w13.shape[0]
    # Deterministic mode: an expert's rows as if alone, however many tokens it got.
    linear = invariant_linear if batch_invariant() else F.linear
    flat = topk_ids.reshape(-1).long()
    flat_weights = topk_weights.reshape(-1)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts).tolist()
    out = x.new_empty(t * top_k, h)
    start = 0
    for expert, count in enumerate(counts):
        if count == 0:
            continue
        rows = order[start : start + count]
        start += count
        gate, up = linear(x[rows // top_k], w13[expert]).chunk(2, dim=-1)
        y = linear(F.silu(gate) * up, w2[expert])
        out[rows] = y * flat_weights[rows, None]
    return out.view(t, top_k, h)


def route_reference(
    router_logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax, a full descending sort, the first ``top_k``: written independently of
    the routing under test (no ``torch.topk``), in float32."""
    probs = torch.softmax(router_logits.float(), dim=-1)
    weights, ids = torch.sort(probs, dim=-1, descending=True, stable=True)
    weights, ids = weights[:, :top_k], ids[:, :top_k]
    if renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    return weights.to(router_logits.dtype), ids.to(torch.int32)


def experts_reference(
    x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor,
    topk_weights: torch.Tensor, topk_ids: torch.Tensor,
) -> torch.Tensor:
    """``[T, H]`` -> ``[T, H]``, one token and one chosen expert at a time, in float32."""
    i = w2.shape[2]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    for token in range(x.shape[0]):
        xt = x[token].float()
        for slot in range(topk_ids.shape[1]):
            e = int(topk_ids[token, slot])
            gate = w13[e, :i].float() @ xt
            up = w13[e, i:].float() @ xt
            out[token] += topk_weights[token, slot].float() * (w2[e].float() @ (F.silu(gate) * up))
    return out
