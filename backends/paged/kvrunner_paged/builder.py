"""Persistent metadata buffers and the code that fills them, for real steps and captures.

The buffers are allocated once, at their largest size, and only ever written in
place: a captured graph reads them by address, so a fresh tensor per step would
leave the graph reading stale data. Every step fills the whole read side and pads
the write side, so no row past the real ones can carry a previous step's values
into a kernel.
"""

from __future__ import annotations

import torch

from kvrunner.contract import PAD_SLOT_ID, StepBatch
from kvrunner_paged.metadata import PagedMetadata


class MetadataBuilder:
    """Owns ``slot_mapping``, ``block_tables``, ``context_lens`` and ``query_start_loc``."""

    def __init__(
        self, *, max_batch: int, max_tokens: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        i32 = {"dtype": torch.int32, "device": device}
        # The write side starts blank: nothing may be written before a real step fills it.
        self.slot_mapping = torch.full((max_tokens,), PAD_SLOT_ID, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), **i32)
        self.context_lens = torch.zeros((max_batch,), **i32)
        self.query_start_loc = torch.zeros((max_batch + 1,), **i32)

    def buffers(self) -> dict[str, torch.Tensor]:
        """The persistent buffers by name (the runner prefixes them with the backend name)."""
        return {
            "slot_mapping": self.slot_mapping,
            "block_tables": self.block_tables,
            "context_lens": self.context_lens,
            "query_start_loc": self.query_start_loc,
        }

    def _check_fits(self, batch: StepBatch, padded_tokens: int) -> None:
        if batch.num_padded_seqs < batch.num_seqs:
            raise ValueError(
                f"num_padded_seqs {batch.num_padded_seqs} < num_seqs {batch.num_seqs}"
            )
        if batch.num_padded_seqs > self.max_batch or padded_tokens > self.max_tokens:
            raise ValueError(
                f"batch of {batch.num_padded_seqs} seqs / {padded_tokens} tokens exceeds the "
                f"paged buffers ({self.max_batch} seqs / {self.max_tokens} tokens)"
            )
        longest = batch.block_table_array.shape[1]  # padded to the longest table
        if longest > self.max_blocks_per_seq:
            raise ValueError(
                f"a block table of {longest} blocks exceeds max_blocks_per_seq "
                f"{self.max_blocks_per_seq} (max_model_len / block_size)"
            )

    def fill(self, batch: StepBatch) -> PagedMetadata:
        """Copy ``batch`` into the buffers in place; pad rows write nothing and read nothing.

        Padded sequence rows (``num_seqs .. num_padded_seqs``) each own one padded token
        row after the real tokens; that row's slot is PAD and its context length 0.
        """
        n, tokens, padded = batch.num_seqs, batch.num_tokens, batch.num_padded_seqs
        padded_tokens = tokens + (padded - n)
        self._check_fits(batch, padded_tokens)

        self.slot_mapping[:tokens].copy_(batch.slot_mapping[:tokens])
        self.slot_mapping[tokens:].fill_(PAD_SLOT_ID)

        # Host staging, then one copy per buffer: a step costs a handful of transfers,
        # not one per sequence. Block-table entries past a sequence's blocks are 0, a
        # valid block, so even an unmasked read of them stays in bounds.
        tables = torch.zeros((padded, self.max_blocks_per_seq), dtype=torch.int32)
        given = batch.block_table_array
        tables[:n, : given.shape[1]] = given[:n]
        self.block_tables[:padded].copy_(tables)

        lens = torch.zeros((self.max_batch,), dtype=torch.int32)
        lens[:n] = batch.context_lens[:n]
        self.context_lens.copy_(lens)

        starts = torch.full((self.max_batch + 1,), tokens, dtype=torch.int32)
        starts[: n + 1] = batch.cu_query_lens[: n + 1]
        self.query_start_loc.copy_(starts)

        max_query_len = int(batch.query_lens[:n].max()) if n else 0
        return PagedMetadata(
            slot_mapping=self.slot_mapping[:padded_tokens],
            block_tables=self.block_tables[:padded],
            context_lens=self.context_lens[:padded],
            query_start_loc=self.query_start_loc[: padded + 1],
            num_seqs=n,
            num_padded_seqs=padded,
            num_tokens=tokens,
            max_query_len=max_query_len,
            is_decode=batch.is_decode,
        )

    def fill_capture(self, batch_size: int) -> PagedMetadata:
        """Decode metadata for capturing ``batch_size`` rows, with a synthesized read side.

        Every row reads one key at block 0, offset 0 (in bounds in any pool), so the
        capture's kernels run their real code paths. ``slot_mapping`` is left exactly as
        the core blanked it: the capture must write no cache row.
        """
        if not 0 < batch_size <= self.max_batch:
            raise ValueError(f"capture batch size {batch_size} not in [1, {self.max_batch}]")
        self.block_tables[:batch_size].zero_()
        self.context_lens.zero_()
        self.context_lens[:batch_size].fill_(1)
        starts = torch.arange(self.max_batch + 1, dtype=torch.int32).clamp_(max=batch_size)
        self.query_start_loc.copy_(starts)
        return PagedMetadata(
            slot_mapping=self.slot_mapping[:batch_size],
            block_tables=self.block_tables[:batch_size],
            context_lens=self.context_lens[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            num_seqs=batch_size,
            num_padded_seqs=batch_size,
            num_tokens=batch_size,
            max_query_len=1,
            is_decode=True,
        )
