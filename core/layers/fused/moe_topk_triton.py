"""Triton kernel: per-token softmax over the router logits, top-k, optional renormalisation.

One program per token holds the row of ``E`` logits in registers, computes the
float32 softmax, then takes the maximum ``top_k`` times (masking each pick), so the
picks come out in descending order as ``torch.topk`` returns them. Ties go to the
lower expert index.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


@triton.jit
def _topk_softmax_kernel(
    logits_ptr,
    weights_ptr,
    ids_ptr,
    stride_logits,
    E: tl.constexpr,
    K: tl.constexpr,
    BLOCK_E: tl.constexpr,
    BLOCK_K: tl.constexpr,
    RENORMALIZE: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_E)
    valid = cols < E
    x = tl.load(logits_ptr + row * stride_logits + cols, mask=valid, other=float("-inf"))
    x = x.to(tl.float32)
    e = tl.exp(x - tl.max(x, axis=0))
    e = tl.where(valid, e, 0.0)
    probs = e / tl.sum(e, axis=0)
    # Masked lanes must never win: below any probability (which are all >= 0).
    probs = tl.where(valid, probs, -1.0)
    slots = tl.arange(0, BLOCK_K)
    picked_w = tl.zeros([BLOCK_K], dtype=tl.float32)
    picked_i = tl.zeros([BLOCK_K], dtype=tl.int32)
    for k in tl.static_range(K):
        best = tl.max(probs, axis=0)
        # The lowest index holding the maximum.
        idx = tl.min(tl.where(probs == best, cols, BLOCK_E), axis=0)
        picked_w = tl.where(slots == k, best, picked_w)
        picked_i = tl.where(slots == k, idx, picked_i)
        probs = tl.where(cols == idx, -2.0, probs)
    if RENORMALIZE:
        picked_w = picked_w / tl.sum(tl.where(slots < K, picked_w, 0.0), axis=0)
    out = slots < K
    tl.store(weights_ptr + row * K + slots, picked_w.to(weights_ptr.dtype.element_ty), mask=out)
    tl.store(ids_ptr + row * K + slots, picked_i, mask=out)


def topk_softmax_triton(
    logits: torch.Tensor, top_k: int, renormalize: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """``[T, E]`` -> ``(weights [T, k] logits' dtype, ids [T, k] int32)``; no host sync."""
    t, e = logits.shape
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    weights = torch.empty(t, top_k, dtype=logits.dtype, device=logits.device)
    ids = torch.empty(t, top_k, dtype=torch.int32, device=logits.device)
    if t > 0:
        block_e = triton.next_power_of_2(e)
        _topk_softmax_kernel[(t,)](
            logits, weights, ids, logits.stride(0),
            E=e, K=top_k, BLOCK_E=block_e, BLOCK_K=triton.next_power_of_2(top_k),
            RENORMALIZE=renormalize, num_warps=max(1, min(8, block_e // 256)),
        )
    return weights, ids
