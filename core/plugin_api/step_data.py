"""Data that crosses the boundary between the core and a backend plugin.

Everything the core hands a hook is one of these typed classes (or a plain
tensor), so a backend written against API version ``PLUGIN_API_VERSION`` keeps
working as long as the version does not change. docs/plugins.md documents every
field; a test checks the two agree.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, TypeVar

import attrs
import torch

#: Version of the hook contract. A backend declares the version it was written
#: against (``plugin_api_version`` on its factory); a mismatch is refused at load.
#: 2: ``StepBatch`` carries block tables only as ``block_table_array``.
#: 3: one declaration of write targets (the hook); hooks answer without their name;
#: the core builds the shared read side of a step once (:class:`StepMetadata`).
#: 4: the contract is one package, :mod:`kvrunner.plugin_api`; a layer backend
#: declares ``supports_overlap``.
#: 5: :class:`BackendContext` carries ``deterministic``; a layer backend declares
#: ``batch_invariant``.
#: 6: :class:`BackendContext` carries ``kv_cache_dtype``; a layer backend declares the
#: ``kv_cache_dtypes`` it accepts.
PLUGIN_API_VERSION = 6

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
    #: the engine's kernel choices addressed to this backend (``[kernels]`` fields named
    #: ``<backend>_<option>``, as ``{option: value}``); a backend reads the ones it knows
    options: Mapping[str, str] = attrs.field(factory=dict)
    #: the engine runs in deterministic mode: the backend's layers must compute every
    #: token row as they would with no other row in the step (only ever True for a
    #: backend whose factory declares ``batch_invariant``)
    deterministic: bool = False
    #: how full-attention keys and values are stored: "auto" (in ``dtype``) or "fp8"
    #: (float8 e4m3, one byte an element, scaled per layer); only ever a value the
    #: backend's factory lists in ``kv_cache_dtypes``
    kv_cache_dtype: str = "auto"
    #: with "fp8": set each layer's scales from its first real prefill (not the start-up
    #: profile's: ``StepMetadata.is_profile``) unless a checkpoint brought them, as
    #: vLLM's ``calculate_kv_scales``; else they stay 1.0 until a checkpoint sets them
    calculate_kv_scales: bool = False

    @property
    def max_blocks_per_seq(self) -> int:
        """Columns of :attr:`StepMetadata.block_tables`: blocks of the longest sequence."""
        return -(-self.max_model_len // self.block_size)


@attrs.frozen(kw_only=True)
class CacheSpec:
    """Bytes one backend needs per KV block and per request slot, over all its layers.

    The runner sizes the pools from the sum over active backends:
    ``num_blocks = (budget - bytes_per_slot * num_slots) // bytes_per_block``.
    """

    #: bytes of one KV block over every layer the backend serves (0: no block pool)
    bytes_per_block: int = 0
    #: bytes of one request slot's state over every layer it serves (0: no slot state)
    bytes_per_slot: int = 0

    def __attrs_post_init__(self) -> None:
        if self.bytes_per_block < 0 or self.bytes_per_slot < 0:
            raise ValueError("cache spec bytes must be >= 0")


@attrs.frozen(kw_only=True)
class CacheWriteTarget:
    """A buffer whose values tell a kernel *where* to write cache or state.

    Before every capture the core fills ``buffer`` with ``pad_value``; the backend's
    kernels skip that value, so a capture (which runs the model for real) writes
    nothing into a live cache row. ``buffer`` may live anywhere: in forward_vars or
    on the backend's own builder. The backend sets ``name``, ``buffer`` and
    ``pad_value``; the manager fills ``backend`` with the name of the backend that
    answered.
    """

    #: unique among the backend's targets; reported as ``"<backend>.<name>"``
    name: str
    #: integer tensor on the backend's device, any shape; blanked whole
    buffer: torch.Tensor
    #: the value the kernels skip
    pad_value: int = PAD_SLOT_ID
    #: set by the manager, never by the backend
    backend: str = ""

    @property
    def qualified_name(self) -> str:
        return f"{self.backend}.{self.name}"


@attrs.frozen(kw_only=True)
class StepBatch:
    """One step's batch on the host: what the engine scheduled, as CPU tensors.

    Sequences are in order; the token rows of sequence ``i`` are
    ``cu_query_lens[i]:cu_query_lens[i+1]``. ``num_padded_seqs`` >= ``num_seqs``
    when a captured graph will replay with a padded tail; the backend must make the
    tail rows write nothing.
    """

    num_seqs: int
    num_tokens: int
    num_padded_seqs: int
    #: ``[num_seqs]`` int32, CPU: new tokens this step
    query_lens: torch.Tensor
    #: ``[num_seqs]`` int32, CPU: tokens already in cache before this step
    start_positions: torch.Tensor
    #: ``[num_seqs]`` int32, CPU: ``start_positions + query_lens``
    context_lens: torch.Tensor
    #: ``[num_seqs + 1]`` int32, CPU: cumulative query lengths, from 0
    cu_query_lens: torch.Tensor
    #: ``[num_seqs, longest]`` int32, CPU: every block table, zero-padded (block 0 is
    #: valid in any pool, so an unmasked read stays in bounds)
    block_table_array: torch.Tensor
    #: ``[num_tokens]`` int64, CPU: physical KV slot of each token
    slot_mapping: torch.Tensor
    #: ``[num_seqs]`` int32, CPU: recurrent-state slot of each sequence
    state_slots: torch.Tensor
    #: ``[num_tokens]`` int64, CPU: position of each token in its sequence
    positions: torch.Tensor

    @property
    def is_decode(self) -> bool:
        return self.num_tokens == self.num_seqs


@attrs.frozen(kw_only=True)
class StepMetadata:
    """A step's shared read side, built once by the core and handed to every backend.

    The tensors are views of persistent device buffers the core owns (a captured
    graph reads them by address, so a later step's fill reaches it); ``host`` holds
    the CPU copies. Padded rows (``num_seqs .. num_padded_seqs``) read nothing: their
    context length is 0, their query range empty, their table all block 0.

    A micro-batch is a contiguous range of sequences (:meth:`micro_batch`): sequence
    rows ``a:b`` and token rows :meth:`token_rows` of every tensor, with
    ``query_start_loc`` rebased to start at 0.
    """

    #: the same step on the host (CPU tensors)
    host: StepBatch
    #: ``[num_padded_seqs + 1]`` int32, device: token row where each sequence starts;
    #: padded sequences are empty (their entries equal ``num_tokens``)
    query_start_loc: torch.Tensor
    #: ``[num_padded_seqs]`` int32, device: keys each sequence attends to, this step's
    #: included; 0 on padded rows
    context_lens: torch.Tensor
    #: ``[num_padded_seqs, max_blocks_per_seq]`` int32, device: physical block of each
    #: logical block; 0 past a sequence's blocks and on padded rows
    block_tables: torch.Tensor
    #: ``[num_padded_tokens]`` int64, device: position of each token row; 0 on padded rows
    positions: torch.Tensor
    num_seqs: int
    num_padded_seqs: int
    num_tokens: int
    #: ``num_tokens`` plus one row per padded sequence
    num_padded_tokens: int
    max_query_len: int
    max_context_len: int
    #: every sequence has exactly one new token
    is_decode: bool
    #: synthesized by the core for a graph capture (each row reads one key at block 0)
    is_capture: bool = False
    #: the start-up profile's step (CUDA): a maximal prefill of placeholder tokens over
    #: a throw-away pool, run only to measure the activation peak; nothing a backend
    #: keeps may be learned from it (``calculate_kv_scales`` skips it)
    is_profile: bool = False

    def token_rows(self, first_seq: int, end_seq: int) -> slice:
        """Token rows of sequences ``first_seq .. end_seq - 1``; a padded sequence owns
        one row after the real tokens."""
        cu, n, tokens = self.host.cu_query_lens, self.num_seqs, self.num_tokens
        row = lambda seq: int(cu[seq]) if seq <= n else tokens + seq - n
        return slice(row(first_seq), row(end_seq))

    def micro_batch(self, first_seq: int, end_seq: int) -> StepMetadata:
        """Sequences ``first_seq .. end_seq - 1`` as a step of their own (padded rows
        count as sequences of zero real tokens, so a range may include the tail).

        Every tensor is a view of this step's rows except ``query_start_loc``, rebased
        to start at 0 (a new tensor of ``end_seq - first_seq + 1`` entries).
        """
        if not 0 <= first_seq < end_seq <= self.num_padded_seqs:
            raise ValueError(f"sequences {first_seq}:{end_seq} not in 0:{self.num_padded_seqs}")
        tokens = self.token_rows(first_seq, end_seq)
        real_end = min(end_seq, self.num_seqs)
        real_first = min(first_seq, real_end)
        host = self.host
        cu = host.cu_query_lens[real_first : real_end + 1] - host.cu_query_lens[real_first]
        seqs, real = slice(real_first, real_end), slice(int(host.cu_query_lens[real_first]),
                                                        int(host.cu_query_lens[real_end]))
        sub_host = StepBatch(
            num_seqs=real_end - real_first,
            num_tokens=real.stop - real.start,
            num_padded_seqs=end_seq - first_seq,
            query_lens=host.query_lens[seqs],
            start_positions=host.start_positions[seqs],
            context_lens=host.context_lens[seqs],
            cu_query_lens=cu,
            block_table_array=host.block_table_array[seqs],
            slot_mapping=host.slot_mapping[real],
            state_slots=host.state_slots[seqs],
            positions=host.positions[real],
        )
        return StepMetadata(
            host=sub_host,
            # Padded sequences start where the real tokens end: clamped, an all-padded
            # range starts at 0.
            query_start_loc=(self.query_start_loc[first_seq : end_seq + 1] - tokens.start)
            .clamp_(min=0),
            context_lens=self.context_lens[first_seq:end_seq],
            block_tables=self.block_tables[first_seq:end_seq],
            positions=self.positions[tokens],
            num_seqs=sub_host.num_seqs,
            num_padded_seqs=end_seq - first_seq,
            num_tokens=sub_host.num_tokens,
            num_padded_tokens=tokens.stop - tokens.start,
            max_query_len=int(sub_host.query_lens.max()) if sub_host.num_seqs else 0,
            max_context_len=int(sub_host.context_lens.max()) if sub_host.num_seqs else 0,
            # Its own rows decide: a slice of a mixed step may hold only decodes.
            is_decode=sub_host.is_decode,
            is_capture=self.is_capture,
            is_profile=self.is_profile,
        )


def pad_block_tables(tables: Sequence[Sequence[int]]) -> torch.Tensor:
    """``tables`` as a ``StepBatch.block_table_array`` (for backends' own tests; the
    runner builds it vectorised in ``prepare_step``)."""
    out = torch.zeros(
        (len(tables), max((len(t) for t in tables), default=1) or 1), dtype=torch.int32
    )
    for row, table in enumerate(tables):
        out[row, : len(table)] = torch.tensor(table, dtype=torch.int32)
    return out


T = TypeVar("T")


@attrs.define
class ForwardContext:
    """Per-step metadata handed down the model: backend name -> that backend's metadata.

    When an overlap plugin cut the step, ``micro_batches`` holds the parts (each a
    :class:`~kvrunner.plugin_api.overlap.MicroBatch` with a context of its own) and
    ``metadata`` is empty: the model is then run part by part, by that plugin.
    """

    metadata: dict[str, Any] = attrs.field(factory=dict)
    micro_batches: tuple[Any, ...] = ()

    def for_backend(self, name: str, kind: type[T] | None = None) -> T:
        """The metadata ``name`` built this step; with ``kind``, checked to be one."""
        try:
            found = self.metadata[name]
        except KeyError:
            raise RuntimeError(f"no metadata was built for backend {name!r} this step") from None
        if kind is not None and not isinstance(found, kind):
            raise TypeError(
                f"backend {name!r} built {type(found).__name__}, not {kind.__name__}"
            )
        return found
