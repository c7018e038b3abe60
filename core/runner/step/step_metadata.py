"""The shared read side of every step, built once by the core in persistent buffers.

Every backend needs the same few tensors on the device: where each sequence's
tokens start, how many keys it attends to, its block table, each token's position.
The core stages them here once per step (one host-to-device copy per buffer) and
hands the :class:`~kvrunner.plugin_api.step_data.StepMetadata` to every backend, so a hybrid
step copies them once, not once per backend. A backend keeps only what its kernels
need beyond this, and its own write targets.

The buffers are allocated once at their largest size and only written in place:
captured graphs read them by address. ``positions`` is the model's own input
buffer (forward_vars ``"positions"``): the rotary embedding and the backends read
the same tensor.
"""

from __future__ import annotations

import torch

from kvrunner.plugin_api.step_data import PAD_SLOT_ID, StepBatch, StepMetadata

#: forward_vars names of the buffers (``positions`` is the model's input buffer)
BUFFER_NAMES = ("step.query_start_loc", "step.context_lens", "step.block_tables", "positions")


class StepMetadataBuilder:
    """Owns the shared buffers and fills them from a :class:`StepBatch`."""

    def __init__(
        self, *, max_batch: int, max_tokens: int, max_blocks_per_seq: int, device: torch.device
    ) -> None:
        self.max_batch = max_batch
        self.max_tokens = max_tokens
        self.max_blocks_per_seq = max_blocks_per_seq
        i32 = {"dtype": torch.int32, "device": device}
        self.query_start_loc = torch.zeros((max_batch + 1,), **i32)
        self.context_lens = torch.zeros((max_batch,), **i32)
        self.block_tables = torch.zeros((max_batch, max_blocks_per_seq), **i32)
        self.positions = torch.zeros((max_tokens,), dtype=torch.int64, device=device)
        #: the steps filled now are the start-up profile's (``StepMetadata.is_profile``)
        self.profiling = False

    def buffers(self) -> dict[str, torch.Tensor]:
        """The buffers by their forward_vars name."""
        return dict(
            zip(
                BUFFER_NAMES,
                (self.query_start_loc, self.context_lens, self.block_tables, self.positions),
                strict=True,
            )
        )

    def _check_fits(self, batch: StepBatch, padded_tokens: int) -> None:
        if batch.num_padded_seqs < batch.num_seqs:
            raise ValueError(f"num_padded_seqs {batch.num_padded_seqs} < num_seqs {batch.num_seqs}")
        if batch.num_padded_seqs > self.max_batch or padded_tokens > self.max_tokens:
            raise ValueError(
                f"batch of {batch.num_padded_seqs} seqs / {padded_tokens} tokens exceeds the "
                f"step buffers ({self.max_batch} seqs / {self.max_tokens} tokens)"
            )
        if batch.block_table_array.shape[1] > self.max_blocks_per_seq:
            raise ValueError(
                f"a block table of {batch.block_table_array.shape[1]} blocks exceeds "
                f"max_blocks_per_seq {self.max_blocks_per_seq} (max_model_len / block_size)"
            )

    def fill(self, batch: StepBatch) -> StepMetadata:
        """Copy ``batch`` in place; every row past the real ones reads nothing.

        Staged on the host and copied once per buffer: a step costs a handful of
        transfers, not one per sequence.
        """
        n, tokens, padded = batch.num_seqs, batch.num_tokens, batch.num_padded_seqs
        padded_tokens = tokens + (padded - n)
        self._check_fits(batch, padded_tokens)
        starts = torch.full((self.max_batch + 1,), tokens, dtype=torch.int32)
        starts[: n + 1] = batch.cu_query_lens[: n + 1]
        self.query_start_loc.copy_(starts, non_blocking=True)
        lens = torch.zeros((self.max_batch,), dtype=torch.int32)
        lens[:n] = batch.context_lens[:n]
        self.context_lens.copy_(lens, non_blocking=True)
        tables = torch.zeros((padded, self.max_blocks_per_seq), dtype=torch.int32)
        given = batch.block_table_array
        tables[:n, : given.shape[1]] = given[:n]
        self.block_tables[:padded].copy_(tables, non_blocking=True)
        self.positions[:tokens].copy_(batch.positions[:tokens], non_blocking=True)
        self.positions[tokens:padded_tokens].zero_()
        return StepMetadata(
            host=batch,
            query_start_loc=self.query_start_loc[: padded + 1],
            context_lens=self.context_lens[:padded],
            block_tables=self.block_tables[:padded],
            positions=self.positions[:padded_tokens],
            num_seqs=n,
            num_padded_seqs=padded,
            num_tokens=tokens,
            num_padded_tokens=padded_tokens,
            max_query_len=int(batch.query_lens[:n].max()) if n else 0,
            max_context_len=int(batch.context_lens[:n].max()) if n else 0,
            is_decode=batch.is_decode,
            is_profile=self.profiling,
        )

    def fill_capture(self, batch_size: int) -> StepMetadata:
        """The read side of a decode graph capture of ``batch_size`` rows.

        Every row is a sequence with one token at position 0 reading one key at block
        0 (in bounds in any pool), so the kernels run their real code paths. Nothing
        here touches a write target: blanking is the capture loop's job.
        """
        if not 0 < batch_size <= self.max_batch:
            raise ValueError(f"capture batch size {batch_size} not in [1, {self.max_batch}]")
        rows = torch.arange(batch_size + 1, dtype=torch.int32)
        zeros = torch.zeros((batch_size,), dtype=torch.int32)
        host = StepBatch(
            num_seqs=batch_size,
            num_tokens=batch_size,
            num_padded_seqs=batch_size,
            query_lens=torch.ones((batch_size,), dtype=torch.int32),
            start_positions=zeros,
            context_lens=zeros + 1,
            cu_query_lens=rows,
            block_table_array=torch.zeros((batch_size, 1), dtype=torch.int32),
            # The write side of a capture is PAD: whatever a backend reads here, it
            # must write nothing.
            slot_mapping=torch.full((batch_size,), PAD_SLOT_ID, dtype=torch.int64),
            state_slots=torch.full((batch_size,), PAD_SLOT_ID, dtype=torch.int32),
            positions=torch.zeros((batch_size,), dtype=torch.int64),
        )
        starts = torch.arange(self.max_batch + 1, dtype=torch.int32).clamp_(max=batch_size)
        self.query_start_loc.copy_(starts)
        self.context_lens.zero_()
        self.context_lens[:batch_size].fill_(1)
        self.block_tables[:batch_size].zero_()
        self.positions[:batch_size].zero_()
        return StepMetadata(
            host=host,
            query_start_loc=self.query_start_loc[: batch_size + 1],
            context_lens=self.context_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            positions=self.positions[:batch_size],
            num_seqs=batch_size,
            num_padded_seqs=batch_size,
            num_tokens=batch_size,
            num_padded_tokens=batch_size,
            max_query_len=1,
            max_context_len=1,
            is_decode=True,
            is_capture=True,
        )
