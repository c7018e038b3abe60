"""Helpers every op shares: block sizes, state-index checks and masks.

No Triton import here: the plain-torch paths use it too."""

from __future__ import annotations

import torch

#: tokens per chunk of the chunked prefill (the Triton kernel rounds it up to a power
#: of two >= 16)
DEFAULT_CHUNK = 64


def next_pow2(n: int) -> int:
    """Smallest power of two >= ``n`` (Triton block shapes must be powers of two)."""
    return 1 << max(int(n) - 1, 0).bit_length()


def dot_block(n: int) -> int:
    """A block size for a ``tl.dot`` operand: a power of two and at least 16 (GPU minimum)."""
    return max(16, next_pow2(n))


def check_indices(name: str, indices: torch.Tensor, rows: int) -> None:
    """State-index vectors are 1-D integer tensors with one entry per sequence."""
    if indices.dtype.is_floating_point or indices.dim() != 1 or indices.shape[0] != rows:
        raise ValueError(
            f"{name} must be a 1-D integer tensor with {rows} rows, "
            f"got {tuple(indices.shape)} {indices.dtype}"
        )


def valid_rows(read: torch.Tensor, write: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Host-side masks for the torch paths: rows that run, and rows that start from a state.

    A row runs only if its write index is >= 0 (PAD rows do nothing at all); it
    reads its initial state only if it runs and its read index is >= 0.
    """
    runs = write >= 0
    return runs, runs & (read >= 0)
