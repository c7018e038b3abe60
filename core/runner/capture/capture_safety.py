"""The capture-safety mechanisms: blanking write targets, seeding the others, the audit.

A capture runs the model for real (a warmup forward, then the captured one), so every
kernel that writes cache does write — wherever its index buffers point. Blanking
sets every declared write target to its PAD value first, so those writes are
skipped. The audit proves it: every pool's per-chunk checksums are taken before
and compared after; a backend that writes through a buffer it did not declare is
caught here. Checksums are computed on the pool's device (two int64 per 4 MiB
chunk), so the audit needs no copy of the pools and can stay on in production.

An undeclared write target that still holds its start-up value (zeros, or PAD)
writes nothing harmful at the first capture and would pass; only after serving does
it hold live rows. So before an audited capture every integer buffer the core can
reach that is *not* a declared write target is seeded with in-range row indices —
what a served batch leaves — and the very first capture catches it. That covers
the buffers a backend keeps on its own builder, outside forward_vars, too
(:meth:`~kvrunner.plugin_host.backend_manager.BackendManager.held_tensors`). What the
audit concludes from a changed pool, and its check of the capture's read side, are
:mod:`~kvrunner.runner.capture.capture_audit`'s.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence

import torch

from kvrunner.layers.fused.dispatch import use_triton
from kvrunner.plugin_api.errors import BackendError
from kvrunner.plugin_api.step_data import CacheWriteTarget

#: 4-byte words per checksum chunk (4 MiB)
CHUNK_WORDS = 1 << 20
#: words checksummed per operation: bounds the int64 temporaries to 2 x 64 MiB
GROUP_WORDS = 1 << 23


class CaptureAuditError(BackendError):
    """A capture broke the capture contract: it changed a cache/state pool, or its
    read side depends on what earlier steps left. The message names the backend and
    says which rule the evidence shows broken."""


def blank_write_targets(targets: Sequence[CacheWriteTarget], value: int | None = None) -> None:
    """Fill every declared write target with its PAD value (or ``value``), in place."""
    for target in targets:
        target.buffer.fill_(target.pad_value if value is None else value)


def seed_undeclared_index_buffers(
    buffers: Iterable[torch.Tensor], declared: Sequence[CacheWriteTarget], *, bound: int,
    offset: int = 0, exclude: Iterable[torch.Tensor] = (),
) -> list[torch.Tensor]:
    """Fill every integer buffer in ``buffers`` that is not a declared write target
    (nor shares storage with one in ``exclude``: the pools) with row indices
    ``offset, offset + 1, ...`` modulo ``bound`` (in range for any block, slot or
    state-slot index); returns the buffers seeded."""
    skip = {t.buffer.untyped_storage().data_ptr() for t in declared}
    skip |= {t.untyped_storage().data_ptr() for t in exclude}
    seeded = []
    for buffer in buffers:
        if buffer.is_floating_point() or buffer.is_complex() or buffer.dtype == torch.bool:
            continue
        if buffer.untyped_storage().data_ptr() in skip:
            continue
        rows = (torch.arange(buffer.numel(), device=buffer.device) + offset) % max(bound, 1)
        buffer.copy_(rows.view(buffer.shape).to(buffer.dtype))
        seeded.append(buffer)
    return seeded


def chunk_checksums(t: torch.Tensor) -> torch.Tensor:
    """``[num_chunks, 2]`` int64 per 4 MiB chunk of ``t``'s bytes: the sum of its
    32-bit words and their position-weighted sum (so a moved word counts too).

    Raw bits, so NaN == NaN and -0.0 != 0.0 as in memory; computed where ``t`` lives:
    one Triton kernel reading each byte once on CUDA, grouped torch ops elsewhere.
    """
    raw = t.detach().contiguous().reshape(-1).view(torch.uint8)
    words = raw.view(torch.int32) if raw.numel() % 4 == 0 else raw
    if use_triton(words):
        from kvrunner.runner.capture.checksum_triton import chunk_checksums_triton

        return chunk_checksums_triton(words, CHUNK_WORDS)
    n = words.numel()
    chunks = -(-n // CHUNK_WORDS)
    out = torch.empty((chunks, 2), dtype=torch.int64, device=t.device)
    weight = torch.arange(1, CHUNK_WORDS + 1, dtype=torch.int64, device=t.device)
    per_group = max(GROUP_WORDS // CHUNK_WORDS, 1)
    full = n // CHUNK_WORDS
    for first in range(0, full, per_group):
        last = min(first + per_group, full)
        block = words[first * CHUNK_WORDS : last * CHUNK_WORDS].view(last - first, CHUNK_WORDS)
        wide = block.to(torch.int64)
        out[first:last, 0] = wide.sum(dim=1)
        out[first:last, 1] = (wide * weight).sum(dim=1)
    if full < chunks:  # a partial last chunk
        tail = words[full * CHUNK_WORDS :].to(torch.int64)
        out[full, 0] = tail.sum()
        out[full, 1] = (tail * weight[: tail.numel()]).sum()
    return out


class PoolSnapshot:
    """Per-chunk checksums of every pool, to compare against after a capture."""

    def __init__(self, pools: Mapping[str, torch.Tensor]) -> None:
        self._pools = dict(pools)
        self._sums = {name: chunk_checksums(t) for name, t in pools.items()}

    def changed_pools(self) -> list[str]:
        return [
            name
            for name, pool in self._pools.items()
            if not torch.equal(chunk_checksums(pool), self._sums[name])
        ]

    def require_unchanged(
        self, *, batch_size: int, blanked: Sequence[CacheWriteTarget], evidence: str = "",
        culprit: str | None = None,
    ) -> None:
        """Raise :class:`CaptureAuditError` naming the backends whose pools changed (or
        ``culprit``, when the evidence blames another plugin); ``evidence`` says which
        rule the audit found broken (default: either)."""
        changed = self.changed_pools()
        if changed:
            owners = sorted({name.split(".", 1)[0] for name in changed})
            who = culprit or f"backend {', '.join(map(repr, owners))}"
            names = ", ".join(t.qualified_name for t in blanked) or "none"
            evidence = evidence or (
                "a kernel writes through a buffer its backend does not declare in "
                "cache_write_targets, or does not skip PAD rows (or blanking is off)"
            )
            raise CaptureAuditError(
                f"{who}: capture of batch size {batch_size} "
                f"wrote into cache pool(s) {changed}; write targets blanked before it: "
                f"{names}. {evidence}"
            )
