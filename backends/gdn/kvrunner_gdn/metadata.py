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
  ``[max_num_seqs]``: the prefill/mixed path. These live on this builder only,
  *not* in forward_vars; the write side is still a declared write target, so the
  core's blanking reaches it. The sequence offsets are the core's shared
  ``query_start_loc``.
"""

from __future__ import annotations

import attrs
import torch

from kvrunner.plugin_api import PAD_SLOT_ID, StepBatch, StepMetadata, fill_head

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
    #: host copies of the prefill read / write indices: a launcher can plan around fresh
    #: and PAD rows (e.g. skip a gather of no state) without reading the device
    read_host: tuple[int, ...] = ()
    write_host: tuple[int, ...] = ()
    max_seqlen: int = 1

    @property
    def num_rows(self) -> int:
        return self.write_indices.shape[0]


def _new_index_buffer(rows: int, device: torch.device) -> torch.Tensor:
    return torch.full((rows,), PAD_SLOT_ID, dtype=INDEX_DTYPE, device=device)


class GDNMetadataBuilder:
    """Owns the state-index buffers, fills them in place and hands out views."""

    def __init__(self, *, max_batch: int, max_num_seqs: int, device: torch.device) -> None:
        self.max_batch = max_batch
        self.decode_state_indices = _new_index_buffer(max_batch, device)
        self.decode_read_indices = _new_index_buffer(max_batch, device)
        self.prefill_state_indices_in_tensor = _new_index_buffer(max_num_seqs, device)
        self.prefill_read_indices_in_tensor = _new_index_buffer(max_num_seqs, device)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The decode side, which captured graphs read by address (forward_vars)."""
        return {
            "decode_state_indices": self.decode_state_indices,
            "decode_read_indices": self.decode_read_indices,
        }

    @staticmethod
    def _indices(batch: StepBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(read, write) per sequence: history only for sequences already past position 0."""
        slots = batch.state_slots[: batch.num_seqs].to(INDEX_DTYPE)
        has_history = batch.start_positions[: batch.num_seqs] > 0
        read = torch.where(has_history, slots, torch.full_like(slots, PAD_SLOT_ID))
        return read, slots

    def build(self, step: StepMetadata) -> GDNMetadata:
        """Metadata for a real step. Pure decode steps (one token per sequence) take the
        decode path, padded to ``num_padded_seqs`` rows; all others the prefill path."""
        read, write = self._indices(step.host)
        if step.is_decode:
            rows = step.num_padded_seqs
            if rows > self.max_batch:
                raise ValueError(
                    f"decode batch of {rows} rows exceeds the GDN decode buffers ({self.max_batch})"
                )
            fill_head(self.decode_state_indices, write, PAD_SLOT_ID)
            fill_head(self.decode_read_indices, read, PAD_SLOT_ID)
            return GDNMetadata(
                is_decode=True,
                read_indices=self.decode_read_indices[:rows],
                write_indices=self.decode_state_indices[:rows],
            )
        n = step.num_seqs
        fill_head(self.prefill_state_indices_in_tensor, write, PAD_SLOT_ID)
        fill_head(self.prefill_read_indices_in_tensor, read, PAD_SLOT_ID)
        return GDNMetadata(
            is_decode=False,
            read_indices=self.prefill_read_indices_in_tensor[:n],
            write_indices=self.prefill_state_indices_in_tensor[:n],
            cu_seqlens=step.query_start_loc[: n + 1],
            cu_seqlens_host=tuple(step.host.cu_query_lens[: n + 1].tolist()),
            read_host=tuple(read.tolist()),
            write_host=tuple(write.tolist()),
            max_seqlen=step.max_query_len,
        )

    def build_capture(self, step: StepMetadata) -> GDNMetadata:
        """Decode metadata for capturing a graph of ``step.num_seqs`` rows.

        Only the read side is synthesized (PAD: no history, nothing read). The write
        side is left exactly as the core left it (blanked to PAD before capture), so
        the warmup and captured forwards write no state anywhere.
        """
        rows = step.num_seqs
        if rows > self.max_batch:
            raise ValueError(
                f"capture batch {rows} exceeds the GDN decode buffers ({self.max_batch})"
            )
        self.decode_read_indices[:rows].fill_(PAD_SLOT_ID)
        return GDNMetadata(
            is_decode=True,
            read_indices=self.decode_read_indices[:rows],
            write_indices=self.decode_state_indices[:rows],
        )
