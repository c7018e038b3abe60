"""Turn the engine's ``StepInput`` into the host-side batch backends build metadata from."""

from __future__ import annotations

import attrs
import torch

from kvrunner.batch import SeqChunk, StepInput
from kvrunner.config import EngineConfig
from kvrunner.contract import StepBatch
from kvrunner.sampling_params import SamplingParams


@attrs.frozen(kw_only=True)
class PreparedStep:
    batch: StepBatch
    input_ids: torch.Tensor  # [num_tokens] int64, CPU
    positions: torch.Tensor  # [num_tokens] int64, CPU
    #: token row whose hidden state is sampled, for each chunk that samples
    sample_rows: list[int]


def prepare_step(
    step: StepInput, *, block_size: int, num_padded_seqs: int | None = None
) -> PreparedStep:
    """Lay the step's chunks out as one flat token batch.

    Slot of the token at position ``p`` of a sequence:
    ``block_table[p // block_size] * block_size + p % block_size``.
    """
    chunks = step.chunks
    num_seqs = len(chunks)
    query_lens = torch.tensor([len(c.token_ids) for c in chunks], dtype=torch.int32)
    starts = torch.tensor([c.start_pos for c in chunks], dtype=torch.int32)
    cu = torch.zeros(num_seqs + 1, dtype=torch.int32)
    torch.cumsum(query_lens, 0, out=cu[1:])
    input_ids = torch.tensor([t for c in chunks for t in c.token_ids], dtype=torch.int64)
    positions = torch.cat(
        [
            torch.arange(c.start_pos, c.start_pos + len(c.token_ids), dtype=torch.int64)
            for c in chunks
        ]
    )
    slot_parts = []
    for c, seq_positions in zip(chunks, torch.split(positions, query_lens.tolist()), strict=True):
        needed = (c.start_pos + len(c.token_ids) + block_size - 1) // block_size
        if len(c.block_table) < needed:
            raise ValueError(
                f"sequence {c.seq_id}: block table holds {len(c.block_table)} blocks, "
                f"{needed} needed for {c.start_pos + len(c.token_ids)} tokens"
            )
        table = torch.tensor(c.block_table, dtype=torch.int64)
        slot_parts.append(
            table[seq_positions // block_size] * block_size + seq_positions % block_size
        )
    sample_rows = [int(cu[i + 1]) - 1 for i, c in enumerate(chunks) if c.sample]
    batch = StepBatch(
        num_seqs=num_seqs,
        num_tokens=int(cu[-1]),
        num_padded_seqs=num_padded_seqs if num_padded_seqs is not None else num_seqs,
        query_lens=query_lens,
        start_positions=starts,
        context_lens=starts + query_lens,
        cu_query_lens=cu,
        block_tables=[tuple(c.block_table) for c in chunks],
        slot_mapping=torch.cat(slot_parts),
        state_slots=torch.tensor([c.state_slot for c in chunks], dtype=torch.int32),
    )
    return PreparedStep(
        batch=batch, input_ids=input_ids, positions=positions, sample_rows=sample_rows
    )


def profile_step(config: EngineConfig, *, num_tokens: int, scratch_slot: int) -> StepInput:
    """The largest prefill the config admits, for measuring the activation peak.

    Every sequence's block table points at block 0 of a throw-away pool and at the
    scratch state slot, so it needs only ``ceil(max_model_len / block_size)`` blocks.
    """
    max_len = config.scheduler.max_model_len - 1
    block_size = config.cache.block_size
    chunks = []
    remaining = num_tokens
    while remaining > 0 and len(chunks) < config.scheduler.max_num_seqs:
        n = min(remaining, max_len)
        chunks.append(
            SeqChunk(
                seq_id=-1 - len(chunks),
                token_ids=(0,) * n,
                start_pos=0,
                block_table=tuple(range((n + block_size - 1) // block_size)),
                state_slot=scratch_slot,
                sample=True,
                sampling=SamplingParams(temperature=0.0),
                num_output_tokens=0,
            )
        )
        remaining -= n
    return StepInput(chunks=tuple(chunks))
