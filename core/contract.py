"""Data that crosses the boundary between the core and a backend plugin.

Everything a hook receives or returns is one of these typed, frozen classes (or a
plain tensor), so a backend written against API version ``PLUGIN_API_VERSION`` keeps
working as long as the version does not change.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import attrs
import torch

#: Version of the hook contract. A backend declares the version it was written
#: against (``plugin_api_version`` on its factory); a mismatch is refused at load.
#: 2: ``StepBatch`` carries block tables only as ``block_table_array``.
PLUGIN_API_VERSION = 2

#: Value written into every cache-write index buffer for rows that must not write.
#: Every kernel that writes cache through an index skips an index < 0.
PAD_SLOT_ID = -1


@attrs.frozen(kw_only=True)
class ModelSpec:
    """The model shapes a backend needs, already divided by tensor parallelism."""

    num_layers: int
    layer_types: tuple[str, ...]
    num_heads: int
    num_kv_heads: int
    head_dim: int
    # Gated-DeltaNet (linear attention) shapes; zero when the model has none.
    linear_num_key_heads: int = 0
    linear_num_value_heads: int = 0
    linear_key_head_dim: int = 0
    linear_value_head_dim: int = 0
    linear_conv_kernel_dim: int = 0

    def layers_of_type(self, layer_type: str) -> tuple[int, ...]:
        return tuple(i for i, t in enumerate(self.layer_types) if t == layer_type)


@attrs.frozen(kw_only=True)
class BackendContext:
    """What a backend is constructed with: who it is and which layers it serves."""

    name: str
    layers: tuple[int, ...]
    model: ModelSpec
    dtype: torch.dtype
    device: torch.device
    block_size: int
    max_num_seqs: int
    max_num_batched_tokens: int
    max_model_len: int
    use_triton: bool


@attrs.frozen(kw_only=True)
class CacheSpec:
    """Bytes one backend needs per KV block and per request slot, over all its layers.

    The runner sizes the pools from the sum over active backends:
    ``num_blocks = (budget - bytes_per_slot * num_slots) // bytes_per_block``.
    """

    backend: str
    bytes_per_block: int = 0
    bytes_per_slot: int = 0

    def __attrs_post_init__(self) -> None:
        if self.bytes_per_block < 0 or self.bytes_per_slot < 0:
            raise ValueError(f"backend {self.backend!r}: cache spec bytes must be >= 0")


@attrs.frozen(kw_only=True)
class CacheWriteTarget:
    """A buffer whose values tell a kernel *where* to write cache or state.

    Before every capture the core fills ``buffer`` with ``pad_value``; the backend's
    kernels skip that value, so a capture (which runs the model for real) writes
    nothing into a live cache row. ``buffer`` may live anywhere: in forward_vars or
    on the backend's own builder.
    """

    backend: str
    name: str
    buffer: torch.Tensor
    pad_value: int = PAD_SLOT_ID

    @property
    def qualified_name(self) -> str:
        return f"{self.backend}.{self.name}"


@attrs.frozen(kw_only=True)
class StepBatch:
    """One step's batch as backends see it when building metadata (host side).

    Sequences are in order; the token rows of sequence ``i`` are
    ``cu_query_lens[i]:cu_query_lens[i+1]``. Tensors are int32 on the CPU.
    ``num_padded_seqs`` >= ``num_seqs`` when a captured graph will replay with a
    padded tail; the backend must make the tail rows write nothing.
    """

    num_seqs: int
    num_tokens: int
    num_padded_seqs: int
    query_lens: torch.Tensor  # [num_seqs] new tokens this step
    start_positions: torch.Tensor  # [num_seqs] tokens already in cache before this step
    context_lens: torch.Tensor  # [num_seqs] start + query
    cu_query_lens: torch.Tensor  # [num_seqs + 1]
    #: every sequence's block table as one ``[num_seqs, longest]`` int32 tensor,
    #: zero-padded (block 0 is valid in any pool, so an unmasked read stays in bounds)
    block_table_array: torch.Tensor
    slot_mapping: torch.Tensor  # [num_tokens] physical KV slot per token
    state_slots: torch.Tensor  # [num_seqs] recurrent-state slot per sequence

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.num_seqs


def pad_block_tables(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """``tables`` as a ``StepBatch.block_table_array`` (for backends' own tests; the
    runner builds it vectorised in ``prepare_step``)."""
    out = torch.zeros(
        (len(tables), max((len(t) for t in tables), default=1) or 1), dtype=torch.int32
    )
    for row, table in enumerate(tables):
        out[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return out


@attrs.define
class ForwardContext:
    """Per-step metadata handed down the model: backend name -> that backend's metadata."""

    metadata: dict[str, Any] = attrs.field(factory=dict)

    def for_backend(self, name: str) -> Any:
        try:
            return self.metadata[name]
        except KeyError:
            raise RuntimeError(f"no metadata was built for backend {name!r} this step") from None
