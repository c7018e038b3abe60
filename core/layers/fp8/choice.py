"""Which weights are FP8: the engine's ``quantization`` against the checkpoint's
``quantization_config``, and the switch the layers read while a model is built (the
parallel projections, ``layers/linear.py``, and the stacked experts, ``layers/moe.py``;
never an embedding, the LM head or a router).

``quantization = "auto"`` follows the checkpoint: FP8 where its ``config.json``
carries Qwen's and DeepSeek's ``{"quant_method": "fp8", "fmt": "e4m3",
"weight_block_size": [128, 128], "activation_scheme": "dynamic"}``, else none.
``"fp8"`` quantizes a bf16 checkpoint as it loads (and every later push); ``"none"``
refuses an FP8 checkpoint (its weights cannot load into bf16 parameters).
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping
from typing import Any

from kvrunner.errors import ConfigError
from kvrunner.layers.fp8.blocks import BLOCK

_BUILDING: list[str | None] = [None]


def checkpoint_quantization(hf_config: Mapping[str, Any]) -> str | None:
    """``"fp8"`` for a checkpoint whose ``quantization_config`` is the FP8 block layout
    served here, None for an unquantized one; any other quantization is a ConfigError
    naming what it asks."""
    qc = hf_config.get("quantization_config")
    if qc is None:
        return None
    if not isinstance(qc, Mapping) or qc.get("quant_method") != "fp8":
        method = qc.get("quant_method") if isinstance(qc, Mapping) else qc
        raise ConfigError(f"config.json quantization_config: quant_method {method!r} is not "
                          f"served (only 'fp8')")
    problems = []
    if qc.get("fmt", "e4m3") != "e4m3":
        problems.append(f"fmt {qc.get('fmt')!r} (only 'e4m3')")
    if list(qc.get("weight_block_size") or ()) != [BLOCK, BLOCK]:
        problems.append(f"weight_block_size {qc.get('weight_block_size')!r} "
                        f"(only [{BLOCK}, {BLOCK}])")
    if qc.get("activation_scheme", "dynamic") != "dynamic":
        problems.append(f"activation_scheme {qc.get('activation_scheme')!r} (only 'dynamic')")
    if problems:
        raise ConfigError("config.json quantization_config: FP8 with " + "; ".join(problems)
                          + " is not served")
    return "fp8"


def resolve_quantization(asked: str, hf_config: Mapping[str, Any], *,
                         deterministic: bool = False) -> str | None:
    """The quantization the engine runs: ``"fp8"`` or None (see the module docstring).

    :raises ConfigError: an FP8 checkpoint with ``quantization="none"``, a checkpoint
        quantized some other way, or FP8 with ``deterministic`` (the FP8 products, dense
        and experts, have no batch-invariant kernel).
    """
    stored = checkpoint_quantization(hf_config)
    if asked == "none" and stored is not None:
        raise ConfigError("quantization='none' cannot load this checkpoint: its config.json "
                          "says its weights are FP8 (quantization_config); use "
                          "quantization='fp8' or 'auto'")
    chosen = stored if asked == "auto" else (None if asked == "none" else asked)
    if chosen == "fp8" and deterministic:
        raise ConfigError("deterministic=True with quantization='fp8': the FP8 product has "
                          "no batch-invariant kernel; use quantization='none' with a bf16 "
                          "checkpoint for deterministic rollouts")
    return chosen


@contextlib.contextmanager
def building_with(quantization: str | None) -> Iterator[None]:
    """While a model is built inside this, its quantizable linears and its experts take
    ``quantization``'s storage (``layers/linear.py`` and ``layers/moe.py`` read
    :func:`building_quantization`)."""
    _BUILDING.append(quantization)
    try:
        yield
    finally:
        _BUILDING.pop()


def building_quantization() -> str | None:
    """The quantization of the model being built (None: none)."""
    return _BUILDING[-1]
