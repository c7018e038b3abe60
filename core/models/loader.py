"""Load a Hugging Face-format checkpoint directory into a kvrunner model.

A checkpoint directory holds ``config.json``, one ``model.safetensors`` or shards
listed by ``model.safetensors.index.json``, and optionally ``tokenizer.json`` and
``generation_config.json`` (whose ``eos_token_id`` adds stop tokens to the
config's). Tensors stream one at a time from the safetensors files into the
model's (possibly sharded) parameters, so peak host memory is one tensor, not the
whole checkpoint. A file that is missing, truncated or malformed raises
:class:`~kvrunner.errors.CheckpointError` naming it (see ``checkpoint_files``).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import torch
from tokenizers import Tokenizer
from torch import nn

from kvrunner.config import ConfigError
from kvrunner.errors import CheckpointError
from kvrunner.layers.weight_copy import copy_weight_
from kvrunner.models.checkpoint_files import load_tokenizer, read_json_object
from kvrunner.models.checkpoint_tensors import CheckpointTensors, load_checkpoint
from kvrunner.models.config_fields import check_hf_fields
from kvrunner.models.weight_names import (  # noqa: F401 - re-exported: callers import them from here
    WeightNameError,
    expected_weight_names,
    load_weights_into,
)
from kvrunner.plugin_api.step_data import ModelSpec

_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


def rope_theta_of(d: dict[str, Any], default: float = 10000.0) -> float:
    """``rope_theta`` from a config dict, flat or in ``rope_parameters``/``rope_scaling``.

    Only plain (``default``) rotary is implemented; a scaled variant (YaRN, linear,
    dynamic ...) is refused rather than silently computed wrong.
    """
    theta = d.get("rope_theta")
    for key in ("rope_parameters", "rope_scaling"):
        sub = d.get(key)
        if not isinstance(sub, dict):
            continue
        kind = sub.get("rope_type", sub.get("type", "default"))
        if kind != "default":
            raise ValueError(f"{key}: rope type {kind!r} is not supported (only 'default')")
        theta = sub.get("rope_theta", theta)
    return float(default if theta is None else theta)


def resolve_dtype(dtype: torch.dtype | str, config: Any) -> torch.dtype:
    """A torch dtype from a dtype or its name; ``"auto"`` takes the checkpoint's."""
    if isinstance(dtype, torch.dtype):
        return dtype
    name = (getattr(config, "dtype", None) or "float32") if dtype == "auto" else dtype
    try:
        return _DTYPES[str(name).removeprefix("torch.")]
    except KeyError:
        raise ValueError(f"unknown dtype {name!r}; known: {sorted(_DTYPES)}") from None


def iter_safetensors(path: Path, dtype: torch.dtype) -> CheckpointTensors:
    """Every tensor of the checkpoint's weight files, floats cast to ``dtype`` (see
    :class:`~kvrunner.models.checkpoint_tensors.CheckpointTensors`)."""
    return CheckpointTensors(Path(path), dtype)


def _id_list(value: Any) -> list[int]:
    return [] if value is None else [value] if isinstance(value, int) else list(value)


def _eos_ids(file: Path, value: Any) -> list[int]:
    ids = _id_list(value)
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise CheckpointError(file, f"eos_token_id must be a token id or a list of them, "
                                    f"got {value!r}")
    return ids


def load_hf_config(path: str | Path) -> dict[str, Any]:
    """The raw ``config.json`` dict, with ``generation_config.json``'s EOS ids merged in
    (config's first, then new ones), as generation stops on either.

    :raises CheckpointError: naming the file, if either is unreadable, or if
        ``config.json`` lacks a field the model needs or describes no supported model.
    :raises ConfigError: naming the file and the field, if a field is of the wrong
        type or out of its range (:mod:`~kvrunner.models.config_fields`).
    """
    path = Path(path)
    file = path / "config.json"
    raw = read_json_object(file)
    gen = path / "generation_config.json"
    if gen.exists():
        extra = _eos_ids(gen, read_json_object(gen).get("eos_token_id"))
        if extra:
            base = _eos_ids(file, raw.get("eos_token_id"))
            raw["eos_token_id"] = list(dict.fromkeys(base + extra))
    try:
        parse_config(raw)  # every later parse of this dict then succeeds
    except ConfigError as e:  # a field of the wrong type or out of range
        raise ConfigError(f"{file}: {e}") from None
    except KeyError as e:
        raise CheckpointError(file, f"lacks the required field {e.args[0]!r}") from None
    except (TypeError, ValueError, AttributeError) as e:
        raise CheckpointError(file, str(e)) from None
    return raw


def parse_config(raw: Mapping[str, Any]) -> tuple[type, Any]:
    """``(model class, parsed config)`` for a raw ``config.json`` dict."""
    from kvrunner.models.registry import resolve

    model_cls = resolve(raw)
    check_hf_fields(raw)
    return model_cls, model_cls.config_class.from_hf_dict(raw)


def read_config(path: str | Path) -> tuple[type, Any]:
    """``(model class, parsed config)`` for a checkpoint directory."""
    return parse_config(load_hf_config(path))


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype | str,
    device: torch.device | str,
    make_layer: Callable[[int, str], Any],
    progress: bool = False,
    load_format: str = "auto",
    seed: int = 0,
    skip_tokenizer: bool = False,
    check_finite: bool = True,
    **model_kwargs: Any,
) -> tuple[nn.Module, Tokenizer | None, Any]:
    """Build the model a checkpoint directory describes and load its weights.

    :param dtype: a torch dtype, its name, or ``"auto"`` (the checkpoint's dtype).
    :param make_layer: ``(layer_index, layer_type) -> attention impl`` (from the backends).
    :param progress: show a progress bar over the tensors loaded.
    :param load_format: ``"auto"`` reads the safetensors files; ``"dummy"`` reads only
        the config and fills the weights with small random values (``seed``), for a
        trainer that pushes the real ones before the first rollout.
    :param skip_tokenizer: load no tokenizer, even if the checkpoint has one.
    :param check_finite: refuse a tensor holding NaN or inf, naming it (one min/max
        pass over each tensor as it is read). Every tensor's name, shape and dtype is
        checked against the model from the headers before any loads, as
        ``load_weights`` does (:func:`~kvrunner.models.checkpoint_tensors.load_checkpoint`).
    :param model_kwargs: passed to the model class (e.g. ``tp=TPGroup(...)``).
    :returns: ``(model, tokenizer, config)``; the model is in eval mode, no grad; the
        tokenizer is None when the checkpoint has none (or ``skip_tokenizer``).
    """
    path = Path(path)
    model_cls, config = read_config(path)
    dtype = resolve_dtype(dtype, config)
    # Every weight file is checked before the model is built (a dummy start reads none).
    tensors = iter_safetensors(path, dtype) if load_format != "dummy" else None
    model = model_cls(config, make_layer, dtype, torch.device(device), **model_kwargs)
    if tensors is None:
        fill_dummy_weights(model, seed=seed)
    else:
        load_checkpoint(model, tensors, check_finite=check_finite, values_first=False,
                        progress=progress)
    model.eval().requires_grad_(False)
    return model, load_tokenizer(path, skip=skip_tokenizer), config


def fill_dummy_weights(model: nn.Module, *, seed: int) -> None:
    """Every parameter uniform in [-1e-3, 1e-3] from a seeded generator (as vLLM's
    ``load_format="dummy"``): finite, small, reproducible, and meaningless."""
    gen = torch.Generator(device="cpu").manual_seed(seed)
    with torch.no_grad():
        for _, param in model.named_parameters():
            values = torch.rand(param.shape, generator=gen, dtype=torch.float32) * 2e-3 - 1e-3
            copy_weight_(param, values)


def model_spec(config: Any, tp_size: int = 1) -> ModelSpec:
    """The per-rank shapes backends need (heads divided by ``tp_size``).

    :param config: a parsed model config, or a raw ``config.json`` dict.
    """
    if isinstance(config, Mapping):
        config = parse_config(config)[1]
    try:
        return config.model_spec(tp_size)
    except ValueError as e:  # the heads do not split over this many ranks
        raise ConfigError(f"tensor_parallel_size={tp_size} does not fit this model: {e}") from None


def max_positions(config: Any) -> int:
    """The model's ``max_position_embeddings`` (the default ``max_model_len``).

    :param config: a parsed model config, or a raw ``config.json`` dict.
    """
    if isinstance(config, Mapping):
        config = parse_config(config)[1]
    return int(config.max_position_embeddings)


def check_model_len(max_model_len: int | None, config: Any) -> None:
    """Refuse a ``max_model_len`` beyond the positions the model was built for
    (``None``, unset, is resolved from the model and always fits).

    :param config: a parsed model config, or a raw ``config.json`` dict.
    """
    if max_model_len is None:
        return
    limit = max_positions(config)
    if max_model_len > limit:
        raise ConfigError(
            f"max_model_len={max_model_len} exceeds the model's max_position_embeddings="
            f"{limit}; set max_model_len to at most {limit}"
        )
