"""vLLM's packed broadcast over a weight-update group: many tensors per broadcast.

vLLM's NCCL weight transfer with ``packed: true`` (``packed_nccl_broadcast_producer``
and ``..._consumer`` in ``vllm/distributed/weight_transfer/packed_tensor.py``) sends
the announced tensors in order as flat ``uint8`` chunks: each tensor's bytes are
appended to the chunk, and the chunk is broadcast as soon as its size passes
``buffer_bytes`` (so a chunk holds at least one tensor and may pass the limit by its
last one), the rest as one last chunk. Both sides derive the chunks from the
announced names, dtypes and shapes and the same ``buffer_bytes``, so nothing but the
bytes travels. ``num_buffers`` only sets how many chunks vLLM keeps in flight on its
CUDA streams; the chunks and their order do not depend on it.
"""

from __future__ import annotations

import math

import attrs
import torch

from kvrunner.models.weight_specs import TensorSpec
from kvrunner.weight_sync.layout import DTYPES

#: vLLM's defaults (``DEFAULT_PACKED_BUFFER_SIZE_BYTES``, ``DEFAULT_PACKED_NUM_BUFFERS``)
DEFAULT_PACKED_BUFFER_BYTES = 1024 * 1024 * 1024
DEFAULT_PACKED_NUM_BUFFERS = 2


@attrs.frozen
class PackedChunk:
    """One broadcast of a packed push: its tensors in order and their byte sizes."""

    specs: tuple[TensorSpec, ...]
    sizes: tuple[int, ...]

    @property
    def nbytes(self) -> int:
        return sum(self.sizes)

    def unpack(self, flat: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        """The chunk's tensors as views of the received ``uint8`` buffer ``flat`` (a
        copy where a tensor's bytes start off its dtype's alignment, as after a
        bfloat16 tensor of odd length in a mixed chunk)."""
        pairs = []
        for spec, part in zip(self.specs, flat.split(list(self.sizes)), strict=True):
            dtype = DTYPES[spec.dtype]
            if part.storage_offset() % dtype.itemsize:
                part = part.clone()
            pairs.append((spec.name, part.view(dtype).view(spec.shape)))
        return pairs


def packed_chunks(specs: list[TensorSpec], buffer_bytes: int) -> list[PackedChunk]:
    """The chunks vLLM's producer broadcasts for ``specs`` (dtypes among
    :data:`~kvrunner.weight_sync.layout.DTYPES`) with ``buffer_bytes``."""
    chunks: list[PackedChunk] = []
    specs_in: list[TensorSpec] = []
    sizes: list[int] = []
    total = 0
    for spec in specs:
        specs_in.append(spec)
        sizes.append(math.prod(spec.shape) * DTYPES[spec.dtype].itemsize)
        total += sizes[-1]
        if total > buffer_bytes:
            chunks.append(PackedChunk(tuple(specs_in), tuple(sizes)))
            specs_in, sizes, total = [], [], 0
    if specs_in:
        chunks.append(PackedChunk(tuple(specs_in), tuple(sizes)))
    return chunks
