"""``align(model)``: a transformers Qwen3 / Qwen3-MoE model whose forward runs on the
engine's deterministic kernels, so its logprobs equal the engine's bit for bit."""

from __future__ import annotations

from collections.abc import Iterable

import torch
from torch import nn

from kvrunner.aligned.body import AlignedBody
from kvrunner.aligned.lm_head import AlignedHead
from kvrunner.aligned.plan import AlignedPlan
from kvrunner.aligned.rules import check_engine, check_model
from kvrunner.config import EngineConfig


def align(model: nn.Module, engine: EngineConfig | None = None, *,
          transformers_ops: Iterable[str] = ()) -> nn.Module:
    """Make ``model`` (transformers ``Qwen3ForCausalLM`` or ``Qwen3MoeForCausalLM``)
    compute as the rollout engine does in deterministic mode; returns ``model``.

    The body's and the LM head's ``forward`` are replaced in place (the weights, their
    names and the optimiser's view of them are untouched); autograd works, with each
    engine op's gradient taken from a plain-torch reference. ``engine``: the engine's
    config, checked against the rules (``rules.py``) and followed for its numerics
    switches and kernel choices; without it the defaults are assumed (deterministic,
    TP 1, the model's dtype, no fp32 switches). ``transformers_ops``: ops of
    :data:`~kvrunner.aligned.plan.OPS` left on transformers' own computation, to
    measure what each contributes to the gap. On the CPU torch is pinned to one
    thread, as the engine pins it in deterministic mode.
    """
    dtype = check_model(model)
    plan = AlignedPlan(transformers_ops=frozenset(transformers_ops))
    if engine is not None:
        plan = AlignedPlan(fp32_lm_head=engine.fp32_lm_head,
                           fp32_router_logits=engine.fp32_router_logits,
                           kernels=engine.kernels, engine_triton=check_engine(engine, model, dtype),
                           transformers_ops=plan.transformers_ops)
    model.model.forward = AlignedBody(model, plan)
    model.lm_head.forward = AlignedHead(model.lm_head, plan)
    model.kvrunner_aligned = plan
    if next(model.parameters()).device.type == "cpu":
        torch.set_num_threads(1)
    return model
