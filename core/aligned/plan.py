"""What an aligned model computes with: the engine's settings it follows."""

from __future__ import annotations

import attrs
import torch

from kvrunner.config import KernelsConfig
from kvrunner.layers.rotary import RotaryEmbedding

#: the ops :func:`~kvrunner.aligned.align` swaps; each may be left on transformers'
#: own computation (``transformers_ops``) to measure what it contributes to the gap
OPS = frozenset({"linear", "norm", "rotary", "attention", "activation", "moe", "lm_head"})


@attrs.define(kw_only=True)
class AlignedPlan:
    """The engine's choices an aligned forward reproduces (from its ``EngineConfig``)."""

    #: the LM head's product in float32 (``EngineConfig.fp32_lm_head``)
    fp32_lm_head: bool = False
    #: MoE router logits in float32 (``EngineConfig.fp32_router_logits``)
    fp32_router_logits: bool = False
    #: the engine's ``[kernels]`` choices, installed for the forward
    kernels: KernelsConfig = attrs.field(factory=KernelsConfig)
    #: whether the engine's layers launch Triton; None: not known (no engine given)
    engine_triton: bool | None = None
    #: ops left on transformers' computation (a subset of :data:`OPS`)
    transformers_ops: frozenset[str] = frozenset()
    #: the engine's rotary table per device, built on first use there
    _rotary: dict[torch.device, RotaryEmbedding] = attrs.field(factory=dict)

    def __attrs_post_init__(self) -> None:
        unknown = sorted(set(self.transformers_ops) - OPS)
        if unknown:
            raise ValueError(f"align: unknown ops {unknown}; the ops are {sorted(OPS)}")

    def aligned(self, op: str) -> bool:
        """Whether ``op`` runs on the engine's kernel."""
        return op not in self.transformers_ops

    def rotary(self, head_dim: int, max_position: int, base: float,
               device: torch.device) -> RotaryEmbedding:
        """The engine's rotary module (its float32 cos/sin table of ``max_position``
        rows, as the engine builds it from the same config) on ``device``."""
        if device not in self._rotary:
            self._rotary[device] = RotaryEmbedding(head_dim, max_position=max_position,
                                                   base=base, device=device)
        return self._rotary[device]
