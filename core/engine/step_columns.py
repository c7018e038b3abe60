"""A scheduled step written as the columns the runner reads (``StepInput``)."""

from __future__ import annotations

from operator import add, attrgetter, sub

from kvrunner.batch import PLACEHOLDER_CHUNK, StepInput
from kvrunner.engine.sequence import Sequence
from kvrunner.engine.table_rows import TableRows

# C-level column reads (``map`` over an attrgetter runs no bytecode per sequence).
_seq_id = attrgetter("seq_id")
_token_ids = attrgetter("token_ids")
_num_prompt_tokens = attrgetter("num_prompt_tokens")
_table_row = attrgetter("table_row")
_state_slot = attrgetter("state_slot")
_sampling = attrgetter("sampling_params")


def step_columns(
    seqs: list[Sequence],
    sizes: list[int],
    starts: list[int],
    pending: list[int],
    samples: list[bool],
    tables: TableRows,
) -> StepInput:
    """The step as columns (what the runner reads): sequence ``s`` feeds ``n``
    tokens from ``start`` (where the step in flight leaves it), and samples
    (``samples``) if they end its tokens - counting the one in flight, which is fed
    as ``PLACEHOLDER_TOKEN``. Block tables come from their persistent rows."""
    num_seqs = len(seqs)
    if pending.count(1) == num_seqs:
        # Every sequence feeds exactly the token in flight: a steady decode step.
        tokens = [PLACEHOLDER_CHUNK] * num_seqs
    else:
        # A sequence with a token in flight feeds exactly that token.
        tokens = [
            PLACEHOLDER_CHUNK if p else tuple(s.token_ids[a : a + n])
            for s, n, a, p in zip(seqs, sizes, starts, pending, strict=True)
        ]
    outputs = list(map(sub, map(len, map(_token_ids, seqs)), map(_num_prompt_tokens, seqs)))
    if any(pending):
        # Seeds already count the token in flight.
        outputs = list(map(add, outputs, pending))
    return StepInput(
        seq_id=list(map(_seq_id, seqs)),
        token_ids=tokens,
        start_pos=starts,
        block_table=tables.gather(list(map(_table_row, seqs))),
        state_slot=list(map(_state_slot, seqs)),
        sample=samples,
        sampling=list(map(_sampling, seqs)),
        num_output_tokens=outputs,
    )
