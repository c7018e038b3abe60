"""What a backend's ``cache_write_targets`` answer must look like, checked at every call."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

from kvrunner.plugin_api.errors import BackendError
from kvrunner.plugin_api.step_data import CacheWriteTarget


def validate_write_targets(name: str, targets: Any) -> list[CacheWriteTarget]:
    """``targets`` checked (integer tensors, integer PAD, unique names) and stamped
    with ``name`` as their backend."""
    if not isinstance(targets, list):
        raise BackendError(f"backend {name!r}: cache_write_targets must return a list")
    owned: list[CacheWriteTarget] = []
    for t in targets:
        if not isinstance(t, CacheWriteTarget):
            raise BackendError(f"backend {name!r}: write target {t!r} is not a CacheWriteTarget")
        if t.backend not in ("", name):
            raise BackendError(
                f"backend {name!r}: write target {t.name!r} claims backend {t.backend!r}"
            )
        if (
            not isinstance(t.buffer, torch.Tensor)
            or t.buffer.dtype.is_floating_point
            or t.buffer.dtype.is_complex
            or t.buffer.dtype == torch.bool
        ):
            raise BackendError(
                f"backend {name!r}: write target {t.name!r} must be an integer tensor"
            )
        if not isinstance(t.pad_value, int) or isinstance(t.pad_value, bool):
            raise BackendError(
                f"backend {name!r}: write target {t.name!r} has non-integer PAD {t.pad_value!r}"
            )
        owned.append(attrs.evolve(t, backend=name))
    names = [t.name for t in owned]
    if len(set(names)) != len(names):
        raise BackendError(f"backend {name!r}: write target names repeat: {sorted(names)}")
    return owned


def require_fixed_names(
    name: str, targets: list[CacheWriteTarget], first_seen: dict[str, frozenset[str]]
) -> None:
    """Refuse an answer whose target names differ from ``name``'s first answer (kept in
    ``first_seen``): blanking and the audit rely on one fixed set."""
    names = frozenset(t.name for t in targets)
    first = first_seen.setdefault(name, names)
    if names != first:
        raise BackendError(
            f"backend {name!r}: cache_write_targets returned {sorted(names)}, "
            f"earlier {sorted(first)}; the set of write targets is fixed"
        )


@attrs.frozen
class TargetIdentity:
    """Which tensor a write target is: captured graphs and blanking hold it by address."""

    data_ptr: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    dtype: torch.dtype

    @classmethod
    def of(cls, buffer: torch.Tensor) -> TargetIdentity:
        return cls(buffer.data_ptr(), tuple(buffer.shape), buffer.stride(), buffer.dtype)


def require_fixed_identity(
    targets: Sequence[CacheWriteTarget], first_seen: dict[str, TargetIdentity]
) -> None:
    """Refuse a write target whose tensor is not the one its first answer gave (kept in
    ``first_seen`` by qualified name): a graph captured over the first reads it by
    address, and blanking the new one leaves the old one live."""
    for target in targets:
        now = TargetIdentity.of(target.buffer)
        first = first_seen.setdefault(target.qualified_name, now)
        if now != first:
            raise BackendError(
                f"backend {target.backend!r}: write target {target.name!r} is a new tensor "
                f"under an old name (address {first.data_ptr:#x}, shape {list(first.shape)} "
                f"first; now {now.data_ptr:#x}, shape {list(now.shape)}): captured graphs "
                f"and blanking hold the first by address, so refill it in place "
                f"(buffer.copy_ / fill_) instead of replacing it"
            )
