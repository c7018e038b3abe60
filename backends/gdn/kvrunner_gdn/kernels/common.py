"""Small helpers shared by the kernel launchers (argument checks, block sizes).

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


def check_heads(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                beta: torch.Tensor, state: torch.Tensor) -> None:
    """Shapes shared by both recurrences: q/k ``[T, Hk, K]``, v ``[T, Hv, V]``, g/beta
    ``[T, Hv]``, an fp32 contiguous pool ``[N, Hv, K, V]``; unit last-dim strides."""
    rows, num_k_heads, head_k = k.shape
    num_v_heads, head_v = v.shape[1:]
    if q.shape != k.shape or v.shape[0] != rows or g.shape != (rows, num_v_heads):
        raise ValueError(f"bad shapes q {q.shape} k {k.shape} v {v.shape} g {g.shape}")
    if beta.shape != g.shape or num_v_heads % num_k_heads:
        raise ValueError(f"beta {beta.shape} must match g; Hv must be a multiple of Hk")
    if state.shape[1:] != (num_v_heads, head_k, head_v) or state.dtype != torch.float32:
        raise ValueError(f"state pool {tuple(state.shape)} {state.dtype} does not match heads")
    if q.stride(-1) != 1 or k.stride(-1) != 1 or v.stride(-1) != 1 or not state.is_contiguous():
        raise ValueError("q/k/v need a unit last-dim stride and the state pool must be contiguous")


def check_chunked_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                          beta: torch.Tensor, state: torch.Tensor, cu_seqlens: torch.Tensor,
                          read_indices: torch.Tensor, write_indices: torch.Tensor) -> int:
    """:func:`check_heads` plus one read and one write index per sequence of
    ``cu_seqlens``, for every chunked-prefill path; returns the number of sequences."""
    check_heads(q, k, v, g, beta, state)
    seqs = cu_seqlens.shape[0] - 1
    check_indices("read_indices", read_indices, seqs)
    check_indices("write_indices", write_indices, seqs)
    return seqs
