"""The trainer's projections on the engine's batch-invariant product."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from kvrunner.aligned.engine_op import engine_op
from kvrunner.aligned.memory import engine_layout
from kvrunner.layers.linear import project


def aligned_linear(x: torch.Tensor, weight: torch.Tensor,
                   bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` as the engine's layers compute it in deterministic
    mode (:func:`~kvrunner.layers.linear.project` under batch invariance: each row as
    alone), with ``F.linear``'s gradient. The bias is added after the product, as
    the engine adds it. The weight is read at an address the engine's could have
    (``memory.py``)."""
    y = engine_op(lambda x, w: project(x, engine_layout(w)), F.linear, x, weight)
    return y if bias is None else y + bias
