"""The tensors an object holds, found by walking its attributes: what the capture audit
seeds on a backend's builder, and what it compares in a capture's metadata.

A backend may keep index buffers that are not in forward_vars (on its metadata
builder, typically), and a capture's metadata is an opaque object of the backend's
own. Both are walked the same way: attributes (``__dict__``, attrs and dataclass
fields), mapping values and sequence items, to a bounded depth, each tensor once,
named by its path. Modules and parameters are never entered: weights are not
buffers, and a walk must never reach them.
"""

from __future__ import annotations

import dataclasses
import functools
import inspect
from collections.abc import Mapping
from typing import Any

import attrs
import torch

#: leaves a walk never enters
_ATOMS = (str, bytes, int, float, complex, bool, type(None), torch.dtype, torch.device, slice)


def held_tensors(obj: Any, *, depth: int) -> dict[str, torch.Tensor]:
    """Every tensor reachable from ``obj`` within ``depth`` object levels, by path
    (``"builder.slot_mapping"``, ``"metadata.paged.block_tables"``, ``"parts[0]"``).

    Containers (mappings, lists, tuples) do not count as a level; an object whose
    attributes are walked does. Parameters, modules, classes and callables are skipped.
    """
    found: dict[str, torch.Tensor] = {}
    _walk(obj, "", depth, found, seen=set())
    return found


def _walk(obj: Any, path: str, depth: int, found: dict[str, torch.Tensor], seen: set[int]) -> None:
    if isinstance(obj, torch.nn.Parameter | torch.nn.Module) or id(obj) in seen:
        return
    if isinstance(obj, torch.Tensor):
        found.setdefault(path, obj)
        return
    if isinstance(obj, (*_ATOMS, type, functools.partial)) or inspect.isroutine(obj):
        return
    seen.add(id(obj))
    if isinstance(obj, Mapping):
        for key, value in obj.items():
            _walk(value, _join(path, str(key)), depth, found, seen)
        return
    if isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            _walk(value, f"{path}[{i}]", depth, found, seen)
        return
    if depth <= 0:
        return
    for name, value in _fields(obj):
        _walk(value, _join(path, name), depth - 1, found, seen)


def _fields(obj: Any) -> list[tuple[str, Any]]:
    if attrs.has(type(obj)):
        return [(f.name, getattr(obj, f.name, None)) for f in attrs.fields(type(obj))]
    if dataclasses.is_dataclass(obj):
        return [(f.name, getattr(obj, f.name, None)) for f in dataclasses.fields(obj)]
    return list(getattr(obj, "__dict__", {}).items())


def _join(path: str, name: str) -> str:
    return f"{path}.{name}" if path else name
