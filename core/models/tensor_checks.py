"""Whether a tensor can be loaded into a floating-point parameter.

The one check of a pushed or loaded value, shared by the driver's push
(:mod:`kvrunner.rl.weight_push`), a rank's weight store and the IPC receiver: a
value that is not a tensor, is on the meta device (a shape without values), is not
floating point (an int, bool or complex tensor would be cast silently and wrongly),
or holds NaN or inf. :func:`dtype_problem` is the dtype part alone, for a tensor
known only by its header (a safetensors file, a pushed layout).
"""

from __future__ import annotations

from typing import Any

import torch
from torch.nn.utils import get_total_norm


def tensor_problem(value: Any, *, check_finite: bool) -> str | None:
    """Why ``value`` cannot be loaded into a floating-point parameter (None: it can).

    ``check_finite`` costs one reduction over the tensor (on its own device): its
    minimum and maximum, where NaN propagates to both and an infinity is one of them,
    with no tensor-sized temporary (a weight push may sit beside a trainer's memory)."""
    if not isinstance(value, torch.Tensor):
        return f"is a {type(value).__name__}, not a torch.Tensor"
    if value.is_meta:
        return "is on the meta device: it has a shape but no values to load"
    if not value.is_floating_point():
        return dtype_problem(str(value.dtype).removeprefix("torch."), floating=False)
    if check_finite and value.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        # no min/max for float8: its NaN (and e5m2's inf) bit patterns, counted
        return "holds NaN or inf values" if _float8_nonfinite(value) else None
    if check_finite and value.numel() and not bool(torch.isfinite(torch.stack(
        torch.aminmax(value))).all()):
        return "holds NaN or inf values"
    return None


def _float8_nonfinite(value: torch.Tensor) -> bool:
    bits = value.contiguous().view(torch.uint8)
    if value.dtype == torch.float8_e4m3fn:  # NaN: x111_1111, no infinity
        return bool(((bits & 0x7F) == 0x7F).any())
    return bool(((bits & 0x7C) == 0x7C).any())  # e5m2: an all-ones exponent


def all_finite(tensors: list[torch.Tensor]) -> bool:
    """Whether every value of ``tensors`` is finite, in one pass over all of them: the
    sum of their L1 norms (torch's multi-tensor norm, a few launches for the lot and
    one wait), which a NaN or an infinity anywhere makes non-finite. ``False`` may
    also mean finite values so large that their sum overflows: a caller naming the
    culprit then checks each tensor (:func:`tensor_problem`)."""
    if any(t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2) for t in tensors):
        return all(tensor_problem(t, check_finite=True) is None for t in tensors)
    tensors = [t for t in tensors if t.numel()]
    return not tensors or bool(torch.isfinite(get_total_norm(tensors, norm_type=1.0)))


def dtype_problem(dtype: str, *, floating: bool) -> str | None:
    """Why a tensor of ``dtype`` (its name, as torch or a safetensors header spells it)
    cannot be loaded into a floating-point parameter (None: it can)."""
    return None if floating else f"has dtype {dtype}; weights must be floating point"
