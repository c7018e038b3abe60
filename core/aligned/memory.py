"""Operands at the addresses the engine's own tensors have.

A CPU BLAS picks its code path by the operands' addresses as well as their shapes:
a transformers weight read from a safetensors file by mmap can start 56 bytes past a
64-byte boundary, and its ``[1, K] x [K, N]`` products then round differently from
the same product on the engine's weight (measured on the tiny Qwen3's ``o_proj``:
1.8e-7 apart on identical values). torch's allocators start every tensor on a
64-byte (CPU) or larger (CUDA) boundary, as every engine weight starts.
"""

from __future__ import annotations

import torch

#: the CPU allocator's alignment, which every engine weight has
ALIGNMENT = 64


def engine_layout(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself where it is contiguous and starts on a :data:`ALIGNMENT` boundary,
    else a fresh contiguous copy (which does)."""
    if t.is_contiguous() and t.data_ptr() % ALIGNMENT == 0:
        return t
    return t.clone(memory_format=torch.contiguous_format)
