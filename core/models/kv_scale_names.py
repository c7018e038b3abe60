"""FP8 KV-cache scales in checkpoints and weight updates: the names vLLM and SGLang read,
each routed to the attention layer's backend object that holds the scales.

A quantized checkpoint (ModelOpt, llm-compressor's ``kv_cache_scheme``, vLLM's own
exports) stores a layer's key and value scales beside its attention projections. They
are not parameters of the model: the backend keeps them with its cache (so a sleep
that discards the weights keeps them) and uses them only under ``kv_cache_dtype =
"fp8"``. So they are optional names: a checkpoint without them loads as before, and one
with them sets them wherever the layer's object can take them (``load_kv_scale``, the
:class:`~kvrunner.plugin_api.layers.KVScaleLoading` protocol).

A scale is one number (per tensor) or one per KV head of the model; each rank takes
its own heads' entries, as its projection takes its heads' rows.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import attrs
import torch

#: a name relative to an attention module -> which scales it sets ("k", "v")
KV_SCALE_NAMES: dict[str, tuple[str, ...]] = {
    "k_scale": ("k",),  # vLLM's and SGLang's ``self_attn.k_scale``
    "v_scale": ("v",),
    "attn.k_scale": ("k",),  # vLLM's module path (``self_attn.attn.k_scale``)
    "attn.v_scale": ("v",),
    "k_proj.k_scale": ("k",),  # ModelOpt
    "v_proj.v_scale": ("v",),
    "qkv_proj.k_scale": ("k",),
    "qkv_proj.v_scale": ("v",),
    "k_proj.output_scale": ("k",),  # compressed-tensors (llm-compressor's kv_cache_scheme)
    "v_proj.output_scale": ("v",),
    "kv_scale": ("k", "v"),  # the older single scale, for keys and values alike
}


def is_kv_scale_name(name: str) -> bool:
    """Whether a checkpoint tensor named ``name`` is a KV-cache scale (kept in float32
    as stored, not cast to the model's dtype: a scale rounded to bf16 moves every key)."""
    return any(name.endswith("." + suffix) for suffix in KV_SCALE_NAMES)


@attrs.frozen
class OptionalWeight:
    """A tensor a checkpoint may carry and the model does not require."""

    #: load it (raises ``ValueError`` naming the problem, loading nothing)
    load: Callable[[torch.Tensor], None]
    #: judge it by its shape alone (a dry run's meta tensors have no values)
    check: Callable[[torch.Tensor], None]
    #: the canonical names it sets, relative to its module: two names setting one of
    #: them in one update are the same tensor given twice
    covers: tuple[str, ...]


def kv_scale_weights(impl: Any, *, total_kv_heads: int, kv_shard: int,
                     local_kv_heads: int) -> dict[str, OptionalWeight]:
    """The optional KV-scale names of one attention module whose backend object is
    ``impl`` (none where it cannot take scales), relative to the module. This rank
    holds KV heads ``kv_shard * local_kv_heads`` onwards, ``local_kv_heads`` of them."""
    if not callable(getattr(impl, "load_kv_scale", None)):
        return {}

    def ours(scale: torch.Tensor) -> torch.Tensor:
        if scale.numel() == 1:
            return scale.reshape(())
        if tuple(scale.shape) != (total_kv_heads,):
            raise ValueError(f"a KV scale is one number or one per KV head ({total_kv_heads}), "
                             f"got shape {tuple(scale.shape)}")
        first = kv_shard * local_kv_heads
        return scale[first : first + local_kv_heads]

    def entry(which: tuple[str, ...]) -> OptionalWeight:
        def load(scale: torch.Tensor) -> None:
            mine = ours(scale)
            for w in which:  # judged whole before either is set
                impl.check_kv_scale(w, mine)
            for w in which:
                impl.load_kv_scale(w, mine)

        def check(scale: torch.Tensor) -> None:
            for w in which:
                impl.check_kv_scale(w, ours(scale))

        return OptionalWeight(load=load, check=check, covers=tuple(f"{w}_scale" for w in which))

    return {name: entry(which) for name, which in KV_SCALE_NAMES.items()}
