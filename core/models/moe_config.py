"""The mixture-of-experts fields of a Qwen3-MoE / Qwen3-Next ``config.json``."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvrunner.layers.linear import divide


def num_experts_of(d: Mapping[str, Any]) -> int:
    """Released configs say ``num_experts``; transformers 5 writes ``num_local_experts``."""
    return int(d.get("num_experts") or d.get("num_local_experts") or 0)


def sparse_layers(d: Mapping[str, Any], num_layers: int) -> tuple[int, ...]:
    """Layers that transformers builds as mixture-of-experts blocks for config ``d``:
    every ``decoder_sparse_step``-th layer not listed in ``mlp_only_layers``."""
    if num_experts_of(d) <= 0:
        return ()
    dense = set(d.get("mlp_only_layers") or ())  # null in a config.json means "none"
    step = d.get("decoder_sparse_step") or 1
    return tuple(i for i in range(num_layers) if i not in dense and (i + 1) % step == 0)


@attrs.frozen(kw_only=True)
class MoeConfig:
    """Experts, routing and which layers are sparse (the others keep the dense MLP)."""

    num_experts: int
    top_k: int
    intermediate_size: int
    norm_topk_prob: bool
    sparse_layers: tuple[int, ...] = attrs.field(converter=tuple)
    #: Qwen3-Next's always-on expert (0: none, as in Qwen3-MoE)
    shared_expert_intermediate_size: int = 0

    def __attrs_post_init__(self) -> None:
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(
                f"num_experts_per_tok={self.top_k} must be between 1 and "
                f"num_experts={self.num_experts}"
            )

    @classmethod
    def from_hf_dict(
        cls, d: Mapping[str, Any], num_layers: int, *, shared_expert: bool
    ) -> MoeConfig | None:
        """The MoE part of a config dict, or None when no layer is sparse.

        :param shared_expert: the architecture has one (Qwen3-Next), so its size is
            required; otherwise any ``shared_expert_intermediate_size`` is ignored.
        """
        layers = sparse_layers(d, num_layers)
        if not layers:
            return None
        return cls(
            num_experts=num_experts_of(d),
            top_k=d["num_experts_per_tok"],
            intermediate_size=d["moe_intermediate_size"],
            norm_topk_prob=bool(d.get("norm_topk_prob", False)),
            sparse_layers=layers,
            shared_expert_intermediate_size=(
                d["shared_expert_intermediate_size"] if shared_expert else 0
            ),
        )

    def check_tp(self, tp_size: int) -> None:
        """Each expert's (and the shared expert's) intermediate dimension splits evenly."""
        divide(self.intermediate_size, tp_size, "moe_intermediate_size")
        divide(self.shared_expert_intermediate_size, tp_size, "shared_expert_intermediate_size")

    def expert_bytes(self, hidden_size: int, element_size: int) -> int:
        """Bytes of one routed expert's three projections."""
        return 3 * hidden_size * self.intermediate_size * element_size
