"""Which kvrunner model class implements a Hugging Face architecture.

Entries are ``"module:Class"`` strings, imported on first use, so listing the
supported architectures never imports every model. A model class exposes
``config_class`` (with ``from_hf_dict``) and the constructor
``(config, make_layer, dtype, device, **kwargs)``.
"""

from __future__ import annotations

from collections.abc import Mapping
from importlib import import_module
from typing import Any

#: HF ``architectures[0]`` -> "module:Class"
ARCHITECTURES: dict[str, str] = {
    "Qwen3ForCausalLM": "kvrunner.models.qwen3:Qwen3ForCausalLM",
    "Qwen3MoeForCausalLM": "kvrunner.models.qwen3_moe:Qwen3MoeForCausalLM",
    "Qwen3NextForCausalLM": "kvrunner.models.qwen3_next:Qwen3NextForCausalLM",
}
#: HF ``model_type`` -> architecture name, for configs without ``architectures``
MODEL_TYPES: dict[str, str] = {
    "qwen3": "Qwen3ForCausalLM",
    "qwen3_moe": "Qwen3MoeForCausalLM",
    "qwen3_next": "Qwen3NextForCausalLM",
}


def supported() -> list[str]:
    return sorted(ARCHITECTURES)


def resolve(hf_config: Mapping[str, Any]) -> type:
    """The model class for a parsed ``config.json``; raises listing the supported ones."""
    archs = hf_config.get("architectures") or []
    name = archs[0] if archs else MODEL_TYPES.get(hf_config.get("model_type", ""))
    if name not in ARCHITECTURES:
        given = name or f"model_type {hf_config.get('model_type')!r}"
        raise ValueError(f"unsupported architecture {given}; supported: {', '.join(supported())}")
    module, _, cls = ARCHITECTURES[name].partition(":")
    return getattr(import_module(module), cls)
