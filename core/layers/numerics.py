"""Numerics choices the RL frameworks set to narrow the trainer-rollout gap.

Two products decide most of a sampled token's logprob outside the attention:

* the LM head, whose ``[hidden] x [hidden, vocab]`` product in bf16 rounds every
  logit to 8 bits of mantissa before the softmax (SGLang's ``--enable-fp32-lm-head``);
* a MoE router, whose bf16 logits round near-ties between experts, so the trainer and
  the engine pick other experts for a token (the R3 paper's mismatch).

``fp32_lm_head`` and ``fp32_router_logits`` (``EngineConfig``) run those products on
float32 copies of the activations and weights, cast at each step, so a pushed weight
is read as pushed and nothing extra is held between steps. The weights stay in the
model dtype; only the product widens.
"""

from __future__ import annotations

import torch
from torch import nn

from kvrunner.layers.embedding import LMHead
from kvrunner.layers.moe import SparseMoeBlock


def choose_numerics(model: nn.Module, *, fp32_lm_head: bool, fp32_router_logits: bool) -> None:
    """Set the compute dtype of every LM head and MoE router of ``model``: float32 where
    asked, else the model's own dtype (``None``)."""
    for module in model.modules():
        if isinstance(module, LMHead):
            module.compute_dtype = torch.float32 if fp32_lm_head else None
        elif isinstance(module, SparseMoeBlock):
            module.router_dtype = torch.float32 if fp32_router_logits else None
