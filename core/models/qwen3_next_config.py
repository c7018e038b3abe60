"""The parsed ``config.json`` of a Qwen3-Next checkpoint (``Qwen3NextConfig``)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

from kvrunner.layers.linear import divide
from kvrunner.models.moe_config import MoeConfig
from kvrunner.models.qwen3 import Qwen3Config
from kvrunner.plugin_api.step_data import ModelSpec

DEFAULT_PARTIAL_ROTARY = 0.25


def _layer_types(d: Mapping[str, Any], num_layers: int) -> tuple[str, ...]:
    """``layer_types``, or (released checkpoints) every ``full_attention_interval``-th
    layer full attention and the rest linear, as transformers derives it."""
    if d.get("layer_types"):
        return tuple(d["layer_types"])
    interval = d.get("full_attention_interval") or 4
    return tuple(
        "full_attention" if (i + 1) % interval == 0 else "linear_attention"
        for i in range(num_layers)
    )


@attrs.frozen(kw_only=True)
class Qwen3NextConfig(Qwen3Config):
    """Qwen3's fields plus the linear-attention shapes and partial rotary; ``moe``
    (with a shared expert) for the sparse layers."""

    partial_rotary_factor: float = DEFAULT_PARTIAL_ROTARY
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    linear_conv_kernel_dim: int

    def __attrs_post_init__(self) -> None:
        # Not Qwen3Config's check, which refuses linear_attention layers.
        if len(self.layer_types) != self.num_hidden_layers:
            raise ValueError(
                f"Qwen3NextConfig: {len(self.layer_types)} layer_types "
                f"for {self.num_hidden_layers} layers"
            )
        unknown = sorted(set(self.layer_types) - {"full_attention", "linear_attention"})
        if unknown:
            raise ValueError(f"Qwen3NextConfig: unsupported layer types {unknown}")
        divide(self.num_attention_heads, self.num_key_value_heads, "num_attention_heads",
               by="num_key_value_heads")
        divide(self.linear_num_value_heads, self.linear_num_key_heads, "linear_num_value_heads",
               by="linear_num_key_heads")

    @classmethod
    def from_hf_dict(cls, d: Mapping[str, Any]) -> Qwen3NextConfig:
        """Parse a Hugging Face ``config.json`` dict, in transformers 5's layout or the
        released checkpoints' (``full_attention_interval``, flat ``partial_rotary_factor``)."""
        n = d["num_hidden_layers"]
        rope = d.get("rope_parameters") or d.get("rope_scaling") or {}
        partial = rope.get("partial_rotary_factor", d.get("partial_rotary_factor"))
        base = attrs.asdict(Qwen3Config.from_hf_dict({**d, "layer_types": None}), recurse=False)
        base["layer_types"] = _layer_types(d, n)
        base["moe"] = MoeConfig.from_hf_dict(d, n, shared_expert=True)
        return cls(
            **base,
            partial_rotary_factor=DEFAULT_PARTIAL_ROTARY if partial is None else partial,
            linear_num_key_heads=d["linear_num_key_heads"],
            linear_num_value_heads=d["linear_num_value_heads"],
            linear_key_head_dim=d["linear_key_head_dim"],
            linear_value_head_dim=d["linear_value_head_dim"],
            linear_conv_kernel_dim=d["linear_conv_kernel_dim"],
        )

    def model_spec(self, tp_size: int = 1) -> ModelSpec:
        """Per-rank shapes: attention, KV and GDN key heads all split evenly over ranks."""
        # No KV-head replication here: the gated attention's projections shard whole heads.
        divide(self.num_key_value_heads, tp_size, "KV heads")
        key_heads = divide(self.linear_num_key_heads, tp_size, "GDN key heads")
        return attrs.evolve(
            super().model_spec(tp_size),
            linear_num_key_heads=key_heads,
            linear_num_value_heads=key_heads
            * (self.linear_num_value_heads // self.linear_num_key_heads),
            linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim,
        )
