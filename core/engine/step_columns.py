"""A scheduled step written as the columns the runner reads (``StepInput``).

Its columns are gathered from the running batch's (``running_batch.py``): numpy takes
for the numbers, the block tables and the sampling settings, list copies or C-level
``compress`` passes for the objects. Only the token ids are built per row, and only
for rows whose chunk the host knows: a row whose chunk is the token still in flight
feeds one shared placeholder.
"""

from __future__ import annotations

from operator import attrgetter

import numpy as np

from kvrunner.engine.running_batch import RunningBatch
from kvrunner.engine.sequence import Sequence
from kvrunner.engine.step_io import PLACEHOLDER_CHUNK, StepInput
from kvrunner.engine.table_rows import TableRows

_token_ids = attrgetter("token_ids")


def prompt_targets(seq: Sequence, start: int, size: int) -> tuple[int, ...]:
    """The prompt tokens a chunk of ``seq`` (``size`` tokens from position ``start``)
    scores for ``SamplingParams.prompt_logprobs``: the token after each of its
    positions, while that is a prompt token; ``()`` if it asked for none."""
    if seq.sampling_params.prompt_logprobs is None:
        return ()
    end = min(start + size + 1, seq.num_prompt_tokens)
    return tuple(seq.token_ids[start + 1 : end]) if start + 1 < end else ()


def route_from(seq: Sequence, start: int) -> int:
    """The first position whose routed experts a chunk of ``seq`` starting at
    ``start`` returns: the first the host does not hold (before ``start`` when a
    prefix came from the cache), or ``start``; -1 if it asked for none."""
    if not seq.sampling_params.return_routed_experts:
        return -1
    return min(start, seq.num_routes)


def step_columns(
    batch: RunningBatch,
    rows: np.ndarray,
    sizes: np.ndarray,
    tables: TableRows,
    *,
    score_prompts: bool = False,
    routes: bool = False,
) -> tuple[StepInput, list[Sequence], np.ndarray, np.ndarray]:
    """The step feeding ``sizes`` tokens to each of the batch's ``rows`` (increasing),
    with the batch moved past it (:meth:`RunningBatch.advance`): the step, its
    sequences, each chunk's start and whether it samples.

    A chunk starts where the steps in flight leave its sequence and samples if it
    ends its tokens, counting the one in flight, which it feeds as
    ``PLACEHOLDER_TOKEN`` (only ever a chunk's last token, and then its only one).
    ``score_prompts``: some running request scores its prompt, so the step carries
    ``prompt_targets`` (else None, at no cost); ``routes``: some request returns its
    routed experts, so the step carries ``route_from`` (else None).
    """
    seqs = batch.pick(batch.seqs, rows)
    starts, samples, in_flight, outputs = batch.advance(rows, sizes)
    m = len(seqs)
    num_placeholders = np.count_nonzero(in_flight)
    if num_placeholders == m:
        # Every row feeds exactly its token in flight: a steady decode step.
        tokens = [PLACEHOLDER_CHUNK] * m
    elif num_placeholders == 0 and np.count_nonzero(samples) == m and int(sizes.sum()) == m:
        # A decode step after the last one was applied: each feeds its newest token.
        tokens = [(t[-1],) for t in map(_token_ids, seqs)]
    else:
        tokens = [
            PLACEHOLDER_CHUNK if p else tuple(s.token_ids[a : a + n])
            for s, n, a, p in zip(seqs, sizes.tolist(), starts.tolist(), in_flight.tolist(),
                                  strict=True)  # fmt: skip
        ]
    at = slice(0, m) if batch.every_row(rows) else rows  # a slice is cheaper
    step = StepInput(
        seq_id=batch.seq_id[at].tolist(),
        token_ids=tokens,
        start_pos=starts.tolist(),
        block_table=tables.gather_rows(batch.table_row[at]),  # a gather: a copy
        state_slot=batch.state_slot[at].tolist(),
        sample=samples.tolist(),
        sampling=batch.sampling_columns(rows),
        num_output_tokens=outputs.tolist(),
        prompt_targets=[
            prompt_targets(s, a, n)
            for s, a, n in zip(seqs, starts.tolist(), sizes.tolist(), strict=True)
        ] if score_prompts else None,
        route_from=[
            route_from(s, a) for s, a in zip(seqs, starts.tolist(), strict=True)
        ] if routes else None,
        history_init=batch.take_history_init(),
    )
    return step, seqs, starts, samples
