"""What trainer-aligned mode needs, and the refusals of what breaks it.

A trainer's forward equals the engine's bit for bit only where both run the same
ops in the same order on the same numbers (``docs/aligned.md``):

* the engine in deterministic mode (``EngineConfig.deterministic``), on the paged
  backend (whose fixed-order attention the trainer runs too);
* one tensor-parallel size: the trainer's transformers model is unsharded, and an
  engine at TP > 1 sums its row-parallel products rank by rank, another order;
* one dtype, one kind of device (Triton kernels on CUDA, the torch paths on the CPU),
  and the engine's numerics switches (``fp32_lm_head``, ``fp32_router_logits``);
* a model the aligned forward knows: transformers' ``Qwen3ForCausalLM`` or
  ``Qwen3MoeForCausalLM`` with SiLU MLPs, plain rotary, full attention everywhere and
  no attention dropout.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from kvrunner.config import EngineConfig
from kvrunner.models.loader import rope_theta_of

#: transformers classes the aligned forward replaces the body of
SUPPORTED_CLASSES = ("Qwen3ForCausalLM", "Qwen3MoeForCausalLM")


class AlignmentError(ValueError):
    """A model, engine or input that trainer-aligned mode cannot make bitwise equal."""


def check_model(model: nn.Module) -> torch.dtype:
    """Refuse a model the aligned forward does not cover; the dtype of its weights."""
    name = type(model).__name__
    if name not in SUPPORTED_CLASSES or not type(model).__module__.startswith("transformers."):
        raise AlignmentError(f"align: {type(model).__module__}.{name} is not supported; "
                             f"transformers' {' or '.join(SUPPORTED_CLASSES)} are")
    config = model.config
    d: dict[str, Any] = config.to_dict()
    if d.get("hidden_act", "silu") != "silu":
        raise AlignmentError(f"align: hidden_act {d['hidden_act']!r} is not supported (silu)")
    if d.get("use_sliding_window"):
        raise AlignmentError("align: sliding-window attention is not supported")
    layer_types = set(d.get("layer_types") or ["full_attention"])
    if layer_types != {"full_attention"}:
        raise AlignmentError(f"align: layer types {sorted(layer_types)} are not supported "
                             "(full_attention only)")
    if d.get("attention_dropout", 0.0):
        raise AlignmentError(f"align: attention_dropout={d['attention_dropout']} would draw "
                             "random masks the engine never applies; set it to 0")
    if d.get("shared_expert_intermediate_size"):
        raise AlignmentError("align: shared experts are not supported")
    try:
        rope_theta_of(d)
    except ValueError as e:
        raise AlignmentError(f"align: {e}") from None
    if getattr(model.model, "gradient_checkpointing", False):
        raise AlignmentError("align: gradient checkpointing is not supported by the aligned "
                             "forward; disable it (model.gradient_checkpointing_disable())")
    dtypes = {p.dtype for p in model.parameters()}
    if len(dtypes) != 1:
        raise AlignmentError(f"align: the weights mix dtypes {sorted(map(str, dtypes))}; the "
                             "engine holds one")
    (dtype,) = dtypes
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise AlignmentError(f"align: weights in {dtype} are not supported")
    return dtype


def check_engine(engine: EngineConfig, model: nn.Module, dtype: torch.dtype) -> bool:
    """Refuse an engine whose numbers the trainer cannot reproduce; whether the
    engine's layers launch Triton (CUDA, or ``[kernels] triton_on_cpu``)."""
    from kvrunner.runner.setup import resolve_device, resolve_dtype

    if not engine.deterministic:
        raise AlignmentError("align: the engine is not deterministic; start it with "
                             "deterministic=True (its kernels follow the batch otherwise)")
    tp = engine.parallel.tensor_parallel_size
    if tp != 1:
        raise AlignmentError(f"align: the engine runs tensor_parallel_size={tp} and the "
                             "trainer's model is unsharded (1); a row-parallel product summed "
                             "rank by rank is another order of additions")
    if engine.backends.full_attention != "paged":
        raise AlignmentError(f"align: the engine's attention backend is "
                             f"{engine.backends.full_attention!r}; the aligned forward runs the "
                             "paged backend's fixed-order attention")
    device = resolve_device(engine.device)
    engine_dtype = resolve_dtype(engine.dtype, device, model.config.to_dict())
    if engine_dtype != dtype:
        raise AlignmentError(f"align: the engine computes in {engine_dtype} (dtype="
                             f"{engine.dtype!r} on {device.type}) and the trainer's weights "
                             f"are {dtype}")
    return device.type == "cuda" or engine.kernels.triton_on_cpu
