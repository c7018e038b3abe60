"""Per-step metadata for the GDN kernels, and the builder that owns its index buffers.

Every sequence has two state indices:

- a *read* index: the slot its conv/recurrent history comes from, or PAD (-1) when
  it has none (a sequence at position 0, or a captured/padded row);
- a *write* index: the slot its new state goes to, or PAD for a row that must do
  nothing at all. The kernels skip a row whose write index is < 0 entirely.

Keeping the two apart is what lets a fresh request ignore stale slot contents
(read = PAD, write = slot), and it is the shape a prefix-cached fork needs (read
slot A, write slot B). Only write indices are write targets.

Buffers, all int32 on the backend's device, created once at their largest size:

- ``decode_state_indices`` / ``decode_read_indices`` ``[max_batch]``: the decode
  path, in forward_vars, read by captured graphs by address;
- ``prefill_state_indices_in_tensor`` / ``prefill_read_indices_in_tensor``
  ``[max_num_seqs]`` and ``cu_seqlens_in_tensor``: the prefill/mixed path. These
  live on this builder only, *not* in forward_vars; the write side is still a
  declared write target, so the core's blanking reaches it.
"""

from __future__ import annotations

import attrs
import torch

from kvrunner.contract import PAD_SLOT_ID, StepBatch

INDEX_DTYPE = torch.int32


@attrs.frozen(kw_only=True)
class GDNMetadata:
    """What one GDN layer needs for one step.

    Decode (one token per row): ``read_indices``/``write_indices`` are views of the
    decode buffers with one row per (padded) token; ``cu_seqlens`` is ``None``.
    Prefill/mixed: one row per sequence, ``cu_seqlens [num_seqs + 1]`` delimits
    each sequence's tokens and ``max_seqlen`` sizes the kernel grids.
    """

    is_decode: bool
    read_indices: torch.Tensor
    write_indices: torch.Tensor
    cu_seqlens: torch.Tensor | None = None
    #: host copy of cu_seqlens (prefill), so launchers need no device sync to read it
    cu_seqlens_host: tuple[int, ...] = ()
    max_seqlen: int = 1

    @property
    def num_rows(self) -> int:
        return self.write_indices.shape[0]


def _new_index_buffer(rows: int, device: torch.device) -> torch.Tensor:
    return torch.full((rows,), PAD_SLOT_ID, dtype=INDEX_DTYPE, device=device)


class GDNMetadataBuilder:
    """Fills the index buffers in place from a :class:`StepBatch` and hands out views."""

    def __init__(self, max_num_seqs: int, device: torch.device) -> None:
        self.device = device
        self.max_num_seqs = max_num_seqs
        self.decode_state_indices = _new_index_buffer(max_num_seqs, device)
        self.decode_read_indices = _new_index_buffer(max_num_seqs, device)
        self.prefill_state_indices_in_tensor = _new_index_buffer(max_num_seqs, device)
        self.prefill_read_indices_in_tensor = _new_index_buffer(max_num_seqs, device)
        self.cu_seqlens_in_tensor = torch.zeros(max_num_seqs + 1, dtype=INDEX_DTYPE, device=device)

    def ensure_decode_capacity(self, max_batch: int) -> None:
        """Grow the decode buffers to ``max_batch`` rows (only before any graph exists:
        this is called from ``persistent_buffers``, which the runner calls once)."""
        if max_batch > self.decode_state_indices.shape[0]:
            self.decode_state_indices = _new_index_buffer(max_batch, self.device)
            self.decode_read_indices = _new_index_buffer(max_batch, self.device)

    @staticmethod
    def _indices(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(read, write) per sequence: history only for sequences already past position 0."""
        slots = batch.state_slots[: batch.num_seqs].to(INDEX_DTYPE)
        has_history = batch.start_positions[: batch.num_seqs] > 0
        read = torch.where(has_history, slots, torch.full_like(slots, PAD_SLOT_ID))
        return read, slots

    @staticmethod
    def _fill(buffer: torch.Tensor, values: torch.Tensor) -> None:
        """Copy ``values`` into the head of ``buffer`` and PAD the tail, in place."""
        n = values.shape[0]
        if n > buffer.shape[0]:
            raise ValueError(f"{n} sequences do not fit a GDN index buffer of {buffer.shape[0]}")
        buffer[:n].copy_(values)
        buffer[n:].fill_(PAD_SLOT_ID)

    def build(self, batch: StepBatch) -> GDNMetadata:
        """Metadata for a real batch. Pure decode batches (one token per sequence) take
        the decode path, padded to ``num_padded_seqs`` rows; all others the prefill path."""
        read, write = self._indices(batch)
        if batch.is_decode:
            rows = max(batch.num_padded_seqs, batch.num_seqs)
            if rows > self.decode_state_indices.shape[0]:
                raise ValueError(
                    f"decode batch of {rows} rows exceeds the GDN decode buffers "
                    f"({self.decode_state_indices.shape[0]})"
                )
            self._fill(self.decode_state_indices, write)
            self._fill(self.decode_read_indices, read)
            return GDNMetadata(
                is_decode=True,
                read_indices=self.decode_read_indices[:rows],
                write_indices=self.decode_state_indices[:rows],
            )
        n = batch.num_seqs
        self._fill(self.prefill_state_indices_in_tensor, write)
        self._fill(self.prefill_read_indices_in_tensor, read)
        self.cu_seqlens_in_tensor[: n + 1].copy_(batch.cu_query_lens[: n + 1])
        max_seqlen = int(batch.query_lens[:n].max()) if n else 0
        return GDNMetadata(
            is_decode=False,
            read_indices=self.prefill_read_indices_in_tensor[:n],
            write_indices=self.prefill_state_indices_in_tensor[:n],
            cu_seqlens=self.cu_seqlens_in_tensor[: n + 1],
            cu_seqlens_host=tuple(batch.cu_query_lens[: n + 1].tolist()),
            max_seqlen=max_seqlen,
        )

    def build_capture(self, batch_size: int) -> GDNMetadata:
        """Decode metadata for capturing a graph of ``batch_size`` rows.

        Only the read side is synthesized (PAD: no history, nothing read). The write
        side is left exactly as the core left it (blanked to PAD before capture), so
        the warmup and captured forwards write no state anywhere.
        """
        if batch_size > self.decode_state_indices.shape[0]:
            raise ValueError(
                f"capture batch {batch_size} exceeds the GDN decode buffers "
                f"({self.decode_state_indices.shape[0]})"
            )
        self.decode_read_indices[:batch_size].fill_(PAD_SLOT_ID)
        return GDNMetadata(
            is_decode=True,
            read_indices=self.decode_read_indices[:batch_size],
            write_indices=self.decode_state_indices[:batch_size],
        )
