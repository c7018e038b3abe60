"""Decode-sized all-reduces through torch symmetric memory (CUDA, one host).

Each decode step of a tensor-parallel model runs two all-reduces per layer on a
few hundred KiB. NCCL spends ~18-38 µs on each of those inside a CUDA graph on two
NVLink'd H200s; torch's symmetric-memory kernels, which read the peer's buffer
directly, take ~9-20 µs (``docs/benchmarks.md``). So tensors up to
:data:`MAX_BYTES` are copied into a buffer every rank mapped at start-up and
reduced there; larger ones (prefill chunks) and anything else stay on NCCL, where
bandwidth, not latency, decides.

Setting up is a collective: every rank first says whether it *can* (CUDA, one host,
peer access, the torch operators present), and only if all can do they allocate and
exchange buffers; then they agree once more. Either every rank uses it or none does.
"""

from __future__ import annotations

import socket
import zlib
from collections.abc import Callable

import torch

#: largest tensor reduced through symmetric memory; above it NCCL is as fast or faster
MAX_BYTES = 8 << 20
#: at or below this the one-shot kernel (each rank reads every peer) is the faster one;
#: above it the two-shot (reduce-scatter then all-gather) is (measured on 2 H200s)
ONE_SHOT_MAX_BYTES = 256 << 10


class SymmetricAllReduce:
    """Sums a small contiguous tensor over the group through a symmetric buffer."""

    def __init__(self, buffer: torch.Tensor, group_name: str) -> None:
        self.buffer = buffer  # flat, this rank's part of the symmetric allocation
        self.group_name = group_name

    def fits(self, x: torch.Tensor) -> bool:
        return (
            x.dtype == self.buffer.dtype
            and x.device == self.buffer.device
            and x.is_contiguous()
            and x.numel() <= self.buffer.numel()
            and (x.numel() * x.element_size()) % 4 == 0  # the kernels' least alignment
        )

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        """``x`` summed over the group, written back into ``x``."""
        staged = self.buffer[: x.numel()]
        staged.copy_(x.view(-1))
        if x.numel() * x.element_size() <= ONE_SHOT_MAX_BYTES:
            out = x.view(-1)
            torch.ops.symm_mem.one_shot_all_reduce_out(staged, "sum", self.group_name, out=out)
        else:
            torch.ops.symm_mem.two_shot_all_reduce_(staged, "sum", self.group_name)
            x.view(-1).copy_(staged)
        return x


#: the dtypes torch's symmetric-memory all-reduce kernels are built for
SUPPORTED_DTYPES = (torch.bfloat16, torch.float32)


def why_unavailable(
    device: torch.device, dtype: torch.dtype, peer_devices: list[int]
) -> str | None:
    """Why this rank cannot use symmetric memory, or ``None`` if it can."""
    if device.type != "cuda":
        return f"device {device} is not CUDA"
    if dtype not in SUPPORTED_DTYPES:
        return f"its all-reduce kernels take bfloat16 and float32, not {dtype}"
    try:
        import torch.distributed._symmetric_memory  # noqa: F401

        torch.ops.symm_mem.one_shot_all_reduce_out  # noqa: B018 - present in this build?
        torch.ops.symm_mem.two_shot_all_reduce_  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as e:
        return f"this torch has no symmetric-memory all-reduce ({e})"
    own = device.index if device.index is not None else torch.cuda.current_device()
    for peer in peer_devices:
        if peer < 0:
            return "a peer rank is not on a CUDA device"
        if peer != own and not torch.cuda.can_device_access_peer(own, peer):
            return f"cuda:{own} cannot access peer cuda:{peer}"
    return None


def host_id() -> int:
    """A number equal on ranks of one host (symmetric memory does not span hosts)."""
    return zlib.crc32(socket.gethostname().encode())


def setup(
    *,
    device: torch.device,
    dtype: torch.dtype,
    group_name: str,
    gather_ints: Callable[[int], list[int]],
) -> tuple[SymmetricAllReduce | None, str]:
    """Collective: a :class:`SymmetricAllReduce` on every rank, or on none.

    Returns it (or ``None``) and a line saying why it is or is not used.
    """
    hosts = gather_ints(host_id())
    own_index = device.index if device.type == "cuda" and device.index is not None else -1
    devices = gather_ints(own_index)
    reason = why_unavailable(device, dtype, devices)
    if reason is None and len(set(hosts)) > 1:
        reason = "the ranks span more than one host"
    refusals = gather_ints(0 if reason is None else 1)
    if any(refusals):
        refusing = [r for r, refused in enumerate(refusals) if refused]
        return None, f"ranks {refusing} cannot use symmetric memory" + (
            f" (this rank: {reason})" if reason is not None else ""
        )
    import torch.distributed._symmetric_memory as symm_mem

    made: SymmetricAllReduce | None = None
    try:
        buffer = symm_mem.empty(
            MAX_BYTES // torch.empty((), dtype=dtype).element_size(), dtype=dtype, device=device
        )
        symm_mem.rendezvous(buffer, group_name)
        made = SymmetricAllReduce(buffer, group_name)
        failed = 0
    except RuntimeError as e:
        reason, failed = f"allocation failed: {e}", 1
    failures = gather_ints(failed)
    if any(failures):
        failing = [r for r, failed in enumerate(failures) if failed]
        return None, f"ranks {failing} could not set up symmetric memory" + (
            f" (this rank: {reason})" if reason else ""
        )
    return made, f"symmetric memory up to {MAX_BYTES >> 20} MiB a tensor, NCCL above"
