"""How the paged pools store keys and values: in the model's dtype, or float8 e4m3 with
a per-tensor scale (``kv_cache_dtype = "fp8"``).

An FP8 pool holds ``clamp(x / scale, -448, 448)`` rounded to e4m3 (round to nearest,
ties to even): the store quantizes, and every attention entry reads ``stored * scale``.
The scales are per tensor, one for keys and one for values, 1.0 as vLLM's are when a
checkpoint brings none. They divide nothing at run time: the kernels multiply by the
reciprocal (``inv_scale``) when they store, fold the key scale into the softmax scale
and multiply the output by the value scale, so an FP8 value reaches the products
exactly (e4m3 is a subset of bf16, fp16 and fp32).

No Triton import here: the plain-torch paths use it too.
"""

from __future__ import annotations

import attrs
import torch

#: the one FP8 format served: e4m3, finite only (torch's ``float8_e4m3fn``, Triton's
#: ``float8e4nv``)
FP8_DTYPE = torch.float8_e4m3fn
#: its largest finite magnitude; a stored value is clamped to it
FP8_MAX = float(torch.finfo(FP8_DTYPE).max)


def _float32(value: float) -> float:
    """``value`` rounded to float32: what a Triton kernel receives for a float argument,
    so the torch paths multiply by the very same number."""
    return float(torch.tensor(value, dtype=torch.float32))


@attrs.frozen(kw_only=True)
class KVFormat:
    """The pools' storage dtype and the per-tensor scales of keys and values."""

    #: what a pool element is: the model's dtype, or :data:`FP8_DTYPE`
    dtype: torch.dtype
    #: a stored key times this is the key (1.0 unless quantized)
    k_scale: float = attrs.field(default=1.0, converter=_float32)
    v_scale: float = attrs.field(default=1.0, converter=_float32)  #: likewise, values

    def __attrs_post_init__(self) -> None:
        for name in ("k_scale", "v_scale"):
            value = getattr(self, name)
            if not (value > 0 and value != float("inf")):
                raise ValueError(f"{name} must be a positive finite number, got {value}")

    @classmethod
    def for_cache_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
        """The format ``context.kv_cache_dtype`` names: ``"auto"`` the model's dtype,
        ``"fp8"`` e4m3 with scales 1.0."""
        if kv_cache_dtype == "auto":
            return cls(dtype=model_dtype)
        if kv_cache_dtype == "fp8":
            return cls(dtype=FP8_DTYPE)
        raise ValueError(f"paged stores keys and values as 'auto' or 'fp8', not {kv_cache_dtype!r}")

    @property
    def quantized(self) -> bool:
        """Whether the pools hold FP8 (the store quantizes, the reads scale)."""
        return self.dtype == FP8_DTYPE


def is_fp8(cache: torch.Tensor) -> bool:
    """Whether ``cache`` holds FP8 values: the store quantizes into it."""
    return cache.dtype == FP8_DTYPE


def quantize_fp8(x: torch.Tensor, inv_scale: float) -> torch.Tensor:
    """``x`` as an FP8 pool stores it: ``x * inv_scale`` in float32, clamped to
    ``±FP8_MAX``, rounded to e4m3 (the torch store's rule; the Triton store's is the same)."""
    return (x.float() * inv_scale).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
