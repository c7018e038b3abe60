"""A model ``config.json``'s numeric and boolean fields, checked before any is used.

A Hugging Face config is JSON a person may have edited: ``"vocab_size": "448"``,
``"hidden_size": -64`` or ``"num_attention_heads": 0`` would otherwise surface as a
``TypeError`` in arithmetic, a torch error building a tensor, or a shape error
blamed on some projection. :func:`check_hf_fields` checks every field kvrunner's
models read, where present, for its type and range, and raises one
:class:`~kvrunner.errors.ConfigError` naming the field (the caller adds the file).
A field that is absent is left to the model's parser (a default, or a missing-field
error).
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from typing import Any

from kvrunner.config_checks import check_type
from kvrunner.errors import ConfigError

#: the largest value a size field may hold (far beyond any real model's)
_BIG = 1 << 24

#: field -> (type as config_checks.check_type names it, smallest, largest)
FIELDS: dict[str, tuple[str, float, float]] = {
    "hidden_size": ("int", 1, _BIG),
    "intermediate_size": ("int", 1, _BIG),
    "num_hidden_layers": ("int", 1, _BIG),
    "num_attention_heads": ("int", 1, _BIG),
    "num_key_value_heads": ("int", 1, _BIG),
    "head_dim": ("int", 1, _BIG),
    "vocab_size": ("int", 1, 1 << 31),
    "max_position_embeddings": ("int", 1, 1 << 31),
    "rms_norm_eps": ("float", 0, 1),
    "tie_word_embeddings": ("bool", 0, 0),
    "attention_bias": ("bool", 0, 0),
    # 0 experts is a dense model (transformers writes so); MoeConfig checks the rest
    "num_experts": ("int", 0, _BIG),
    "num_experts_per_tok": ("int", 0, _BIG),
    "moe_intermediate_size": ("int", 0, _BIG),
    "shared_expert_intermediate_size": ("int", 0, _BIG),
    "partial_rotary_factor": ("float", 0, 1),
    "linear_num_key_heads": ("int", 1, _BIG),
    "linear_num_value_heads": ("int", 1, _BIG),
    "linear_key_head_dim": ("int", 1, _BIG),
    "linear_value_head_dim": ("int", 1, _BIG),
    "linear_conv_kernel_dim": ("int", 1, _BIG),
}


def check_hf_fields(d: Mapping[str, Any]) -> None:
    """Raise ConfigError naming the first field of :data:`FIELDS` in ``d`` (``null``
    counts as absent) whose value is of the wrong type or out of its range."""
    for name, (kind, lo, hi) in FIELDS.items():
        value = d.get(name)
        if value is None:
            continue
        check_type("", name, kind, value)
        if kind == "bool":
            continue
        if isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{name} must be a finite number, got {value!r}")
        if not lo <= value <= hi or (kind == "float" and value == lo):
            bound = f"> {lo}" if kind == "float" else f">= {lo}"
            raise ConfigError(f"{name} must be {bound} and <= {hi}, got {value!r}")
