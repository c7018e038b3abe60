"""Where each tensor of a bucket lies in its flat buffer, and the checks a received
layout must pass before a byte of it is read.

A bucket is a flat byte buffer holding several tensors back to back, each at an
offset aligned to :data:`ALIGNMENT` bytes (so a view of any dtype is aligned). Its
:class:`BucketLayout` names every tensor with its dtype, shape and offset. The
sender plans layouts with :func:`plan_buckets`; the engine checks a layout it
received with :meth:`BucketLayout.check` against the buffer it points into, so a
malformed bucket is refused by name instead of read out of bounds.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Iterator

import attrs
import torch

from kvrunner.weight_sync.errors import WeightSyncError

#: every tensor starts at a multiple of this many bytes in its bucket
ALIGNMENT = 256

#: the dtypes a bucket may carry, by the names that travel (weights are floating point)
DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "float64": torch.float64,
}


def dtype_name(dtype: torch.dtype) -> str:
    """The wire name of ``dtype``; a dtype weights cannot have is refused."""
    name = str(dtype).removeprefix("torch.")
    if name not in DTYPES:
        raise WeightSyncError(
            f"dtype {name} cannot be pushed; weights travel as one of {sorted(DTYPES)}"
        )
    return name


def aligned(nbytes: int) -> int:
    return -(-nbytes // ALIGNMENT) * ALIGNMENT


@attrs.frozen
class TensorSlot:
    """One tensor of a bucket: its name, dtype (wire name), shape and byte offset."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int

    @property
    def nbytes(self) -> int:
        return math.prod(self.shape) * DTYPES[self.dtype].itemsize

    def check(self, buffer_bytes: int, *, where: str) -> int:
        """Raise :class:`WeightSyncError` naming the first fault of this slot in a
        buffer of ``buffer_bytes``: a field of the wrong type, an unknown dtype, a
        negative or misaligned offset, bytes past the end. Returns the slot's end
        offset. ``where`` names the bucket or message the slot came in."""
        if not isinstance(self.name, str) or not self.name:
            raise WeightSyncError(f"{where}: a tensor's name must be a non-empty string, "
                                  f"got {self.name!r:.80}")
        what = f"{where}, tensor {self.name!r}"
        if self.dtype not in DTYPES:
            raise WeightSyncError(f"{what}: dtype {self.dtype!r} is not one of "
                                  f"{sorted(DTYPES)}")
        if not (isinstance(self.shape, tuple)
                and all(isinstance(d, int) and d >= 0 for d in self.shape)):
            raise WeightSyncError(f"{what}: shape {self.shape!r} is not a tuple of "
                                  f"non-negative ints")
        itemsize = DTYPES[self.dtype].itemsize
        if not isinstance(self.offset, int) or self.offset < 0 or self.offset % itemsize:
            raise WeightSyncError(f"{what}: offset {self.offset!r} is not a non-negative "
                                  f"multiple of {itemsize}")
        end = self.offset + self.nbytes
        if end > buffer_bytes:
            raise WeightSyncError(f"{what}: bytes {self.offset}..{end} run past the end "
                                  f"of the {buffer_bytes}-byte buffer")
        return end

    def view(self, flat: torch.Tensor) -> torch.Tensor:
        """This slot's tensor in the flat uint8 ``flat`` (checked first)."""
        part = flat[self.offset : self.offset + self.nbytes]
        return part.view(DTYPES[self.dtype]).view(self.shape)


@attrs.frozen
class BucketLayout:
    """The tensors of one bucket, in the order they were packed."""

    slots: tuple[TensorSlot, ...]

    @property
    def nbytes(self) -> int:
        """Bytes the bucket uses (to the end of its last tensor)."""
        return max((s.offset + s.nbytes for s in self.slots), default=0)

    def check(self, buffer_bytes: int, *, where: str) -> None:
        """Raise :class:`WeightSyncError` naming the first fault: a field of the wrong
        type, an unknown dtype, a negative or misaligned offset, a tensor past the
        end of the buffer, or two tensors that overlap. ``where`` names the bucket."""
        if not isinstance(self.slots, tuple):
            raise WeightSyncError(f"{where}: slots must be a tuple of TensorSlot")
        spans = []
        for i, slot in enumerate(self.slots):
            if not isinstance(slot, TensorSlot):
                raise WeightSyncError(f"{where}, tensor {i} is a {type(slot).__name__}, not a "
                                      f"TensorSlot")
            end = slot.check(buffer_bytes, where=where)
            spans.append((slot.offset, end, slot.name))
        spans.sort()
        for (_, end, first), (start, _, second) in zip(spans, spans[1:], strict=False):
            if start < end:
                raise WeightSyncError(f"{where}: tensors {first!r} and {second!r} overlap")

    def views(self, buffer: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """``(name, tensor)`` views into the flat uint8 ``buffer`` (checked first)."""
        return [(slot.name, slot.view(buffer)) for slot in self.slots]


def plan_buckets(
    tensors: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[TensorSlot, torch.Tensor]]]:
    """Group ``(name, tensor)`` pairs, in order, into buckets of at most
    ``bucket_bytes`` (each tensor at an aligned offset); lazily, one bucket at a time.
    A tensor larger than a bucket is refused (:class:`WeightSyncError` naming it)."""
    bucket: list[tuple[TensorSlot, torch.Tensor]] = []
    used = 0
    for name, tensor in tensors:
        slot = TensorSlot(name, dtype_name(tensor.dtype), tuple(tensor.shape), 0)
        if slot.nbytes > bucket_bytes:
            raise WeightSyncError(
                f"tensor {name!r} ({slot.nbytes} bytes) does not fit a bucket of "
                f"{bucket_bytes} bytes; raise bucket_bytes"
            )
        if bucket and aligned(used) + slot.nbytes > bucket_bytes:
            yield bucket
            bucket, used = [], 0
        slot = attrs.evolve(slot, offset=aligned(used))
        bucket.append((slot, tensor))
        used = slot.offset + slot.nbytes
    if bucket:
        yield bucket
