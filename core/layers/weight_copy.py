"""Copying a checkpoint or trainer tensor into a parameter, fast from pageable memory.

A trainer's host tensors and a safetensors file's mmap are pageable memory. A plain
``param.copy_(host)`` copies those through the driver's own small staging buffer,
one tensor at a time and waiting for each: 4-7 GB/s on an H200 host, against about
55 GB/s from pinned memory. :func:`copy_weight_` instead copies the tensor in chunks
into pinned buffers (the host copy runs on torch's CPU threads and casts to the
parameter's dtype, as the plain copy would) and sends each chunk without waiting,
so one chunk's transfer overlaps the next chunk's host copy.

The pinned buffers come from torch's caching host allocator, which records the
transfer that reads a buffer and hands the buffer out again only once it is done:
a buffer dropped here is never overwritten while its bytes are still in flight.
The caller's tensor is read in full before :func:`copy_weight_` returns, so the
caller may change or free it at once.
"""

from __future__ import annotations

from collections.abc import Callable

import torch

#: bytes per staged chunk: large enough for the transfer to stream, small enough
#: that the next chunk's host copy overlaps it
STAGE_CHUNK_BYTES = 32 << 20
#: smaller tensors copy directly (a staging round costs more than it saves)
STAGE_MIN_BYTES = 1 << 20

_FP8 = (torch.float8_e4m3fn, torch.float8_e5m2)

#: ``(shape, dtype) -> host tensor`` a chunk is staged in
Stager = Callable[[torch.Size, torch.dtype], torch.Tensor]


def _pinned(shape: torch.Size, dtype: torch.dtype) -> torch.Tensor:
    return torch.empty(shape, dtype=dtype, pin_memory=True)


def needs_staging(dst: torch.Tensor, src: torch.Tensor) -> bool:
    """Whether ``src`` is pageable host memory big enough to stage on its way to CUDA."""
    return (
        dst.is_cuda
        and src.device.type == "cpu"
        and dst.dim() > 0
        and dst.numel() * dst.element_size() >= STAGE_MIN_BYTES
        and not src.is_pinned()
    )


def copy_weight_(dst: torch.Tensor, src: torch.Tensor, *, what: str = "") -> None:
    """``dst.copy_(src)`` for loading weights: the same values (cast on the host, as
    ``copy_`` does), staged through pinned memory when ``src`` is pageable host
    memory and ``dst`` is on CUDA. Shapes must match (no broadcasting); ``what``
    names the weight in the error."""
    prefix = f"{what}: " if what else ""
    if dst.shape != src.shape:
        raise ValueError(f"{prefix}expected shape {tuple(dst.shape)}, got {tuple(src.shape)}")
    if src.dtype in _FP8 and dst.dtype not in _FP8 and dst.is_floating_point():
        # an FP8 tensor means nothing without its block scales: refuse a silent cast
        raise ValueError(f"{prefix}an FP8 ({src.dtype}) tensor loads only into FP8 weights "
                         f"(quantization='fp8'); this parameter is {dst.dtype}")
    with torch.no_grad():
        if needs_staging(dst, src):
            staged_copy_(dst, src, stage=_pinned, chunk_bytes=STAGE_CHUNK_BYTES)
        else:
            dst.copy_(src)


def staged_copy_(
    dst: torch.Tensor, src: torch.Tensor, *, stage: Stager, chunk_bytes: int
) -> None:
    """Copy ``src`` into ``dst`` in chunks of whole rows (dim 0), each through a
    buffer from ``stage`` in ``dst``'s dtype; at least one row per chunk."""
    row_bytes = max(1, dst[0].numel() * dst.element_size())
    rows_per_chunk = max(1, chunk_bytes // row_bytes)
    for start in range(0, dst.shape[0], rows_per_chunk):
        part = src[start : start + rows_per_chunk]
        buffer = stage(part.shape, dst.dtype)
        buffer.copy_(part)  # the host's copy and cast, on torch's CPU threads
        dst[start : start + rows_per_chunk].copy_(buffer, non_blocking=True)
