"""The trainer's LM head on the engine's: the batch-invariant product, in float32
where the engine runs ``fp32_lm_head``."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvrunner.aligned.context import aligned_context
from kvrunner.aligned.linear import aligned_linear
from kvrunner.aligned.plan import AlignedPlan


class AlignedHead:
    """The ``forward`` of a transformers ``lm_head``: ``[..., hidden]`` -> logits in the
    model dtype (float32 under ``fp32_lm_head``), as the engine's
    :class:`~kvrunner.layers.embedding.LMHead` computes them before widening."""

    def __init__(self, head: nn.Linear, plan: AlignedPlan) -> None:
        self.head, self.plan = head, plan

    def __call__(self, hidden: torch.Tensor) -> torch.Tensor:
        weight = self.head.weight
        if not self.plan.aligned("lm_head"):
            return F.linear(hidden, weight)
        if self.plan.fp32_lm_head:
            hidden, weight = hidden.float(), weight.float()
        with aligned_context(self.plan, hidden.device):
            return aligned_linear(hidden, weight)
