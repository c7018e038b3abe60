"""A scheduled step written as the columns the runner reads (``StepInput``)."""

from __future__ import annotations

from kvrunner.batch import PLACEHOLDER_CHUNK, StepInput
from kvrunner.engine.sequence import Sequence


def step_columns(
    seqs: list[Sequence], sizes: list[int], starts: list[int], pending: list[int]
) -> StepInput:
    """The step as columns (what the runner reads): sequence ``s`` feeds ``n``
    tokens from ``start`` (where the step in flight leaves it), and samples if they
    end its tokens - counting the one in flight, which is fed as
    ``PLACEHOLDER_TOKEN``."""
    if any(pending):
        # A sequence with a token in flight feeds exactly that token.
        tokens = [
            PLACEHOLDER_CHUNK if p else tuple(s.token_ids[a : a + n])
            for s, n, a, p in zip(seqs, sizes, starts, pending, strict=True)
        ]
        outputs = [s.num_output_tokens + p for s, p in zip(seqs, pending, strict=True)]
    else:
        tokens = [
            tuple(s.token_ids[a : a + n]) for s, n, a in zip(seqs, sizes, starts, strict=True)
        ]
        outputs = [s.num_output_tokens for s in seqs]
    return StepInput(
        seq_id=[s.seq_id for s in seqs],
        token_ids=tokens,
        start_pos=starts,
        block_table=[tuple(s.block_table) for s in seqs],
        state_slot=[s.state_slot for s in seqs],
        sample=[
            a + n == len(s.token_ids) + p
            for s, n, a, p in zip(seqs, sizes, starts, pending, strict=True)
        ],
        sampling=[s.sampling_params for s in seqs],
        num_output_tokens=outputs,
    )
