"""Turn the engine's ``StepInput`` into the host-side batch backends build metadata from."""

from __future__ import annotations

import itertools

import attrs
import numpy as np
import torch

from kvrunner.config import EngineConfig
from kvrunner.engine.step_io import SamplingColumns, StepInput
from kvrunner.plugin_api.step_data import StepBatch
from kvrunner.sampling_params import SamplingParams


@attrs.frozen(kw_only=True)
class PreparedStep:
    batch: StepBatch
    input_ids: torch.Tensor  # [num_tokens] int64, CPU
    #: token row whose hidden state is sampled, for each chunk that samples
    sample_rows: list[int]


def prepare_step(
    step: StepInput, *, block_size: int, num_padded_seqs: int | None = None
) -> PreparedStep:
    """Lay the step's chunks out as one flat token batch.

    Slot of the token at position ``p`` of a sequence:
    ``block_table[p // block_size] * block_size + p % block_size``. Built with a few
    vectorised numpy passes: this runs on the host every step, before every replay.
    """
    cols = step  # one list per field: numpy reads each in a single C pass
    num_seqs = len(cols.seq_id)
    query_lens = np.fromiter(map(len, cols.token_ids), np.int64, num_seqs)
    starts = np.array(cols.start_pos, np.int64)
    tables = cols.block_table.array  # already zero-padded (BlockTables)
    table_lens = cols.block_table.lens
    cu = np.zeros(num_seqs + 1, np.int64)
    np.cumsum(query_lens, out=cu[1:])
    num_tokens = int(cu[-1])
    needed = (starts + query_lens + block_size - 1) // block_size
    short = np.flatnonzero(table_lens < needed)
    if short.size:
        i = int(short[0])
        raise ValueError(
            f"sequence {cols.seq_id[i]}: block table holds {int(table_lens[i])} blocks, "
            f"{int(needed[i])} needed for {int(starts[i] + query_lens[i])} tokens"
        )
    input_ids = np.fromiter(itertools.chain.from_iterable(cols.token_ids), np.int64, num_tokens)
    seq_of_token = np.repeat(np.arange(num_seqs), query_lens)
    positions = np.arange(num_tokens) - cu[seq_of_token] + starts[seq_of_token]
    slot_mapping = (
        tables[seq_of_token, positions // block_size] * block_size + positions % block_size
    )
    sample_rows = (cu[1:] - 1)[np.array(cols.sample, bool)].tolist()
    query_lens_t = torch.from_numpy(query_lens.astype(np.int32))
    starts_t = torch.from_numpy(starts.astype(np.int32))
    batch = StepBatch(
        num_seqs=num_seqs,
        num_tokens=num_tokens,
        num_padded_seqs=num_padded_seqs if num_padded_seqs is not None else num_seqs,
        query_lens=query_lens_t,
        start_positions=starts_t,
        context_lens=starts_t + query_lens_t,
        cu_query_lens=torch.from_numpy(cu.astype(np.int32)),
        block_table_array=torch.from_numpy(tables),
        slot_mapping=torch.from_numpy(slot_mapping.astype(np.int64)),
        state_slots=torch.from_numpy(np.array(cols.state_slot, np.int32)),
        positions=torch.from_numpy(positions),
    )
    return PreparedStep(
        batch=batch,
        input_ids=torch.from_numpy(input_ids),
        sample_rows=sample_rows,
    )


def profile_step(config: EngineConfig, *, num_tokens: int, scratch_slot: int) -> StepInput:
    """The largest prefill the config admits, for measuring the activation peak.

    Every sequence's block table points at block 0 of a throw-away pool and at the
    scratch state slot, so it needs only ``ceil(max_model_len / block_size)`` blocks.
    """
    max_len = config.scheduler.max_model_len - 1
    block_size = config.cache.block_size
    lengths = []
    remaining = num_tokens
    while remaining > 0 and len(lengths) < config.scheduler.max_num_seqs:
        lengths.append(min(remaining, max_len))
        remaining -= lengths[-1]
    n = len(lengths)
    return StepInput(
        seq_id=[-1 - i for i in range(n)],
        token_ids=[(0,) * length for length in lengths],
        start_pos=[0] * n,
        block_table=[tuple(range(-(-length // block_size))) for length in lengths],
        state_slot=[scratch_slot] * n,
        sample=[True] * n,
        sampling=SamplingColumns.of([SamplingParams(temperature=0.0)] * n),
        num_output_tokens=[0] * n,
    )
