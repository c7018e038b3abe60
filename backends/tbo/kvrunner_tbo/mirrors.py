"""Per-part copies of the layer backends' metadata buffers, owned by this plugin.

A layer backend fills *its* buffers for one step at a time; two parts need two
copies that both outlive the step (a graph replays them by address). So every
tensor in a backend's metadata is re-pointed at a mirror: a buffer of this plugin
with the layout of the backend's buffer (same size, same view offsets), one per
part. Tensors that already belong to the part (the read side the core or this
plugin built for it) are kept as they are.

The mirror of a declared write target is itself a write target: it is made when
the plugin is set up, PAD-filled, and declared in ``cache_write_targets``, so the
core blanks it before every capture. At a capture it is never copied into: it stays
as the core blanked it, exactly as the contract asks of a backend's own write side.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch

from kvrunner.plugin_api import CacheWriteTarget, ForwardContext, map_tensors

PARTS = 2


def _storage_key(t: torch.Tensor) -> int:
    return t.untyped_storage().data_ptr()


def _whole_storage_like(t: torch.Tensor, fill: int | None = None) -> torch.Tensor:
    """A flat tensor as large as ``t``'s whole storage, in ``t``'s dtype and device."""
    numel = t.untyped_storage().nbytes() // t.element_size()
    if fill is None:
        return torch.zeros((numel,), dtype=t.dtype, device=t.device)
    return torch.full((numel,), fill, dtype=t.dtype, device=t.device)


class Mirrors:
    """Every part's mirrors, the write-target ones made up front."""

    def __init__(self, layer_write_targets: Iterable[CacheWriteTarget]) -> None:
        #: (part, storage of the layer backend's buffer) -> (mirror, declared name, PAD)
        self._write: dict[tuple[int, int], tuple[torch.Tensor, str, int]] = {}
        self._targets: list[CacheWriteTarget] = []
        for part in range(PARTS):
            for target in layer_write_targets:
                mirror = _whole_storage_like(target.buffer, target.pad_value)
                name = f"part{part}.{target.backend}.{target.name}"
                self._write[(part, _storage_key(target.buffer))] = (
                    mirror, name, target.pad_value
                )
                self._targets.append(
                    CacheWriteTarget(name=name, buffer=mirror, pad_value=target.pad_value)
                )
        #: (part, place in the metadata) -> mirror, for the read side, made when first seen
        self._read: dict[tuple[int, str], torch.Tensor] = {}

    def buffers(self) -> dict[str, torch.Tensor]:
        """The write-target mirrors by name (persistent buffers of the plugin)."""
        return {name: mirror for mirror, name, _ in self._write.values()}

    def write_targets(self) -> list[CacheWriteTarget]:
        return list(self._targets)

    def relocate(
        self, part: int, ctx: ForwardContext, own: Iterable[torch.Tensor], *, capture: bool
    ) -> ForwardContext:
        """``ctx`` with every tensor not in ``own`` (the part's own read side) replaced
        by this part's mirror of it, holding the same values; at a capture the write
        targets' mirrors are left untouched."""
        keep = {_storage_key(t) for t in own}
        return ForwardContext(metadata={
            name: self._relocate(part, name, value, keep, capture)
            for name, value in ctx.metadata.items()
        })

    def _relocate(
        self, part: int, path: str, value: object, keep: set[int], capture: bool
    ) -> object:
        """``value`` re-pointed at mirrors; ``path`` names where it sits in the metadata.
        The walk is the plugin API's (:func:`kvrunner.plugin_api.map_tensors`): the
        containers it enters are what a backend declaring ``supports_overlap`` keeps
        its tensors in."""

        def mirror(place: str, tensor: torch.Tensor) -> torch.Tensor:
            key = _storage_key(tensor)
            if key in keep:
                return tensor
            written = self._write.get((part, key))
            if written is None:
                read = self._read_mirror(part, place, tensor)
                view = read.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
                view.copy_(tensor)
                return view
            target, _, pad = written
            view = target.as_strided(tensor.shape, tensor.stride(), tensor.storage_offset())
            if not capture:
                # Every row this part does not use holds PAD, whatever a larger step
                # left there: what no kernel should write through, none can.
                target.fill_(pad)
                view.copy_(tensor)
            return view

        return map_tensors(value, mirror, path)

    def _read_mirror(self, part: int, path: str, like: torch.Tensor) -> torch.Tensor:
        """The part's mirror for the read-side tensor at ``path``, made on first use
        (keyed by place, not storage, so a backend's temporaries do not pile up)."""
        mirror = self._read.get((part, path))
        too_small = mirror is not None and (
            mirror.dtype != like.dtype
            or mirror.numel() * mirror.element_size() < like.untyped_storage().nbytes()
        )
        if mirror is None or too_small:
            # Decode buffers are first seen at the first capture, so a graph never reads
            # a read-side mirror that is replaced later.
            mirror = _whole_storage_like(like)
            self._read[(part, path)] = mirror
        return mirror
