"""How the paged pools store keys and values: in the model's dtype, or float8 e4m3
scaled per layer (``kv_cache_dtype = "fp8"``).

An FP8 pool holds ``clamp(x / scale, -448, 448)`` rounded to e4m3 (round to nearest,
ties to even): the store quantizes, and every attention entry reads ``stored * scale``.
Each layer has a key scale and a value scale per KV head (a per-tensor scale is the
same number on every head); where they come from is :mod:`.kv_scales`. They divide
nothing at run time: a layer's :func:`scale_table` holds each scale beside its float32
reciprocal, the kernels multiply by the reciprocal when they store, fold the key scale
into the softmax scale and multiply the output by the value scale, so an FP8 value
reaches the products exactly (e4m3 is a subset of bf16, fp16 and fp32).

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

#: rows of a layer's scale table (``[4, num_kv_heads]`` float32): the key scales, the
#: value scales, and their reciprocals, which the stores multiply by
K_SCALE, V_SCALE, K_INV, V_INV = range(4)

#: a per-tensor scale, or one per KV head
Scale = float | torch.Tensor


@attrs.frozen(kw_only=True)
class KVFormat:
    """The pools' storage dtype."""

    #: what a pool element is: the model's dtype, or :data:`FP8_DTYPE`
    dtype: torch.dtype

    @classmethod
    def for_cache_dtype(cls, kv_cache_dtype: str, model_dtype: torch.dtype) -> KVFormat:
        """The format ``context.kv_cache_dtype`` names: ``"auto"`` the model's dtype,
        ``"fp8"`` e4m3."""
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


def checked_scale(scale: Scale, num_kv_heads: int, what: str) -> torch.Tensor:
    """``scale`` as ``[num_kv_heads]`` float32 on the CPU: a number or a one-element
    tensor (per tensor) repeated on every head, or one per head. Raises ``ValueError``
    naming ``what`` for another shape or a value that is not positive and finite."""
    t = torch.as_tensor(scale, dtype=torch.float32).detach().cpu()
    if t.numel() == 1:
        t = t.reshape(1).expand(num_kv_heads)
    elif t.shape != (num_kv_heads,):
        raise ValueError(f"{what} must be one number or one per KV head ({num_kv_heads}), "
                         f"got shape {tuple(t.shape)}")
    if not (torch.isfinite(t) & (t > 0)).all():
        raise ValueError(f"{what} must be positive and finite, got {t.tolist()}")
    return t.contiguous()


def scale_table(k_scale: Scale, v_scale: Scale, num_kv_heads: int,
                device: torch.device | str = "cpu") -> torch.Tensor:
    """A layer's ``[4, num_kv_heads]`` float32 table (rows :data:`K_SCALE`,
    :data:`V_SCALE`, :data:`K_INV`, :data:`V_INV`) for these scales."""
    k = checked_scale(k_scale, num_kv_heads, "k_scale")
    v = checked_scale(v_scale, num_kv_heads, "v_scale")
    return torch.stack([k, v, k.reciprocal(), v.reciprocal()]).to(device)


def quantize_fp8(x: torch.Tensor, inv_scale: torch.Tensor) -> torch.Tensor:
    """``x`` (``[..., num_kv_heads, dim]``) as an FP8 pool stores it: ``x * inv_scale``
    (``[num_kv_heads]``, per head) in float32, clamped to ``±FP8_MAX``, rounded to e4m3
    (the torch store's rule; the Triton store's is the same)."""
    return (x.float() * inv_scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8_DTYPE)
