"""Model-parity test support: a cache-free attention layer and a flat forward.

``SdpaAttention`` is causal SDPA within each sequence of a flat batch, reading the
sequences' cumulative bounds from the ForwardContext under a key of the test's
choosing. It stands in for a cache backend so that a parity test checks the model
(weights, projections, norms, rotary, MLP, LM head), not the kernels.
``flat_logits`` runs prompts through a model as one such flat batch.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from kvrunner.plugin_api.step_data import ForwardContext


class SdpaAttention:
    """Causal attention within each sequence of a flat batch; no cache.

    :param key: the ForwardContext entry holding ``[0, end_0, end_1, ...]``.
    """

    def __init__(self, key: str) -> None:
        self.key = key

    def forward(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, ctx: ForwardContext
    ) -> torch.Tensor:
        bounds: list[int] = ctx.for_backend(self.key)
        groups = q.shape[1] // k.shape[1]
        out = torch.empty_like(q)
        for start, end in zip(bounds[:-1], bounds[1:], strict=True):
            qs, ks, vs = (t[start:end].transpose(0, 1) for t in (q, k, v))
            ks, vs = ks.repeat_interleave(groups, 0), vs.repeat_interleave(groups, 0)
            attended = F.scaled_dot_product_attention(qs, ks, vs, is_causal=True)
            out[start:end] = attended.transpose(0, 1)
        return out


def flat_logits(model: Any, prompts: list[list[int]], key: str) -> list[torch.Tensor]:
    """One flat forward over all prompts concatenated; logits for every token of each.

    The sequences' cumulative bounds go into the ForwardContext under ``key``.
    """
    ids = torch.tensor([t for p in prompts for t in p])
    positions = torch.cat([torch.arange(len(p)) for p in prompts])
    bounds = [0]
    for p in prompts:
        bounds.append(bounds[-1] + len(p))
    with torch.no_grad():
        logits = model.compute_logits(model(ids, positions, ForwardContext({key: bounds})))
    return [logits[s:e] for s, e in zip(bounds[:-1], bounds[1:], strict=True)]
