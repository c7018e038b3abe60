"""What a layer backend that declares ``supports_overlap`` promises about its metadata,
and the walk an overlap plugin uses to copy it.

An overlap plugin (``tbo``) cuts a step into parts and builds every layer backend's
metadata once per part, but each build overwrites the backend's own buffers. So it
keeps each part's metadata in copies of its own: it walks the metadata object a
backend returned and re-points every tensor in it at a buffer of the plugin. The
backend's layers must then read the part's values, which holds only if:

- everything a layer reads for a step, except the cache pools, is reachable from
  the metadata ``build_metadata`` / ``build_capture_metadata`` returned (a layer
  that reads a buffer through the backend object, ``self.backend.slot_mapping``,
  reads whichever part was built last);
- the tensors are reachable through containers :func:`map_tensors` walks: attrs
  classes, dataclasses, tuples (named ones too), lists and dicts. Any other object
  is passed through as it is, tensors inside it unmirrored; :func:`unwalked_tensors`
  names such places, and the conformance kit refuses them.

The pools are shared by every part (each writes its own rows), so a layer may keep
looking its pool up on the backend, as every backend does.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import attrs
import torch

#: ``fn(path, tensor) -> tensor``: ``path`` names the place in the metadata
#: (``"paged.slot_mapping"``, ``"gdn.steps[0]"``), stable from one step to the next
TensorMap = Callable[[str, torch.Tensor], torch.Tensor]


def map_tensors(value: object, fn: TensorMap, path: str = "") -> object:
    """``value`` with every tensor it holds, through the containers named in the
    module docstring, replaced by ``fn(path, tensor)``; other leaves are kept."""
    if isinstance(value, torch.Tensor):
        return fn(path, value)
    if attrs.has(type(value)):
        return attrs.evolve(value, **{  # type: ignore[misc]
            f.alias: map_tensors(getattr(value, f.name), fn, f"{path}.{f.name}")
            for f in attrs.fields(type(value)) if f.init
        })
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return dataclasses.replace(value, **{
            f.name: map_tensors(getattr(value, f.name), fn, f"{path}.{f.name}")
            for f in dataclasses.fields(value) if f.init
        })
    if isinstance(value, dict):
        return type(value)(
            (key, map_tensors(v, fn, f"{path}[{key!r}]")) for key, v in value.items()
        )
    if isinstance(value, tuple | list):
        items = [map_tensors(v, fn, f"{path}[{i}]") for i, v in enumerate(value)]
        if hasattr(type(value), "_fields"):  # a named tuple takes its fields positionally
            return type(value)(*items)
        return type(value)(items)
    return value


def unwalked_tensors(value: object, path: str = "") -> list[str]:
    """Places in ``value`` :func:`map_tensors` would not enter that hold tensors (an
    object's attributes, or an attrs / dataclass field outside ``__init__``), as
    ``"path: what"``; empty when every tensor is reachable."""
    found: list[str] = []

    def note(path: str, obj: object) -> None:
        if isinstance(obj, torch.Tensor):
            return
        if attrs.has(type(obj)):
            fields = attrs.fields(type(obj))
            children = {f.name: getattr(obj, f.name) for f in fields}
            hidden = [f.name for f in fields if not f.init]
        elif dataclasses.is_dataclass(obj) and not isinstance(obj, type):
            fields = dataclasses.fields(obj)
            children = {f.name: getattr(obj, f.name) for f in fields}
            hidden = [f.name for f in fields if not f.init]
        elif isinstance(obj, dict):
            for key, v in obj.items():
                note(f"{path}[{key!r}]", v)
            return
        elif isinstance(obj, tuple | list):
            for i, v in enumerate(obj):
                note(f"{path}[{i}]", v)
            return
        else:
            held = [k for k, v in getattr(obj, "__dict__", {}).items()
                    if isinstance(v, torch.Tensor)]
            if held:
                found.append(f"{path}: a {type(obj).__name__} holding tensors {held}")
            return
        for name in hidden:
            if isinstance(children[name], torch.Tensor):
                found.append(f"{path}.{name}: a field outside __init__")
        for name, child in children.items():
            if name not in hidden:
                note(f"{path}.{name}", child)

    note(path, value)
    return found
