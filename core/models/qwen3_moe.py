"""Qwen3-MoE (``Qwen3MoeForCausalLM``): Qwen3 with mixture-of-experts MLPs.

Every ``decoder_sparse_step``-th layer not in ``mlp_only_layers`` routes each token
to ``num_experts_per_tok`` of ``num_experts`` SwiGLU experts
(:class:`~kvrunner.layers.moe.SparseMoeBlock`); the other layers keep Qwen3's dense
MLP. Attention, norms and weight names are Qwen3's.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvrunner.models.moe_config import MoeConfig
from kvrunner.models.qwen3 import Qwen3Config, Qwen3ForCausalLM


@attrs.frozen(kw_only=True)
class Qwen3MoeConfig(Qwen3Config):
    """Qwen3's fields; ``moe`` from the config's expert fields."""

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Qwen3MoeConfig:
        base = attrs.asdict(Qwen3Config.from_hf_dict(d), recurse=False)
        base["moe"] = MoeConfig.from_hf_dict(d, d["num_hidden_layers"], shared_expert=False)
        return cls(**base)


class Qwen3MoeForCausalLM(Qwen3ForCausalLM):
    """The Hugging Face ``Qwen3MoeForCausalLM`` architecture on a flat token batch.

    The layers are Qwen3's; which MLP each gets follows ``config.moe``
    (:func:`kvrunner.models.qwen3.make_mlp`), and the experts' per-expert
    checkpoint tensors load through the parameters' ``checkpoint_shards``.
    """

    config_class = Qwen3MoeConfig
