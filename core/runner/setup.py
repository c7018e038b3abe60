"""Resolve the device, dtype and model directory a runner is built on."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from kvrunner.config import ConfigError
from kvrunner.models.loader import resolve_dtype as dtype_by_name


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(name)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise ConfigError(f"device {name!r} asked for, but CUDA is not available here")
    return device


#: a GPU at least this large takes the larger default step (vLLM draws the line here)
LARGE_GPU_BYTES = 70 << 30


def default_batched_tokens(device_type: str, total_memory_bytes: int) -> int:
    """``max_num_batched_tokens`` when unset: vLLM's defaults for its offline ``LLM``.

    A larger step prefills a batch of long prompts in fewer, fuller steps (an RL
    rollout's 256 prompts of 1,024 tokens: 16 steps at 16,384, 128 at 2,048); its
    activations come out of the KV pool's share. The CPU keeps small steps."""
    if device_type != "cuda":
        return 2048
    return 16384 if total_memory_bytes >= LARGE_GPU_BYTES else 8192


def resolve_max_num_batched_tokens(asked: int | None, device: torch.device) -> int:
    """The value asked for, else :func:`default_batched_tokens` for ``device``."""
    if asked is not None:
        return asked
    total = torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else 0
    return default_batched_tokens(device.type, total)


def resolve_dtype(name: str, device: torch.device, hf_config: dict[str, Any]) -> torch.dtype:
    """``auto``: float32 on the CPU; on CUDA the checkpoint's half type, else bfloat16."""
    if name != "auto":
        return dtype_by_name(name, None)
    if device.type != "cuda":
        return torch.float32
    stored = hf_config.get("torch_dtype") or hf_config.get("dtype")
    return torch.float16 if stored == "float16" else torch.bfloat16


def resolve_model_path(model: str) -> Path:
    """An HF-format directory, or the name of an embedded default (made on first use)."""
    from kvrunner.models.tiny import DEFAULT_MODELS, ensure_default_model

    path = Path(model).expanduser()
    if path.is_dir():
        if not (path / "config.json").is_file():
            raise ConfigError(f"model directory {str(path)!r} has no config.json")
        return path
    if model in DEFAULT_MODELS:
        return ensure_default_model(model)
    raise ConfigError(
        f"model {model!r} is neither a directory nor an embedded default "
        f"({', '.join(sorted(DEFAULT_MODELS))}); no hub access exists here"
    )
